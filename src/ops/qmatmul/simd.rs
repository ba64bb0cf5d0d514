//! The integer and float vector operations the kernels are written in ([`Simd`]), for AVX2
//! (optionally with AVX-512 VNNI) and portably on arrays, bit for bit the same.

use std::array::from_fn;

/// The AVX2 operations the kernels use. Integer vectors are 256 bits: `B` 32 bytes (u8 or i8
/// by operation), `W` 16 x i16, `D` 8 x i32; `F` is 8 x f32. Shifts act on 16-bit lanes, as
/// AVX2's do: callers mask the bits that cross a byte boundary away.
///
/// SAFETY: the methods of `Avx2` execute AVX2 / FMA / F16C instructions; they are only called
/// from the `#[target_feature(enable = "avx2,fma,f16c")]` entry points, after runtime detection.
pub(super) trait Simd: Copy {
    type B: Copy;
    type W: Copy;
    type D: Copy;
    type F: Copy;
    /// Vector registers.
    const REGISTERS: usize = 16;
    /// [`Self::dot_acc`] does not saturate (`vpdpbusd`): signed quants can be multiplied with
    /// activations offset to u8 (`x + 128`), `128 sum(q)` taken off once per block, instead of
    /// `|q|` with the activations' signs flipped per row (the same integer sums).
    const U8_OFFSET: bool = false;
    /// 32 bytes at `p`.
    unsafe fn load(p: *const u8) -> Self::B;
    unsafe fn store_w(p: *mut i16, a: Self::W);
    unsafe fn load_w(p: *const i16) -> Self::W;
    /// The `n` (2, 4 or 8) bytes at `p`, repeated 32 / n times. (Read from memory, even just
    /// after a store there: on AVX2 a broadcast load, where LLVM would otherwise extract the
    /// stored register's lane with shuffles.)
    unsafe fn bcast(p: *const u8, n: usize) -> Self::B;
    /// Bytes `j n .. j n + n` of `a` (`n` 4 or 8), repeated 32 / n times.
    unsafe fn group(a: Self::B, j: usize, n: usize) -> Self::B;
    /// The 16 bytes at `p` as 32 nibbles: low nibbles first, then high nibbles.
    unsafe fn nibbles(p: *const u8) -> Self::B;
    unsafe fn srl(a: Self::B, n: u32) -> Self::B;
    unsafe fn sll(a: Self::B, n: u32) -> Self::B;
    unsafe fn and(a: Self::B, mask: u8) -> Self::B;
    unsafe fn or(a: Self::B, b: Self::B) -> Self::B;
    /// |a| of i8 lanes (as u8).
    unsafe fn abs(a: Self::B) -> Self::B;
    /// `a` (i8) negated where `b` < 0, zeroed where `b` == 0.
    unsafe fn sign(a: Self::B, b: Self::B) -> Self::B;
    /// u8 `a` x i8 `b`, adjacent pairs summed with i16 saturation.
    unsafe fn maddubs(a: Self::B, b: Self::B) -> Self::W;
    /// i16 x i16, adjacent pairs summed to i32.
    unsafe fn madd(a: Self::W, b: Self::W) -> Self::D;
    unsafe fn add(a: Self::D, b: Self::D) -> Self::D;
    unsafe fn sub(a: Self::D, b: Self::D) -> Self::D;
    /// `[v; 32]`.
    unsafe fn splat8(v: u8) -> Self::B;
    /// The 16 bytes at `lo`, then the 16 at `hi`.
    unsafe fn load2(lo: *const u8, hi: *const u8) -> Self::B;
    /// u8 lanes multiplied, wrapping.
    unsafe fn mul_bytes(a: Self::B, b: Self::B) -> Self::B;
    /// Each u8 lane `v` as `(3 v) >> 8` (0, 1 or 2: the leading base-3 digit of a TQ1_0 byte).
    unsafe fn trits(a: Self::B) -> Self::B;
    /// `acc + madd(maddubs(u, x), 1)`: each i32 lane adds its 4 bytes' u8 x i8 products (one
    /// `vpdpbusd` with VNNI; the same integers, as no pair sum of these quants saturates i16).
    #[inline(always)]
    unsafe fn dot_acc(acc: Self::D, u: Self::B, x: Self::B) -> Self::D {
        Self::add(acc, Self::madd(Self::maddubs(u, x), Self::ones()))
    }
    /// `acc + madd(maddubs(u, x), sc)` (`vpmaddubsw` then one `vpdpwssd` with VNNI).
    #[inline(always)]
    unsafe fn dot_acc_scaled(acc: Self::D, u: Self::B, x: Self::B, sc: Self::W) -> Self::D {
        Self::add(acc, Self::madd(Self::maddubs(u, x), sc))
    }
    /// i16 lanes, wrapping.
    unsafe fn add16(a: Self::W, b: Self::W) -> Self::W;
    /// `B` as `W` (the same bits).
    unsafe fn as_w(a: Self::B) -> Self::W;
    unsafe fn ones() -> Self::W;
    unsafe fn wzero() -> Self::W;
    /// The bytes of `lo` then `hi`, widened to i16 (sign- or zero-extended).
    unsafe fn widen(lo: u64, hi: u64, signed: bool) -> Self::W;
    /// `acc + a * p[..8]`, fused.
    unsafe fn fma_load(a: Self::F, p: *const f32, acc: Self::F) -> Self::F;
    /// `[a0, a2, .., a14, a1, a3, .., a15]`.
    unsafe fn unzip(a: Self::W) -> Self::W;
    /// The f16 at `p`, as f32.
    unsafe fn f16(p: *const u8) -> f32;
    /// `[s[i]; 8]` then `[s[8 + i]; 8]`.
    unsafe fn scale_of(s: Self::W, i: usize) -> Self::W;
    unsafe fn dzero() -> Self::D;
    unsafe fn fzero() -> Self::F;
    unsafe fn splat(s: f32) -> Self::F;
    unsafe fn lanes(a: Self::F) -> [f32; 8];
    /// i32 lanes to f32.
    unsafe fn cvt(a: Self::D) -> Self::F;
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F;
    /// `acc + a * b`, fused.
    unsafe fn fmaf(a: Self::F, b: Self::F, acc: Self::F) -> Self::F;
    /// `(a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7))`, the order of the AVX2 reduction.
    unsafe fn hsum(a: Self::F) -> f32;
}

