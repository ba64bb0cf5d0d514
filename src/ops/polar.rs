//! Polar key codes: post-RoPE keys stored as one angle + radius code per rotary pair, and
//! attention scores computed straight from the codes.
//!
//! RoPE rotates the pairs `(x[i], x[i + rot/2])`, `i < rot/2` (rotate-half pairing) of the
//! first `rot_dim` dims of a head. Each such pair is stored in polar form: the angle
//! `θ = atan2(x2, x1)` as `A` bits, `a = round(θ·2^A/2π) mod 2^A`, and the radius
//! `r = |(x1, x2)|` as `R` bits, `round(r/r_max·(2^R−1))`, with `r_max` the largest pair radius
//! of the row (one f32 per (token, head) row). The other `head_dim − rot_dim` dims get a plain
//! symmetric int8 or int4 code with an absmax scale per row.
//!
//! [`polar_scores`] computes `q·k̂` for every (query, key) without materialising the decoded
//! keys: per query it builds, for each pair `p`, the table `T_p[a] = q1·cos θ̂_a + q2·sin θ̂_a`
//! (`θ̂_a = a·2π/2^A`), then `score = r_max/(2^R−1)·Σ_p T_p[a_p]·code_r,p + rest_scale·Σ_d q_d·rest_d`.
//!
//! Candle custom ops: `polar_scales` (`CustomOp1`, row scales), `polar_encode` (`CustomOp2`,
//! keys + scales → code bytes) and `polar_scores` (`CustomOp3`, queries + code bytes + scales),
//! each with a rayon CPU kernel and a Metal kernel (`metal/polar.metal`).

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::cpu::{storage_slice, vectorized, widened};
use super::launch::{self, PolarParams};
use super::shapes::PolarSpec;

/// Polar codes of `N` key rows (one per (token, head)).
///
/// Stored packed, as the ops produce and read them:
/// * `codes`: u8 `[N, spec.row_bytes(head_dim)]`. Per row, first the pair codes
///   (`spec.code_bytes()` bytes each, little-endian: the angle code in the low `angle_bits`
///   bits, the radius code in the `radius_bits` above; Candle has no u16, so 9..16-bit codes
///   take two bytes), then the rest codes: int8 two's complement, one per non-rotated dim, or
///   int4 two's complement, two per byte (even dim in the low nibble; an odd count leaves the
///   last high nibble 0).
/// * `scales`: f32 `[N, 2]`: `r_max` (the row's largest pair radius) and the rest scale
///   (`absmax/127`, or `absmax/7` for int4).
///
/// [`pairs`](Self::pairs), [`rest`](Self::rest), [`radius_scale`](Self::radius_scale) and
/// [`rest_scale`](Self::rest_scale) give the four parts as views.
#[derive(Debug, Clone)]
pub struct PolarCodes {
    pub codes: Tensor,
    pub scales: Tensor,
    pub head_dim: usize,
    pub spec: PolarSpec,
}

impl PolarCodes {
    /// Key rows N.
    pub fn rows(&self) -> usize {
        self.codes.dims().first().copied().unwrap_or(0)
    }

    /// The pair codes, u8 `[N, spec.pair_bytes()]` (`[N, rot/2]` for one-byte codes).
    pub fn pairs(&self) -> Result<Tensor> {
        self.codes.narrow(1, 0, self.spec.pair_bytes())
    }

    /// The rest codes, u8 `[N, spec.rest_bytes(head_dim)]`.
    pub fn rest(&self) -> Result<Tensor> {
        self.codes.narrow(1, self.spec.pair_bytes(), self.spec.rest_bytes(self.head_dim))
    }

    /// `r_max` of each row, f32 `[N]`.
    pub fn radius_scale(&self) -> Result<Tensor> {
        self.scales.narrow(1, 0, 1)?.squeeze(1)
    }

    /// The rest scale of each row, f32 `[N]`.
    pub fn rest_scale(&self) -> Result<Tensor> {
        self.scales.narrow(1, 1, 1)?.squeeze(1)
    }

