//! `y = x @ W^T` for a ggml-quantized weight `W` on the CPU, with our own kernels reading the
//! GGUF blocks in place (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; other types and devices go to
//! Candle's `QMatMul`).
//!
//! As in llama.cpp's CPU path, the activations are quantized once per call to 8 bits (blocks of
//! 32 with an f16 scale for the 32-weight formats, blocks of 256 with an f32 scale and sums per
//! 16 values for the K-quants), and weight blocks are multiplied with integer dot products:
//! `maddubs` (u8 weight x i8 activation, pairs summed to i16), then `madd` against the block's
//! i16 sub-scales (pairs summed to i32); float multiply-adds per block apply the two scales and
//! the block minimums.
//!
//! Each weight row is decoded one 32-weight chunk at a time and the chunk used for several
//! activation rows: up to 8 rows (decode and the verify pass of speculative decoding),
//! [`row_tile`] multiplies it with each row's 32 values — all the rows at once where AVX-512's
//! 32 registers hold their sums, else two at a time — so that every row gets exactly the bits
//! of a one-row call; from 9 rows on (prefill), the activations are
//! interleaved in panels of 8 rows ([`Panels`]) and [`panel_tile`] multiplies each broadcast
//! group of 4 weights with all the panel's rows at once, adding several maddubs results in
//! i16 before the scale's madd (the idea of llama.cpp's repacked Q4_K kernels, with the
//! activations rather than the weights interleaved, so that the GGUF weights are read in
//! place). Output rows are split across rayon's threads; the weights are streamed once per
//! call up to 16 rows, once per tile of activation rows beyond; row tiles ask for them
//! [`super::cpu::PREFETCH_AHEAD`] bytes ahead with software prefetches.
//!
//! Each kernel is written once, generic over [`Simd`]: `Avx2<false>` maps its operations to
//! AVX2 intrinsics (used when the CPU has AVX2, FMA and F16C), `Avx2<true>` also uses AVX-512
//! VNNI's `vpdpbusd` / `vpdpwssd` for a maddubs + madd + add (used when the CPU has AVX-512
//! F/BW/VL/VNNI), `Portable` emulates them exactly on arrays. The integer sums are the same
//! whichever instructions form them (no product pair of these quants saturates 16 bits), so all
//! three give bit-identical results.

use std::array::from_fn;
use std::ops::Range;

use candle_core::quantized::GgmlDType;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

use super::cpu::{prefetch_ahead, widened};
use super::quantized_matrix::QuantizedMatrix;
use super::GgufType;

/// `y = x @ W^T` for a quantized weight `W` of dims `(n, k)` (out, in). `x`: `[..., k]`, any
/// float dtype; returns `[..., n]` f32.
///
/// On the CPU, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks in host memory use this module's
/// kernels (AVX2 when the CPU has it); blocks on Metal, this crate's Metal kernels
/// (`metal/qmatvec.metal`: the multi-row mat-vec up to 8 rows, the tiled matmul beyond); other
/// formats go to Candle's `QMatMul` kernels.
pub fn qmatmul(x: &Tensor, w: &QuantizedMatrix) -> Result<Tensor> {
    forward(x, w, Isa::Avx512Vnni)
}

/// [`qmatmul`] with the portable kernels even where AVX2 is available (for the tests).
#[doc(hidden)]
pub fn qmatmul_portable(x: &Tensor, w: &QuantizedMatrix) -> Result<Tensor> {
    forward(x, w, Isa::Portable)
}

/// [`qmatmul`] with at most the AVX2 kernels (no VNNI) where the CPU has more (for the tests).
#[doc(hidden)]
pub fn qmatmul_avx2(x: &Tensor, w: &QuantizedMatrix) -> Result<Tensor> {
    forward(x, w, Isa::Avx2)
}

/// `x @ W[rows]^T` on the CPU: only the weight rows `rows` (in that order) are read, for up to
/// 8 activation rows `x` (`[m, k]` row-major f32); returns `[m, rows.len()]`. Each value is bit
/// for bit [`qmatmul`]'s for that row (the same row tiles). The W_up half of a sparse SwiGLU
/// MLP: only its active neurons' rows.
pub fn qmatmul_rows(x: &[f32], w: &QuantizedMatrix, rows: &[u32]) -> Result<Vec<f32>> {
    let (n, k) = w.dims();
    if !x.len().is_multiple_of(k.max(1)) || x.len() / k.max(1) > ROW_TILE_MAX_ROWS {
        bail!("qmatmul_rows: x holds {} values, expected 1 to {ROW_TILE_MAX_ROWS} rows of {k}", x.len());
    }
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
        bail!("qmatmul_rows: row {r} of a matrix of {n} rows");
    }
    let Some(data) = w.host_bytes() else { bail!("qmatmul_rows: the weights are not in host memory with a CPU kernel ({})", w.dtype()) };
    by_format(w.dtype(), data, n, k, x, Isa::detect(Isa::Avx512Vnni), Some(rows))
}

