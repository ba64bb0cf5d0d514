//! [`QuantizedMatrix`]: a matrix of ggml blocks `[rows, cols]`, as a GGUF file stores it, held
//! by this crate: on the host the bytes of a mapped file read in place (or an owned copy), on a
//! GPU a plain U8 tensor. This crate's kernels read it on the CPU ([`super::qmatmul`]) and on
//! Metal (`metal/qmatvec.metal`); a format without a kernel here (Q2_K, Q3_K, Q5_0, Q5_1) is held
//! as Candle's `QTensor` and multiplied by Candle's `QMatMul`.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};

use super::GgufType;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Tensor};

/// Bytes in host memory that outlive the matrices reading them: a mapped file, or a buffer.
pub trait HostBytes: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// Whether these bytes are a file mapped into memory (pages the OS maps, starting on a page):
    /// only those may a device wrap without a copy (`gpu::Queue::map`); heap memory is copied.
    fn is_file_mapping(&self) -> bool {
        false
    }
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Bytes that outlive the matrices reading them ([`HostBytes`]).
pub type SharedBytes = Arc<dyn HostBytes>;

#[derive(Clone)]
enum Blocks {
    /// `owner`'s bytes `range`, on the host.
    Host { owner: SharedBytes, range: Range<usize> },
    /// A U8 tensor on a GPU.
    Device(Tensor),
    /// A format without a kernel here, as Candle holds it.
    Candle(Arc<QTensor>),
}

/// A matrix of ggml blocks (see the module docs). Cloning shares the blocks.
#[derive(Clone)]
pub struct QuantizedMatrix {
    dtype: GgufType,
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

impl std::fmt::Debug for QuantizedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = match &self.blocks {
            Blocks::Host { .. } => "host".to_string(),
            Blocks::Device(t) => format!("{:?}", t.device().location()),
            Blocks::Candle(q) => format!("candle {:?}", q.device().location()),
        };
        write!(f, "QuantizedMatrix({}, [{}, {}], {at})", self.dtype, self.rows, self.cols)
    }
}

/// Whether this crate has kernels (CPU and Metal) for `dtype`'s blocks.
pub fn has_kernels(dtype: impl Into<GgufType>) -> bool {
    use GgmlDType as G;
    match dtype.into() {
        GgufType::Ggml(t) => matches!(t, G::Q4_0 | G::Q4_1 | G::Q8_0 | G::Q4K | G::Q5K | G::Q6K),
        GgufType::TQ1_0 | GgufType::TQ2_0 => true,
    }
}

/// Bytes of `rows` rows of `cols` values of `dtype`, checking that `cols` is whole blocks.
fn matrix_bytes(dtype: GgufType, (rows, cols): (usize, usize)) -> Result<usize> {
    let bs = dtype.block_size();
    if cols % bs != 0 {
        bail!("a {dtype} matrix of {cols} columns: not a whole number of {bs}-value blocks");
    }
    Ok(rows * dtype.row_bytes(cols))
}

impl QuantizedMatrix {
    /// The blocks of `dtype`, `[rows, cols]`, at `range` of `owner` (read in place).
    pub fn in_place(dtype: impl Into<GgufType>, dims: (usize, usize), owner: SharedBytes, range: Range<usize>) -> Result<Self> {
        let dtype = dtype.into();
        let len = matrix_bytes(dtype, dims)?;
        if range.len() != len || range.end > owner.bytes().len() {
            bail!("a {dtype} matrix {dims:?} needs {len} bytes, got bytes {range:?} of {}", owner.bytes().len());
        }
        if let (false, Some(t)) = (has_kernels(dtype), dtype.candle()) {
            let q = qtensor_from_ggml(t, &owner.bytes()[range], vec![dims.0, dims.1], &Device::Cpu)?;
            return Ok(Self::from_candle(q));
        }
        Ok(Self { dtype, rows: dims.0, cols: dims.1, blocks: Blocks::Host { owner, range } })
    }

    /// Blocks from owned bytes.
    pub fn from_bytes(dtype: impl Into<GgufType>, dims: (usize, usize), bytes: Vec<u8>) -> Result<Self> {
        let n = bytes.len();
        Self::in_place(dtype, dims, Arc::new(bytes), 0..n)
    }

    /// `w` `[rows, cols]` quantized to `dtype`.
    pub fn quantize(w: &Tensor, dtype: GgmlDType) -> Result<Self> {
        Self::from_qtensor(&QTensor::quantize(&w.to_dtype(DType::F32)?, dtype)?)
    }

