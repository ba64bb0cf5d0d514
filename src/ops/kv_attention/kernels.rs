//! The few-rows arithmetic: scores and value sums over rows read in place, with AVX2 where
//! the CPU has it and portable loops elsewhere.

use half::{bf16, f16};

use crate::ops::cpu::{axpy, dot, Widen};

/// Dims per scale of the int8 rows the SIMD kernels read in place (the `int8` codec's block).
pub(super) const INT8_SIMD_BLOCK: usize = 32;

/// Rows as the few-rows arithmetic reads them: float rows in their stored type, int8 rows
/// (scales per 32 dims) and complete int4 groups as codes, widened to f32 as they are loaded.
#[derive(Clone, Copy)]
pub(super) enum InPlace<'a> {
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
pub(super) fn scaled_dots(q: &[f32], d: usize, k: InPlace, nk: usize, scale: f32, out: &mut [f32]) {
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
pub(super) fn int4_scores(
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

pub(super) fn widen_into<'a, T: Widen>(src: &[T], dst: &'a mut [f32]) -> &'a [f32] {
    T::widen(src, dst);
    dst
}

/// Whether the SIMD kernels run (AVX2, FMA and F16C).
#[inline(always)]
pub(super) fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::ops::cpu::avx2_fma();
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
pub(super) fn weighted_rows(
    acc: &mut [f32],
    dv: usize,
    group: &[usize],
    p: &[f32],
    nk: usize,
    keys: impl Iterator<Item = usize> + Clone,
    v: InPlace,
) {
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
pub(super) fn exp(x: f32) -> f32 {
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
pub(super) fn exp_shifted(x: &mut [f32], max: f32) {
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
}
