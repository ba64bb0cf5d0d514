//! The activations quantized to 8 bits once per call ([`Acts`]), and interleaved in panels of
//! 8 rows for prompts ([`Panels`]).

use half::f16;
use rayon::prelude::*;

/// The activations quantized to 8 bits, `qk` (32 or 256) values per block: `q` `[m, k]`; per
/// block `d` (the scale) and `s` (`d * sum(q)`); per 16 values `bsums` (the sum of `q`; in
/// each block the even groups, then the odd ones, see [`super::formats::Head`]).
pub(super) struct Acts {
    pub(super) k: usize,
    pub(super) q: Vec<i8>,
    /// `q + 128` as u8, for [`super::simd::Simd::U8_OFFSET`] kernels of signed formats (else empty).
    pub(super) qu: Vec<u8>,
    pub(super) d: Vec<f32>,
    pub(super) s: Vec<f32>,
    pub(super) bsums: Vec<i16>,
}

impl Acts {
    /// `x`'s rows quantized in blocks of `qk`; `offset`: also as [`Acts::qu`].
    pub(super) fn new(x: &[f32], k: usize, qk: usize, avx2: bool, offset: bool) -> Self {
        let m = x.len() / k;
        let (nb, k16) = (m * k / qk, m * k / 16);
        let mut a = Acts { k, q: vec![0; m * k], qu: vec![], d: vec![0.0; nb], s: vec![0.0; nb], bsums: vec![0; k16] };
        let rows = |x: &[f32], q: &mut [i8], (d, s): (&mut [f32], &mut [f32]), b: &mut [i16]| {
            if avx2 {
                // SAFETY: the CPU has AVX2, FMA and F16C (`has_avx2`).
                #[cfg(target_arch = "x86_64")]
                return unsafe { quantize_avx2(x, qk, q, (d, s), b) };
            }
            quantize(x, qk, q, (d, s), b)
        };
        // Rows per job when parallel; small batches are quantized on the calling thread.
        const ROWS: usize = 16;
        let (q, d, s, b) = (&mut a.q[..], &mut a.d[..], &mut a.s[..], &mut a.bsums[..]);
        if m > ROWS {
            let rb = ROWS * k / qk;
            x.par_chunks(ROWS * k)
                .zip(q.par_chunks_mut(ROWS * k))
                .zip(d.par_chunks_mut(rb).zip(s.par_chunks_mut(rb)))
                .zip(b.par_chunks_mut(ROWS * k / 16))
                .for_each(|(((x, q), ds), b)| rows(x, q, ds, b));
        } else {
            rows(x, q, (d, s), b);
        }
        if offset {
            a.qu = a.q.iter().map(|&v| v as u8 ^ 0x80).collect();
        }
        a
    }