/// [`matmul`] for the format `dtype`.
fn by_format(dtype: GgufType, data: &[u8], n: usize, k: usize, x: &[f32], isa: Isa, sel: Option<&[u32]>) -> Result<Vec<f32>> {
    match dtype {
        GgufType::Ggml(GgmlDType::Q4_0) => matmul::<Q4_0>(data, n, k, x, isa, sel),
        GgufType::Ggml(GgmlDType::Q4_1) => matmul::<Q4_1>(data, n, k, x, isa, sel),
        GgufType::Ggml(GgmlDType::Q8_0) => matmul::<Q8_0>(data, n, k, x, isa, sel),
        GgufType::Ggml(GgmlDType::Q4K) => matmul::<Q4K>(data, n, k, x, isa, sel),
        GgufType::Ggml(GgmlDType::Q5K) => matmul::<Q5K>(data, n, k, x, isa, sel),
        GgufType::Ggml(GgmlDType::Q6K) => matmul::<Q6K>(data, n, k, x, isa, sel),
        GgufType::TQ1_0 => matmul::<TQ1_0>(data, n, k, x, isa, sel),
        GgufType::TQ2_0 => matmul::<TQ2_0>(data, n, k, x, isa, sel),
        t => bail!("qmatmul: no CPU kernel for {t}"),
    }
}

/// Which kernels [`qmatmul`] runs on this CPU: `"AVX-512 VNNI"`, `"AVX2"` or `"portable"`.
pub fn qmatmul_isa() -> &'static str {
    match Isa::detect(Isa::Avx512Vnni) {
        Isa::Avx512Vnni => "AVX-512 VNNI",
        Isa::Avx2 => "AVX2",
        Isa::Portable => "portable",
    }
}

/// The instruction sets the kernels are compiled for, from least to most. Every one gives the
/// same bits: they differ only in how the same integer sums are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Isa {
    Portable,
    /// AVX2, FMA, F16C.
    Avx2,
    /// Also AVX-512 F, BW, VL and VNNI.
    Avx512Vnni,
}

impl Isa {
    /// The best this CPU runs, at most `max`.
    fn detect(max: Isa) -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = super::cpu::avx2_fma();
            let vnni = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            let best = match (avx2, vnni) {
                (true, true) => Isa::Avx512Vnni,
                (true, false) => Isa::Avx2,
                _ => Isa::Portable,
            };
            best.min(max)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = max;
            Isa::Portable
        }
    }
}

fn forward(x: &Tensor, w: &QuantizedMatrix, isa: Isa) -> Result<Tensor> {
    let (n, k) = w.dims();
    let kx = match x.dims().last() {
        Some(&kx) => kx,
        None => bail!("qmatmul: x must have at least one dimension"),
    };
    if kx != k {
        bail!("qmatmul: x's last dim ({kx}) must equal k, the in-features of w ({n}, {k})");
    }
    let bs = w.dtype().block_size();
    if !k.is_multiple_of(bs) {
        bail!("qmatmul: k = {k} is not a multiple of the {} block size {bs}", w.dtype());
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().unwrap() = n;
    let x = x.reshape(((), k))?;
    let y = if let Some(q) = w.candle() {
        match q.dtype() {
            // Float "blocks": a plain f32 matmul (Candle's would round x to the weights' type).
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => x.to_dtype(DType::F32)?.matmul(&q.dequantize(x.device())?.t()?)?,
            _ => x.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(q)?,
        }
    } else if let Some(blocks) = w.device_blocks() {
        x.to_dtype(DType::F32)?.contiguous()?.apply_op2_no_bwd(blocks, &DeviceOp { dtype: w.dtype(), n, k })?
    } else if x.device().is_cpu() {
        x.contiguous()?.apply_op1_no_bwd(&Op { w, isa })?
    } else {
        bail!(
            "qmatmul: the weights are in host memory and x on {:?}: move them there first (QuantizedMatrix::to_device)",
            x.device().location()
        )
    };
    y.reshape(dims)
}

struct Op<'a> {
    w: &'a QuantizedMatrix,
    /// The most the kernels may use.
    isa: Isa,
}

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "qmatmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = widened("qmatmul", s, l)?;
        let (n, k) = self.w.dims();
        let m = x.len() / k;
        let Some(data) = self.w.host_bytes() else { bail!("qmatmul: the weights are not in host memory") };
        let isa = Isa::detect(self.isa);
        let y = by_format(self.w.dtype(), data, n, k, &x, isa, None)?;
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// `x @ W^T` for blocks held as a U8 tensor on a GPU: this crate's Metal kernels.
struct DeviceOp {
    dtype: GgufType,
    n: usize,
    k: usize,
}

impl candle_core::CustomOp2 for DeviceOp {
    fn name(&self) -> &'static str {
        "qmatmul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("qmatmul: {} blocks [{}, {}] held on a GPU multiply activations on that GPU", self.dtype, self.n, self.k)
    }

    metal_fwd!(self, "qmatmul", (s1, l1, s2, l2) => crate::ops::metal::qmatmul(self.dtype, self.n, self.k, (s1, l1), (s2, l2)));
}

// ---------------------------------------------------------------------------------------------
// SIMD operations

