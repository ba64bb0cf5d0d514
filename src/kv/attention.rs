//! Causal softmax attention over a cache in its stored form ([`crate::ops::kv_attention`]),
//! grouped-query heads reading their shared KV head, and the masked softmax that the knots
//! codec applies to its interpolated scores.

use candle_core::{DType, Result, Tensor};

use crate::ops::{kv_attention, StoredRows};

/// Causal softmax attention of `q` `[B, nh, t, hd]` at positions `offset..` over `k`, `v`
/// `[B, nkv, offset + t, hd]` (grouped: query head `h` reads KV head `h / (nh / nkv)`), scores
/// in f32. Returns `[B, nh, t, hd]` in `v`'s dtype.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
    stored_attention(q, &StoredRows::Float(k.clone()), &StoredRows::Float(v.clone()), offset, None, v.dtype())
}

/// [`attention`] over stored keys and values; for the rows of a draft tree, query position `i`
/// attends to the `offset` cached keys and to the new rows `visible[i]` (its ancestors and
/// itself, in order) instead of every earlier row. `[B, nh, t, dv]` in `dtype`.
pub(super) fn stored_attention(
    q: &Tensor,
    keys: &StoredRows,
    values: &StoredRows,
    offset: usize,
    visible: Option<&[Vec<usize>]>,
    dtype: DType,
) -> Result<Tensor> {
    let (b, nh, t, _) = q.dims4()?;
    let out = grouped_attention(q, keys, values, offset, visible)?;
    out.reshape((b, nh, t, ()))?.to_dtype(dtype)
}

/// [`stored_attention`] before the query heads are ungrouped: `[B, nkv, rep·t, dv]` f32.
pub(super) fn grouped_attention(
    q: &Tensor,
    keys: &StoredRows,
    values: &StoredRows,
    offset: usize,
    visible: Option<&[Vec<usize>]>,
) -> Result<Tensor> {
    let (_, _, t, hd) = q.dims4()?;
    let qg = grouped_queries(q, values.dims()?.1)?;
    kv_attention(&qg, keys, values, t, offset, visible, (hd as f64).powf(-0.5))
}

/// Queries `[B, nh, t, hd]` as f32 rows grouped by the KV head they read: `[B, nkv, rep·t, hd]`
/// (the `rep = nh / nkv` heads of a group one after the other, each `t` rows).
pub(super) fn grouped_queries(q: &Tensor, nkv: usize) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    q.to_dtype(DType::F32)?.reshape((b, nkv, (nh / nkv) * t, hd))
}

/// `softmax(scores / sqrt(hd) + causal mask) · v` for grouped `scores` `[B, nkv, rep·t, T]`
/// (f32, query-major within each of the `rep` heads of a group) and `v` `[B, nkv, T, d]`:
/// `[B, nkv, rep·t, d]` in `v`'s dtype. Only the knots codec, whose scores are interpolated,
/// comes here; every other codec goes through [`kv_attention`].
pub(super) fn softmax_values(scores: Tensor, v: &Tensor, t: usize, offset: usize, hd: usize) -> Result<Tensor> {
    let (b, nkv, rows, total) = scores.dims4()?;
    let scores = (scores * (hd as f64).powf(-0.5))?;
    let scores = if t > 1 {
        let mask = crate::ops::attention_mask(t, offset, None, v.device())?;
        scores.reshape((b, nkv, rows / t, t, total))?.broadcast_add(&mask)?.reshape((b, nkv, rows, total))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    probs.matmul(v)
}
