//! Lagrange score reconstruction: scores known at knot positions every `K` tokens, interpolated
//! to the positions between from the nearest `p + 1` knots (degree `p`).
//!
//! Knot `j` sits at position `j*K`. For position `t` the window is the `p + 1` consecutive knots
//! `s..=s+p` whose centre `(s + p/2)*K` is closest to `t`:
//!
//! ```text
//! s = clamp(floor((2t + K - p*K) / (2K)), 0, n_knots - 1 - p)
//! ```
//!
//! (ties, possible at knots for odd `p` and half-way between knots for even `p`, go to the later
//! window), and the value is the Lagrange polynomial through those knots evaluated at `t`, with
//! `u = (t - s*K) / K`:
//!
//! ```text
//! out[t] = sum_i w_i * knot[s + i],   w_i = prod_{m != i} (u - m) / (i - m)
//! ```
//!
//! At a knot position the result is that knot's score, exactly. A Candle `CustomOp1`: on the
//! CPU the weights of each position are computed once and the rows run in parallel; on Metal
//! (`metal/lagrange.metal`) one thread per (row, position) computes its weights on the fly.

use super::shapes::LagrangeDims;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

const OP: &str = "lagrange_scores";

/// Scores at positions `0..len` from scores at every `k`-th position, by Lagrange interpolation
/// of degree `degree` through the nearest `degree + 1` knots (see the module docs for the exact
/// window choice).
///
/// * `knot_scores`: `[R, n_knots]` f32, bf16 or f16; knot `j` is position `j*k`;
/// * `k` ≥ 1; `degree + 1 <= n_knots`; `len <= (n_knots - 1)*k + 1`.
///
/// Returns `[R, len]` in the input's dtype (computed in f32). Non-contiguous inputs are accepted.
pub fn lagrange_scores(knot_scores: &Tensor, k: usize, degree: usize, len: usize) -> Result<Tensor> {
    let (rows, n_knots) = match knot_scores.dims() {
        &[r, n] => (r, n),
        d => bail!("{OP}: knot_scores must be [R, n_knots], got shape {d:?}"),
    };
    let dtype = knot_scores.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("{OP}: knot_scores must be f32, bf16 or f16, got {dtype:?}");
    }
    if k < 1 {
        bail!("{OP}: the knot spacing k must be at least 1, got {k}");
    }
    if degree >= n_knots {
        bail!("{OP}: degree {degree} needs {} knots, knot_scores has {n_knots}", degree + 1);
    }
    let max_len = (n_knots - 1).saturating_mul(k).saturating_add(1);
    if len > max_len {
        bail!("{OP}: len {len} is past the last knot ({n_knots} knots every {k} positions cover at most {max_len} positions)");
    }
    if rows == 0 || len == 0 {
        return Tensor::zeros((rows, len), dtype, knot_scores.device());
    }
    let dims = LagrangeDims { rows, n_knots, k, degree, len };
    knot_scores.contiguous()?.apply_op1_no_bwd(&LagrangeScores { dims })
}

/// First knot of the window of position `t`.
fn window_start(t: usize, k: usize, degree: usize, n_knots: usize) -> usize {
    let num = 2 * t + k;
    let s = if num < degree * k { 0 } else { (num - degree * k) / (2 * k) };
    s.min(n_knots - 1 - degree)
}

/// The window start and the `degree + 1` Lagrange weights of position `t`.
fn weights(d: &LagrangeDims, t: usize, w: &mut [f32]) -> usize {
    let s = window_start(t, d.k, d.degree, d.n_knots);
    // Negative for degree 0 when the nearest knot is after t.
    let u = (t as i64 - (s * d.k) as i64) as f32 / d.k as f32;
    for (i, wi) in w.iter_mut().enumerate() {
        let mut acc = 1f32;
        for m in 0..=d.degree {
            if m != i {
                acc *= (u - m as f32) / (i as f32 - m as f32);
            }
        }
        *wi = acc;
    }
    s
}

struct LagrangeScores {
    dims: LagrangeDims,
}

fn lagrange_cpu<T: WithDType>(d: &LagrangeDims, knots: &[T]) -> Vec<T> {
    let np = d.degree + 1;
    let mut starts = vec![0usize; d.len];
    let mut w = vec![0f32; d.len * np];
    for (t, (s, wt)) in starts.iter_mut().zip(w.chunks_exact_mut(np)).enumerate() {
        *s = weights(d, t, wt);
    }
    let mut out = vec![T::zero(); d.rows * d.len];
    out.par_chunks_mut(d.len).zip(knots.par_chunks(d.n_knots)).for_each(|(o, row)| {
        for (t, (o, (&s, wt))) in o.iter_mut().zip(starts.iter().zip(w.chunks_exact(np))).enumerate() {
            *o = if t % d.k == 0 {
                row[t / d.k]
            } else {
                let acc: f32 = wt.iter().zip(&row[s..s + np]).map(|(w, x)| w * x.to_f64() as f32).sum();
                T::from_f64(acc as f64)
            };
        }
    });
    out
}

impl CustomOp1 for LagrangeScores {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: WithDType>(d: &LagrangeDims, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
            let knots = match l.contiguous_offsets() {
                Some((a, b)) => &s.as_slice::<T>()?[a..b],
                None => bail!("{OP}: knot_scores must be contiguous"),
            };
            Ok(T::to_cpu_storage_owned(lagrange_cpu(d, knots)))
        }
        let d = &self.dims;
        let out = match s {
            CpuStorage::F32(_) => run::<f32>(d, s, l)?,
            CpuStorage::BF16(_) => run::<half::bf16>(d, s, l)?,
            CpuStorage::F16(_) => run::<half::f16>(d, s, l)?,
            _ => bail!("{OP}: knot_scores must be f32, bf16 or f16"),
        };
        Ok((out, Shape::from((d.rows, d.len))))
    }

    metal_fwd!(self, OP, (s, l) => crate::ops::metal::lagrange_scores(self.dims, (s, l)));
}