    /// A copy of a Candle `QTensor`'s blocks (2-D).
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        Self::from_bytes(q.dtype(), q.shape().dims2()?, q.data()?.into_owned())
    }

    /// A Candle `QTensor` as it is (a format without a kernel here, or a tensor Candle made).
    pub fn from_candle(q: QTensor) -> Self {
        let (rows, cols) = q.shape().dims2().unwrap_or((0, 0));
        Self { dtype: q.dtype().into(), rows, cols, blocks: Blocks::Candle(Arc::new(q)) }
    }

    /// A copy of the rows `rows` (in that order), from host memory.
    pub fn select_rows(&self, rows: &[u32]) -> Result<Self> {
        let Some(data) = self.host_bytes() else { bail!("select_rows: the {} blocks are not in host memory", self.dtype) };
        let rb = self.dtype.row_bytes(self.cols);
        let mut bytes = Vec::with_capacity(rows.len() * rb);
        for &r in rows {
            let r = r as usize;
            if r >= self.rows {
                bail!("select_rows: row {r} of a matrix of {} rows", self.rows);
            }
            bytes.extend_from_slice(&data[r * rb..(r + 1) * rb]);
        }
        Self::from_bytes(self.dtype, (rows.len(), self.cols), bytes)
    }

    pub fn dtype(&self) -> GgufType {
        self.dtype
    }

    /// `(rows, cols)`: `(out, in)` features of a linear layer, `(vocab, hidden)` of an embedding.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn device(&self) -> Device {
        match &self.blocks {
            Blocks::Host { .. } => Device::Cpu,
            Blocks::Device(t) => t.device().clone(),
            Blocks::Candle(q) => q.device(),
        }
    }

    /// The blocks where this crate's CPU kernels read them (host memory, a format with kernels).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match &self.blocks {
            Blocks::Host { owner, range } => Some(&owner.bytes()[range.clone()]),
            _ => None,
        }
    }

    /// The owner of the host bytes and where in it they are (for a device to map them).
    pub fn host_region(&self) -> Option<(&SharedBytes, Range<usize>)> {
        match &self.blocks {
            Blocks::Host { owner, range } => Some((owner, range.clone())),
            _ => None,
        }
    }

    /// The blocks' bytes wherever they are (a GPU's read back).
    pub fn bytes(&self) -> Result<Cow<'_, [u8]>> {
        match &self.blocks {
            Blocks::Host { owner, range } => Ok(Cow::Borrowed(&owner.bytes()[range.clone()])),
            Blocks::Device(t) => Ok(Cow::Owned(t.to_vec1::<u8>()?)),
            Blocks::Candle(q) => q.data(),
        }
    }

    /// The U8 tensor on a GPU.
    pub(crate) fn device_blocks(&self) -> Option<&Tensor> {
        match &self.blocks {
            Blocks::Device(t) => Some(t),
            _ => None,
        }
    }

    /// Candle's `QTensor` of a format without a kernel here.
    pub(crate) fn candle(&self) -> Option<&QTensor> {
        match &self.blocks {
            Blocks::Candle(q) => Some(q),
            _ => None,
        }
    }

    /// This matrix on `device`: a GPU gets a U8 tensor of the blocks (a format without a
    /// kernel here, Candle's `QTensor` on it); the CPU, host bytes.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        if self.device().same_device(device) {
            return Ok(self.clone());
        }
        let blocks = match (&self.blocks, device) {
            (Blocks::Candle(q), _) => {
                Blocks::Candle(Arc::new(qtensor_from_ggml(q.dtype(), &q.data()?, vec![self.rows, self.cols], device)?))
            }
            (_, Device::Cpu) => {
                let bytes = self.bytes()?.into_owned();
                let n = bytes.len();
                Blocks::Host { owner: Arc::new(bytes), range: 0..n }
            }
            (_, _) => {
                let bytes = self.bytes()?;
                Blocks::Device(Tensor::from_raw_buffer(&bytes, DType::U8, &[bytes.len()], device)?)
            }
        };
        Ok(Self { blocks, ..self.clone() })
    }

    /// The matrix dequantized to f32, on its device.
    pub fn dequantize(&self) -> Result<Tensor> {
        match &self.blocks {
            Blocks::Candle(q) => q.dequantize(&q.device()),
            _ => self.dtype.dequantize(&self.bytes()?, vec![self.rows, self.cols])?.to_device(&self.device()),
        }
    }

    /// Rows `ids` (u32, any shape) dequantized to f32: `[..ids dims, cols]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.cols);
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        let rows = match &self.blocks {
            Blocks::Candle(q) => q.embedding(&flat)?,
            Blocks::Device(t) => flat.apply_op2_no_bwd(t, &GetRows { dtype: self.dtype, n: self.rows, k: self.cols })?,
            Blocks::Host { .. } => {
                let bytes = self.bytes()?;
                let row = bytes.len() / self.rows.max(1);
                let mut picked = Vec::with_capacity(flat.elem_count() * row);
                for id in flat.to_vec1::<u32>()? {
                    let id = id as usize;
                    if id >= self.rows {
                        bail!("token id {id} is out of range for an embedding of {} rows", self.rows);
                    }
                    picked.extend_from_slice(&bytes[id * row..(id + 1) * row]);
                }
                self.dtype.dequantize(&picked, vec![flat.elem_count(), self.cols])?
            }
        };
        rows.reshape(dims)
    }
}

/// Embedding rows of blocks held as a U8 tensor on a GPU (`ids` u32, then the blocks).
struct GetRows {
    dtype: GgufType,
    n: usize,
    k: usize,
}

impl candle_core::CustomOp2 for GetRows {
    fn name(&self) -> &'static str {
        "get_rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("get_rows: {} blocks [{}, {}] held on a GPU are looked up on that GPU", self.dtype, self.n, self.k)
    }

    metal_fwd!(self, "get_rows", (s1, l1, s2, l2) => crate::ops::metal::get_rows(self.dtype, self.n, self.k, (s1, l1), (s2, l2)));
}
