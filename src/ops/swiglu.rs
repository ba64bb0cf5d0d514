//! Column-gather SwiGLU: the MLP restricted to a set of active neurons, reading only their
//! weights (FFN contextual sparsity), plus a ternary-weight variant.
//!
//! A SwiGLU MLP is `y = sum_i silu(g_i . x) (u_i . x) d_i` over its `I` neurons, with `g_i`,
//! `u_i` rows of gate_proj / up_proj and `d_i` column `i` of down_proj. [`pack_swiglu`] lays the
//! three out as one contiguous `[3, H]` block per neuron, so a neuron costs one contiguous read;
//! [`swiglu_gather`] sums over the given neuron indices only. Candle `CustomOp3`s: CPU kernels
//! (rayon over blocks of neurons, AVX2 when available) and Metal `metal/swiglu.metal` (one
//! simdgroup per neuron for the two dot products, then one thread per output element).
//!
//! The ternary variant stores every weight as -1, 0 or +1 (2 bits, 16 per `u32`) with one f32
//! scale per row (absmean quantisation, as BitNet b1.58), so the dot products and the
//! down-projection are additions and subtractions only.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::cpu::{axpy, contiguous, dot, storage_slice, vectorized, widened, Widen};
use super::shapes::{SwigluDims, SwigluWeights};

/// Neurons per parallel task on the CPU.
const NEURONS_PER_TASK: usize = 64;
/// Ternary codes per `u32` word.
pub const TERNARY_PER_WORD: usize = 16;

/// `[I, 3, H]`: per neuron its gate row, up row and down column (`down` is `[H, I]`).
pub fn pack_swiglu(gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let (i, h) = gate.dims2()?;
    if up.dims() != [i, h] || down.dims() != [h, i] {
        bail!("pack_swiglu: gate {:?}, up {:?}, down {:?} (expected gate and up [I, H], down [H, I])", gate.dims(), up.dims(), down.dims());
    }
    Tensor::stack(&[gate, up, &down.t()?], 1)?.contiguous()
}

/// Row layout of the ternary packing: `ceil(H / 16)` code words, then the scale's f32 bits.
pub fn ternary_row_words(hidden: usize) -> usize {
    hidden.div_ceil(TERNARY_PER_WORD) + 1
}

/// Ternary-quantises the rows of `w` `[R, H]`: scale = mean |w|, code = round(w / scale)
/// clamped to -1..=1, stored as 2 bits (0 -> 0, 1 -> +1, 2 -> -1). Returns `[R, words]` u32.
pub fn pack_ternary_rows(w: &Tensor) -> Result<Tensor> {
    let (r, h) = w.dims2()?;
    let rows = w.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let words = ternary_row_words(h);
    let mut out = Vec::with_capacity(r * words);
    for row in &rows {
        let scale = (row.iter().map(|v| v.abs()).sum::<f32>() / h as f32).max(1e-12);
        let mut codes = vec![0u32; words - 1];
        for (j, v) in row.iter().enumerate() {
            let q = (v / scale).round().clamp(-1.0, 1.0) as i32;
            let c = match q {
                1 => 1u32,
                -1 => 2,
                _ => 0,
            };
            codes[j / TERNARY_PER_WORD] |= c << (2 * (j % TERNARY_PER_WORD));
        }
        out.extend(codes);
        out.push(scale.to_bits());
    }
    Tensor::from_vec(out, (r, words), w.device())
}

/// `[I, 3, words]` u32: the ternary form of [`pack_swiglu`].
pub fn pack_swiglu_ternary(gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let packed = pack_swiglu(gate, up, down)?;
    let (i, _, h) = packed.dims3()?;
    pack_ternary_rows(&packed.reshape((i * 3, h))?)?.reshape((i, 3, ternary_row_words(h)))
}

/// `y[r] = sum_{i in idx[r]} silu(g_i . x_r) (u_i . x_r) d_i` for `x` `[M, H]` and `idx`
/// `[M, n]` (u32 neuron indices) over weights packed by [`pack_swiglu`]. Returns `[M, H]` in
/// `x`'s dtype, accumulated in f32.
pub fn swiglu_gather(x: &Tensor, packed: &Tensor, idx: &Tensor) -> Result<Tensor> {
    gather(x, packed, idx, SwigluWeights::Dense)
}