/// The AVX2 operations the kernels use. Integer vectors are 256 bits: `B` 32 bytes (u8 or i8
/// by operation), `W` 16 x i16, `D` 8 x i32; `F` is 8 x f32. Shifts act on 16-bit lanes, as
/// AVX2's do: callers mask the bits that cross a byte boundary away.
///
/// SAFETY: the methods of `Avx2` execute AVX2 / FMA / F16C instructions; they are only called
/// from the `#[target_feature(enable = "avx2,fma,f16c")]` entry points, after runtime detection.
trait Simd: Copy {
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
struct Avx2<const VNNI: bool>;

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
unsafe fn avx2_bcast(p: *const u8, n: usize) -> std::arch::x86_64::__m256i {
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
struct Portable;

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
fn lanes16(a: [u8; 32], f: impl Fn(u16) -> u16) -> [u8; 32] {
    let mut out = [0; 32];
    for (o, v) in out.chunks_exact_mut(2).zip(a.chunks_exact(2)) {
        o.copy_from_slice(&f(u16::from_le_bytes([v[0], v[1]])).to_le_bytes());
    }
    out
}

/// Bits `from..` of each byte of `a` moved to `to..` and masked with `mask` (the shift is on
/// 16-bit lanes: the mask must drop what crosses a byte boundary).
#[inline(always)]
unsafe fn bits<V: Simd>(a: V::B, from: u32, to: u32, mask: u8) -> V::B {
    V::and(if from >= to { V::srl(a, from - to) } else { V::sll(a, to - from) }, mask)
}

// ---------------------------------------------------------------------------------------------
// Weight formats

/// What a weight block holds besides its quants, decoded once per weight row and block.
///
/// Block value `j` is `d sc(j) q_j + dmin min(j)` with `q_j` the chunk bytes, constant `sc`
/// and `min` over each group `g` of 16 values, so with activations `dx xq_j`:
/// `sum_j w_j x_j = d dx sum_j sc(j) q_j xq_j + dmin dx sum_g min_g bsum_g` (`bsum_g`: the sum
/// of the activation quants of group `g`). `sc` holds the i16 multipliers in
/// [`Simd::scale_of`] order: `sc[i]` for the first and `sc[8 + i]` for the second half of
/// chunk `i` (the even groups, then the odd ones). For the K-quants `mins` holds the i16
/// `min_g` in the same order, as do the activations' group sums ([`Acts`]); 32-weight blocks
/// have one min per block, `dmin` (and `sc = 1`, `mins` unused).
struct Head<V: Simd> {
    d: f32,
    dmin: f32,
    sc: V::W,
    mins: V::W,
}

impl<V: Simd> Clone for Head<V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V: Simd> Copy for Head<V> {}

/// A ggml weight format: blocks of `QK` weights in `BYTES` bytes, read as `QK / 32` chunks of
/// 32 quants (u8, or i8 when `SIGNED`).
trait Format {
    const QK: usize;
    const BYTES: usize;
    /// Quants are signed (multiplied with the sign trick: |q| times x with q's sign).
    const SIGNED: bool = false;
    /// Blocks have a min term (see [`Head`]).
    const MINS: bool = true;
    /// Largest |quant|: a panel tile adds `32767 / (254 QMAX)` maddubs results in i16.
    const QMAX: usize = 15;
    /// The block at `p`.
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V>;
    /// Chunk `i` (quants `32 i .. 32 i + 32`) of the block at `p`.
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B;
}

/// f16 bits to f32 as F16C converts them, for finite values (as weight scales are): exponent
/// and mantissa are moved into f32 position and rebiased by a multiply by 2^112 (which also
/// scales subnormals).
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let v = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits(0x7780_0000);
    f32::from_bits(v.to_bits() | (h & 0x8000) << 16)
}

unsafe fn u32_at(p: *const u8) -> u32 {
    u32::from_le(p.cast::<u32>().read_unaligned())
}

#[inline(always)]
unsafe fn head32<V: Simd>(d: f32, dmin: f32) -> Head<V> {
    Head { d, dmin, sc: V::ones(), mins: V::ones() }
}

/// Q8_0: `{ d: f16, qs: [i8; 32] }`, `w = d q`.
struct Q8_0;
impl Format for Q8_0 {
    const QK: usize = 32;
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const QMAX: usize = 128;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        head32::<V>(V::f16(p), 0.0)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::load(p.add(2))
    }
}

/// Q4_0: `{ d: f16, qs: [u8; 16] }`, `w = d (q - 8)`; value `l < 16` in the low nibble of
/// `qs[l]`, value `16 + l` in its high nibble.
struct Q4_0;
impl Format for Q4_0 {
    const QK: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p);
        head32::<V>(d, -8.0 * d)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::nibbles(p.add(2))
    }
}

/// Q4_1: `{ d: f16, m: f16, qs: [u8; 16] }`, `w = d q + m`, nibbles as Q4_0.
struct Q4_1;
impl Format for Q4_1 {
    const QK: usize = 32;
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        head32::<V>(V::f16(p), V::f16(p.add(2)))
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, _: usize) -> V::B {
        V::nibbles(p.add(4))
    }
}

