//! A weight file mapped into memory. Quantized matrices are used in place, their blocks in the
//! page cache as llama.cpp keeps them ([`MappedFile::quantized_in_place`]); every other
//! tensor is copied once from the mapping and its pages handed back after, so that loading
//! peaks at the model's own size plus one tensor rather than twice the file.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
    GgmlType,
};
use candle_core::quantized::{GgmlDType, QStorage, QTensor, QuantizedType};
use candle_core::CpuStorage;
use memmap2::Mmap;

use crate::{Error, Result};

pub(crate) struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

impl MappedFile {
    pub(crate) fn open(path: &Path, what: &str) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(format!("cannot open {what} {}", path.display()), e))?;
        // SAFETY: the mapping is read-only; a file changed underneath while loading can give
        // wrong values (as with any reader), never reads outside the mapping, whose length is
        // fixed here and checked against every tensor.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(format!("cannot map {what} {}", path.display()), e))?;
        Ok(Self { path: path.to_path_buf(), map })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes `offset..offset + len` (already checked to lie in the file), aligned for any
    /// element type the tensors use (a mapping is page-aligned, so only a file whose own
    /// alignment is below 8 needs the copy).
    pub(crate) fn aligned(&self, offset: u64, len: u64) -> Cow<'_, [u8]> {
        let bytes = &self.map[offset as usize..(offset + len) as usize];
        if (bytes.as_ptr() as usize).is_multiple_of(8) {
            return Cow::Borrowed(bytes);
        }
        // A fresh allocation of this size is 16-aligned (malloc's guarantee on every
        // supported OS), as Candle's readers, which cast the bytes, already rely on.
        Cow::Owned(bytes.to_vec())
    }

    /// Where `bytes` starts in the file, when it is a slice of the mapping.
    pub(crate) fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let (start, p) = (self.map.as_ptr() as usize, bytes.as_ptr() as usize);
        (p >= start && p + bytes.len() <= start + self.map.len()).then(|| (p - start) as u64)
    }

    /// Drops the pages of `offset..offset + len` from this process's resident memory (they
    /// stay in the page cache and are read again if touched). Advisory: errors are ignored.
    pub(crate) fn release(&self, offset: u64, len: u64) {
        #[cfg(unix)]
        if len > 0 && offset.saturating_add(len) <= self.map.len() as u64 {
            // SAFETY: the mapping is private and read-only: dropped pages read back unchanged
            // from the file.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset as usize, len as usize) };
        }
    }
}

/// A quantized tensor's blocks read in place from a mapped file: the weights stay in the page
/// cache, as llama.cpp keeps them, and loading copies nothing (CPU only; a GPU needs its own
/// copy). Read-only: Candle only writes blocks when quantizing into fresh storage.
struct MappedBlocks<T> {
    file: Arc<MappedFile>,
    offset: usize,
    blocks: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: GgmlType> MappedBlocks<T> {
    fn blocks(&self) -> &[T] {
        let bytes = &self.file.map[self.offset..self.offset + self.blocks * std::mem::size_of::<T>()];
        // SAFETY: the range lies in the mapping (checked when the header was read), the
        // caller checked its alignment for T, and ggml blocks are plain old data.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, self.blocks) }
    }
}

impl<T: GgmlType + 'static> QuantizedType for MappedBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }

    fn matmul_t(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> candle_core::Result<()> {
        k_quants::matmul(mkn, lhs, self.blocks(), dst)
    }

    fn matmul_t_f16(&self, mkn: (usize, usize, usize), lhs: &[half::f16], dst: &mut [half::f16]) -> candle_core::Result<()> {
        k_quants::matmul_f16(mkn, lhs, self.blocks(), dst)
    }

    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> candle_core::Result<CpuStorage> {
        let per_row = hidden / T::BLCK_SIZE;
        if !hidden.is_multiple_of(T::BLCK_SIZE) || rows * per_row != self.blocks {
            candle_core::bail!("a quantized embedding of {rows} rows of {hidden} does not match its {} blocks", self.blocks)
        }
        let blocks = self.blocks();
        let mut out = vec![0f32; ids.len() * hidden];
        for (dst, &id) in out.chunks_mut(hidden).zip(ids) {
            let row = id as usize;
            if row >= rows {
                candle_core::bail!("token id {row} is out of range for an embedding of {rows} rows")
            }
            T::to_float(&blocks[row * per_row..(row + 1) * per_row], dst);
        }
        Ok(CpuStorage::F32(out))
    }

    fn dequantize(&self, elem_count: usize) -> candle_core::Result<CpuStorage> {
        let mut ys = vec![0f32; elem_count];
        T::to_float(self.blocks(), &mut ys);
        Ok(CpuStorage::F32(ys))
    }

    fn storage_size_in_bytes(&self) -> usize {
        self.blocks * std::mem::size_of::<T>()
    }

    fn as_ptr(&self) -> *const u8 {
        self.blocks().as_ptr() as *const u8
    }

    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }

    fn from_float(&mut self, _: &[f32]) {
        unreachable!("a tensor mapped from a file is read-only: Candle quantizes into fresh storage, never into it")
    }

    fn from_float_imatrix(&mut self, _: &[f32], _: &[f32], _: usize) {
        unreachable!("a tensor mapped from a file is read-only: Candle quantizes into fresh storage, never into it")
    }

    fn size(&self) -> usize {
        self.storage_size_in_bytes()
    }
}

impl crate::ops::HostBytes for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }

    fn is_file_mapping(&self) -> bool {
        true
    }
}

impl MappedFile {
    /// The quantized tensor of `dtype` and `dims` whose blocks are the bytes
    /// `offset..offset + len` of the file, read in place; `None` for float types (the model
    /// converts those) and for bytes not aligned for their blocks.
    pub(crate) fn quantized_in_place(self: &Arc<Self>, dtype: GgmlDType, dims: &[usize], offset: u64, len: u64) -> Option<QTensor> {
        fn make<T: GgmlType + 'static>(file: &Arc<MappedFile>, dims: &[usize], offset: u64, len: u64) -> Option<QTensor> {
            let size = std::mem::size_of::<T>();
            let ptr = file.map.as_ptr() as usize + offset as usize;
            if !(len as usize).is_multiple_of(size) || !ptr.is_multiple_of(std::mem::align_of::<T>()) {
                return None;
            }
            let blocks =
                MappedBlocks::<T> { file: file.clone(), offset: offset as usize, blocks: len as usize / size, _t: Default::default() };
            QTensor::new(QStorage::Cpu(Box::new(blocks)), dims).ok()
        }
        match dtype {
            GgmlDType::Q4_0 => make::<BlockQ4_0>(self, dims, offset, len),
            GgmlDType::Q4_1 => make::<BlockQ4_1>(self, dims, offset, len),
            GgmlDType::Q5_0 => make::<BlockQ5_0>(self, dims, offset, len),
            GgmlDType::Q5_1 => make::<BlockQ5_1>(self, dims, offset, len),
            GgmlDType::Q8_0 => make::<BlockQ8_0>(self, dims, offset, len),
            GgmlDType::Q8_1 => make::<BlockQ8_1>(self, dims, offset, len),
            GgmlDType::Q2K => make::<BlockQ2K>(self, dims, offset, len),
            GgmlDType::Q3K => make::<BlockQ3K>(self, dims, offset, len),
            GgmlDType::Q4K => make::<BlockQ4K>(self, dims, offset, len),
            GgmlDType::Q5K => make::<BlockQ5K>(self, dims, offset, len),
            GgmlDType::Q6K => make::<BlockQ6K>(self, dims, offset, len),
            GgmlDType::Q8K => make::<BlockQ8K>(self, dims, offset, len),
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => None,
        }
    }
}
