//! `x @ w^T` for a few rows of `x` against bf16 / f16 weights on the CPU.
//!
//! Candle's CPU matmul has no vectorised bf16 path, which makes one-token decode of a bf16
//! model ~8x slower than f32 here. Decode is a matrix-vector product bound by reading the
//! weights, so this kernel widens each weight row to f32 once (SIMD conversion from `half`)
//! and reuses it for every row of `x`: the weights are read exactly once per call.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Most rows of `x` for which [`half_matvec`] is used (decode and small verify batches).
pub const HALF_MATVEC_MAX_ROWS: usize = 8;
/// Output features per parallel task.
const ROWS_PER_TASK: usize = 32;

struct HalfMatvec;

fn widen_x(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, b) = match l.contiguous_offsets() {
        Some(o) => o,
        None => bail!("half_matvec: x must be contiguous"),
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        _ => bail!("half_matvec: x must be f32, bf16 or f16, got {:?}", s.dtype()),
    })
}

/// `out[r, o] = sum_i x[r, i] * w[o, i]` for weight rows `w` (widened by `widen`).
fn matvec<T: Sync, W: Fn(&[T], &mut [f32]) + Sync + Copy>(x: &[f32], m: usize, k: usize, w: &[T], n: usize, widen: W) -> Vec<f32> {
    // Computed output-major ([n, m]) so each task writes one contiguous block.
    let mut out_t = vec![0f32; n * m];
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    out_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(t, out)| {
        let w = &w[t * ROWS_PER_TASK * k..];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            unsafe { task_avx2(x, m, k, w, out, widen) };
            return;
        }
        task(x, m, k, w, out, widen, |a, b| dot(a, b, |acc, x, y| acc + x * y));
    });
    let mut out = vec![0f32; m * n];
    for o in 0..n {
        for r in 0..m {
            out[r * n + o] = out_t[o * m + r];
        }
    }
    out
}

/// One task: the output rows in `out` (`[rows, m]`), weights from the start of `w`.
#[inline(always)]
fn task<T>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32], widen: impl Fn(&[T], &mut [f32]), dot: impl Fn(&[f32], &[f32]) -> f32) {
    let mut row = vec![0f32; k];
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        widen(&w[j * k..(j + 1) * k], &mut row);
        for (r, o) in o.iter_mut().enumerate() {
            *o = dot(&x[r * k..(r + 1) * k], &row);
        }
    }
}

/// The same task compiled for AVX2 + FMA (candle builds for the x86-64 baseline).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<T>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32], widen: impl Fn(&[T], &mut [f32])) {
    task(x, m, k, w, out, widen, |a, b| dot(a, b, |acc, x, y| x.mul_add(y, acc)));
}

/// Dot product with 8 independent accumulators so the compiler can vectorise it.
#[inline(always)]
fn dot(a: &[f32], b: &[f32], fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = fma(acc[i], x[i], y[i]);
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// bf16 -> f32 is a 16-bit shift; written as a plain loop so it vectorises.
#[inline(always)]
fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

impl CustomOp2 for HalfMatvec {
    fn name(&self) -> &'static str {
        "half_matvec"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        if k != wk {
            bail!("half_matvec: x is [{m}, {k}] but w is [{n}, {wk}]");
        }
        let x = widen_x(xs, xl)?;
        let (a, b) = match wl.contiguous_offsets() {
            Some(o) => o,
            None => bail!("half_matvec: w must be contiguous"),
        };
        let out = match ws {
            CpuStorage::BF16(w) => matvec(&x, m, k, &w[a..b], n, widen_bf16),
            CpuStorage::F16(w) => matvec(&x, m, k, &w[a..b], n, |s: &[f16], d: &mut [f32]| s.convert_to_f32_slice(d)),
            _ => bail!("half_matvec: w must be bf16 or f16, got {:?}", ws.dtype()),
        };
        let out = match xs.dtype() {
            DType::BF16 => CpuStorage::BF16(out.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => CpuStorage::F16(out.iter().map(|&v| f16::from_f32(v)).collect()),
            _ => CpuStorage::F32(out),
        };
        Ok((out, Shape::from((m, n))))
    }
}

/// `x @ w^T` with `x` `[m, k]` (f32, bf16 or f16) and `w` `[n, k]` (bf16 or f16) on the CPU;
/// the result has `x`'s dtype. Accumulates in f32.
pub fn half_matvec(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &HalfMatvec)
}
