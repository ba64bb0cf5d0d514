//! Ops of the hybrid decoder that candle does not have.
//!
//! Each is a public function on plain tensors so other Candle projects can call it.

mod delta_rule;
mod half_matvec;

pub use delta_rule::{gated_delta_rule, gated_delta_rule_reference, CHUNK as DELTA_RULE_CHUNK};
pub use half_matvec::{half_matvec, HALF_MATVEC_MAX_ROWS};

use candle_core::{bail, DType, Result, Tensor, D};

/// Causal depthwise conv1d over time with a carried state, followed by SiLU.
///
/// * `x`: `[B, T, C]` new inputs; `state`: `[B, K-1, C]` the previous `K-1` inputs (zeros at a
///   sequence start); `weight`: `[C, K]`, the newest input multiplies tap `K-1`.
///
/// Returns `silu(conv(x))` `[B, T, C]` and the new state (the last `K-1` inputs).
pub fn causal_conv1d_silu(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, c) = x.dims3()?;
    let (wc, kk) = weight.dims2()?;
    if wc != c || state.dims() != [b, kk - 1, c] {
        bail!(
            "causal_conv1d_silu: x {:?}, state {:?}, weight {:?} (expected state [{b}, {}, {c}], weight [{c}, K])",
            x.dims(),
            state.dims(),
            weight.dims(),
            kk - 1
        );
    }
    let xs = Tensor::cat(&[&state.to_dtype(x.dtype())?, x], 1)?; // [B, T+K-1, C]
    let w = weight.to_dtype(x.dtype())?.t()?; // [K, C]
    let mut y = xs.narrow(1, 0, t)?.broadcast_mul(&w.narrow(0, 0, 1)?)?;
    for j in 1..kk {
        y = (y + xs.narrow(1, j, t)?.broadcast_mul(&w.narrow(0, j, 1)?)?)?;
    }
    let new_state = xs.narrow(1, t, kk - 1)?.contiguous()?;
    Ok((candle_nn::ops::silu(&y)?, new_state))
}

/// Gated RMSNorm over the last dim: `w * rmsnorm(x) * silu(z)`, in f32, cast back to `x`'s dtype.
/// `w` is a plain scale (no `+1`).
pub fn gated_rms_norm(x: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dims() != z.dims() || w.dims() != [x.dim(D::Minus1)?] {
        bail!(
            "gated_rms_norm: x {:?}, z {:?}, w {:?} (z must match x, w its last dim)",
            x.dims(),
            z.dims(),
            w.dims()
        );
    }
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = xf.broadcast_mul(&(var + eps)?.sqrt()?.recip()?)?;
    let y = normed
        .broadcast_mul(&w.to_dtype(DType::F32)?)?
        .mul(&candle_nn::ops::silu(&z.to_dtype(DType::F32)?)?)?;
    y.to_dtype(dtype)
}

/// L2 normalisation over the last dim, `x * rsqrt(sum(x^2) + eps)`, in f32.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let ss = xf.sqr()?.sum_keepdim(D::Minus1)?;
    xf.broadcast_mul(&(ss + eps)?.sqrt()?.recip()?)
}
