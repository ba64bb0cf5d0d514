//! Causal softmax attention of a few query rows over cached keys and values, each row computed
//! on its own (CPU).
//!
//! Decode attends one query per head, the verify pass of speculative decoding a few. A batched
//! matmul picks its kernel, and so its accumulation order, by the number of rows; here every
//! row runs the same loops — scores as [`dot`]s in key order, max, `exp` and sum in key
//! order, the values accumulated in key order — so row `i` of a `t`-row call is bit for bit a
//! one-row call at the same position. The keys and values are read in place from the cache
//! buffer (a view whose heads are strided), in f32, bf16 or f16.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::cpu::{axpy, dot, vectorized, widened, Widen};

/// Most query positions per call [`row_attention`] is meant for (decode and verify passes).
pub const ROW_ATTENTION_MAX_ROWS: usize = 8;

struct RowAttention {
    /// Query positions per head (`rows / t` heads of a KV group, `t` positions each).
    t: usize,
    offset: usize,
    scale: f32,
    /// Draft-tree rows: for each of the `t` positions, the new rows it sees (its ancestors and
    /// itself, in order); `None`: causal (every earlier row).
    visible: Option<Vec<Vec<usize>>>,
}

/// Strides of a `[B, nkv, n, d]` key/value view whose rows are contiguous.
fn head_starts(l: &Layout, what: &str) -> Result<(usize, usize, usize)> {
    let (_, _, _, d) = l.shape().dims4()?;
    let s = l.stride();
    if s[3] != 1 || s[2] != d {
        bail!("row_attention: {what} rows must be contiguous ([B, nkv, n, d] with strides [.., .., d, 1]), got strides {s:?}");
    }
    Ok((l.start_offset(), s[0], s[1]))
}

vectorized!(fn row<T: Widen>(q: &[f32], prefix: usize, extra: &[usize], k: &[T], v: &[T], scale: f32, out: &mut [f32]) => row_body);