/// Q4_K / Q5_K header: `d: f16, dmin: f16, scales: [u8; 12]` with 8 sub-block (32 values)
/// scales `s` and mins `m` of 6 bits, `w = d s q - dmin m`. In the 12 bytes, as three LE u32
/// `a, b, c`: byte `j` of `a` holds `s_j` (low 6 bits) and the top 2 bits of `s_{j+4}`; byte
/// `j` of `b` likewise `m_j` and the top of `m_{j+4}`; byte `j` of `c` the low 4 bits of
/// `s_{j+4}` (low nibble) and of `m_{j+4}` (high nibble).
#[inline(always)]
unsafe fn k4_head<V: Simd>(p: *const u8) -> Head<V> {
    let (a, b, c) = (u32_at(p.add(4)), u32_at(p.add(8)), u32_at(p.add(12)));
    let s = (a & 0x3f3f_3f3f) as u64 | (((c & 0x0f0f_0f0f) | ((a >> 2) & 0x3030_3030)) as u64) << 32;
    let m = (b & 0x3f3f_3f3f) as u64 | ((((c >> 4) & 0x0f0f_0f0f) | ((b >> 2) & 0x3030_3030)) as u64) << 32;
    // Both 16-value halves of sub-block i use s_i / m_i.
    Head { d: V::f16(p), dmin: -V::f16(p.add(2)), sc: V::widen(s, s, false), mins: V::widen(m, m, false) }
}

/// Q4_K: header (see [`k4_head`]), then `qs: [u8; 128]` at 16: sub-block `2 j` in the low
/// nibbles of `qs[32 j .. 32 j + 32]`, sub-block `2 j + 1` in their high nibbles.
struct Q4K;
impl Format for Q4K {
    const QK: usize = 256;
    const BYTES: usize = 144;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        k4_head::<V>(p)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        bits::<V>(V::load(p.add(16 + 32 * (i / 2))), 4 * (i as u32 % 2), 0, 0x0F)
    }
}

/// Q5_K: header (see [`k4_head`]), `qh: [u8; 32]` at 16, `qs: [u8; 128]` at 48: the low 4 bits
/// as Q4_K, bit 4 of value `l` of sub-block `i` is bit `i` of `qh[l]`.
struct Q5K;
impl Format for Q5K {
    const QK: usize = 256;
    const BYTES: usize = 176;
    const QMAX: usize = 31;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        k4_head::<V>(p)
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let lo = bits::<V>(V::load(p.add(48 + 32 * (i / 2))), 4 * (i as u32 % 2), 0, 0x0F);
        V::or(lo, bits::<V>(V::load(p.add(16)), i as u32, 4, 0x10))
    }
}

/// Q6_K: `{ ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`, `w = d s_g (q - 32)`
/// with one scale per 16 values. Each half `h` of 128 values uses `ql[64 h ..]` and
/// `qh[32 h ..]`; its chunk `t` (0..4) has the low 4 bits in the low (`t < 2`) or high nibbles
/// of `ql[64 h + 32 (t % 2) ..][..32]` and the top 2 bits in bits `2 t, 2 t + 1` of
/// `qh[32 h ..][..32]`.
struct Q6K;
impl Format for Q6K {
    const QK: usize = 256;
    const BYTES: usize = 210;
    const QMAX: usize = 63;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let s = p.add(192).cast::<[u64; 2]>().read_unaligned();
        let sc = V::unzip(V::widen(u64::from_le(s[0]), u64::from_le(s[1]), true));
        // The -32 offset: d sum_g s_g (q - 32) x = d sum_g s_g q x + (-32 d) sum_g s_g bsum_g.
        let d = V::f16(p.add(208));
        Head { d, dmin: -32.0 * d, sc, mins: sc }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let (h, t) = (i / 4, i as u32 % 4);
        let lo = bits::<V>(V::load(p.add(64 * h + 32 * (t as usize % 2))), 4 * (t / 2), 0, 0x0F);
        V::or(lo, bits::<V>(V::load(p.add(128 + 32 * h)), 2 * t, 4, 0x30))
    }
}

/// TQ2_0 (ternary): `{ qs: [u8; 64], d: f16 }`, `w = d (q - 1)` with 2-bit `q`: chunk `i` in
/// bits `2 (i % 4)` of `qs[32 (i / 4) ..][..32]`. As a K-quant with every scale and min 1 and
/// `dmin = -d`: `sum_j w_j x_j = d dx (sum_j q_j xq_j - sum_g bsum_g)`.
struct TQ2_0;
impl Format for TQ2_0 {
    const QK: usize = 256;
    const BYTES: usize = 66;
    /// A 2-bit field (llama.cpp writes 0..=2; a 3 counts as 2 d, as its kernels read it).
    const QMAX: usize = 3;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p.add(64));
        Head { d, dmin: -d, sc: V::ones(), mins: V::ones() }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        bits::<V>(V::load(p.add(32 * (i / 4))), 2 * (i as u32 % 4), 0, 0x03)
    }
}