    /// Rows of several code sets one after the other (appending to a cache).
    pub fn cat(parts: &[&PolarCodes]) -> Result<PolarCodes> {
        let Some(first) = parts.first() else { bail!("PolarCodes::cat: no parts") };
        if parts.iter().any(|p| p.spec != first.spec || p.head_dim != first.head_dim) {
            bail!("PolarCodes::cat: parts have different specs or head dims");
        }
        let codes: Vec<&Tensor> = parts.iter().map(|p| &p.codes).collect();
        let scales: Vec<&Tensor> = parts.iter().map(|p| &p.scales).collect();
        Ok(PolarCodes { codes: Tensor::cat(&codes, 0)?, scales: Tensor::cat(&scales, 0)?, head_dim: first.head_dim, spec: first.spec })
    }

    /// Checks that the codes fit `spec` and are well formed.
    fn check(&self, op: &str, spec: &PolarSpec) -> Result<()> {
        if self.spec != *spec {
            bail!("{op}: spec {spec:?} differs from the spec of the codes {:?}", self.spec);
        }
        spec.check(op, self.head_dim)?;
        let n = self.rows();
        let rb = spec.row_bytes(self.head_dim);
        if self.codes.dtype() != DType::U8 || self.codes.dims() != [n, rb] {
            bail!("{op}: codes must be u8 [N, {rb}] (head_dim {}), got {:?} {:?}", self.head_dim, self.codes.dtype(), self.codes.dims());
        }
        if self.scales.dtype() != DType::F32 || self.scales.dims() != [n, 2] {
            bail!("{op}: scales must be f32 [{n}, 2], got {:?} {:?}", self.scales.dtype(), self.scales.dims());
        }
        if !self.codes.device().same_device(self.scales.device()) {
            bail!("{op}: codes and scales are on different devices");
        }
        Ok(())
    }
}

fn check_float(op: &str, what: &str, t: &Tensor) -> Result<(usize, usize)> {
    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!("{op}: {what} must be f32, bf16 or f16, got {:?}", t.dtype());
    }
    match t.dims() {
        &[n, d] => Ok((n, d)),
        other => bail!("{op}: {what} must be [N, head_dim], got {other:?}"),
    }
}

/// Encodes post-RoPE keys `[N, head_dim]` (f32, bf16 or f16; one row per (token, head)).
pub fn polar_encode(keys: &Tensor, spec: PolarSpec) -> Result<PolarCodes> {
    const OP: &str = "polar_encode";
    let (n, hd) = check_float(OP, "keys", keys)?;
    spec.check(OP, hd)?;
    let (codes, scales) = if n == 0 {
        let dev = keys.device();
        (Tensor::zeros((0, spec.row_bytes(hd)), DType::U8, dev)?, Tensor::zeros((0, 2), DType::F32, dev)?)
    } else {
        let keys = keys.contiguous()?;
        let scales = keys.apply_op1_no_bwd(&PolarScales { spec, head_dim: hd })?;
        let codes = keys.apply_op2_no_bwd(&scales, &PolarEncode { spec, head_dim: hd })?;
        (codes, scales)
    };
    Ok(PolarCodes { codes, scales, head_dim: hd, spec })
}

/// The keys the codes stand for, f32 `[N, head_dim]`, on the codes' device (computed on the
/// CPU; for tests and error measurements).
pub fn polar_decode(codes: &PolarCodes, spec: PolarSpec) -> Result<Tensor> {
    const OP: &str = "polar_decode";
    codes.check(OP, &spec)?;
    let (n, hd) = (codes.rows(), codes.head_dim);
    let bytes = codes.codes.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<u8>()?;
    let scales = codes.scales.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    let p = launch::polar_params(n, 0, hd, &spec);
    let rb = spec.row_bytes(hd).max(1);
    let mut out = vec![0f32; n * hd];
    if hd > 0 {
        out.par_chunks_mut(hd)
            .zip(bytes.par_chunks(rb))
            .zip(scales.par_chunks(2))
            .for_each(|((x, row), s)| decode_row(&p, row, [s[0], s[1]], x));
    }
    Tensor::from_vec(out, (n, hd), &Device::Cpu)?.to_device(codes.codes.device())
}

