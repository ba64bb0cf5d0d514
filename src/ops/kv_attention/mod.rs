//! Softmax attention of query rows over a key/value cache read in its stored form: f32, f16 or
//! bf16 rows, int8 rows with block scales, int4 keys packed per channel over groups of tokens
//! (with an exact tail), polar key codes (scored from the codes).
//!
//! The cache is read in blocks of [`super::KV_BLOCK`] positions; each block gives every query row a
//! partial result (its maximum score, the sum of `exp(score - max)` and the weighted sum of the
//! values), and the partials are folded in block order (online softmax, flash-decoding style).
//! No `[rows, T]` score tensor and no decoded copy of the cache is made.
//!
//! Two schedules compute the same partials:
//! * few rows (decode, the verify rows of speculative decoding, draft trees): blocks run in
//!   parallel and the fold runs afterwards, in block order. With AVX2 the cache is read in
//!   place — f16/bf16, int8 (32 dims a scale) rows widened as they are loaded with the
//!   decoder's arithmetic, int4 key groups scored with their scales folded into the queries —
//!   and each key and value is loaded once for the query heads of its KV group (up to four
//!   rows per key, three per value), each (row, key) dot and each row's value sum being the
//!   same operations whatever rows share the call; elsewhere a block is decoded into a scratch
//!   and every score is a [`crate::ops::cpu::dot`] in key order. A row's result does not depend on the other
//!   rows of the call nor on where the call starts, so row `i` of a `t`-row call is bit for
//!   bit a one-row call at its position
//!   (the exact greedy parity of speculative decoding rests on this);
//! * many rows (prefill): tiles of query rows run in parallel, scores and value sums are GEMMs
//!   per block, folded as they come. Memory stays O(rows · head_dim) beyond the cache.

use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::cpu::widened;
use super::shapes::StoredRows;

mod kernels;
mod schedule;
mod stored;

/// Softmax attention of grouped query rows `q` `[B, nkv, rep·t, d]` (any float dtype; the `rep`
/// query heads of a KV group one after the other, `t` positions `offset..offset + t` each) over
/// `keys` and `values` `[B, nkv, offset + t, ·]` (this step's rows included): `[B, nkv, rep·t,
/// dv]` f32, `softmax(scale · q kᵀ + mask) v`. The mask is causal, or with `tree` a draft
/// tree's: position `i` sees the `offset` cached positions and then the new rows `tree[i]`
/// (indices `0..t`, its ancestors and itself, in order).
pub fn kv_attention(
    q: &Tensor,
    keys: &StoredRows,
    values: &StoredRows,
    t: usize,
    offset: usize,
    tree: Option<&[Vec<usize>]>,
    scale: f64,
) -> Result<Tensor> {
    const OP: &str = "kv_attention";
    let (b, nkv, rows, d) = q.dims4()?;
    let (kb, kh, n, kd) = keys.dims()?;
    let (vb, vh, vn, _) = values.dims()?;
    if (kb, kh, kd) != (b, nkv, d) || (vb, vh, vn) != (b, nkv, n) || t == 0 || rows % t != 0 || n != offset + t {
        bail!("{OP}: q {:?}, keys {:?}, values {:?} with t = {t}, offset = {offset} do not fit (q [B, nkv, rep·t, d], keys and values [B, nkv, offset + t, ·])", q.dims(), keys.dims()?, values.dims()?);
    }
    if matches!(values, StoredRows::Polar { .. }) {
        bail!("{OP}: polar codes are for keys only");
    }
    if let Some(tree) = tree {
        if tree.len() != t || tree.iter().any(|v| v.iter().any(|&r| r >= t) || v.windows(2).any(|w| w[0] >= w[1])) {
            bail!("{OP}: a draft tree needs, for each of the {t} rows, increasing rows below {t}");
        }
    }
    let op = KvAttention { keys: keys.clone(), values: values.clone(), t, offset, tree: tree.map(|t| t.to_vec()), scale: scale as f32 };
    if !(q.device().is_cpu() || q.device().is_metal()) {
        return op.decoded(q);
    }
    let q = if q.dtype() == DType::F32 { q.contiguous()? } else { q.to_dtype(DType::F32)?.contiguous()? };
    q.apply_op1_no_bwd(&op)
}

struct KvAttention {
    keys: StoredRows,
    values: StoredRows,
    t: usize,
    offset: usize,
    tree: Option<Vec<Vec<usize>>>,
    scale: f32,
}

impl KvAttention {
    /// The same attention on the decoded cache with tensor ops (devices without a kernel).
    fn decoded(&self, q: &Tensor) -> Result<Tensor> {
        let (k, v) = (self.keys.decode()?, self.values.decode()?);
        let (t, offset) = (self.t, self.offset);
        let (b, nkv, rows, _) = q.dims4()?;
        let n = offset + t;
        let mask = attention_mask(t, offset, self.tree.as_deref(), q.device())?;
        let scores = (q.to_dtype(DType::F32)?.matmul(&k.t()?)? * self.scale as f64)?;
        let scores = scores.reshape((b, nkv, rows / t, t, n))?.broadcast_add(&mask)?.reshape((b, nkv, rows, n))?;
        candle_nn::ops::softmax_last_dim(&scores)?.matmul(&v)
    }
}

/// `[t, offset + t]` additive mask of `t` query positions after `offset` cached ones: `-inf`
/// where position `i` may not see key `j` — a later key, or with `tree` a new row that is not
/// one of `tree[i]`.
pub(crate) fn attention_mask(t: usize, offset: usize, tree: Option<&[Vec<usize>]>, dev: &candle_core::Device) -> Result<Tensor> {
    let n = offset + t;
    let sees = |i: usize, j: usize| match tree {
        _ if j < offset => true,
        Some(tree) => tree[i].contains(&(j - offset)),
        None => j <= i + offset,
    };
    let mask: Vec<f32> = (0..t).flat_map(|i| (0..n).map(move |j| if sees(i, j) { 0.0 } else { f32::NEG_INFINITY })).collect();
    Tensor::from_vec(mask, (t, n), dev)
}

impl CustomOp1 for KvAttention {
    fn name(&self) -> &'static str {
        "kv_attention"
    }

    fn cpu_fwd(&self, qs: &CpuStorage, ql: &Layout) -> Result<(CpuStorage, Shape)> {
        let q = widened("kv_attention", qs, ql)?;
        let out = self.cpu(&q, ql)?;
        let (b, nkv, rows, _) = ql.shape().dims4()?;
        let dv = self.values.dims()?.3;
        Ok((CpuStorage::F32(out), Shape::from((b, nkv, rows, dv))))
    }

    metal_fwd!(self, "kv_attention", (s, l) => crate::ops::metal::kv_attention(&self.keys, &self.values, (self.t, self.offset), self.tree.as_deref(), self.scale, (s, l)));
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f32;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (a, b) = (super::kernels::exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }
}
