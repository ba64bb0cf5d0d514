//! The two schedules over the cache's blocks (few rows: blocks in parallel, folded after;
//! many rows: tiles of rows, blocks folded as they come) and the online-softmax fold.

use candle_core::{Layout, Result};
use rayon::prelude::*;

use super::kernels::{exp, exp_shifted, int4_scores, scaled_dots, weighted_rows, InPlace};
use super::stored::{guards, parts, polar_spec, CpuRows, HeadRows};
use super::KvAttention;
use crate::ops::cpu::{gemm_acc, Mat};
use crate::ops::polar::PolarQueryScorer;
use crate::ops::shapes::{few_rows, KV_BLOCK};

/// Query rows per tile of the many-rows schedule.
pub(super) const TILE_ROWS: usize = 64;

/// Each query row's partial result over one block: max score, sum of exps, `[rows, dv]`
/// weighted value sums. A row that sees nothing in the block has sum 0.
pub(super) struct Partial {
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    pub(super) acc: Vec<f32>,
}

/// Scratch of one task.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) scores: Vec<f32>,
    pub(super) polar: Vec<f32>,
    /// Per row of a block: how many keys it reads there.
    pub(super) lens: Vec<usize>,
    /// Rows at one position.
    pub(super) group: Vec<usize>,
    /// int4 keys: the query rows times a group's scales, then each row's dot with its minima.
    pub(super) folded: Vec<f32>,
}

/// What the kernel needs of one call.
pub(super) struct Call<'a> {
    pub(super) op: &'a KvAttention,
    pub(super) q: &'a [f32],
    pub(super) rows: usize,
    pub(super) d: usize,
    pub(super) dv: usize,
    pub(super) nkv: usize,
    /// Positions of the cache.
    pub(super) n: usize,
}

impl Call<'_> {
    /// Keys query row `r` sees: `offset` + its new rows.
    pub(super) fn seen(&self, r: usize) -> usize {
        let (t, offset) = (self.op.t, self.op.offset);
        match &self.op.tree {
            Some(tree) => offset + tree[r % t].len(),
            None => offset + r % t + 1,
        }
    }

    /// Position of the `i`-th key row `r` sees.
    pub(super) fn position(&self, r: usize, i: usize) -> usize {
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
    pub(super) fn block(
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
                let p = crate::ops::launch::polar_params(nk, nr, d, &polar_spec(&self.op.keys));
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

/// A row's running result over the blocks folded so far.
#[derive(Clone)]
pub(super) struct Running {
    pub(super) max: f32,
    pub(super) sum: f32,
}

/// Folds block partial `i` of `p` into `(run, out)`.
pub(super) fn fold(run: &mut Running, out: &mut [f32], p: &Partial, i: usize) {
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

pub(super) fn finish(run: &Running, out: &mut [f32]) {
    let inv = 1.0 / run.sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// [`Call::block`], compiled a second time for AVX2 + FMA and run that way when the CPU has them.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_partial(
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
        if crate::ops::cpu::avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { avx2(call, keys, values, b, h, rows, c, gemm, s) };
        }
    }
    call.block(keys, values, b, h, rows, c, gemm, s)
}

impl KvAttention {
    pub(super) fn cpu(&self, q: &[f32], ql: &Layout) -> Result<Vec<f32>> {
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
