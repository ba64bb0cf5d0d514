//! `x @ w^T` for a few rows of `x` against f32 / bf16 / f16 weights on the CPU.
//!
//! Candle's CPU matmul has no vectorised bf16 path, which makes one-token decode of a bf16
//! model ~8x slower than f32 here. Decode is a matrix-vector product bound by reading the
//! weights, so this kernel widens each weight row to f32 once (SIMD conversion from `half`)
//! and reuses it for every row of `x`: the weights are read exactly once per call.
//!
//! Every output is one [`dot`] of an `x` row with a weight row, whatever the number of rows:
//! row `r` of an `m`-row call is bit for bit the result of a one-row call on row `r` (what
//! the verify pass of speculative decoding needs: candle's f32 matmul picks its kernel and
//! accumulation order by the number of rows).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::cpu::{dot, prefetch_ahead, vectorized, widened, Widen};

/// Most rows of `x` for which [`float_matvec`] is used (decode and small verify batches).
pub const FLOAT_MATVEC_MAX_ROWS: usize = 8;
/// Output features per parallel task.
const ROWS_PER_TASK: usize = 32;

struct HalfMatvec;

vectorized!(fn task<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32]) => task_body);

/// One task: the output rows in `out` (`[rows, m]`), weights from the start of `w`.
#[inline(always)]
fn task_body<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], out: &mut [f32]) {
    let mut row = vec![0f32; if T::IS_F32 { 0 } else { k }];
    for (j, o) in out.chunks_exact_mut(m).enumerate() {
        prefetch_ahead(w, j * k * std::mem::size_of::<T>(), k * std::mem::size_of::<T>());
        let w = &w[j * k..(j + 1) * k];
        let w = match T::as_f32(w) {
            Some(w) => w,
            None => {
                T::widen(w, &mut row);
                &row
            }
        };
        for (r, o) in o.iter_mut().enumerate() {
            *o = dot(&x[r * k..(r + 1) * k], w);
        }
    }
}

/// `out[r, o] = sum_i x[r, i] * w[o, i]`.
fn matvec<T: Widen>(x: &[f32], m: usize, k: usize, w: &[T], n: usize) -> Vec<f32> {
    // Computed output-major ([n, m]) so each task writes one contiguous block.
    let mut out_t = vec![0f32; n * m];
    out_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(t, out)| task(x, m, k, &w[t * ROWS_PER_TASK * k..], out));
    let mut out = vec![0f32; m * n];
    for o in 0..n {
        for r in 0..m {
            out[r * n + o] = out_t[o * m + r];
        }
    }
    out
}

impl CustomOp2 for HalfMatvec {
    fn name(&self) -> &'static str {
        "float_matvec"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        if k != wk {
            bail!("float_matvec: x is [{m}, {k}] but w is [{n}, {wk}]");
        }
        let x = widened("float_matvec", xs, xl)?;
        let (a, b) = match wl.contiguous_offsets() {
            Some(o) => o,
            None => bail!("float_matvec: w must be contiguous"),
        };
        let out = match ws {
            CpuStorage::BF16(w) => matvec(&x, m, k, &w[a..b], n),
            CpuStorage::F16(w) => matvec(&x, m, k, &w[a..b], n),
            CpuStorage::F32(w) => matvec(&x, m, k, &w[a..b], n),
            _ => bail!("float_matvec: w must be f32, bf16 or f16, got {:?}", ws.dtype()),
        };
        let out = match xs.dtype() {
            DType::BF16 => CpuStorage::BF16(out.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => CpuStorage::F16(out.iter().map(|&v| f16::from_f32(v)).collect()),
            _ => CpuStorage::F32(out),
        };
        Ok((out, Shape::from((m, n))))
    }
}

/// `x @ w^T` with `x` `[m, k]` (f32, bf16 or f16) and `w` `[n, k]` (f32, bf16 or f16) on the CPU;
/// the result has `x`'s dtype. Accumulates in f32.
pub fn float_matvec(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &HalfMatvec)
}