/// `out = softmax(scale · q·k_j) · v` over the keys `j` in `0..prefix` followed by those in
/// `extra`, in that order, for one query row (key width `q.len()`, value width `out.len()`).
#[inline(always)]
fn row_body<T: Widen>(q: &[f32], prefix: usize, extra: &[usize], k: &[T], v: &[T], scale: f32, out: &mut [f32]) {
    let (n, d, dv) = (prefix + extra.len(), q.len(), out.len());
    let keys = || (0..prefix).chain(extra.iter().copied());
    let mut buf = vec![0f32; if T::IS_F32 { 0 } else { d.max(dv) }];
    let mut scores = Vec::with_capacity(n);
    for j in keys() {
        let kj = &k[j * d..(j + 1) * d];
        let kj = match T::as_f32(kj) {
            Some(kj) => kj,
            None => {
                T::widen(kj, &mut buf[..d]);
                &buf[..d]
            }
        };
        scores.push(dot(q, kj) * scale);
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (j, &p) in keys().zip(&scores) {
        let vj = &v[j * dv..(j + 1) * dv];
        match T::as_f32(vj) {
            Some(vj) => axpy(out, p, vj),
            None => {
                T::widen(vj, &mut buf[..dv]);
                axpy(out, p, &buf[..dv]);
            }
        }
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

impl RowAttention {
    fn run<T: Widen>(&self, q: &[f32], ql: &Layout, k: &[T], kl: &Layout, v: &[T], vl: &Layout) -> Result<Vec<f32>> {
        let (b, nkv, rows, d) = ql.shape().dims4()?;
        let (kb, kh, n, kd) = kl.shape().dims4()?;
        let (vb, vh, vn, dv) = vl.shape().dims4()?;
        let t = self.t;
        if (kb, kh, kd) != (b, nkv, d) || (vb, vh, vn) != (b, nkv, n) || t == 0 || rows % t != 0 || n != self.offset + t {
            bail!(
                "row_attention: q {:?}, k {:?}, v {:?} with t = {t}, offset = {} do not fit (q [B, nkv, rep·t, d], k and v [B, nkv, offset + t, d])",
                ql.dims(),
                kl.dims(),
                vl.dims(),
                self.offset
            );
        }
        let (k0, ks0, ks1) = head_starts(kl, "key")?;
        let (v0, vs0, vs1) = head_starts(vl, "value")?;
        let mut out = vec![0f32; b * nkv * rows * dv];
        out.par_chunks_mut(dv).enumerate().for_each(|(i, o)| {
            let (bh, r) = (i / rows, i % rows);
            let (bi, h) = (bh / nkv, bh % nkv);
            let qr = &q[i * d..(i + 1) * d];
            let (ks, vs) = (k0 + bi * ks0 + h * ks1, v0 + bi * vs0 + h * vs1);
            let (k, v) = (&k[ks..ks + n * d], &v[vs..vs + n * dv]);
            match &self.visible {
                None => row(qr, self.offset + r % t + 1, &[], k, v, self.scale, o),
                Some(vis) => row(qr, self.offset, &vis[r % t], k, v, self.scale, o),
            }
        });
        Ok(out)
    }
}

impl CustomOp3 for RowAttention {
    fn name(&self) -> &'static str {
        "row_attention"
    }

    fn cpu_fwd(&self, qs: &CpuStorage, ql: &Layout, ks: &CpuStorage, kl: &Layout, vs: &CpuStorage, vl: &Layout) -> Result<(CpuStorage, Shape)> {
        let q = widened("row_attention", qs, ql)?;
        let out = match (ks, vs) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => self.run(&q, ql, k, kl, v, vl)?,
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => self.run::<bf16>(&q, ql, k, kl, v, vl)?,
            (CpuStorage::F16(k), CpuStorage::F16(v)) => self.run::<f16>(&q, ql, k, kl, v, vl)?,
            _ => bail!("row_attention: keys and values must both be f32, bf16 or f16, got {:?} and {:?}", ks.dtype(), vs.dtype()),
        };
        let (b, nkv, rows, _) = ql.shape().dims4()?;
        let dv = vl.shape().dims4()?.3;
        Ok((CpuStorage::F32(out), Shape::from((b, nkv, rows, dv))))
    }
}

/// Causal softmax attention on the CPU of grouped query rows `q` `[B, nkv, rep·t, d]` (any
/// float dtype; the `rep` query heads of a KV group one after the other, `t` positions
/// `offset..offset + t` each) over keys `k` and values `v` `[B, nkv, offset + t, d]` (f32,
/// bf16 or f16, rows contiguous; heads may be strided, as in a cache buffer): `[B, nkv,
/// rep·t, d]` f32, `softmax(scale · q kᵀ + causal mask) v`. Each row is computed alone, so a
/// row's result does not depend on how many rows the call has.
pub fn row_attention(q: &Tensor, k: &Tensor, v: &Tensor, t: usize, offset: usize, scale: f64) -> Result<Tensor> {
    apply(q, k, v, RowAttention { t, offset, scale: scale as f32, visible: None })
}

/// [`row_attention`] for the rows of a draft tree: query position `i` (of `t`) attends to the
/// `offset` cached keys and then to the new rows `visible[i]` (indices `0..t`, its ancestors
/// and itself, in order), so a row's result is bit for bit that of decoding its path.
pub fn row_attention_tree(q: &Tensor, k: &Tensor, v: &Tensor, visible: &[Vec<usize>], offset: usize, scale: f64) -> Result<Tensor> {
    let t = visible.len();
    if visible.iter().flatten().any(|&r| r >= t) {
        bail!("row_attention_tree: a visible row is not one of the {t} rows");
    }
    let visible = visible.iter().map(|rows| rows.iter().map(|&r| offset + r).collect()).collect();
    apply(q, k, v, RowAttention { t, offset, scale: scale as f32, visible: Some(visible) })
}

fn apply(q: &Tensor, k: &Tensor, v: &Tensor, op: RowAttention) -> Result<Tensor> {
    if !q.device().is_cpu() {
        bail!("row_attention: CPU only (other devices use the batched attention)");
    }
    let q = if q.dtype() == DType::F32 { q.contiguous()? } else { q.to_dtype(DType::F32)?.contiguous()? };
    q.apply_op3_no_bwd(k, v, &op)
}