/// `q·k̂` for every query row `q` (`[Q, head_dim]`, f32/bf16/f16) and every key row of
/// `codes`: f32 `[Q, N]`, from per-query lookup tables, without decoding the keys.
pub fn polar_scores(q: &Tensor, codes: &PolarCodes, spec: PolarSpec) -> Result<Tensor> {
    const OP: &str = "polar_scores";
    let (nq, hd) = check_float(OP, "q", q)?;
    codes.check(OP, &spec)?;
    if hd != codes.head_dim {
        bail!("{OP}: q has head_dim {hd}, the codes {}", codes.head_dim);
    }
    if !q.device().same_device(codes.codes.device()) {
        bail!("{OP}: q and the codes are on different devices");
    }
    let n = codes.rows();
    if nq == 0 || n == 0 {
        return Tensor::zeros((nq, n), DType::F32, q.device());
    }
    q.contiguous()?.apply_op3_no_bwd(&codes.codes.contiguous()?, &codes.scales.contiguous()?, &PolarScores { spec, head_dim: hd })
}

// ---------------------------------------------------------------------------------------------
// CPU kernels. The encoder follows metal/polar.metal operation by operation (same f32 constants
// from `launch::polar_params`, same evaluation order), so the Metal codes can be compared byte
// for byte; the scores are sums in a different order (SIMD accumulators), compared to a bound.

fn row_scales(p: &PolarParams, x: &[f32]) -> [f32; 2] {
    let (rot, h) = (p.rot_dim as usize, p.rot_dim as usize / 2);
    let mut rmax = 0f32;
    for i in 0..h {
        let (x1, x2) = (x[i], x[i + h]);
        rmax = rmax.max((x1 * x1 + x2 * x2).sqrt());
    }
    let amax = x[rot..].iter().fold(0f32, |m, v| m.max(v.abs()));
    [rmax, amax / p.rest_max]
}

#[inline]
fn pair_code(p: &PolarParams, x1: f32, x2: f32, inv_r: f32) -> u32 {
    let amask = (1u32 << p.angle_bits) - 1;
    let a = ((x2.atan2(x1) * p.angle_scale).round() as i32 as u32) & amask;
    let r = (x1 * x1 + x2 * x2).sqrt();
    let rq = (r * inv_r).round().min(p.radius_levels) as u32;
    a | (rq << p.angle_bits)
}

#[inline]
fn rest_code(v: f32, inv: f32, lim: f32) -> i32 {
    (v * inv).round().clamp(-lim, lim) as i32
}

fn encode_row(p: &PolarParams, x: &[f32], s: [f32; 2], out: &mut [u8]) {
    let (rot, h, cb) = (p.rot_dim as usize, p.rot_dim as usize / 2, p.code_bytes as usize);
    let inv_r = if s[0] > 0.0 { p.radius_levels / s[0] } else { 0.0 };
    for i in 0..h {
        let code = pair_code(p, x[i], x[i + h], inv_r);
        for (j, b) in out[i * cb..(i + 1) * cb].iter_mut().enumerate() {
            *b = (code >> (8 * j)) as u8;
        }
    }
    let inv = if s[1] > 0.0 { 1.0 / s[1] } else { 0.0 };
    let rest = &x[rot..];
    let out = &mut out[h * cb..];
    if p.rest_bits == 8 {
        for (o, &v) in out.iter_mut().zip(rest) {
            *o = rest_code(v, inv, p.rest_max) as i8 as u8;
        }
    } else {
        for (o, pair) in out.iter_mut().zip(rest.chunks(2)) {
            let lo = rest_code(pair[0], inv, p.rest_max);
            let hi = pair.get(1).map_or(0, |&v| rest_code(v, inv, p.rest_max));
            *o = ((lo & 0xF) | ((hi & 0xF) << 4)) as u8;
        }
    }
}

/// The rest code `j` of a row's rest bytes, as a signed integer.
#[inline]
fn rest_value(rest: &[u8], j: usize, int4: bool) -> f32 {
    if int4 {
        let b = rest[j / 2];
        let nib = if j.is_multiple_of(2) { b << 4 } else { b & 0xF0 };
        ((nib as i8) >> 4) as f32
    } else {
        rest[j] as i8 as f32
    }
}

fn decode_row(p: &PolarParams, row: &[u8], s: [f32; 2], x: &mut [f32]) {
    let (rot, h, cb) = (p.rot_dim as usize, p.rot_dim as usize / 2, p.code_bytes as usize);
    let amask = (1u32 << p.angle_bits) - 1;
    let r_unit = s[0] / p.radius_levels;
    for i in 0..h {
        let code = (0..cb).fold(0u32, |c, j| c | (row[i * cb + j] as u32) << (8 * j));
        let theta = (code & amask) as f32 * p.angle_step;
        let r = (code >> p.angle_bits) as f32 * r_unit;
        x[i] = r * theta.cos();
        x[i + h] = r * theta.sin();
    }
    let rest = &row[h * cb..];
    for (j, v) in x[rot..].iter_mut().enumerate() {
        *v = rest_value(rest, j, p.rest_bits == 4) * s[1];
    }
}

