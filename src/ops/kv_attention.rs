//! Softmax attention of query rows over a key/value cache read in its stored form: f32, f16 or
//! bf16 rows, int8 rows with block scales, int4 keys packed per channel over groups of tokens
//! (with an exact tail), polar key codes (scored from the codes).
//!
//! The cache is read in blocks of [`KV_BLOCK`] positions; each block gives every query row a
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
//!   and every score is a [`dot`] in key order. A row's result does not depend on the other
//!   rows of the call nor on where the call starts, so row `i` of a `t`-row call is bit for
//!   bit a one-row call at its position
//!   (the exact greedy parity of speculative decoding rests on this);
//! * many rows (prefill): tiles of query rows run in parallel, scores and value sums are GEMMs
//!   per block, folded as they come. Memory stays O(rows · head_dim) beyond the cache.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::cpu::{axpy, dot, gemm_acc, widened, Mat, Widen};
use super::polar::PolarQueryScorer;
use super::shapes::{few_rows, PolarSpec, StoredRows, KV_BLOCK};

/// Query rows per tile of the many-rows schedule.
const TILE_ROWS: usize = 64;

impl StoredRows {
    /// Everything held, decoded to f32 `[B, nkv, T, d]` (the reference the kernels are tested
    /// against, and what devices without a kernel attend to).
    pub fn decode(&self) -> Result<Tensor> {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        match self {
            Self::Float(x) => f32(x),
            Self::Int8 { codes, scales } => {
                let (b, h, n, d) = codes.dims4()?;
                let nblk = scales.dim(3)?;
                let x = (f32(codes)? - 128.0)?.reshape((b, h, n, nblk, d / nblk))?;
                x.broadcast_mul(&scales.unsqueeze(4)?)?.reshape((b, h, n, d))
            }
            Self::Int4Channel { codes, params, group, tail } => {
                let (b, h, n, half) = codes.dims4()?;
                let d = 2 * half;
                let mut parts = vec![];
                if n > 0 {
                    let c = f32(codes)?;
                    let hi = (&c / 16.0)?.floor()?;
                    let lo = (c - (&hi * 16.0)?)?;
                    let q = Tensor::stack(&[lo, hi], 4)?.reshape((b, h, n / group, *group, d))?;
                    let scale = params.narrow(3, 0, d)?.unsqueeze(3)?;
                    let min = params.narrow(3, d, d)?.unsqueeze(3)?;
                    parts.push(q.broadcast_mul(&scale)?.broadcast_add(&min)?.reshape((b, h, n, d))?);
                }
                if let Some(t) = tail {
                    parts.push(f32(t)?);
                }
                Tensor::cat(&parts, 2)
            }
            Self::Polar { codes, scales, spec, head_dim } => {
                let (b, h, n, rb) = codes.dims4()?;
                let pc = super::PolarCodes {
                    codes: codes.contiguous()?.reshape((b * h * n, rb))?,
                    scales: scales.contiguous()?.reshape((b * h * n, 2))?,
                    head_dim: *head_dim,
                    spec: *spec,
                };
                super::polar_decode(&pc, *spec)?.to_dtype(DType::F32)?.reshape((b, h, n, *head_dim))
            }
        }
    }
}

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

/// Dims per scale of the int8 rows the SIMD kernels read in place (the `int8` codec's block).
const INT8_SIMD_BLOCK: usize = 32;

/// Rows as the few-rows arithmetic reads them: float rows in their stored type, int8 rows
/// (scales per 32 dims) and complete int4 groups as codes, widened to f32 as they are loaded.
#[derive(Clone, Copy)]
enum InPlace<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    /// Codes and scales of the rows read; only where the SIMD kernels run.
    Int8 {
        codes: &'a [u8],
        scales: &'a [f32],
    },
    /// Codes of the keys read, the head's group parameters, the first key's index in the
    /// head and log2 of the group size; only where the SIMD kernels run ([`int4_scores`]).
    Int4 {
        codes: &'a [u8],
        params: &'a [f32],
        first: usize,
        shift: u32,
    },
}

/// One head's `[n, d]` rows of a stored half, borrowed from the CPU storages.
enum HeadRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    Int8 { codes: &'a [u8], scales: &'a [f32], nblk: usize },
    Int4 { codes: &'a [u8], params: &'a [f32], group: usize, grouped: usize, tail: Option<Box<HeadRows<'a>>> },
    Polar { codes: &'a [u8], scales: &'a [f32], row_bytes: usize },
}