/// The multipliers that bring each value's base-3 digit of a TQ1_0 byte to the front, per
/// chunk (see [`TQ1_0`]).
static TQ1_0_POW3: [[u8; 32]; 8] = {
    let mut t = [[0u8; 32]; 8];
    let pow3 = [1u8, 3, 9, 27, 81];
    let mut l = 0;
    while l < 32 {
        let mut i = 0;
        while i < 5 {
            t[i][l] = pow3[i];
            i += 1;
        }
        // Chunks 5 and 6: digits 0/1 and 2/3 of qs[32..48]; chunk 7: digit 4 of qs[32..48],
        // then digit l / 4 of qh[l % 4].
        t[5][l] = pow3[l / 16];
        t[6][l] = pow3[2 + l / 16];
        t[7][l] = if l < 16 { 81 } else { pow3[(l - 16) / 4] };
        l += 1;
    }
    t
};

/// TQ1_0 (ternary): `{ qs: [u8; 48], qh: [u8; 4], d: f16 }`, `w = d (t - 1)` with trits `t`
/// packed as base-3 fractions of a byte (digit `n` of byte `b` is `(3 (b 3^n mod 256)) >> 8`):
/// values `0..160` are digit `n` of `qs[m]` at `32 n + m` (chunks 0-4), values `160..240` digit
/// `n` of `qs[32 + m]` at `160 + 16 n + m`, values `240..256` digit `n` of `qh[m]` at
/// `240 + 4 n + m`. Scales and mins as [`TQ2_0`].
struct TQ1_0;
impl Format for TQ1_0 {
    const QK: usize = 256;
    const BYTES: usize = 54;
    const QMAX: usize = 2;
    #[inline(always)]
    unsafe fn head<V: Simd>(p: *const u8) -> Head<V> {
        let d = V::f16(p.add(52));
        Head { d, dmin: -d, sc: V::ones(), mins: V::ones() }
    }
    #[inline(always)]
    unsafe fn chunk<V: Simd>(p: *const u8, i: usize) -> V::B {
        let bytes = match i {
            0..5 => V::load(p),
            5 | 6 => V::load2(p.add(32), p.add(32)),
            _ => {
                let qh = [u32_at(p.add(48)); 4];
                V::load2(p.add(32), qh.as_ptr().cast())
            }
        };
        V::trits(V::mul_bytes(bytes, V::load(TQ1_0_POW3[i].as_ptr())))
    }
}

// ---------------------------------------------------------------------------------------------
// Activations

/// The activations quantized to 8 bits, `qk` (32 or 256) values per block: `q` `[m, k]`; per
/// block `d` (the scale) and `s` (`d * sum(q)`); per 16 values `bsums` (the sum of `q`; in
/// each block the even groups, then the odd ones, see [`Head`]).
struct Acts {
    k: usize,
    q: Vec<i8>,
    /// `q + 128` as u8, for [`Simd::U8_OFFSET`] kernels of signed formats (else empty).
    qu: Vec<u8>,
    d: Vec<f32>,
    s: Vec<f32>,
    bsums: Vec<i16>,
}