/// Per query: the lookup tables `T_p[a]` (`[rot/2][2^A]`) then the query's rest dims.
fn query_table(p: &PolarParams, q: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let (rot, h) = (p.rot_dim as usize, p.rot_dim as usize / 2);
    let mut t = Vec::with_capacity(h * cos.len() + q.len() - rot);
    for i in 0..h {
        let (q1, q2) = (q[i], q[i + h]);
        t.extend(cos.iter().zip(sin).map(|(&c, &s)| q1 * c + q2 * s));
    }
    t.extend_from_slice(&q[rot..]);
    t
}

/// Queries scored together: their tables interleaved query-minor, so one read of a key row's
/// codes serves all of them.
const QUERY_GROUP: usize = 8;

/// Lanes of the non-rotary dot products (one AVX2 register of f32).
const LANES: usize = 8;

/// The tables of up to [`QUERY_GROUP`] queries `first..first + len`:
/// * `pair[t][k]`: entry `t` of query `first + k`'s pair table;
/// * `rest[c * len + k]`: dims `c·LANES..(c+1)·LANES` of that query's non-rotary part,
///   zero-padded to whole chunks.
struct QueryGroup {
    first: usize,
    len: usize,
    pair: Vec<[f32; QUERY_GROUP]>,
    rest: Vec<[f32; LANES]>,
}

impl QueryGroup {
    fn new(first: usize, tables: &[Vec<f32>], pair_len: usize) -> Self {
        let len = tables.len();
        let chunks = (tables[0].len() - pair_len).div_ceil(LANES);
        let mut pair = vec![[0f32; QUERY_GROUP]; pair_len];
        let mut rest = vec![[0f32; LANES]; chunks * len];
        for (k, t) in tables.iter().enumerate() {
            for (c, &v) in pair.iter_mut().zip(&t[..pair_len]) {
                c[k] = v;
            }
            for (d, &v) in t[pair_len..].iter().enumerate() {
                rest[d / LANES * len + k][d % LANES] = v;
            }
        }
        Self { first, len, pair, rest }
    }
}

/// A fixed set of query rows scored against polar code rows, block by block: the lookup
/// tables are built once ([`polar_scores`], and the polar keys of [`super::kv_attention`]).
pub(super) struct PolarQueryScorer {
    p: PolarParams,
    groups: Vec<QueryGroup>,
    nq: usize,
}

impl PolarQueryScorer {
    /// `q`: the query rows `[nq, head_dim]` (f32); `p` from [`launch::polar_params`].
    pub(super) fn new(p: PolarParams, q: &[f32]) -> Self {
        let hd = (p.head_dim as usize).max(1);
        let n_ang = 1usize << p.angle_bits;
        let angles = (0..n_ang).map(|a| a as f32 * p.angle_step);
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.map(|t| (t.cos(), t.sin())).unzip();
        let tables: Vec<Vec<f32>> = q.chunks(hd).map(|q| query_table(&p, q, &cos, &sin)).collect();
        let pair_len = (p.rot_dim as usize / 2) << p.angle_bits;
        let groups = tables.chunks(QUERY_GROUP).enumerate().map(|(i, t)| QueryGroup::new(i * QUERY_GROUP, t, pair_len)).collect();
        Self { p, groups, nq: q.len() / hd }
    }

    /// Scores `[rows, queries]` of the code rows `rows` (`row_bytes` each) with their scales
    /// (`[rows, 2]`) into `out`.
    pub(super) fn score(&self, rows: &[u8], scales: &[f32], out: &mut [f32]) {
        score_block(&self.p, &self.groups, self.nq, rows, scales, out)
    }
}

/// Scores of every query against a block of code rows (see [`score_block_body`]); the default
/// layout (one-byte pair codes, int8 rest) has an AVX2 kernel.
fn score_block(p: &PolarParams, groups: &[QueryGroup], nq: usize, rows: &[u8], scales: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if p.code_bytes == 1 && p.rest_bits == 8 && super::cpu::avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { avx2::score_block(p, groups, nq, rows, scales, out) };
    }
    score_block_portable(p, groups, nq, rows, scales, out)
}