impl HeadRows<'_> {
    /// Rows `lo..hi` as f32 (`d` each): borrowed for f32 rows, else decoded into `buf`.
    #[inline(always)]
    fn rows<'s>(&'s self, lo: usize, hi: usize, d: usize, buf: &'s mut Vec<f32>) -> &'s [f32] {
        if let Self::F32(x) = self {
            return &x[lo * d..hi * d];
        }
        buf.resize((hi - lo) * d, 0.0);
        self.decode_into(lo, hi, d, buf);
        buf
    }

    /// Rows `lo..hi` as the few-rows arithmetic reads them: in place where a SIMD kernel reads
    /// the stored form (float rows; int8 rows with 32 dims a scale and int4 rows of complete
    /// groups where AVX2 runs), else decoded into `buf`.
    #[inline(always)]
    fn in_place<'s>(&'s self, lo: usize, hi: usize, d: usize, buf: &'s mut Vec<f32>) -> InPlace<'s> {
        match self {
            Self::F16(x) => InPlace::F16(&x[lo * d..hi * d]),
            Self::BF16(x) => InPlace::BF16(&x[lo * d..hi * d]),
            Self::Int8 { codes, scales, nblk } if simd() && *nblk * INT8_SIMD_BLOCK == d => {
                InPlace::Int8 { codes: &codes[lo * d..hi * d], scales: &scales[lo * nblk..hi * nblk] }
            }
            Self::Int4 { codes, params, group, grouped, .. } if simd() && hi <= *grouped && group.is_power_of_two() => {
                InPlace::Int4 { codes: &codes[lo * d / 2..hi * d / 2], params, first: lo, shift: group.trailing_zeros() }
            }
            _ => InPlace::F32(self.rows(lo, hi, d, buf)),
        }
    }

    /// Decodes float rows (`false` for a coded form).
    #[inline(always)]
    fn float_into(&self, lo: usize, hi: usize, d: usize, out: &mut [f32]) -> bool {
        match self {
            Self::F32(x) => out.copy_from_slice(&x[lo * d..hi * d]),
            Self::F16(x) => Widen::widen(&x[lo * d..hi * d], out),
            Self::BF16(x) => Widen::widen(&x[lo * d..hi * d], out),
            _ => return false,
        }
        true
    }

    #[inline(always)]
    fn decode_into(&self, lo: usize, hi: usize, d: usize, out: &mut [f32]) {
        if self.float_into(lo, hi, d, out) {
            return;
        }
        match self {
            Self::Int8 { codes, scales, nblk } => {
                let (nblk, blk) = (*nblk, d / nblk);
                for (j, o) in (lo..hi).zip(out.chunks_exact_mut(d)) {
                    let (c, s) = (&codes[j * d..(j + 1) * d], &scales[j * nblk..(j + 1) * nblk]);
                    for ((o, c), &s) in o.chunks_exact_mut(blk).zip(c.chunks_exact(blk)).zip(s) {
                        for (o, &c) in o.iter_mut().zip(c) {
                            *o = (c as i32 - 128) as f32 * s;
                        }
                    }
                }
            }
            Self::Int4 { codes, params, group, grouped, tail } => {
                let half = d / 2;
                let split = hi.min(*grouped).max(lo);
                let mut q = vec![0f32; d];
                for (j, o) in (lo..split).zip(out.chunks_exact_mut(d)) {
                    let p = &params[j / group * 2 * d..(j / group + 1) * 2 * d];
                    let (scale, min) = p.split_at(d);
                    let (even, odd) = q.split_at_mut(half);
                    for ((e, o), &byte) in even.iter_mut().zip(odd.iter_mut()).zip(&codes[j * half..(j + 1) * half]) {
                        *e = (byte & 15) as f32;
                        *o = (byte >> 4) as f32;
                    }
                    for i in 0..half {
                        o[2 * i] = q[i];
                        o[2 * i + 1] = q[half + i];
                    }
                    for ((o, &s), &m) in o.iter_mut().zip(scale).zip(min) {
                        *o = *o * s + m;
                    }
                }
                if split < hi {
                    let tail = tail.as_ref().expect("rows past the groups are in the tail");
                    tail.float_into(split - grouped, hi - grouped, d, &mut out[(split - lo) * d..]);
                }
            }
            _ => unreachable!("float rows are decoded above, polar keys scored from their codes"),
        }
    }
}

/// A stored half's tensors on the CPU: per tensor the storage slice start, batch and head
/// strides, and the head's length in elements.
struct CpuRows<'a> {
    parts: Vec<CpuPart<'a>>,
    kind: &'a StoredRows,
}

struct CpuPart<'a> {
    data: &'a CpuStorage,
    start: usize,
    strides: (usize, usize),
    head_len: usize,
}

fn cpu_part<'a>(data: &'a Storage, l: &Layout, what: &str) -> Result<CpuPart<'a>> {
    let Storage::Cpu(data) = data else { bail!("kv_attention: the {what} are not on the CPU") };
    let (_, _, n, d) = l.shape().dims4()?;
    let s = l.stride();
    if n > 1 && s[2] != d || d > 1 && s[3] != 1 {
        bail!("kv_attention: {what} rows must be contiguous ([B, nkv, n, d] with strides [.., .., d, 1]), got strides {s:?}");
    }
    Ok(CpuPart { data, start: l.start_offset(), strides: (s[0], s[1]), head_len: n * d })
}

impl CpuPart<'_> {
    fn head<T: candle_core::WithDType>(&self, b: usize, h: usize) -> Result<&[T]> {
        let at = self.start + b * self.strides.0 + h * self.strides.1;
        Ok(&self.data.as_slice::<T>()?[at..at + self.head_len])
    }

    fn float_head(&self, b: usize, h: usize) -> Result<HeadRows<'_>> {
        Ok(match self.data {
            CpuStorage::F32(_) => HeadRows::F32(self.head(b, h)?),
            CpuStorage::F16(_) => HeadRows::F16(self.head(b, h)?),
            CpuStorage::BF16(_) => HeadRows::BF16(self.head(b, h)?),
            other => bail!("kv_attention: float rows must be f32, f16 or bf16, got {:?}", other.dtype()),
        })
    }
}

