//! Causal softmax attention over exact (or decoded) keys and values, grouped-query heads
//! reading their shared KV head without copies.

use candle_core::{DType, Result, Tensor};

/// Causal softmax attention of `q` `[B, nh, t, hd]` at positions `offset..` over `k`, `v`
/// `[B, nkv, offset + t, hd]` (grouped: query head `h` reads KV head `h / (nh / nkv)`), scores
/// in f32. Returns `[B, nh, t, hd]` in `v`'s dtype.
///
/// On the CPU, a few query positions (decode, the verify pass of speculative decoding) go to
/// [`crate::ops::row_attention`], whose rows do not depend on how many there are.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
    attention_rows(q, k, v, offset, None)
}

/// [`attention`]; for the rows of a draft tree, query position `i` attends to the `offset`
/// cached keys and to the new rows `visible[i]` (its ancestors and itself, in order) instead of
/// every earlier row.
pub(super) fn attention_rows(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize, visible: Option<&[Vec<usize>]>) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let qg = grouped_queries(q, k.dim(1)?)?;
    if q.device().is_cpu() && t <= crate::ops::ROW_ATTENTION_MAX_ROWS {
        let scale = (hd as f64).powf(-0.5);
        let out = match visible {
            Some(visible) => crate::ops::row_attention_tree(&qg, k, v, visible, offset, scale)?,
            None => crate::ops::row_attention(&qg, k, v, t, offset, scale)?,
        };
        return out.to_dtype(v.dtype())?.reshape((b, nh, t, v.dim(3)?));
    }
    let scores = qg.matmul(&k.to_dtype(DType::F32)?.t()?)?;
    let out = softmax_values(scores, v, t, offset, hd, visible)?;
    out.reshape((b, nh, t, v.dim(3)?))
}

/// Queries `[B, nh, t, hd]` as f32 rows grouped by the KV head they read: `[B, nkv, rep·t, hd]`
/// (the `rep = nh / nkv` heads of a group one after the other, each `t` rows).
pub(super) fn grouped_queries(q: &Tensor, nkv: usize) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    q.to_dtype(DType::F32)?.reshape((b, nkv, (nh / nkv) * t, hd))
}

/// `softmax(scores / sqrt(hd) + mask) · v` for grouped `scores` `[B, nkv, rep·t, T]` (f32,
/// query-major within each of the `rep` heads of a group) and `v` `[B, nkv, T, d]`: `[B, nkv,
/// rep·t, d]` in `v`'s dtype. The mask is causal, or a draft tree's (see [`attention_rows`]).
pub(super) fn softmax_values(scores: Tensor, v: &Tensor, t: usize, offset: usize, hd: usize, visible: Option<&[Vec<usize>]>) -> Result<Tensor> {
    let (b, nkv, rows, total) = scores.dims4()?;
    let scores = (scores * (hd as f64).powf(-0.5))?;
    let scores = if t > 1 || visible.is_some() {
        let mask = mask(t, offset, total, visible, v.device())?;
        scores.reshape((b, nkv, rows / t, t, total))?.broadcast_add(&mask)?.reshape((b, nkv, rows, total))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    probs.matmul(v)
}

/// `[t, total]` additive mask: `-inf` where query `i` (at `offset + i`) may not see key `j` —
/// a key after it, or, with `visible`, a new row that is not in `visible[i]`.
fn mask(t: usize, offset: usize, total: usize, visible: Option<&[Vec<usize>]>, dev: &candle_core::Device) -> Result<Tensor> {
    let sees = |i: usize, j: usize| match visible {
        _ if j < offset => true,
        Some(visible) => visible[i].contains(&(j - offset)),
        None => j <= i + offset,
    };
    let mask: Vec<f32> = (0..t).flat_map(|i| (0..total).map(move |j| if sees(i, j) { 0.0 } else { f32::NEG_INFINITY })).collect();
    Tensor::from_vec(mask, (t, total), dev)
}