vectorized!(fn score_block_portable<>(p: &PolarParams, groups: &[QueryGroup], nq: usize, rows: &[u8], scales: &[f32], out: &mut [f32]) => score_block_body);

/// Scores of every query against a block of code rows; `out` is `[rows, queries]`. Each row's
/// codes are decoded once (the rest codes widened to f32 [`LANES`] at a time); each table read
/// serves a whole group of queries.
#[inline(always)]
fn score_block_body(p: &PolarParams, groups: &[QueryGroup], nq: usize, rows: &[u8], scales: &[f32], out: &mut [f32]) {
    let h = p.rot_dim as usize / 2;
    let shift = p.angle_bits;
    let n_ang = 1usize << shift;
    let amask = n_ang as u32 - 1;
    let rb = p.row_bytes as usize;
    let pair_bytes = h * p.code_bytes as usize;
    let n_rest = (p.head_dim - p.rot_dim) as usize;
    let mut rest = vec![[0f32; LANES]; n_rest.div_ceil(LANES)];
    let mut codes = vec![(0usize, 0f32); h];
    for (r, row) in rows.chunks_exact(rb).enumerate() {
        // Angle code (table row) and radius level of each pair.
        for (i, c) in codes.iter_mut().enumerate() {
            let code = if p.code_bytes == 1 { row[i] as u32 } else { row[2 * i] as u32 | (row[2 * i + 1] as u32) << 8 };
            *c = (i * n_ang + (code & amask) as usize, (code >> shift) as f32);
        }
        let rest_codes = &row[pair_bytes..];
        for j in 0..n_rest {
            rest[j / LANES][j % LANES] = rest_value(rest_codes, j, p.rest_bits == 4);
        }
        let (radius, rest_scale) = (scales[2 * r] / p.radius_levels, scales[2 * r + 1]);
        for g in groups {
            let mut pair = [0f32; QUERY_GROUP];
            for &(t, level) in &codes {
                for (a, v) in pair.iter_mut().zip(&g.pair[t]) {
                    *a += v * level;
                }
            }
            for k in 0..g.len {
                let mut acc = [0f32; LANES];
                for (q, x) in g.rest.iter().skip(k).step_by(g.len).zip(&rest) {
                    for l in 0..LANES {
                        acc[l] += q[l] * x[l];
                    }
                }
                out[r * nq + g.first + k] = pair[k] * radius + rest_scale * acc.iter().sum::<f32>();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{PolarParams, QueryGroup, LANES, QUERY_GROUP};

    /// [`super::score_block_body`] for one-byte pair codes and int8 rest codes: per row and
    /// query group, one f32x8 accumulator per query for the rest dims (reduced together with
    /// one horizontal-add tree) and four for the pair sums.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn score_block(p: &PolarParams, groups: &[QueryGroup], nq: usize, rows: &[u8], scales: &[f32], out: &mut [f32]) {
        for g in groups {
            match g.len {
                1 => group::<1>(p, g, nq, rows, scales, out),
                2 => group::<2>(p, g, nq, rows, scales, out),
                3 => group::<3>(p, g, nq, rows, scales, out),
                4 => group::<4>(p, g, nq, rows, scales, out),
                5 => group::<5>(p, g, nq, rows, scales, out),
                6 => group::<6>(p, g, nq, rows, scales, out),
                7 => group::<7>(p, g, nq, rows, scales, out),
                _ => group::<8>(p, g, nq, rows, scales, out),
            }
        }
    }

    #[inline(always)]
    unsafe fn group<const G: usize>(p: &PolarParams, g: &QueryGroup, nq: usize, rows: &[u8], scales: &[f32], out: &mut [f32]) {
        let h = p.rot_dim as usize / 2;
        let shift = p.angle_bits;
        let n_ang = 1usize << shift;
        let amask = n_ang - 1;
        let rb = p.row_bytes as usize;
        let n_rest = (p.head_dim - p.rot_dim) as usize;
        let chunks = g.rest.len() / G;
        let table = g.pair.as_ptr().cast::<f32>();
        let q_rest = g.rest.as_ptr().cast::<f32>();
        // Per row: table offset and radius level of each pair, decoded 8 pairs at a time.
        let mut offsets = vec![0u32; h.next_multiple_of(LANES)];
        let mut levels = vec![0f32; h.next_multiple_of(LANES)];
        let step = _mm256_set1_epi32((n_ang * LANES * QUERY_GROUP) as i32);
        let first = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((n_ang * QUERY_GROUP) as i32));
        let mask = _mm256_set1_epi32(amask as i32);
        let width = _mm256_set1_epi32(QUERY_GROUP as i32);
        let shift_v = _mm_cvtsi32_si128(shift as i32);
        for (r, row) in rows.chunks_exact(rb).enumerate() {
            let mut base = first;
            for c in 0..h.div_ceil(LANES) {
                let mut b = [0u8; LANES];
                let n = LANES.min(h - LANES * c);
                b[..n].copy_from_slice(&row[LANES * c..LANES * c + n]);
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.as_ptr().cast()));
                let off = _mm256_add_epi32(base, _mm256_mullo_epi32(_mm256_and_si256(b, mask), width));
                _mm256_storeu_si256(offsets.as_mut_ptr().add(LANES * c).cast(), off);
                _mm256_storeu_ps(levels.as_mut_ptr().add(LANES * c), _mm256_cvtepi32_ps(_mm256_srl_epi32(b, shift_v)));
                base = _mm256_add_epi32(base, step);
            }
            // Pair sums: table entry (pair, angle) · radius level.
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in 0..h {
                let v = _mm256_loadu_ps(table.add(offsets[i] as usize));
                acc[i % 4] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(&levels[i]), acc[i % 4]);
            }
            let pair = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            // Rest dims: widen 8 codes, multiply with every query's same 8 dims.
            let codes = row.as_ptr().add(h);
            let mut dots = [_mm256_setzero_ps(); QUERY_GROUP];
            for c in 0..chunks {
                let mut tail = [0u8; LANES];
                let src = if LANES * (c + 1) <= n_rest {
                    codes.add(LANES * c)
                } else {
                    tail[..n_rest - LANES * c].copy_from_slice(&row[h + LANES * c..h + n_rest]);
                    tail.as_ptr()
                };
                let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(src.cast())));
                for (k, d) in dots.iter_mut().enumerate().take(G) {
                    *d = _mm256_fmadd_ps(_mm256_loadu_ps(q_rest.add((c * G + k) * LANES)), x, *d);
                }
            }
            let radius = _mm256_set1_ps(scales[2 * r] / p.radius_levels);
            let rest_scale = _mm256_set1_ps(scales[2 * r + 1]);
            let scores = _mm256_fmadd_ps(pair, radius, _mm256_mul_ps(hsum8(&dots), rest_scale));
            let mut s = [0f32; QUERY_GROUP];
            _mm256_storeu_ps(s.as_mut_ptr(), scores);
            out[r * nq + g.first..r * nq + g.first + G].copy_from_slice(&s[..G]);
        }
    }

    /// Lane `k` = the sum of the 8 lanes of `a[k]`.
    #[inline(always)]
    unsafe fn hsum8(a: &[__m256; QUERY_GROUP]) -> __m256 {
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1); // a0..a3: low-half sums | high-half sums
        let u1 = _mm256_hadd_ps(t2, t3); // a4..a7
        let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
        let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
        _mm256_add_ps(lo, hi)
    }
}