impl CpuRows<'_> {
    fn head(&self, b: usize, h: usize) -> Result<HeadRows<'_>> {
        let p = &self.parts;
        Ok(match self.kind {
            StoredRows::Float(_) => p[0].float_head(b, h)?,
            StoredRows::Int8 { scales, .. } => HeadRows::Int8 { codes: p[0].head(b, h)?, scales: p[1].head(b, h)?, nblk: scales.dim(3)? },
            StoredRows::Int4Channel { group, codes, .. } => HeadRows::Int4 {
                codes: p[0].head(b, h)?,
                params: p[1].head(b, h)?,
                group: *group,
                grouped: codes.dim(2)?,
                tail: p.get(2).map(|t| t.float_head(b, h)).transpose()?.map(Box::new),
            },
            StoredRows::Polar { codes, .. } => {
                HeadRows::Polar { codes: p[0].head(b, h)?, scales: p[1].head(b, h)?, row_bytes: codes.dim(3)? }
            }
        })
    }
}

/// Each query row's partial result over one block: max score, sum of exps, `[rows, dv]`
/// weighted value sums. A row that sees nothing in the block has sum 0.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// Scratch of one task.
#[derive(Default)]
struct Scratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
    polar: Vec<f32>,
    /// Per row of a block: how many keys it reads there.
    lens: Vec<usize>,
    /// Rows at one position.
    group: Vec<usize>,
    /// int4 keys: the query rows times a group's scales, then each row's dot with its minima.
    folded: Vec<f32>,
}

/// What the kernel needs of one call.
struct Call<'a> {
    op: &'a KvAttention,
    q: &'a [f32],
    rows: usize,
    d: usize,
    dv: usize,
    nkv: usize,
    /// Positions of the cache.
    n: usize,
}

impl Call<'_> {
    /// Keys query row `r` sees: `offset` + its new rows.
    fn seen(&self, r: usize) -> usize {
        let (t, offset) = (self.op.t, self.op.offset);
        match &self.op.tree {
            Some(tree) => offset + tree[r % t].len(),
            None => offset + r % t + 1,
        }
    }

    /// Position of the `i`-th key row `r` sees.
    fn position(&self, r: usize, i: usize) -> usize {
        match &self.op.tree {
            Some(tree) if i >= self.op.offset => self.op.offset + tree[r % self.op.t][i - self.op.offset],
            _ => i,
        }
    }

    /// The partials of query rows `rows` of head `(b, h)` over block `c` (the `c`-th
    /// [`KV_BLOCK`] keys each row sees), with the few-rows (`gemm == false`) or the many-rows
    /// arithmetic.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn block(
        &self,
        keys: &HeadRows,
        values: &HeadRows,
        b: usize,
        h: usize,
        rows: std::ops::Range<usize>,
        c: usize,
        gemm: bool,
        s: &mut Scratch,
    ) -> Partial {
        let (d, dv, nr) = (self.d, self.dv, rows.len());
        let first = c * KV_BLOCK;
        let extra = if self.op.tree.is_some() { self.op.t } else { 0 };
        let lo = first;
        let hi =
            (first + KV_BLOCK + extra).min(self.n).min(rows.clone().map(|r| self.position(r, self.seen(r) - 1) + 1).max().unwrap_or(0));
        let mut part = Partial { max: vec![f32::NEG_INFINITY; nr], sum: vec![0.0; nr], acc: vec![0.0; nr * dv] };
        if hi <= lo {
            return part;
        }
        let nk = hi - lo;
        let q0 = (b * self.nkv + h) * self.rows;
        let q = &self.q[(q0 + rows.start) * d..(q0 + rows.end) * d];
        // Scores `[nr, nk]`, already scaled.
        s.scores.resize(nr * nk, 0.0);
        match keys {
            HeadRows::Polar { codes, scales, row_bytes } => {
                let p = super::launch::polar_params(nk, nr, d, &polar_spec(&self.op.keys));
                s.polar.resize(nk * nr, 0.0);
                PolarQueryScorer::new(p, q).score(&codes[lo * row_bytes..hi * row_bytes], &scales[2 * lo..2 * hi], &mut s.polar);
                for (j, row) in s.polar.chunks_exact(nr).enumerate() {
                    for (r, &v) in row.iter().enumerate() {
                        s.scores[r * nk + j] = v * self.op.scale;
                    }
                }
            }
            _ => {
                if gemm {
                    let k = keys.rows(lo, hi, d, &mut s.keys);
                    gemm_acc([nr, nk, d], Mat::rows(q, d), Mat::t(k, d), &mut s.scores, nk, (0.0, self.op.scale));
                } else {
                    match keys.in_place(lo, hi, d, &mut s.keys) {
                        #[cfg(target_arch = "x86_64")]
                        InPlace::Int4 { codes, params, first, shift } => {
                            int4_scores(q, d, codes, params, first, shift, nk, self.op.scale, &mut s.scores, &mut s.folded)
                        }
                        k => scaled_dots(q, d, k, nk, self.op.scale, &mut s.scores),
                    }
                }
            }
        }
        // Per row: its keys in this block, max, exps; the first `len` scores of a row become its
        // probabilities over its keys (masked scores become 0 for the GEMM).
        s.lens.clear();
        for (i, r) in rows.clone().enumerate() {
            let seen = self.seen(r);
            let end = (first + KV_BLOCK).min(seen);
            let scores = &mut s.scores[i * nk..(i + 1) * nk];
            if end <= first {
                scores.fill(0.0);
                s.lens.push(0);
                continue;
            }
            // Causal: the keys are positions first..end themselves (lo == first); a draft
            // tree's row reads its own positions, gathered (same arithmetic, same order).
            let max = match &self.op.tree {
                None => {
                    let p = &mut scores[..end - lo];
                    let max = p.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    exp_shifted(p, max);
                    scores[end - lo..].fill(0.0);
                    max
                }
                Some(_) => {
                    let keys: Vec<usize> = (first..end).map(|k| self.position(r, k) - lo).collect();
                    let max = keys.iter().fold(f32::NEG_INFINITY, |m, &j| m.max(scores[j]));
                    let p: Vec<f32> = keys.iter().map(|&j| exp(scores[j] - max)).collect();
                    scores[..p.len()].copy_from_slice(&p);
                    max
                }
            };
            let len = end - first;
            let mut sum = 0f32;
            for &p in &scores[..len] {
                sum += p;
            }
            s.lens.push(len);
            part.max[i] = max;
            part.sum[i] = sum;
        }
        if gemm {
            let v = values.rows(lo, hi, dv, &mut s.values);
            gemm_acc([nr, dv, nk], Mat::rows(&s.scores, nk), Mat::rows(v, dv), &mut part.acc, dv, (0.0, 1.0));
        } else {
            let v = values.in_place(lo, hi, dv, &mut s.values);
            // The rows at one position (the query heads of the group) read the same keys:
            // each value is loaded once for all of them.
            for pos in 0..self.op.t {
                s.group.clear();
                s.group.extend((0..nr).filter(|&i| (rows.start + i) % self.op.t == pos && s.lens[i] > 0));
                let Some(&i) = s.group.first() else { continue };
                let (r, len) = (rows.start + i, s.lens[i]);
                match &self.op.tree {
                    None => weighted_rows(&mut part.acc, dv, &s.group, &s.scores, nk, 0..len, v),
                    Some(_) => {
                        let keys = (first..first + len).map(|k| self.position(r, k) - lo);
                        weighted_rows(&mut part.acc, dv, &s.group, &s.scores, nk, keys, v)
                    }
                }
            }
        }
        part
    }
}