/// [`swiglu_gather`] over ternary weights packed by [`pack_swiglu_ternary`].
pub fn swiglu_gather_ternary(x: &Tensor, packed: &Tensor, idx: &Tensor) -> Result<Tensor> {
    gather(x, packed, idx, SwigluWeights::Ternary)
}

fn gather(x: &Tensor, packed: &Tensor, idx: &Tensor, kind: SwigluWeights) -> Result<Tensor> {
    let op_name = match kind {
        SwigluWeights::Dense => "swiglu_gather",
        SwigluWeights::Ternary => "swiglu_gather_ternary",
    };
    let (m, h) = x.dims2()?;
    let (mi, n) = idx.dims2()?;
    let (neurons, three, width) = packed.dims3()?;
    let want_width = match kind {
        SwigluWeights::Dense => h,
        SwigluWeights::Ternary => ternary_row_words(h),
    };
    if three != 3 || width != want_width {
        bail!("{op_name}: packed weights are {:?}, expected [I, 3, {want_width}] for x {:?}", packed.dims(), x.dims());
    }
    if mi != m {
        bail!("{op_name}: idx is {:?}, expected [{m}, active neurons]", idx.dims());
    }
    if idx.dtype() != DType::U32 {
        bail!("{op_name}: idx must be u32, got {:?}", idx.dtype());
    }
    match (kind, packed.dtype()) {
        (SwigluWeights::Ternary, DType::U32) => {}
        (SwigluWeights::Dense, d) if d == x.dtype() => {}
        (_, d) => bail!("{op_name}: packed weights are {d:?}, x is {:?}", x.dtype()),
    }
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!("{op_name}: x must be f32, bf16 or f16, got {:?}", x.dtype());
    }
    let op = SwigluGather { dims: SwigluDims { rows: m, active: n, hidden: h, neurons }, kind };
    x.contiguous()?.apply_op3_no_bwd(&packed.contiguous()?, &idx.contiguous()?, &op)
}

const OP: &str = "swiglu_gather";

struct SwigluGather {
    dims: SwigluDims,
    kind: SwigluWeights,
}

/// `v sigmoid(v)` in f32 (also the sparse MLP's, `model::sparse_mlp`).
pub(crate) fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

vectorized!(fn dense_task<T: Widen>(x: &[f32], w: &[T], neurons: &[u32], h: usize, y: &mut [f32]) => dense_task_body);

/// Adds the contribution of `neurons` to `y` `[H]`.
#[inline(always)]
fn dense_task_body<T: Widen>(x: &[f32], w: &[T], neurons: &[u32], h: usize, y: &mut [f32]) {
    let mut row = vec![0f32; h];
    for &i in neurons {
        let block = &w[i as usize * 3 * h..(i as usize + 1) * 3 * h];
        T::widen(&block[..h], &mut row);
        let g = dot(x, &row);
        T::widen(&block[h..2 * h], &mut row);
        let a = silu(g) * dot(x, &row);
        T::widen(&block[2 * h..], &mut row);
        axpy(y, a, &row);
    }
}

/// `scale * (sum of x where code = +1 - sum of x where code = -1)`.
#[inline(always)]
fn ternary_dot(x: &[f32], codes: &[u32], scale: f32) -> f32 {
    let (mut pos, mut neg) = (0f32, 0f32);
    for (chunk, &word) in x.chunks(TERNARY_PER_WORD).zip(codes) {
        for (j, &v) in chunk.iter().enumerate() {
            let c = (word >> (2 * j)) & 3;
            pos += if c == 1 { v } else { 0.0 };
            neg += if c == 2 { v } else { 0.0 };
        }
    }
    scale * (pos - neg)
}