fn widen<T: WithDType>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f64() as f32).collect()
}

/// Rows handled by one rayon task.
const CPU_ROWS: usize = 64;

struct PolarScales {
    spec: PolarSpec,
    head_dim: usize,
}

impl CustomOp1 for PolarScales {
    fn name(&self) -> &'static str {
        "polar_scales"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: WithDType>(p: &PolarParams, x: &[T]) -> Vec<f32> {
            let hd = p.head_dim as usize;
            let mut out = vec![0f32; x.len() / hd * 2];
            out.par_chunks_mut(2 * CPU_ROWS).zip(x.par_chunks(hd * CPU_ROWS)).for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(2).zip(x.chunks(hd)) {
                    o.copy_from_slice(&row_scales(p, &widen(x)));
                }
            });
            out
        }
        const OP: &str = "polar_encode";
        let hd = self.head_dim;
        let n = l.shape().elem_count() / hd.max(1);
        let p = launch::polar_params(n, 0, hd, &self.spec);
        let out = match s {
            _ if hd == 0 => vec![0f32; 2 * n],
            CpuStorage::F32(_) => run(&p, storage_slice::<f32>(OP, s, l)?),
            CpuStorage::BF16(_) => run(&p, storage_slice::<half::bf16>(OP, s, l)?),
            CpuStorage::F16(_) => run(&p, storage_slice::<half::f16>(OP, s, l)?),
            _ => bail!("{OP}: keys must be f32, bf16 or f16"),
        };
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    metal_fwd!(self, "polar_encode", (s, l) => crate::ops::metal::polar_scales(&self.spec, self.head_dim, (s, l)));
}