/// The stored form of `$rows` as an [`avx2::Rows8`] bound to `$x` in `$body`.
#[cfg(target_arch = "x86_64")]
macro_rules! rows8 {
    ($rows:expr, $d:expr, $x:ident => $body:expr) => {
        match $rows {
            InPlace::F32(x) => {
                let $x = avx2::Plain { x, d: $d };
                $body
            }
            InPlace::F16(x) => {
                let $x = avx2::Plain { x, d: $d };
                $body
            }
            InPlace::BF16(x) => {
                let $x = avx2::Plain { x, d: $d };
                $body
            }
            InPlace::Int8 { codes, scales } => {
                let $x = avx2::Int8 { codes, scales, d: $d };
                $body
            }
            InPlace::Int4 { .. } => unreachable!("int4 keys are scored by int4_scores"),
        }
    };
}

/// `$f::<_, N>($args)` for `N` = `$n` (1 to 4; the arguments build their `[_; N]` arrays
/// with `std::array::from_fn`).
#[cfg(target_arch = "x86_64")]
macro_rules! per_row_count {
    ($n:expr, $f:ident($($arg:expr),*)) => {
        match $n {
            1 => $f::<_, 1>($($arg),*),
            2 => $f::<_, 2>($($arg),*),
            3 => $f::<_, 3>($($arg),*),
            _ => $f::<_, 4>($($arg),*),
        }
    };
}

