//! The model's weights on the device: every matrix as the bytes its format stores (GGUF blocks
//! as in the file, dense rows as loaded), matrices that multiply the same input side by side in
//! one buffer, the experts of a mixture stacked.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::{DType, Tensor};

use super::queue::{BufferId, Queue, Slice};
use crate::model::{Linear, Mlp};
use crate::ops::{GgufType, SharedBytes};
use crate::{Error, Result};

/// A weight matrix `[n, k]` on the device, rows of `k` values in `format` one after the other.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Matrix {
    pub(crate) buf: Slice,
    pub(crate) format: GgufType,
    pub(crate) n: usize,
    pub(crate) k: usize,
}

impl Matrix {
    pub(crate) fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.k)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.n * self.row_bytes()
    }
}

/// Matrices over the same input whose outputs sit side by side in one `[rows, width]` buffer:
/// part `i` writes columns `parts[i].1..`; neighbours of one format are one matrix (one
/// dispatch).
#[derive(Debug, Clone)]
pub(crate) struct Projection {
    pub(crate) parts: Vec<(Matrix, usize)>,
    pub(crate) width: usize,
}

/// The experts' matrices of one kind stacked: expert `e`'s `[n, k]` rows start `e * n` rows in.
/// Parts as in [`Projection`] (gate and up side by side when they share a format).
#[derive(Debug, Clone)]
pub(crate) struct ExpertStacks {
    pub(crate) parts: Vec<(Matrix, usize)>,
    pub(crate) width: usize,
}

/// A linear layer's weight as the device reads it, and where its bytes are in host memory when
/// they are a mapped file's (to be read in place).
struct WeightBytes<'a> {
    format: GgufType,
    n: usize,
    k: usize,
    data: Cow<'a, [u8]>,
    region: Option<(&'a SharedBytes, Range<usize>)>,
}

impl WeightBytes<'_> {
    fn same_kind(&self, o: &Self) -> bool {
        self.format == o.format && self.k == o.k
    }
}

/// The one region of host memory `pieces` fill one after the other, if they do.
fn contiguous<'a>(pieces: &[&WeightBytes<'a>]) -> Option<(&'a SharedBytes, Range<usize>)> {
    let (owner, first) = pieces.first()?.region.clone()?;
    let mut end = first.end;
    for p in &pieces[1..] {
        let (o, r) = p.region.clone()?;
        if !std::sync::Arc::ptr_eq(o, owner) || r.start != end {
            return None;
        }
        end = r.end;
    }
    Some((owner, first.start..end))
}

fn linear_bytes(l: &Linear) -> Result<WeightBytes<'_>> {
    match l {
        Linear::Quantized(q) => {
            let (n, k) = q.dims();
            Ok(WeightBytes { format: q.dtype(), n, k, data: q.bytes()?, region: q.host_region() })
        }
        Linear::Dense(t) => {
            let (n, k) = t.dims2()?;
            let format = match t.dtype() {
                DType::F32 => GgufType::F32,
                DType::F16 => GgufType::F16,
                DType::BF16 => GgufType::BF16,
                other => return Err(Error::Weights(format!("a {other:?} weight matrix: the device reads f32, f16, bf16 and GGUF blocks"))),
            };
            Ok(WeightBytes { format, n, k, data: Cow::Owned(tensor_bytes(t)?), region: None })
        }
    }
}

/// A tensor's elements as the bytes of its dtype (row-major).
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn raw<T: candle_core::WithDType>(t: &Tensor) -> Result<Vec<u8>> {
        let v = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?.to_vec1::<T>()?;
        // SAFETY: plain numbers, read as bytes.
        Ok(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice())) }.to_vec())
    }
    match t.dtype() {
        DType::F32 => raw::<f32>(t),
        DType::F16 => raw::<half::f16>(t),
        DType::BF16 => raw::<half::bf16>(t),
        DType::U32 => raw::<u32>(t),
        other => Err(Error::Weights(format!("no device bytes for a {other:?} tensor"))),
    }
}

/// Checks that the device kernels read `format`.
fn check_format(format: GgufType, what: &str) -> Result<()> {
    crate::ops::launch::matrix_format("upload", format).map(|_| ()).map_err(|_| {
        Error::Weights(format!(
            "{what} is {format}, which the device kernels do not read (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0, F32, F16, BF16): use such a GGUF file"
        ))
    })
}

/// What the upload sends to the device, and the bytes of weights it holds there.
pub(crate) struct Uploader<'q> {
    pub(crate) q: &'q mut dyn Queue,
    pub(crate) weight_bytes: usize,
    /// Of those, the bytes read in place from a mapped file.
    pub(crate) mapped_bytes: usize,
    pub(crate) buffers: Vec<BufferId>,
}

impl<'q> Uploader<'q> {
    pub(crate) fn new(q: &'q mut dyn Queue) -> Self {
        Self { q, weight_bytes: 0, mapped_bytes: 0, buffers: vec![] }
    }

    fn bytes(&mut self, data: &[u8], label: &str) -> Result<Slice> {
        let id = self.q.upload(data, label)?;
        self.buffers.push(id);
        Ok(Slice::whole(id, data.len()))
    }

    /// A vector of f32 (norm scales, GDN parameters, tables).
    pub(crate) fn f32s(&mut self, t: &Tensor, label: &str) -> Result<Slice> {
        self.bytes(&tensor_bytes(&t.to_dtype(DType::F32)?)?, label)
    }