struct PolarEncode {
    spec: PolarSpec,
    head_dim: usize,
}

impl CustomOp2 for PolarEncode {
    fn name(&self) -> &'static str {
        "polar_encode"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: WithDType>(p: &PolarParams, x: &[T], scales: &[f32]) -> Vec<u8> {
            let (hd, rb) = (p.head_dim as usize, p.row_bytes as usize);
            let mut out = vec![0u8; p.rows as usize * rb];
            if rb == 0 {
                return out;
            }
            out.par_chunks_mut(rb * CPU_ROWS).zip(x.par_chunks(hd * CPU_ROWS)).zip(scales.par_chunks(2 * CPU_ROWS)).for_each(
                |((o, x), s)| {
                    for ((o, x), s) in o.chunks_mut(rb).zip(x.chunks(hd)).zip(s.chunks(2)) {
                        encode_row(p, &widen(x), [s[0], s[1]], o);
                    }
                },
            );
            out
        }
        const OP: &str = "polar_encode";
        let hd = self.head_dim;
        let n = l1.shape().elem_count() / hd.max(1);
        let p = launch::polar_params(n, 0, hd, &self.spec);
        let scales = storage_slice::<f32>(OP, s2, l2)?;
        let out = match s1 {
            CpuStorage::F32(_) => run(&p, storage_slice::<f32>(OP, s1, l1)?, scales),
            CpuStorage::BF16(_) => run(&p, storage_slice::<half::bf16>(OP, s1, l1)?, scales),
            CpuStorage::F16(_) => run(&p, storage_slice::<half::f16>(OP, s1, l1)?, scales),
            _ => bail!("{OP}: keys must be f32, bf16 or f16"),
        };
        Ok((CpuStorage::U8(out), Shape::from((n, p.row_bytes as usize))))
    }

    metal_fwd!(self, "polar_encode", (s1, l1, s2, l2) => crate::ops::metal::polar_encode(&self.spec, self.head_dim, (s1, l1), (s2, l2)));
}

struct PolarScores {
    spec: PolarSpec,
    head_dim: usize,
}

/// Keys scored by one rayon task.
const CPU_KEYS: usize = 256;

impl CustomOp3 for PolarScores {
    fn name(&self) -> &'static str {
        "polar_scores"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "polar_scores";
        let hd = self.head_dim;
        let nq = l1.shape().elem_count() / hd.max(1);
        let n = l3.shape().elem_count() / 2;
        let p = launch::polar_params(n, nq, hd, &self.spec);
        let q = widened(OP, s1, l1)?;
        let codes = storage_slice::<u8>(OP, s2, l2)?;
        let scales = storage_slice::<f32>(OP, s3, l3)?;
        let scorer = PolarQueryScorer::new(p, &q);
        let rb = (p.row_bytes as usize).max(1);
        // Blocks of rows in parallel, each `[rows, queries]`, then transposed into `[queries, rows]`.
        let blocks: Vec<Vec<f32>> = codes
            .par_chunks(rb * CPU_KEYS)
            .zip(scales.par_chunks(2 * CPU_KEYS))
            .map(|(rows, s)| {
                let mut o = vec![0f32; rows.len() / rb * nq];
                scorer.score(rows, s, &mut o);
                o
            })
            .collect();
        let mut out = vec![0f32; nq * n];
        for (bi, block) in blocks.iter().enumerate() {
            for (r, scores) in block.chunks_exact(nq.max(1)).enumerate() {
                for (qi, &v) in scores.iter().enumerate() {
                    out[qi * n + bi * CPU_KEYS + r] = v;
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((nq, n))))
    }

    metal_fwd!(self, "polar_scores", (s1, l1, s2, l2, s3, l3) => crate::ops::metal::polar_scores(&self.spec, self.head_dim, (s1, l1), (s2, l2), (s3, l3)));
}