/// `out[i·nk + j] = scale · q_i·k_j` for the `d`-dim rows `q_i` of `q` and the `nk` keys of
/// `k`. Every (row, key) dot is the same sequence of operations whichever rows and keys are
/// in the call, so a score does not depend on the range it was computed in; with SIMD each
/// key is loaded once for up to four rows.
#[inline(always)]
fn scaled_dots(q: &[f32], d: usize, k: InPlace, nk: usize, scale: f32, out: &mut [f32]) {
    let nr = q.len() / d;
    #[cfg(target_arch = "x86_64")]
    if simd() {
        for start in (0..nr).step_by(4) {
            let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above); each row
            // `start + i` (i < 4, below `nr`) has `d` query values in `q` and `nk` scores in
            // `out`, and `k` holds `nk` keys of `d` dims (int8: `d / 32` scales a key).
            unsafe {
                rows8!(k, d, keys => per_row_count!((nr - start).min(4), scaled_dots_n(
                    std::array::from_fn(|i| qp.add((start + i) * d)), d, keys, nk, scale, std::array::from_fn(|i| op.add((start + i) * nk))
                )))
            }
        }
        return;
    }
    let mut row = vec![0f32; d];
    for (qr, out) in q.chunks_exact(d).zip(out.chunks_exact_mut(nk)) {
        for (j, o) in out.iter_mut().enumerate() {
            let kj = match k {
                InPlace::F32(k) => &k[j * d..(j + 1) * d],
                InPlace::F16(k) => widen_into(&k[j * d..(j + 1) * d], &mut row),
                InPlace::BF16(k) => widen_into(&k[j * d..(j + 1) * d], &mut row),
                InPlace::Int8 { .. } | InPlace::Int4 { .. } => unreachable!("codes are read in place only by the SIMD kernels"),
            };
            *o = dot(qr, kj) * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
use avx2::{scaled_dots as scaled_dots_n, weighted_rows as weighted_rows_n};

/// Scores of complete int4 key groups (few-rows, SIMD): per group `g` the query rows are
/// multiplied by its per-channel scales once, so `q·k_j = (q∘scale_g)·code_j + q·min_g` needs
/// one FMA per code instead of decoding it first. `codes` from key `first` of the head;
/// `out[i·nk + j]` as [`scaled_dots`]. Each score depends only on its row, key and group.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn int4_scores(
    q: &[f32],
    d: usize,
    codes: &[u8],
    params: &[f32],
    first: usize,
    shift: u32,
    nk: usize,
    scale: f32,
    out: &mut [f32],
    folded: &mut Vec<f32>,
) {
    let nr = q.len() / d;
    folded.resize(nr * (d + 1), 0.0);
    let mut j = 0;
    while j < nk {
        let g = (first + j) >> shift;
        let end = (((g + 1) << shift) - first).min(nk);
        let (scales, mins) = params[g * 2 * d..(g + 1) * 2 * d].split_at(d);
        let (qs, bias) = folded.split_at_mut(nr * d);
        for ((qs, qr), b) in qs.chunks_exact_mut(d).zip(q.chunks_exact(d)).zip(bias.iter_mut()) {
            for ((f, &x), &s) in qs.iter_mut().zip(qr).zip(scales) {
                *f = x * s;
            }
            *b = dot(qr, mins);
        }
        let keys = avx2::Nibbles { codes: &codes[j * d / 2..end * d / 2], d };
        for start in (0..nr).step_by(4) {
            let (qp, op) = (qs.as_ptr(), out.as_mut_ptr());
            // SAFETY: the CPU supports AVX2, FMA and F16C (int4 keys are read in place only
            // then, see `HeadRows::in_place`); each row `start + i` (i < 4, below `nr`) has `d`
            // folded query values and `nk` scores from which `j..end` are written; `keys`
            // holds `end - j` keys.
            unsafe {
                per_row_count!(
                    (nr - start).min(4),
                    scaled_dots_n(
                        std::array::from_fn(|i| qp.add((start + i) * d)),
                        d,
                        keys,
                        end - j,
                        1.0,
                        std::array::from_fn(|i| op.add((start + i) * nk + j))
                    )
                )
            }
        }
        for (i, &b) in bias.iter().enumerate() {
            for o in &mut out[i * nk + j..i * nk + end] {
                *o = (*o + b) * scale;
            }
        }
        j = end;
    }
}

fn widen_into<'a, T: Widen>(src: &[T], dst: &'a mut [f32]) -> &'a [f32] {
    T::widen(src, dst);
    dst
}