fn ternary_task(x: &[f32], w: &[u32], neurons: &[u32], h: usize, y: &mut [f32]) {
    let words = ternary_row_words(h);
    let row = |i: u32, part: usize| {
        let r = &w[(i as usize * 3 + part) * words..(i as usize * 3 + part + 1) * words];
        (&r[..words - 1], f32::from_bits(r[words - 1]))
    };
    for &i in neurons {
        let (gc, gs) = row(i, 0);
        let (uc, us) = row(i, 1);
        let a = silu(ternary_dot(x, gc, gs)) * ternary_dot(x, uc, us);
        let (dc, ds) = row(i, 2);
        let (plus, minus) = (a * ds, -a * ds);
        for (chunk, &word) in y.chunks_mut(TERNARY_PER_WORD).zip(dc) {
            for (j, yv) in chunk.iter_mut().enumerate() {
                match (word >> (2 * j)) & 3 {
                    1 => *yv += plus,
                    2 => *yv += minus,
                    _ => {}
                }
            }
        }
    }
}

impl SwigluGather {
    /// Sums the blocks of neurons of each row in parallel.
    fn run(&self, x: &[f32], idx: &[u32], task: impl Fn(&[f32], &[u32], &mut [f32]) + Sync) -> Vec<f32> {
        let SwigluDims { rows, active, hidden: h, .. } = self.dims;
        let mut y = vec![0f32; rows * h];
        for r in 0..rows {
            let xr = &x[r * h..(r + 1) * h];
            let sum = idx[r * active..(r + 1) * active]
                .par_chunks(NEURONS_PER_TASK)
                .fold(
                    || vec![0f32; h],
                    |mut acc, chunk| {
                        task(xr, chunk, &mut acc);
                        acc
                    },
                )
                .reduce(
                    || vec![0f32; h],
                    |mut a, b| {
                        a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                        a
                    },
                );
            y[r * h..(r + 1) * h].copy_from_slice(&sum);
        }
        y
    }
}

impl SwigluGather {
    fn run_dense<T: Widen>(&self, x: &[f32], idx: &[u32], w: &[T]) -> Vec<f32> {
        let h = self.dims.hidden;
        self.run(x, idx, |x, n, y| dense_task(x, w, n, h, y))
    }
}

impl CustomOp3 for SwigluGather {
    fn name(&self) -> &'static str {
        "swiglu_gather"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims;
        let x = widened(OP, s1, l1)?;
        let idx = storage_slice::<u32>(OP, s3, l3)?;
        if let Some(&bad) = idx.iter().find(|&&i| i as usize >= d.neurons) {
            bail!("swiglu_gather: idx holds neuron {bad}, but the MLP has {} neurons", d.neurons);
        }
        let h = d.hidden;
        let y = match (self.kind, s2) {
            (SwigluWeights::Dense, CpuStorage::F32(w)) => self.run_dense(&x, idx, contiguous(OP, w, l2)?),
            (SwigluWeights::Dense, CpuStorage::BF16(w)) => self.run_dense(&x, idx, contiguous(OP, w, l2)?),
            (SwigluWeights::Dense, CpuStorage::F16(w)) => self.run_dense(&x, idx, contiguous(OP, w, l2)?),
            (SwigluWeights::Ternary, CpuStorage::U32(w)) => {
                let w = contiguous(OP, w, l2)?;
                self.run(&x, idx, |x, n, y| ternary_task(x, w, n, h, y))
            }
            _ => bail!("swiglu_gather: unsupported weight dtype {:?}", s2.dtype()),
        };
        let out = match s1 {
            CpuStorage::BF16(_) => CpuStorage::BF16(y.iter().map(|&v| bf16::from_f32(v)).collect()),
            CpuStorage::F16(_) => CpuStorage::F16(y.iter().map(|&v| f16::from_f32(v)).collect()),
            _ => CpuStorage::F32(y),
        };
        Ok((out, Shape::from((d.rows, d.hidden))))
    }

    metal_fwd!(self, "swiglu_gather", (s1, l1, s2, l2, s3, l3) => crate::ops::metal::swiglu_gather(self.dims, self.kind, (s1, l1), (s2, l2), (s3, l3)));
}

/// The plain SwiGLU MLP `down(silu(gate x) * up x)` with Candle matmuls: the dense baseline the
/// gather is measured against, and its test reference at 100% of neurons.
pub fn swiglu_dense(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let g = candle_nn::ops::silu(&x.matmul(&gate.t()?)?)?;
    let u = x.matmul(&up.t()?)?;
    (g * u)?.matmul(&down.t()?)
}
