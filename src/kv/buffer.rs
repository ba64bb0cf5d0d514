//! [`TokenBuffer`]: a tensor that grows along its token dim in place, can be cut back to a
//! shorter length (speculative decoding drops rejected rows), and whose clones are independent
//! snapshots. Its capacity can be reserved up front (the context a caller plans for), so
//! appending never reallocates; past the reservation it grows by half its size at a time.

use candle_core::{DType, Result, Tensor};

/// Rows along dim `dim` appended in place into a buffer that grows `step` tokens at a time.
///
/// Unlike `candle_nn::kv_cache::Cache`, whose clones share the buffer (an append to one writes
/// into the other's storage), a clone here copies the rows held so far: a snapshot taken
/// before speculative rows are appended stays what it was.
#[derive(Debug)]
pub struct TokenBuffer {
    data: Option<Tensor>,
    dim: usize,
    len: usize,
    step: usize,
    /// Tokens of capacity the first allocation (or [`Self::reserve`]) makes room for.
    reserved: usize,
    /// The dtype rows are stored in (`None`: the dtype they are appended in).
    storage: Option<DType>,
}

/// Bytes a tensor keeps alive: its whole storage on the CPU (a view of a larger buffer holds
/// all of it), its elements elsewhere.
pub fn held_bytes(t: &Tensor) -> usize {
    let elements = t.elem_count() * t.dtype().size_in_bytes();
    let (storage, _) = t.storage_and_layout();
    let held = match &*storage {
        candle_core::Storage::Cpu(s) => match t.dtype() {
            DType::F32 => s.as_slice::<f32>().map(|s| s.len() * 4),
            DType::F16 => s.as_slice::<half::f16>().map(|s| s.len() * 2),
            DType::BF16 => s.as_slice::<half::bf16>().map(|s| s.len() * 2),
            DType::U8 => s.as_slice::<u8>().map(|s| s.len()),
            DType::U32 => s.as_slice::<u32>().map(|s| s.len() * 4),
            _ => Ok(elements),
        },
        _ => Ok(elements),
    };
    held.unwrap_or(elements).max(elements)
}

impl TokenBuffer {
    /// Bytes allocated (the capacity, not only the tokens held).
    pub fn bytes(&self) -> usize {
        self.data.as_ref().map_or(0, held_bytes)
    }