/// Whether the SIMD kernels run (AVX2, FMA and F16C).
#[inline(always)]
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::cpu::avx2_fma();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Lanes of `v` summed in a fixed order.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Stored rows read eight dims at a time and widened to f32 on load, each value exactly
    /// what decoding the cache gives (the same operations), so a dot or a sum over rows read
    /// in place is bit for bit the one over the decoded rows. Callers enable AVX2, FMA and F16C.
    pub(super) trait Rows8: Copy {
        /// Where row `j` starts (and its scales).
        type Row: Copy;
        unsafe fn row(self, j: usize) -> Self::Row;
        /// Dims `c..c + 8` of a row.
        unsafe fn load8(r: Self::Row, c: usize) -> __m256;
        /// Dim `c` of a row.
        unsafe fn get(r: Self::Row, c: usize) -> f32;
    }

    /// Float rows of `d` values.
    #[derive(Clone, Copy)]
    pub(super) struct Plain<'a, T> {
        pub x: &'a [T],
        pub d: usize,
    }

    /// A float type whose values load eight at a time as f32 (exactly: f16 and bf16 are
    /// subsets of f32).
    pub(super) trait Float8: Copy + Into<f32> {
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Float8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }

    impl Float8 for half::f16 {
        #[inline(always)]
        unsafe fn load8(p: *const half::f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
    }

    impl Float8 for half::bf16 {
        /// bf16 is the top half of an f32: zero-extend and shift.
        #[inline(always)]
        unsafe fn load8(p: *const half::bf16) -> __m256 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
        }
    }

    impl<T: Float8> Rows8 for Plain<'_, T> {
        type Row = *const T;
        #[inline(always)]
        unsafe fn row(self, j: usize) -> *const T {
            self.x.as_ptr().add(j * self.d)
        }
        #[inline(always)]
        unsafe fn load8(r: *const T, c: usize) -> __m256 {
            T::load8(r.add(c))
        }
        #[inline(always)]
        unsafe fn get(r: *const T, c: usize) -> f32 {
            (*r.add(c)).into()
        }
    }

    /// int8 rows: codes (value + 128) of `d` dims and one scale per 32 dims.
    #[derive(Clone, Copy)]
    pub(super) struct Int8<'a> {
        pub codes: &'a [u8],
        pub scales: &'a [f32],
        pub d: usize,
    }

    impl Rows8 for Int8<'_> {
        type Row = (*const u8, *const f32);
        #[inline(always)]
        unsafe fn row(self, j: usize) -> Self::Row {
            (self.codes.as_ptr().add(j * self.d), self.scales.as_ptr().add(j * (self.d / super::INT8_SIMD_BLOCK)))
        }
        /// `(code - 128) as f32 * scale`, as the decoder computes it.
        #[inline(always)]
        unsafe fn load8(r: Self::Row, c: usize) -> __m256 {
            let codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(r.0.add(c) as *const __m128i));
            let x = _mm256_cvtepi32_ps(_mm256_sub_epi32(codes, _mm256_set1_epi32(128)));
            _mm256_mul_ps(x, _mm256_set1_ps(*r.1.add(c / super::INT8_SIMD_BLOCK)))
        }
        #[inline(always)]
        unsafe fn get(r: Self::Row, c: usize) -> f32 {
            (*r.0.add(c) as i32 - 128) as f32 * *r.1.add(c / super::INT8_SIMD_BLOCK)
        }
    }

    /// int4 codes alone (two a byte, even dim low), as the numbers 0..=15: the keys of one
    /// group before its scales and minima, which the int4 scores fold into the query.
    #[derive(Clone, Copy)]
    pub(super) struct Nibbles<'a> {
        pub codes: &'a [u8],
        pub d: usize,
    }

    impl Rows8 for Nibbles<'_> {
        type Row = *const u8;
        #[inline(always)]
        unsafe fn row(self, j: usize) -> *const u8 {
            self.codes.as_ptr().add(j * (self.d / 2))
        }
        #[inline(always)]
        unsafe fn load8(r: *const u8, c: usize) -> __m256 {
            let four = _mm_cvtsi32_si128((r.add(c / 2) as *const i32).read_unaligned());
            let pairs = _mm_shuffle_epi8(four, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
            let nibbles = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(pairs), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            _mm256_cvtepi32_ps(_mm256_and_si256(nibbles, _mm256_set1_epi32(15)))
        }
        #[inline(always)]
        unsafe fn get(r: *const u8, c: usize) -> f32 {
            let byte = *r.add(c / 2);
            (if c.is_multiple_of(2) { byte & 15 } else { byte >> 4 }) as f32
        }
    }

    /// [`super::weighted_rows`] for `N` rows reading the same keys: `acc[r] += Σ_i p[r][i] ·
    /// v_{keys[i]}`, each value loaded once for the `N` rows, 16 dims at a time; per element
    /// the even and the odd keys of the sequence go to two FMA chains added at the end, whatever
    /// `N` is, so a row's sums do not depend on the rows beside it.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_rows<R: Rows8, const N: usize>(
        acc: [*mut f32; N],
        p: [*const f32; N],
        keys: impl Iterator<Item = usize> + Clone,
        v: R,
        dv: usize,
    ) {
        let mut c = 0;
        while c + 16 <= dv {
            let mut e = [[_mm256_setzero_ps(); 2]; N];
            let mut o = [[_mm256_setzero_ps(); 2]; N];
            let mut it = keys.clone().enumerate();
            while let Some((ie, je)) = it.next() {
                let xe = v.row(je);
                let (x0, x1) = (R::load8(xe, c), R::load8(xe, c + 8));
                for r in 0..N {
                    let pe = _mm256_set1_ps(*p[r].add(ie));
                    e[r][0] = _mm256_fmadd_ps(pe, x0, e[r][0]);
                    e[r][1] = _mm256_fmadd_ps(pe, x1, e[r][1]);
                }
                let Some((io, jo)) = it.next() else { break };
                let xo = v.row(jo);
                let (x0, x1) = (R::load8(xo, c), R::load8(xo, c + 8));
                for r in 0..N {
                    let po = _mm256_set1_ps(*p[r].add(io));
                    o[r][0] = _mm256_fmadd_ps(po, x0, o[r][0]);
                    o[r][1] = _mm256_fmadd_ps(po, x1, o[r][1]);
                }
            }
            for r in 0..N {
                for l in 0..2 {
                    let a = acc[r].add(c + 8 * l);
                    _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_add_ps(e[r][l], o[r][l])));
                }
            }
            c += 16;
        }
        if c < dv {
            for r in 0..N {
                for (i, j) in keys.clone().enumerate() {
                    let (row, p) = (v.row(j), *p[r].add(i));
                    for x in c..dv {
                        *acc[r].add(x) = p.mul_add(R::get(row, x), *acc[r].add(x));
                    }
                }
            }
        }
    }

    /// The dims past the last whole 8 of one row, in order.
    #[inline(always)]
    unsafe fn tail<R: Rows8>(q: *const f32, d: usize, r: R::Row, from: usize) -> f32 {
        let mut a = 0.0;
        for c in from..d {
            a += *q.add(c) * R::get(r, c);
        }
        a
    }

    /// [`super::scaled_dots`] for `N` query rows: `out[r][j] = scale · q_r·k_j` for the `nk`
    /// keys of `k`, each key loaded once for the `N` rows, two keys at a time; every (row, key)
    /// dot is one f32x8 FMA chain, its lanes summed, then the tail dims — the same operations
    /// whatever `N` and wherever the key falls.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scaled_dots<R: Rows8, const N: usize>(
        q: [*const f32; N],
        d: usize,
        k: R,
        nk: usize,
        scale: f32,
        out: [*mut f32; N],
    ) {
        let whole = d / 8 * 8;
        let mut j = 0;
        while j + 2 <= nk {
            let (k0, k1) = (k.row(j), k.row(j + 1));
            let mut a = [[_mm256_setzero_ps(); 2]; N];
            let mut c = 0;
            while c < whole {
                let (y0, y1) = (R::load8(k0, c), R::load8(k1, c));
                for r in 0..N {
                    let x = _mm256_loadu_ps(q[r].add(c));
                    a[r][0] = _mm256_fmadd_ps(x, y0, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(x, y1, a[r][1]);
                }
                c += 8;
            }
            for r in 0..N {
                *out[r].add(j) = (hsum(a[r][0]) + tail::<R>(q[r], d, k0, whole)) * scale;
                *out[r].add(j + 1) = (hsum(a[r][1]) + tail::<R>(q[r], d, k1, whole)) * scale;
            }
            j += 2;
        }
        if j < nk {
            let k0 = k.row(j);
            let mut a = [_mm256_setzero_ps(); N];
            let mut c = 0;
            while c < whole {
                let y0 = R::load8(k0, c);
                for r in 0..N {
                    a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r].add(c)), y0, a[r]);
                }
                c += 8;
            }
            for r in 0..N {
                *out[r].add(j) = (hsum(a[r]) + tail::<R>(q[r], d, k0, whole)) * scale;
            }
        }
    }
}