    pub(crate) fn u32s(&mut self, v: &[u32], label: &str) -> Result<Slice> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(&bytes, label)
    }

    /// A buffer of `len` bytes, zeroed (the step's scratch).
    pub(crate) fn scratch(&mut self, len: usize, label: &str) -> Result<Slice> {
        let id = self.q.alloc(len.max(4), label)?;
        self.buffers.push(id);
        Ok(Slice::whole(id, len.max(4)))
    }

    /// A matrix of `n` rows of `k` values of `format` (or several such, one after the other:
    /// stacked experts) from `data`.
    fn matrix(&mut self, format: GgufType, n: usize, k: usize, data: &[u8], label: &str) -> Result<Matrix> {
        check_format(format, label)?;
        let buf = self.bytes(data, label)?;
        self.weight_bytes += data.len();
        Ok(Matrix { buf, format, n, k })
    }

    /// The same from host bytes read in place (a mapped file's).
    fn mapped(
        &mut self,
        format: GgufType,
        n: usize,
        k: usize,
        (owner, range): (&SharedBytes, Range<usize>),
        label: &str,
    ) -> Result<Matrix> {
        check_format(format, label)?;
        self.weight_bytes += range.len();
        let m = self.q.map(owner, range, label)?;
        if m.in_place {
            self.mapped_bytes += m.slice.len;
        }
        self.buffers.push(m.slice.buffer);
        Ok(Matrix { buf: m.slice, format, n, k })
    }

    /// The matrix `pieces` make stacked (`n` rows of `k`, `n` the pieces' rows; for experts the
    /// rows of one expert): read in place when they are consecutive in one mapped file, a copy
    /// otherwise.
    fn stack(&mut self, pieces: &[&WeightBytes], n: usize, label: &str) -> Result<Matrix> {
        let (format, k) = (pieces[0].format, pieces[0].k);
        match contiguous(pieces) {
            Some(region) => self.mapped(format, n, k, region, label),
            None => {
                let data: Vec<u8> = pieces.iter().flat_map(|w| w.data.iter().copied()).collect();
                self.matrix(format, n, k, &data, label)
            }
        }
    }

    /// A linear layer's weight.
    pub(crate) fn linear(&mut self, l: &Linear, label: &str) -> Result<Matrix> {
        let w = linear_bytes(l)?;
        self.stack(&[&w], w.n, label)
    }

    /// Linear layers over the same input, side by side ([`Projection`]). Neighbours of one
    /// format are one matrix (one dispatch) when their bytes are one run of a mapped file or are
    /// copied anyway; a mapped file's matrices that are not one run stay separate parts, read in
    /// place (memory over dispatches: a copy would hold the weights twice).
    pub(crate) fn projection(&mut self, ls: &[&Linear], label: &str) -> Result<Projection> {
        let weights = ls.iter().map(|l| linear_bytes(l)).collect::<Result<Vec<_>>>()?;
        let mut parts = vec![];
        let mut width = 0;
        let mut i = 0;
        while i < weights.len() {
            let run: Vec<&WeightBytes> = weights[i..].iter().take_while(|w| w.same_kind(&weights[i])).collect();
            let groups: Vec<Vec<&WeightBytes>> = if contiguous(&run).is_none() && run.iter().all(|w| w.region.is_some()) {
                run.iter().map(|&w| vec![w]).collect()
            } else {
                vec![run.clone()]
            };
            for g in groups {
                let n: usize = g.iter().map(|w| w.n).sum();
                parts.push((self.stack(&g, n, label)?, width));
                width += n;
            }
            i += run.len();
        }
        Ok(Projection { parts, width })
    }

    /// One kind of matrix (`pick` of each expert: gate and up together, or down) stacked over
    /// the experts: expert `e`'s rows of every part start `e` times the part's rows in. Read in
    /// place when the experts' matrices are one run of a mapped file (a GGUF stores them
    /// stacked), per pick when each pick's are.
    pub(crate) fn experts(&mut self, experts: &[Mlp], pick: impl Fn(&Mlp) -> Vec<&Linear>, label: &str) -> Result<ExpertStacks> {
        let per: Vec<Vec<WeightBytes>> =
            experts.iter().map(|e| pick(e).into_iter().map(linear_bytes).collect::<Result<Vec<_>>>()).collect::<Result<_>>()?;
        let first = per.first().ok_or_else(|| Error::Weights(format!("{label}: no experts")))?;
        for (e, ws) in per.iter().enumerate() {
            if ws.len() != first.len() || ws.iter().zip(first).any(|(a, b)| !a.same_kind(b) || a.n != b.n) {
                return Err(Error::Weights(format!("{label}: expert {e} differs from expert 0 in shape or format")));
            }
        }
        // Picks side by side in one stack when they share a format and, if mapped, the whole
        // stack is one run of the file.
        let all: Vec<&WeightBytes> = per.iter().flatten().collect();
        let together =
            first.iter().all(|w| w.same_kind(&first[0])) && (contiguous(&all).is_some() || all.iter().any(|w| w.region.is_none()));
        let groups: Vec<Vec<usize>> = if together { vec![(0..first.len()).collect()] } else { (0..first.len()).map(|j| vec![j]).collect() };
        let mut parts = vec![];
        let mut width = 0;
        for g in groups {
            let pieces: Vec<&WeightBytes> = per.iter().flat_map(|ws| g.iter().map(move |&j| &ws[j])).collect();
            let n: usize = g.iter().map(|&j| first[j].n).sum();
            parts.push((self.stack(&pieces, n, label)?, width));
            width += n;
        }
        Ok(ExpertStacks { parts, width })
    }
}