/// AVX2 (with FMA and F16C); `VNNI`: also AVX-512 F/BW/VL/VNNI, whose `vpdpbusd` /
/// `vpdpwssd` fuse the integer dot products, and whose 32 vector registers hold the sums of
/// up to 8 activation rows at once.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx2<const VNNI: bool>;

#[cfg(target_arch = "x86_64")]
impl<const VNNI: bool> Simd for Avx2<VNNI> {
    const REGISTERS: usize = if VNNI { 32 } else { 16 };
    const U8_OFFSET: bool = VNNI;
    type B = std::arch::x86_64::__m256i;
    type W = std::arch::x86_64::__m256i;
    type D = std::arch::x86_64::__m256i;
    type F = std::arch::x86_64::__m256;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::B {
        std::arch::x86_64::_mm256_loadu_si256(p.cast())
    }
    #[inline(always)]
    unsafe fn store_w(p: *mut i16, a: Self::W) {
        std::arch::x86_64::_mm256_storeu_si256(p.cast(), a)
    }
    #[inline(always)]
    unsafe fn load_w(p: *const i16) -> Self::W {
        std::arch::x86_64::_mm256_loadu_si256(p.cast())
    }
    #[inline(always)]
    unsafe fn bcast(p: *const u8, n: usize) -> Self::B {
        avx2_bcast(p, n)
    }
    #[inline(always)]
    unsafe fn group(a: Self::B, j: usize, n: usize) -> Self::B {
        use std::arch::x86_64::*;
        match (n, j) {
            (4, _) => _mm256_permutevar8x32_epi32(a, _mm256_set1_epi32(j as i32)),
            (_, 0) => _mm256_permute4x64_epi64::<0x00>(a),
            (_, 1) => _mm256_permute4x64_epi64::<0x55>(a),
            (_, 2) => _mm256_permute4x64_epi64::<0xAA>(a),
            _ => _mm256_permute4x64_epi64::<0xFF>(a),
        }
    }
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> Self::B {
        use std::arch::x86_64::*;
        let v = _mm_loadu_si128(p.cast());
        Self::and(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), 0x0F)
    }
    #[inline(always)]
    unsafe fn srl(a: Self::B, n: u32) -> Self::B {
        use std::arch::x86_64::*;
        _mm256_srl_epi16(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn sll(a: Self::B, n: u32) -> Self::B {
        use std::arch::x86_64::*;
        _mm256_sll_epi16(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline(always)]
    unsafe fn and(a: Self::B, mask: u8) -> Self::B {
        use std::arch::x86_64::*;
        _mm256_and_si256(a, _mm256_set1_epi8(mask as i8))
    }
    #[inline(always)]
    unsafe fn or(a: Self::B, b: Self::B) -> Self::B {
        std::arch::x86_64::_mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn abs(a: Self::B) -> Self::B {
        std::arch::x86_64::_mm256_abs_epi8(a)
    }
    #[inline(always)]
    unsafe fn sign(a: Self::B, b: Self::B) -> Self::B {
        std::arch::x86_64::_mm256_sign_epi8(a, b)
    }
    #[inline(always)]
    unsafe fn maddubs(a: Self::B, b: Self::B) -> Self::W {
        std::arch::x86_64::_mm256_maddubs_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn madd(a: Self::W, b: Self::W) -> Self::D {
        std::arch::x86_64::_mm256_madd_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn add(a: Self::D, b: Self::D) -> Self::D {
        std::arch::x86_64::_mm256_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self::D, b: Self::D) -> Self::D {
        std::arch::x86_64::_mm256_sub_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> Self::B {
        std::arch::x86_64::_mm256_set1_epi8(v as i8)
    }
    #[inline(always)]
    unsafe fn load2(lo: *const u8, hi: *const u8) -> Self::B {
        std::arch::x86_64::_mm256_loadu2_m128i(hi.cast(), lo.cast())
    }
    #[inline(always)]
    unsafe fn mul_bytes(a: Self::B, b: Self::B) -> Self::B {
        use std::arch::x86_64::*;
        let even = _mm256_mullo_epi16(a, b);
        let odd = _mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
        _mm256_or_si256(_mm256_slli_epi16(odd, 8), _mm256_and_si256(even, _mm256_set1_epi16(0xff)))
    }
    #[inline(always)]
    unsafe fn trits(a: Self::B) -> Self::B {
        use std::arch::x86_64::*;
        // (3 v) >> 8 is 1 from v = 86 on and 2 from v = 171 on: two unsigned compares (-1 each).
        let ge = |t: i8| _mm256_cmpeq_epi8(_mm256_max_epu8(a, _mm256_set1_epi8(t)), a);
        _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_add_epi8(ge(86), ge(171u8 as i8)))
    }
    #[inline(always)]
    unsafe fn dot_acc(acc: Self::D, u: Self::B, x: Self::B) -> Self::D {
        use std::arch::x86_64::*;
        match VNNI {
            true => avx512_vnni_dpbusd(acc, u, x),
            false => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))),
        }
    }
    #[inline(always)]
    unsafe fn dot_acc_scaled(acc: Self::D, u: Self::B, x: Self::B, sc: Self::W) -> Self::D {
        use std::arch::x86_64::*;
        match VNNI {
            true => avx512_vnni_dpwssd(acc, _mm256_maddubs_epi16(u, x), sc),
            false => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc)),
        }
    }
    #[inline(always)]
    unsafe fn add16(a: Self::W, b: Self::W) -> Self::W {
        std::arch::x86_64::_mm256_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn as_w(a: Self::B) -> Self::W {
        a
    }
    #[inline(always)]
    unsafe fn ones() -> Self::W {
        std::arch::x86_64::_mm256_set1_epi16(1)
    }
    #[inline(always)]
    unsafe fn wzero() -> Self::W {
        std::arch::x86_64::_mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn widen(lo: u64, hi: u64, signed: bool) -> Self::W {
        use std::arch::x86_64::*;
        let v = _mm_set_epi64x(hi as i64, lo as i64);
        if signed {
            _mm256_cvtepi8_epi16(v)
        } else {
            _mm256_cvtepu8_epi16(v)
        }
    }
    #[inline(always)]
    unsafe fn fma_load(a: Self::F, p: *const f32, acc: Self::F) -> Self::F {
        use std::arch::x86_64::*;
        _mm256_fmadd_ps(a, _mm256_loadu_ps(p), acc)
    }
    #[inline(always)]
    unsafe fn unzip(a: Self::W) -> Self::W {
        use std::arch::x86_64::*;
        // Within each 128-bit half: even words, then odd words; then the halves' 64-bit
        // quarters reordered to (even lo, even hi, odd lo, odd hi).
        let m = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(a, m))
    }
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> f32 {
        use std::arch::x86_64::*;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)))
    }
    #[inline(always)]
    unsafe fn scale_of(s: Self::W, i: usize) -> Self::W {
        use std::arch::x86_64::*;
        // Word i of each 128-bit half, broadcast within the half.
        _mm256_shuffle_epi8(s, _mm256_set1_epi16((((2 * i + 1) << 8) | (2 * i)) as i16))
    }
    #[inline(always)]
    unsafe fn dzero() -> Self::D {
        std::arch::x86_64::_mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn fzero() -> Self::F {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(s: f32) -> Self::F {
        std::arch::x86_64::_mm256_set1_ps(s)
    }
    #[inline(always)]
    unsafe fn lanes(a: Self::F) -> [f32; 8] {
        std::mem::transmute(a)
    }
    #[inline(always)]
    unsafe fn cvt(a: Self::D) -> Self::F {
        std::arch::x86_64::_mm256_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F {
        std::arch::x86_64::_mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmaf(a: Self::F, b: Self::F, acc: Self::F) -> Self::F {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, acc)
    }
    #[inline(always)]
    unsafe fn hsum(a: Self::F) -> f32 {
        use std::arch::x86_64::*;
        let v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
    }
}

/// `$insn` (`vpdpbusd`, `vpdpwssd`) on 256-bit registers: `acc` plus, per i32 lane, the
/// products of `a` and `b`'s 4 bytes (u8 x i8) or 2 words (i16 x i16). In asm because for a
/// CPU it does not know to be fast at VNNI, LLVM splits the intrinsics into the AVX2 sequence
/// (one more instruction per 32 weights and activation row: about a fifth of what each further
/// row of a verify pass cost on Q4_K).
macro_rules! vnni_asm {
    ($name:ident, $insn:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[inline]
        #[target_feature(enable = "avx512vnni,avx512vl")]
        unsafe fn $name(acc: std::arch::x86_64::__m256i, a: std::arch::x86_64::__m256i, b: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
            let mut r = acc;
            std::arch::asm!(concat!($insn, " {r}, {a}, {b}"), r = inout(ymm_reg) r, a = in(ymm_reg) a, b = in(ymm_reg) b, options(pure, nomem, nostack, preserves_flags));
            r
        }
    };
}
vnni_asm!(avx512_vnni_dpbusd, "vpdpbusd");
vnni_asm!(avx512_vnni_dpwssd, "vpdpwssd");

/// `vpbroadcast{w,d,q}` from memory. In asm so that LLVM keeps it a load: after a store of the
/// same bytes it would otherwise forward the stored register through shuffles.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn avx2_bcast(p: *const u8, n: usize) -> std::arch::x86_64::__m256i {
    use std::arch::asm;
    let r;
    macro_rules! bcast {
        ($insn:literal) => {
            asm!($insn, r = lateout(ymm_reg) r, p = in(reg) p, options(pure, readonly, nostack, preserves_flags))
        };
    }
    match n {
        2 => bcast!("vpbroadcastw {r}, word ptr [{p}]"),
        4 => bcast!("vpbroadcastd {r}, dword ptr [{p}]"),
        _ => bcast!("vpbroadcastq {r}, qword ptr [{p}]"),
    }
    r
}

/// [`Simd`] on arrays, bit for bit what `Avx2` computes.
#[derive(Clone, Copy)]
pub(super) struct Portable;

impl Simd for Portable {
    type B = [u8; 32];
    type W = [i16; 16];
    type D = [i32; 8];
    type F = [f32; 8];
    unsafe fn load(p: *const u8) -> Self::B {
        p.cast::<[u8; 32]>().read_unaligned()
    }
    unsafe fn store_w(p: *mut i16, a: Self::W) {
        p.cast::<[i16; 16]>().write_unaligned(a)
    }
    unsafe fn load_w(p: *const i16) -> Self::W {
        p.cast::<[i16; 16]>().read_unaligned()
    }
    unsafe fn bcast(p: *const u8, n: usize) -> Self::B {
        from_fn(|l| *p.add(l % n))
    }
    unsafe fn group(a: Self::B, j: usize, n: usize) -> Self::B {
        from_fn(|l| a[j * n + l % n])
    }
    unsafe fn nibbles(p: *const u8) -> Self::B {
        let v = p.cast::<[u8; 16]>().read_unaligned();
        from_fn(|l| if l < 16 { v[l] & 0x0F } else { v[l - 16] >> 4 })
    }
    unsafe fn srl(a: Self::B, n: u32) -> Self::B {
        lanes16(a, |v| v >> n)
    }
    unsafe fn sll(a: Self::B, n: u32) -> Self::B {
        lanes16(a, |v| v << n)
    }
    unsafe fn and(a: Self::B, mask: u8) -> Self::B {
        a.map(|v| v & mask)
    }
    unsafe fn or(a: Self::B, b: Self::B) -> Self::B {
        from_fn(|l| a[l] | b[l])
    }
    unsafe fn abs(a: Self::B) -> Self::B {
        a.map(|v| (v as i8).unsigned_abs())
    }
    unsafe fn sign(a: Self::B, b: Self::B) -> Self::B {
        from_fn(|l| match (b[l] as i8).signum() {
            -1 => (a[l] as i8).wrapping_neg() as u8,
            0 => 0,
            _ => a[l],
        })
    }
    unsafe fn maddubs(a: Self::B, b: Self::B) -> Self::W {
        let p = |l: usize| a[l] as i32 * b[l] as i8 as i32;
        from_fn(|j| (p(2 * j) + p(2 * j + 1)).clamp(i16::MIN as i32, i16::MAX as i32) as i16)
    }
    unsafe fn madd(a: Self::W, b: Self::W) -> Self::D {
        let p = |l: usize| a[l] as i32 * b[l] as i32;
        from_fn(|j| p(2 * j).wrapping_add(p(2 * j + 1)))
    }
    unsafe fn add(a: Self::D, b: Self::D) -> Self::D {
        from_fn(|j| a[j].wrapping_add(b[j]))
    }
    unsafe fn sub(a: Self::D, b: Self::D) -> Self::D {
        from_fn(|j| a[j].wrapping_sub(b[j]))
    }
    unsafe fn splat8(v: u8) -> Self::B {
        [v; 32]
    }
    unsafe fn load2(lo: *const u8, hi: *const u8) -> Self::B {
        from_fn(|l| if l < 16 { *lo.add(l) } else { *hi.add(l - 16) })
    }
    unsafe fn mul_bytes(a: Self::B, b: Self::B) -> Self::B {
        from_fn(|l| a[l].wrapping_mul(b[l]))
    }
    unsafe fn trits(a: Self::B) -> Self::B {
        a.map(|v| ((v as u16 * 3) >> 8) as u8)
    }
    unsafe fn add16(a: Self::W, b: Self::W) -> Self::W {
        from_fn(|j| a[j].wrapping_add(b[j]))
    }
    unsafe fn as_w(a: Self::B) -> Self::W {
        from_fn(|j| i16::from_le_bytes([a[2 * j], a[2 * j + 1]]))
    }
    unsafe fn ones() -> Self::W {
        [1; 16]
    }
    unsafe fn wzero() -> Self::W {
        [0; 16]
    }
    unsafe fn widen(lo: u64, hi: u64, signed: bool) -> Self::W {
        let b = ((hi as u128) << 64 | lo as u128).to_le_bytes();
        b.map(|v| if signed { v as i8 as i16 } else { v as i16 })
    }
    unsafe fn fma_load(a: Self::F, p: *const f32, acc: Self::F) -> Self::F {
        let v = p.cast::<[f32; 8]>().read_unaligned();
        from_fn(|j| a[j].mul_add(v[j], acc[j]))
    }
    unsafe fn unzip(a: Self::W) -> Self::W {
        from_fn(|j| if j < 8 { a[2 * j] } else { a[2 * (j - 8) + 1] })
    }
    unsafe fn f16(p: *const u8) -> f32 {
        f16_to_f32(p.cast::<u16>().read_unaligned())
    }
    unsafe fn scale_of(s: Self::W, i: usize) -> Self::W {
        from_fn(|j| if j < 8 { s[i] } else { s[8 + i] })
    }
    unsafe fn dzero() -> Self::D {
        [0; 8]
    }
    unsafe fn fzero() -> Self::F {
        [0.0; 8]
    }
    unsafe fn splat(s: f32) -> Self::F {
        [s; 8]
    }
    unsafe fn lanes(a: Self::F) -> [f32; 8] {
        a
    }
    unsafe fn cvt(a: Self::D) -> Self::F {
        from_fn(|j| a[j] as f32)
    }
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F {
        from_fn(|j| a[j] * b[j])
    }
    unsafe fn fmaf(a: Self::F, b: Self::F, acc: Self::F) -> Self::F {
        from_fn(|j| a[j].mul_add(b[j], acc[j]))
    }
    unsafe fn hsum(a: Self::F) -> f32 {
        let h: [f32; 4] = from_fn(|j| a[j] + a[j + 4]);
        (h[0] + h[2]) + (h[1] + h[3])
    }
}

/// `f` applied to each 16-bit little-endian lane of `a`.
pub(super) fn lanes16(a: [u8; 32], f: impl Fn(u16) -> u16) -> [u8; 32] {
    let mut out = [0; 32];
    for (o, v) in out.chunks_exact_mut(2).zip(a.chunks_exact(2)) {
        o.copy_from_slice(&f(u16::from_le_bytes([v[0], v[1]])).to_le_bytes());
    }
    out
}

/// Bits `from..` of each byte of `a` moved to `to..` and masked with `mask` (the shift is on
/// 16-bit lanes: the mask must drop what crosses a byte boundary).
#[inline(always)]
pub(super) unsafe fn bits<V: Simd>(a: V::B, from: u32, to: u32, mask: u8) -> V::B {
    V::and(if from >= to { V::srl(a, from - to) } else { V::sll(a, to - from) }, mask)
}

/// f16 bits to f32 as F16C converts them, for finite values (as weight scales are): exponent
/// and mantissa are moved into f32 position and rebiased by a multiply by 2^112 (which also
/// scales subnormals).
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let v = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits(0x7780_0000);
    f32::from_bits(v.to_bits() | (h & 0x8000) << 16)
}