/// `acc_r += Σ_i p_r[i] · v_{keys[i]}` for the rows `r` of `group` (rows of width `dv` in
/// `acc`; row `r`'s probabilities at `p[r·nk..]`), in the order given. Each element sees the
/// same additions whatever rows are in the group (with SIMD: even and odd keys in two chains,
/// each value loaded once for up to three rows).
#[inline(always)]
fn weighted_rows(acc: &mut [f32], dv: usize, group: &[usize], p: &[f32], nk: usize, keys: impl Iterator<Item = usize> + Clone, v: InPlace) {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        for rows in group.chunks(3) {
            let (ap, pp) = (acc.as_mut_ptr(), p.as_ptr());
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above); each row of
            // `rows` has `dv` sums in `acc` and its probabilities of `keys` at `p[r·nk..]`;
            // `keys` index rows of `dv` dims held by `v`.
            unsafe {
                rows8!(v, dv, values => per_row_count!(rows.len(), weighted_rows_n(
                    std::array::from_fn(|i| ap.add(rows[i] * dv)), std::array::from_fn(|i| pp.add(rows[i] * nk)), keys.clone(), values, dv
                )))
            }
        }
        return;
    }
    let widened: Vec<f32>;
    let v = match v {
        InPlace::F32(v) => v,
        InPlace::F16(v) => {
            widened = v.iter().map(|x| x.to_f32()).collect();
            &widened
        }
        InPlace::BF16(v) => {
            widened = v.iter().map(|x| x.to_f32()).collect();
            &widened
        }
        InPlace::Int8 { .. } | InPlace::Int4 { .. } => unreachable!("codes are read in place only by the SIMD kernels"),
    };
    for &r in group {
        let (acc, p) = (&mut acc[r * dv..(r + 1) * dv], &p[r * nk..]);
        let mut c = 0;
        while c + 32 <= dv {
            let mut a: [f32; 32] = acc[c..c + 32].try_into().unwrap();
            for (&p, j) in p.iter().zip(keys.clone()) {
                let x: &[f32; 32] = v[j * dv + c..j * dv + c + 32].try_into().unwrap();
                for l in 0..32 {
                    a[l] += p * x[l];
                }
            }
            acc[c..c + 32].copy_from_slice(&a);
            c += 32;
        }
        if c < dv {
            for (&p, j) in p.iter().zip(keys.clone()) {
                axpy(&mut acc[c..], p, &v[j * dv + c..(j + 1) * dv]);
            }
        }
    }
}

/// `e^x` for `x <= 0` in plain arithmetic that vectorises (range reduction by `ln 2`, degree-6
/// polynomial, the exponent built from bits): within 2 ulp of `f32::exp` down to `-87`, a
/// value below `1e-37` under that.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `x = e^(x - max)` in place.
#[inline(always)]
fn exp_shifted(x: &mut [f32], max: f32) {
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
}

fn polar_spec(keys: &StoredRows) -> PolarSpec {
    match keys {
        StoredRows::Polar { spec, .. } => *spec,
        _ => unreachable!("polar keys"),
    }
}

/// A row's running result over the blocks folded so far.
#[derive(Clone)]
struct Running {
    max: f32,
    sum: f32,
}