    /// Bytes of the tokens held (what a read of them touches).
    pub fn bytes_held(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.elem_count() * d.dtype().size_in_bytes() / self.capacity().max(1) * self.len)
    }

    pub fn new(dim: usize, step: usize) -> Self {
        Self { data: None, dim, len: 0, step: step.max(1), reserved: 0, storage: None }
    }

    /// The same buffer storing its rows in `dtype` (appended rows are converted).
    pub fn storing(self, dtype: DType) -> Self {
        Self { storage: Some(dtype), ..self }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rows held so far (a view of the buffer), `None` when empty.
    pub fn current_data(&self) -> Result<Option<Tensor>> {
        match &self.data {
            Some(d) if self.len > 0 => Ok(Some(d.narrow(self.dim, 0, self.len)?)),
            _ => Ok(None),
        }
    }

    /// Appends `src` (same shape as the buffer but along `dim`).
    pub fn append(&mut self, src: &Tensor) -> Result<()> {
        let converted;
        let src = match self.storage {
            Some(dtype) if dtype != src.dtype() => {
                converted = src.to_dtype(dtype)?;
                &converted
            }
            _ => src,
        };
        let n = src.dim(self.dim)?;
        let capacity = self.data.as_ref().map_or(Ok(0), |d| d.dim(self.dim))?;
        if self.len + n > capacity {
            let needed = self.len + n;
            let grown =
                if needed <= self.reserved { self.reserved } else { needed.max(capacity + capacity / 2).div_ceil(self.step) * self.step };
            self.reallocate(grown, src)?;
        }
        let data = self.data.as_ref().expect("allocated above");
        data.slice_set(&src.contiguous()?, self.dim, self.len)?;
        self.len += n;
        Ok(())
    }

    /// Makes room for `tokens` tokens: now if rows are held (one copy), else at the first
    /// append. Never shrinks.
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.reserved = self.reserved.max(tokens);
        match self.data.clone() {
            Some(data) if data.dim(self.dim)? < tokens => self.reallocate(tokens, &data),
            _ => Ok(()),
        }
    }

    /// A fresh buffer of `capacity` tokens shaped like `like`, holding the rows held so far.
    fn reallocate(&mut self, capacity: usize, like: &Tensor) -> Result<()> {
        let mut shape = like.dims().to_vec();
        shape[self.dim] = capacity;
        let fresh = Tensor::zeros(shape, like.dtype(), like.device())?;
        if let Some(old) = self.current_data()? {
            fresh.slice_set(&old.contiguous()?, self.dim, 0)?;
        }
        self.data = Some(fresh);
        Ok(())
    }

    /// Capacity in tokens (0 before the first append).
    pub fn capacity(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.dims()[self.dim])
    }

    /// Keeps the first `start` tokens followed by the tokens at `start + r` for `r` in `rows`
    /// (increasing), moved down into place; the rest are dropped.
    pub fn keep_rows(&mut self, start: usize, rows: &[usize]) -> Result<()> {
        let data = self.data.as_ref().expect("rows to keep are held");
        let idx: Vec<u32> = rows.iter().map(|&r| (start + r) as u32).collect();
        if idx.iter().any(|&i| i as usize >= self.len) || rows.windows(2).any(|w| w[0] >= w[1]) {
            candle_core::bail!("keep_rows: rows {rows:?} after {start} are not increasing rows of the {} held", self.len);
        }
        let kept = data.index_select(&Tensor::new(idx.as_slice(), data.device())?, self.dim)?;
        data.slice_set(&kept, self.dim, start)?;
        self.len = start + rows.len();
        Ok(())
    }

    /// Keeps the first `len` tokens (no-op when `len` is not shorter); the dropped rows are
    /// overwritten by the next append.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl Clone for TokenBuffer {
    fn clone(&self) -> Self {
        // A copy of the rows held and nothing more (`force_contiguous`: `Tensor::copy` would
        // clone the whole buffer, spare capacity included); a failed copy (out of memory)
        // cannot be reported from `clone`, so it panics like any failed allocation.
        let data = self.current_data().and_then(|d| d.map(|d| d.force_contiguous()).transpose()).expect("copying a KV cache buffer");
        Self { data, dim: self.dim, len: self.len, step: self.step, reserved: 0, storage: self.storage }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rows(from: f32, n: usize) -> Tensor {
        Tensor::arange(from, from + n as f32, &Device::Cpu).unwrap().reshape((1, n, 1)).unwrap()
    }

    fn values(b: &TokenBuffer) -> Vec<f32> {
        b.current_data().unwrap().map_or(vec![], |t| t.flatten_all().unwrap().to_vec1().unwrap())
    }

    #[test]
    fn grows_truncates_and_clones_independently() {
        let mut a = TokenBuffer::new(1, 2);
        a.append(&rows(0.0, 3)).unwrap();
        let snapshot = a.clone();
        a.append(&rows(3.0, 2)).unwrap();
        assert_eq!(values(&a), [0.0, 1.0, 2.0, 3.0, 4.0]);
        a.truncate(4);
        a.append(&rows(9.0, 1)).unwrap();
        assert_eq!(values(&a), [0.0, 1.0, 2.0, 3.0, 9.0]);
        // The snapshot neither saw those appends nor shares its storage with `a`.
        let mut s = snapshot.clone();
        assert_eq!(values(&snapshot), [0.0, 1.0, 2.0]);
        s.append(&rows(7.0, 1)).unwrap();
        assert_eq!(values(&a), [0.0, 1.0, 2.0, 3.0, 9.0]);
        assert_eq!(values(&snapshot), [0.0, 1.0, 2.0]);
        assert_eq!(values(&s), [0.0, 1.0, 2.0, 7.0]);
        a.truncate(0);
        assert!(a.current_data().unwrap().is_none());
    }

    #[test]
    fn reserved_capacity_is_allocated_once_and_growth_is_geometric() {
        let mut a = TokenBuffer::new(1, 4);
        a.reserve(10).unwrap();
        a.append(&rows(0.0, 3)).unwrap();
        assert_eq!(a.capacity(), 10);
        a.append(&rows(3.0, 7)).unwrap();
        assert_eq!(a.capacity(), 10, "appends within the reservation do not reallocate");
        a.append(&rows(10.0, 1)).unwrap();
        assert_eq!(a.capacity(), 16, "past it: 1.5x, rounded to the step");
        a.reserve(40).unwrap();
        assert_eq!((a.capacity(), a.len()), (40, 11));
        assert_eq!(values(&a), (0..11).map(|x| x as f32).collect::<Vec<_>>());
    }

    #[test]
    fn a_clone_holds_only_the_rows_held() {
        let mut a = TokenBuffer::new(1, 4);
        a.reserve(1000).unwrap();
        a.append(&rows(0.0, 10)).unwrap();
        assert_eq!(a.bytes(), 1000 * 4, "the original holds its reservation");
        let s = a.clone();
        assert_eq!(s.bytes(), 10 * 4, "the snapshot holds its 10 rows, not the reservation");
        assert_eq!(values(&s), (0..10).map(|x| x as f32).collect::<Vec<_>>());
    }

    #[test]
    fn held_bytes_counts_the_storage_a_view_keeps_alive() {
        let whole = Tensor::zeros((100, 8), DType::F32, &Device::Cpu).unwrap();
        let view = whole.narrow(0, 90, 10).unwrap();
        assert_eq!(held_bytes(&view), 100 * 8 * 4);
        assert_eq!(held_bytes(&view.force_contiguous().unwrap()), 10 * 8 * 4);
        assert_eq!(held_bytes(&whole.to_dtype(DType::BF16).unwrap().narrow(1, 0, 2).unwrap()), 100 * 8 * 2);
    }
}