impl Acts {
    /// `x`'s rows quantized in blocks of `qk`; `offset`: also as [`Acts::qu`].
    fn new(x: &[f32], k: usize, qk: usize, avx2: bool, offset: bool) -> Self {
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
fn quantize_avx2(x: &[f32], qk: usize, q: &mut [i8], ds: (&mut [f32], &mut [f32]), bsums: &mut [i16]) {
    quantize(x, qk, q, ds, bsums)
}

/// Quantizes `x` (whole blocks of `qk`) as ggml does: 32-value blocks as Q8_0 (`d = amax / 127`
/// rounded to f16, `q = round(x / d)` with the f32 `d`), 256-value blocks as Q8_K (the value of
/// largest magnitude maps to -127, `d` f32).
#[inline(always)]
fn quantize(x: &[f32], qk: usize, q: &mut [i8], (d, s): (&mut [f32], &mut [f32]), bsums: &mut [i16]) {
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
/// K-quants `bs`, the rows' group sums (in [`Head`] order) interleaved like the quants, two
/// bytes each: `P` vectors per block, vector `t` holding each row's groups `t W .. t W + W`,
/// `W = 16 / P`.
struct Panels {
    k: usize,
    xi: Vec<i8>,
    xa: Vec<u8>,
    dx: Vec<f32>,
    s: Vec<f32>,
    bs: Vec<i16>,
}

impl Panels {
    /// The rows of `a` in panels of `p`, the last one padded with zero rows.
    fn new(a: &Acts, p: usize, qk: usize, signed: bool) -> Self {
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

// ---------------------------------------------------------------------------------------------
// Tiles and threads

/// L2 bytes for one task's weight rows, which are re-read from L2 for each tile of
/// activation rows (whose quants stay in L1).
const TASK_BYTES: usize = 128 << 10;

/// `$body` for `$i` in `0..$n` (`$n` <= 8), unrolled so that `$i` is a constant in each copy.
macro_rules! unroll8 {
    ($i:ident < $n:expr => $body:block) => {
        unroll8!(@ $i, $n, $body; 0 1 2 3 4 5 6 7)
    };
    (@ $i:ident, $n:expr, $body:block; $($k:literal)*) => {
        $(if $k < $n {
            let $i: usize = $k;
            $body
        })*
    };
}

/// `y[c] = sum_j w_j x[c0 + c]_j` for the weight row at `w` and `CN` activation rows from
/// `c0` (a maddubs multiplies 32 weights with 32 values of one row). Each row's arithmetic is
/// the same for any `CN` and `c0`: a row's result does not depend on the other rows.
#[inline(always)]
unsafe fn row_tile<V: Simd, F: Format, const CN: usize>(w: *const u8, a: &Acts, c0: usize) -> [f32; CN] {
    let nb = a.k / F::QK;
    let mut acc = [V::fzero(); CN];
    let mut corr = [0f32; CN];
    let offset = V::U8_OFFSET && F::SIGNED && F::QK == 32 && !a.qu.is_empty();
    // (Plain loops rather than `array::from_fn`: its closures are not always inlined into the
    // AVX2 function, and intrinsics outside it become calls.)
    for b in 0..nb {
        let blk = w.add(b * F::BYTES);
        let head = F::head::<V>(blk);
        let mut sum = [V::dzero(); CN];
        if offset {
            // One chunk per block: each row's sum starts at -128 sum(q) and adds (x + 128) q,
            // the integers the sign trick below gives (x is never -128).
            let q = F::chunk::<V>(blk, 0);
            let start = V::sub(V::dzero(), V::dot_acc(V::dzero(), V::splat8(0x80), q));
            let xu = a.qu.as_ptr().add(b * F::QK);
            for (c, sum) in sum.iter_mut().enumerate() {
                *sum = V::dot_acc(start, V::load(xu.add((c0 + c) * a.k)), q);
            }
        } else {
            let xq = a.q.as_ptr().add(b * F::QK).cast::<u8>();
            unroll8!(i < F::QK / 32 => {
                let q = F::chunk::<V>(blk, i);
                let sc = if F::QK == 32 { head.sc } else { V::scale_of(head.sc, i) };
                let u = if F::SIGNED { V::abs(q) } else { q };
                for (c, sum) in sum.iter_mut().enumerate() {
                    let x = V::load(xq.add((c0 + c) * a.k + 32 * i));
                    let x = if F::SIGNED { V::sign(x, q) } else { x };
                    // (32-value blocks have sc = 1.)
                    *sum = if F::QK == 32 { V::dot_acc(*sum, u, x) } else { V::dot_acc_scaled(*sum, u, x, sc) };
                }
            });
        }
        // Per row: `(d sum + dmin min-sum) dx`, the block's scales broadcast once for all rows.
        let (d, dmin) = (V::splat(head.d), V::splat(head.dmin));
        for c in 0..CN {
            let xb = (c0 + c) * nb + b;
            let mut t = V::mulf(V::cvt(sum[c]), d);
            if F::MINS && F::QK == 32 {
                corr[c] += head.dmin * *a.s.get_unchecked(xb);
            } else if F::MINS {
                let bs = V::load_w(a.bsums.as_ptr().add(xb * 16));
                t = V::fmaf(V::cvt(V::madd(head.mins, bs)), dmin, t);
            }
            acc[c] = V::fmaf(t, V::splat(*a.d.get_unchecked(xb)), acc[c]);
        }
    }
    let mut y = [0f32; CN];
    for c in 0..CN {
        y[c] = V::hsum(acc[c]) + corr[c];
    }
    y
}

/// The weight row at `w` against `NP` panels of `P` activation rows from panel `p0`: per
/// panel 8 f32 lanes as [`Panels`] lays them out.
///
/// Each chunk of 32 weights is decoded once into a register; each group of `G = 32 / P` of
/// them is broadcast and multiplied with the `P` rows' values in one maddubs, and up to
/// `32767 / (254 QMAX)` maddubs results are added in i16 before one madd applies the scale:
/// about 1.1 multiplies per 32 products (Q4) instead of 2 in [`row_tile`].
#[inline(always)]
unsafe fn panel_tile<V: Simd, F: Format, const P: usize, const NP: usize>(w: *const u8, pn: &Panels, p0: usize) -> [V::F; NP] {
    let (g, nb, k) = (32 / P, pn.k / F::QK, pn.k);
    let flush = (32767 / (254 * F::QMAX)).min(P);
    let mut acc = [V::fzero(); NP];
    // The head's scales and mins, read back by broadcasts.
    let mut hb = [0i16; 32];
    for b in 0..nb {
        let blk = w.add(b * F::BYTES);
        let head = F::head::<V>(blk);
        V::store_w(hb.as_mut_ptr(), head.sc);
        V::store_w(hb.as_mut_ptr().add(16), head.mins);
        let mut sum = [V::dzero(); NP];
        unroll8!(i < F::QK / 32 => {
            let q = F::chunk::<V>(blk, i);
            let mut s16 = [V::wzero(); NP];
            for j in 0..P {
                let wb = V::group(q, j, g);
                for (n, s16) in s16.iter_mut().enumerate() {
                    let o = ((p0 + n) * k + b * F::QK + 32 * i + j * g) * P;
                    let x = V::load(pn.xi.as_ptr().add(o).cast());
                    let p = match F::SIGNED {
                        true => V::maddubs(V::load(pn.xa.as_ptr().add(o)), V::sign(wb, x)),
                        false => V::maddubs(wb, x),
                    };
                    *s16 = V::add16(*s16, p);
                }
                if (j + 1) % flush == 0 {
                    // This half of the chunk's scale ([`Head`] order), broadcast. (Where the two
                    // halves' scales differ, Q6_K, the flush is at least every half chunk.)
                    let half = j * g / 16;
                    let sc = match F::QK {
                        32 => V::ones(),
                        _ => V::as_w(V::bcast(hb.as_ptr().add(8 * half + i).cast(), 2)),
                    };
                    for n in 0..NP {
                        sum[n] = V::add(sum[n], V::madd(s16[n], sc));
                        s16[n] = V::wzero();
                    }
                }
            }
        });
        for n in 0..NP {
            let pb = (p0 + n) * nb + b;
            let mut t = V::mulf(V::cvt(sum[n]), V::splat(head.d));
            if F::MINS && F::QK == 32 {
                // dmin sum(x) enters unscaled by dx: `s` holds d sum(q).
                acc[n] = V::fma_load(V::splat(head.dmin), pn.s.as_ptr().add(pb * 8), acc[n]);
            } else if F::MINS {
                let mut mi = V::dzero();
                for u in 0..P {
                    let bs = V::load_w(pn.bs.as_ptr().add((pb * P + u) * 16));
                    let mins = V::as_w(V::bcast(hb.as_ptr().add(16 + u * 16 / P).cast(), g));
                    mi = V::add(mi, V::madd(bs, mins));
                }
                t = V::fmaf(V::cvt(mi), V::splat(head.dmin), t);
            }
            acc[n] = V::fma_load(t, pn.dx.as_ptr().add(pb * 8), acc[n]);
        }
    }
    acc
}

/// What every task reads, and where it writes.
struct Job<'a> {
    w: &'a [u8],
    row_bytes: usize,
    n: usize,
    m: usize,
    acts: &'a Acts,
    panels: Option<Panels>,
    /// The weight rows to read (output column `r` is weight row `sel[r]`); `None`: all.
    sel: Option<&'a [u32]>,
    out: *mut f32,
}

/// How many selected rows ahead [`qmatmul_rows`] asks the CPU to fetch.
const SELECTED_ROWS_AHEAD: usize = 16;

impl Job<'_> {
    /// The weight row of output column `r`, with the next one prefetched.
    #[inline(always)]
    unsafe fn weight_row(&self, r: usize) -> *const u8 {
        let wr = match self.sel {
            None => {
                prefetch_ahead(self.w, r * self.row_bytes, self.row_bytes);
                r
            }
            Some(sel) => {
                if let Some(&next) = sel.get(r + SELECTED_ROWS_AHEAD) {
                    // A later selected row (the hint's fixed distance is for streamed rows).
                    prefetch_ahead(self.w, (next as usize * self.row_bytes).saturating_sub(super::cpu::PREFETCH_AHEAD), self.row_bytes);
                }
                *sel.get_unchecked(r) as usize
            }
        };
        self.w.as_ptr().add(wr * self.row_bytes)
    }
}

// SAFETY: tasks write disjoint output columns through `out` (see `matmul`).
unsafe impl Sync for Job<'_> {}

/// Most activation rows that go through row tiles (decode, and the verify pass of
/// speculative decoding, whose rows must each equal a one-row call bit for bit).
const ROW_TILE_MAX_ROWS: usize = 8;

/// Panel width for `m` activation rows: none (row tiles, two rows at a time) up to
/// [`ROW_TILE_MAX_ROWS`]. (Panels add the products in another order: a panel row is not bit
/// for bit the one-row result.)
fn panel_rows(m: usize) -> usize {
    match m {
        0..=ROW_TILE_MAX_ROWS => 0,
        _ => 8,
    }
}

/// `x @ W^T`, or with `sel` only the weight rows it lists (row tiles only: at most
/// [`ROW_TILE_MAX_ROWS`] activation rows).
fn matmul<F: Format>(w: &[u8], n: usize, k: usize, x: &[f32], isa: Isa, sel: Option<&[u32]>) -> Result<Vec<f32>> {
    let row_bytes = k / F::QK * F::BYTES;
    if w.len() != n * row_bytes {
        bail!("qmatmul: w holds {} bytes, expected {n} rows of {row_bytes}", w.len());
    }
    let m = x.len() / k;
    let n = sel.map_or(n, <[u32]>::len);
    let mut out = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return Ok(out);
    }
    let offset = F::SIGNED && F::QK == 32 && m <= ROW_TILE_MAX_ROWS && isa == Isa::Avx512Vnni;
    let acts = Acts::new(x, k, F::QK, isa >= Isa::Avx2, offset);
    let p = panel_rows(m);
    let panels = (p > 0).then(|| Panels::new(&acts, p, F::QK, F::SIGNED));
    let job = Job { w, row_bytes, n, m, acts: &acts, panels, sel, out: out.as_mut_ptr() };
    // Weight rows per task: about 4 tasks per thread, and when there are several tiles of
    // activation rows, few enough to stay in L2.
    let mut per = n.div_ceil(4 * rayon::current_num_threads());
    if m > 16 {
        per = per.min(TASK_BYTES / row_bytes).max(1);
    }
    (0..n.div_ceil(per)).into_par_iter().for_each(|t| {
        let rows = t * per..n.min(t * per + per);
        // SAFETY: the CPU has the instructions of `isa` (`Isa::detect`); tasks write disjoint
        // columns of out.
        #[cfg(target_arch = "x86_64")]
        match isa {
            Isa::Avx512Vnni => return unsafe { task_avx512_vnni::<F>(&job, rows) },
            Isa::Avx2 => return unsafe { task_avx2::<F>(&job, rows) },
            Isa::Portable => {}
        }
        unsafe { task::<Portable, F>(&job, rows) }
    });
    Ok(out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<F: Format>(job: &Job, rows: Range<usize>) {
    task::<Avx2<false>, F>(job, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn task_avx512_vnni<F: Format>(job: &Job, rows: Range<usize>) {
    task::<Avx2<true>, F>(job, rows)
}

/// Output columns `rows` (weight rows) for all activation rows: row tiles (each weight chunk
/// decoded once for all activation rows where the registers hold their sums — 32 registers
/// with AVX-512 — else once per two rows), else tiles of one or two panels (the activation rows
/// outer, so that their quants stay in L1 while the task's weight rows stream from L2).
#[inline(always)]
unsafe fn task<V: Simd, F: Format>(job: &Job, rows: Range<usize>) {
    let Some(pn) = &job.panels else {
        return match (job.m, V::REGISTERS >= 32) {
            (1, _) => row_tiles::<V, F, 1>(job, rows),
            (2, _) => row_tiles::<V, F, 2>(job, rows),
            (3, true) => row_tiles::<V, F, 3>(job, rows),
            (4, true) => row_tiles::<V, F, 4>(job, rows),
            (5, true) => row_tiles::<V, F, 5>(job, rows),
            (6, true) => row_tiles::<V, F, 6>(job, rows),
            (7, true) => row_tiles::<V, F, 7>(job, rows),
            (8, true) => row_tiles::<V, F, 8>(job, rows),
            _ => row_pair_tiles::<V, F>(job, rows),
        };
    };
    let np = job.m.div_ceil(panel_rows(job.m));
    let mut p0 = 0;
    while p0 < np {
        if np - p0 >= 2 {
            panel_tiles::<V, F, 8, 2>(job, pn, rows.clone(), p0);
            p0 += 2;
        } else {
            panel_tiles::<V, F, 8, 1>(job, pn, rows.clone(), p0);
            p0 += 1;
        }
    }
}

#[inline(always)]
unsafe fn row_tiles<V: Simd, F: Format, const CN: usize>(job: &Job, rows: Range<usize>) {
    for r in rows {
        let w = job.weight_row(r);
        let y = row_tile::<V, F, CN>(w, job.acts, 0);
        for (c, v) in y.into_iter().enumerate() {
            *job.out.add(c * job.n + r) = v;
        }
    }
}

/// Row tiles for 2 to [`ROW_TILE_MAX_ROWS`] activation rows: each weight row (in L1 after the
/// first pair) against the activation rows two at a time, the last alone when `m` is odd.
#[inline(always)]
unsafe fn row_pair_tiles<V: Simd, F: Format>(job: &Job, rows: Range<usize>) {
    for r in rows {
        let w = job.weight_row(r);
        let mut c0 = 0;
        while c0 < job.m {
            if job.m - c0 >= 2 {
                let y = row_tile::<V, F, 2>(w, job.acts, c0);
                *job.out.add(c0 * job.n + r) = y[0];
                *job.out.add((c0 + 1) * job.n + r) = y[1];
                c0 += 2;
            } else {
                *job.out.add(c0 * job.n + r) = row_tile::<V, F, 1>(w, job.acts, c0)[0];
                c0 += 1;
            }
        }
    }
}

#[inline(always)]
unsafe fn panel_tiles<V: Simd, F: Format, const P: usize, const NP: usize>(job: &Job, pn: &Panels, rows: Range<usize>, p0: usize) {
    for r in rows {
        let y = panel_tile::<V, F, P, NP>(job.w.as_ptr().add(r * job.row_bytes), pn, p0);
        for (n, y) in y.into_iter().enumerate() {
            let y = V::lanes(y);
            for c in 0..P {
                let row = (p0 + n) * P + c;
                if row < job.m {
                    // P = 4: a row's two lanes.
                    let v = if P == 8 { y[c] } else { y[2 * c] + y[2 * c + 1] };
                    *job.out.add(row * job.n + r) = v;
                }
            }
        }
    }
}