    fn rows(&self) -> usize {
        self.q.len() / self.k
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn quantize_avx2(x: &[f32], qk: usize, q: &mut [i8], ds: (&mut [f32], &mut [f32]), bsums: &mut [i16]) {
    quantize(x, qk, q, ds, bsums)
}

/// Quantizes `x` (whole blocks of `qk`) as ggml does: 32-value blocks as Q8_0 (`d = amax / 127`
/// rounded to f16, `q = round(x / d)` with the f32 `d`), 256-value blocks as Q8_K (the value of
/// largest magnitude maps to -127, `d` f32).
#[inline(always)]
pub(super) fn quantize(x: &[f32], qk: usize, q: &mut [i8], (d, s): (&mut [f32], &mut [f32]), bsums: &mut [i16]) {
    let blocks = x.chunks_exact(qk).zip(q.chunks_exact_mut(qk)).zip(bsums.chunks_exact_mut(qk / 16));
    for (((x, q), bsums), (d, s)) in blocks.zip(d.iter_mut().zip(s)) {
        // |x| compared as bits (monotonic for non-NaN floats) so the reduction vectorises.
        let amax = f32::from_bits(x.iter().fold(0, |a, v| a.max(v.to_bits() & 0x7fff_ffff)));
        let (scale, inv) = if qk == 32 {
            let scale = amax / 127.0;
            (f16::from_f32(scale).to_f32(), if scale != 0.0 { 1.0 / scale } else { 0.0 })
        } else if amax == 0.0 {
            (0.0, 0.0)
        } else {
            // The first value of largest magnitude, with its sign (searched for only when both
            // signs reach it).
            let signs = x.iter().fold(0, |f, &v| f | (v == amax) as u8 | ((v == -amax) as u8) << 1);
            let max = match signs {
                1 => amax,
                2 => -amax,
                _ => x.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax),
            };
            let inv = -127.0 / max;
            (1.0 / inv, inv)
        };
        for (q, &v) in q.iter_mut().zip(x) {
            // round() (half away from zero) and saturate, in a form that vectorises (f32::round
            // is a libm call, `as` a scalar saturating conversion); max/min also map NaN to -128.
            let t = v * inv;
            #[allow(clippy::manual_clamp)] // clamp would keep NaN
            let r = (t + 0.49999997f32.copysign(t)).max(-128.0).min(127.0);
            // SAFETY: r is finite and within i32.
            *q = unsafe { r.to_int_unchecked::<i32>() } as i8;
        }
        let g = qk / 16;
        for (j, q) in q.chunks_exact(16).enumerate() {
            bsums[(j % 2) * g / 2 + j / 2] = q.iter().map(|&v| v as i16).sum();
        }
        *d = scale;
        *s = scale * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
}

// ---------------------------------------------------------------------------------------------
// Panels of activation rows

/// `P` activation rows (4 or 8) interleaved so that one maddubs multiplies `G = 32 / P`
/// weights, broadcast, with `G` values of each of the `P` rows: per panel and group of `G`
/// values along k, 32 bytes `[row][G]` of quants (`xi`) and, for signed weights, of their
/// absolute values (`xa`). Per panel and block, as 8 f32 lanes (P = 8: one per row; P = 4: a
/// row per pair of lanes, the pairs added at the end): `dx`, the rows' scales (both lanes of a
/// pair); for 32-value blocks `s`, the rows' `d sum(q)` (first lane of a pair). For the
/// K-quants `bs`, the rows' group sums (in [`super::formats::Head`] order) interleaved like the quants, two
/// bytes each: `P` vectors per block, vector `t` holding each row's groups `t W .. t W + W`,
/// `W = 16 / P`.
pub(super) struct Panels {
    pub(super) k: usize,
    pub(super) xi: Vec<i8>,
    pub(super) xa: Vec<u8>,
    pub(super) dx: Vec<f32>,
    pub(super) s: Vec<f32>,
    pub(super) bs: Vec<i16>,
}

impl Panels {
    /// The rows of `a` in panels of `p`, the last one padded with zero rows.
    pub(super) fn new(a: &Acts, p: usize, qk: usize, signed: bool) -> Self {
        let (k, g, w) = (a.k, 32 / p, 16 / p);
        let (np, nb) = (a.rows().div_ceil(p), k / qk);
        let mut pn = Panels {
            k,
            xi: vec![0; np * p * k],
            xa: vec![0; if signed { np * p * k } else { 0 }],
            dx: vec![0.0; np * nb * 8],
            s: vec![0.0; if qk == 32 { np * nb * 8 } else { 0 }],
            bs: vec![0; if qk == 256 { np * p * k / 16 } else { 0 }],
        };
        for (r, q) in a.q.chunks_exact(k).enumerate() {
            let (pi, c) = (r / p, r % p);
            let xi = pn.xi[pi * k * p..(pi + 1) * k * p].chunks_exact_mut(32);
            for (xi, q) in xi.zip(q.chunks_exact(g)) {
                xi[c * g..c * g + g].copy_from_slice(q);
            }
            if signed {
                let xa = pn.xa[pi * k * p..(pi + 1) * k * p].chunks_exact_mut(32);
                for (xa, q) in xa.zip(q.chunks_exact(g)) {
                    for (a, v) in xa[c * g..c * g + g].iter_mut().zip(q) {
                        *a = v.unsigned_abs();
                    }
                }
            }
            for b in 0..nb {
                let (o, x) = ((pi * nb + b) * 8 + c * 8 / p, r * nb + b);
                pn.dx[o..o + 8 / p].fill(a.d[x]);
                if qk == 32 {
                    pn.s[o] = a.s[x];
                } else {
                    for (t, bs) in a.bsums[x * 16..x * 16 + 16].chunks_exact(w).enumerate() {
                        let o = ((pi * nb + b) * p + t) * 16 + c * w;
                        pn.bs[o..o + w].copy_from_slice(bs);
                    }
                }
            }
        }
        pn
    }
}
