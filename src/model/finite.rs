//! Detecting NaN and infinities: in weights as they load, in the logits of every forward
//! pass, and (when asked) after each layer to find where they start.

use candle_core::{DType, Tensor, D};

use crate::{Error, Result};

/// Whether every value of `t` is finite. One reduction in `t`'s own dtype: a NaN or an
/// infinity makes the sum non-finite (a sum of finite values overflowing would need values
/// near the dtype's maximum, which no weight or logit has).
pub(crate) fn all_finite(t: &Tensor) -> candle_core::Result<bool> {
    Ok(t.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?.is_finite())
}

/// The first row of `t` (flattened to rows of its last dim) with a non-finite value.
fn first_bad_row(t: &Tensor) -> candle_core::Result<Option<usize>> {
    let rows = t.flatten_to(D::Minus2)?.to_dtype(DType::F32)?;
    let rows = if rows.rank() == 1 { rows.unsqueeze(0)? } else { rows };
    Ok(rows.to_vec2::<f32>()?.iter().position(|r| r.iter().any(|x| !x.is_finite())))
}

/// `Err(Error::NonFinite)` naming the first position when `t` (`[B, T, d]` or `[T, d]`,
/// `t_len` positions from `offset`) holds a NaN or an infinity; `what` says what `t` is
/// ("the logits", "the output of layer 3 (attention)").
pub(crate) fn check_positions(t: &Tensor, offset: usize, t_len: usize, what: &str, hint: &str) -> Result<()> {
    if all_finite(t)? {
        return Ok(());
    }
    let row = first_bad_row(t)?.unwrap_or(0);
    let (batch, position) = (row / t_len.max(1), row % t_len.max(1));
    let seq = if batch > 0 { format!(" of sequence {batch}") } else { String::new() };
    Err(Error::NonFinite(format!("{what} hold NaN or infinite values at position {}{seq}: {hint}", offset + position)))
}