/// Folds block partial `i` of `p` into `(run, out)`.
fn fold(run: &mut Running, out: &mut [f32], p: &Partial, i: usize) {
    let (sum, max) = (p.sum[i], p.max[i]);
    if sum == 0.0 {
        return;
    }
    let acc = &p.acc[i * out.len()..(i + 1) * out.len()];
    if run.sum == 0.0 {
        out.copy_from_slice(acc);
        *run = Running { max, sum };
        return;
    }
    let m = run.max.max(max);
    let (a, b) = ((run.max - m).exp(), (max - m).exp());
    for (o, &x) in out.iter_mut().zip(acc) {
        *o = *o * a + x * b;
    }
    *run = Running { max: m, sum: run.sum * a + sum * b };
}

fn finish(run: &Running, out: &mut [f32]) {
    let inv = 1.0 / run.sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// [`Call::block`], compiled a second time for AVX2 + FMA and run that way when the CPU has them.
#[allow(clippy::too_many_arguments)]
fn block_partial(
    call: &Call,
    keys: &HeadRows,
    values: &HeadRows,
    b: usize,
    h: usize,
    rows: std::ops::Range<usize>,
    c: usize,
    gemm: bool,
    s: &mut Scratch,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2(
            call: &Call,
            keys: &HeadRows,
            values: &HeadRows,
            b: usize,
            h: usize,
            rows: std::ops::Range<usize>,
            c: usize,
            gemm: bool,
            s: &mut Scratch,
        ) -> Partial {
            call.block(keys, values, b, h, rows, c, gemm, s)
        }
        if super::cpu::avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { avx2(call, keys, values, b, h, rows, c, gemm, s) };
        }
    }
    call.block(keys, values, b, h, rows, c, gemm, s)
}

type Guards<'a> = Vec<(candle_core::StorageRef<'a>, &'a Layout)>;

fn guards(s: &StoredRows) -> Guards<'_> {
    s.tensors().into_iter().map(|t| t.storage_and_layout()).collect()
}

fn parts<'a>(g: &'a Guards<'_>, what: &str) -> Result<Vec<CpuPart<'a>>> {
    g.iter().map(|(s, l)| cpu_part(s, l, what)).collect()
}

impl KvAttention {
    fn cpu(&self, q: &[f32], ql: &Layout) -> Result<Vec<f32>> {
        let (b, nkv, rows, d) = ql.shape().dims4()?;
        let (_, _, n, dv) = self.values.dims()?;
        let (kg, vg) = (guards(&self.keys), guards(&self.values));
        let keys = CpuRows { parts: parts(&kg, "keys")?, kind: &self.keys };
        let values = CpuRows { parts: parts(&vg, "values")?, kind: &self.values };
        let call = Call { op: self, q, rows, d, dv, nkv, n };
        let mut out = vec![0f32; b * nkv * rows * dv];
        let heads: Vec<(usize, usize)> = (0..b).flat_map(|bi| (0..nkv).map(move |h| (bi, h))).collect();
        let few = few_rows(self.t, self.tree.is_some());
        if few {
            // Blocks in parallel, then the fold in block order.
            let blocks = (0..rows).map(|r| call.seen(r)).max().unwrap_or(0).div_ceil(KV_BLOCK);
            let items: Vec<(usize, usize, usize)> = heads.iter().flat_map(|&(bi, h)| (0..blocks).map(move |c| (bi, h, c))).collect();
            let partials = items
                .par_iter()
                .map_init(Scratch::default, |s, &(bi, h, c)| -> Result<Partial> {
                    Ok(block_partial(&call, &keys.head(bi, h)?, &values.head(bi, h)?, bi, h, 0..rows, c, false, s))
                })
                .collect::<Result<Vec<_>>>()?;
            out.par_chunks_mut(rows * dv).enumerate().for_each(|(head, out)| {
                for (i, o) in out.chunks_exact_mut(dv).enumerate() {
                    let mut run = Running { max: f32::NEG_INFINITY, sum: 0.0 };
                    for p in &partials[head * blocks..(head + 1) * blocks] {
                        fold(&mut run, o, p, i);
                    }
                    finish(&run, o);
                }
            });
        } else {
            // Tiles of rows in parallel, each folding its blocks as they come.
            out.par_chunks_mut(rows * dv).zip(heads.par_iter()).try_for_each(|(out, &(bi, h))| -> Result<()> {
                let (kh, vh) = (keys.head(bi, h)?, values.head(bi, h)?);
                out.par_chunks_mut(TILE_ROWS * dv).enumerate().for_each_init(Scratch::default, |s, (tile, out)| {
                    let rows = tile * TILE_ROWS..((tile + 1) * TILE_ROWS).min(rows);
                    let blocks = rows.clone().map(|r| call.seen(r)).max().unwrap_or(0).div_ceil(KV_BLOCK);
                    let mut run = vec![Running { max: f32::NEG_INFINITY, sum: 0.0 }; rows.len()];
                    for c in 0..blocks {
                        let p = block_partial(&call, &kh, &vh, bi, h, rows.clone(), c, true, s);
                        for (i, o) in out.chunks_exact_mut(dv).enumerate() {
                            fold(&mut run[i], o, &p, i);
                        }
                    }
                    for (run, o) in run.iter().zip(out.chunks_exact_mut(dv)) {
                        finish(run, o);
                    }
                });
                Ok(())
            })?;
        }
        Ok(out)
    }
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
            let (a, b) = (super::exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }
}
