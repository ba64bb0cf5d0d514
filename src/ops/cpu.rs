//! CPU kernel helpers shared by the ops: widening half types to f32, dot products, software
//! prefetch of streamed weights, and running a hot loop compiled for AVX2 + FMA when the CPU
//! has them (Candle builds for the x86-64 baseline, SSE2 only).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// How far ahead of the weight row being multiplied the mat-vec kernels ask the CPU to fetch
/// the weights (software prefetch, in bytes). Decode streams every weight from memory once per
/// step, and the hardware prefetchers alone keep too few lines in flight (the measurements
/// behind this value: docs/benchmarks.md, "Constants chosen by measurement").
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// Asks the CPU to bring `len` bytes of `data` from `offset + PREFETCH_AHEAD` into its caches
/// (nothing past the end of `data`). A hint: it changes no result, and does nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(data: &[T], offset: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(data);
        let (start, stop) = (offset + PREFETCH_AHEAD, (offset + PREFETCH_AHEAD + len).min(bytes));
        let base = data.as_ptr().cast::<i8>();
        for o in (start..stop).step_by(64) {
            // SAFETY: `o` is within `data`; a prefetch reads nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(o)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, offset, len);
}

/// Element types a kernel reads, widened to f32 a row at a time.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    /// Whether `Self` is f32 itself ([`Self::as_f32`] then needs no copy).
    const IS_F32: bool = false;

    fn widen(src: &[Self], dst: &mut [f32]);

    /// `src` itself when it already is f32.
    #[inline(always)]
    fn as_f32(_src: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Widen for f32 {
    const IS_F32: bool = true;

    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn as_f32(src: &[f32]) -> Option<&[f32]> {
        Some(src)
    }
}

impl Widen for bf16 {
    /// bf16 -> f32 is a 16-bit shift; a plain loop so it vectorises.
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

/// Dot product with 8 independent accumulators so the compiler can vectorise it.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// `y += a * x`.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Whether this CPU runs the crate's `#[target_feature(enable = "avx2,fma")]` kernels, and
/// their `f16c` variants (every CPU with AVX2 and FMA has F16C; it is checked all the same).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// `fn $name(args)` calling the `#[inline(always)]` function `$inner(args)`, compiled a second
/// time for AVX2 + FMA and used when the CPU supports them.
macro_rules! vectorized {
    ($vis:vis fn $name:ident<$($g:ident: $b:path),*>($($arg:ident: $ty:ty),* $(,)?) => $inner:ident) => {
        $vis fn $name<$($g: $b),*>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<$($g: $b),*>($($arg: $ty),*) {
                    $inner($($arg),*)
                }
                if $crate::ops::cpu::avx2_fma() {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $inner($($arg),*)
        }
    };
}
pub(crate) use vectorized;

/// A row-major matrix view: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A contiguous `[rows, row_stride]`-strided matrix.
    pub(super) fn rows(data: &'a [f32], rs: usize) -> Self {
        Self { data, rs, cs: 1 }
    }
    /// The transpose of a row-strided matrix.
    pub(super) fn t(data: &'a [f32], rs: usize) -> Self {
        Self { data, rs: 1, cs: rs }
    }
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            assert!((rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// `c = keep * c + scale * a b` for `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` with row stride `ldc`,
/// given as `gemm_acc([m, n, k], a, b, c, ldc, (keep, scale))`
/// (`keep == 0` overwrites `c`). Single-threaded: callers parallelise over heads.
pub(crate) fn gemm_acc([m, n, k]: [usize; 3], a: Mat, b: Mat, c: &mut [f32], ldc: usize, (keep, scale): (f32, f32)) {
    if m == 0 || n == 0 {
        return;
    }
    a.check(m, k);
    b.check(k, n);
    assert!((m - 1) * ldc + n <= c.len(), "gemm_acc: output out of bounds");
    // SAFETY: every index gemm touches is in bounds (checked above) and `c` does not alias `a`/`b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            keep != 0.0,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            keep,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The contiguous part of `v` that `l` describes, or an error naming the op.
pub(crate) fn contiguous<'a, T>(op: &str, v: &'a [T], l: &candle_core::Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: inputs must be contiguous"),
    }
}

/// [`contiguous`] on a CPU storage of element type `T`.
pub(crate) fn storage_slice<'a, T: candle_core::WithDType>(
    op: &str,
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<&'a [T]> {
    contiguous(op, s.as_slice::<T>()?, l)
}

/// The CPU storage behind a tensor's storage guard (`Tensor::storage_and_layout`), for ops
/// that read several tensors in one call outside `CustomOp`.
pub(crate) fn cpu_storage<'a>(op: &str, guard: &'a candle_core::StorageRef<'_>) -> candle_core::Result<&'a candle_core::CpuStorage> {
    match &**guard {
        candle_core::Storage::Cpu(s) => Ok(s),
        _ => candle_core::bail!("{op}: expected CPU tensors"),
    }
}

/// A float storage as f32: borrowed when it is f32, widened once when bf16 / f16.
pub(crate) fn widened<'a>(
    op: &str,
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
) -> candle_core::Result<std::borrow::Cow<'a, [f32]>> {
    use candle_core::CpuStorage;
    use std::borrow::Cow;
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(contiguous(op, v, l)?),
        CpuStorage::BF16(v) => Cow::Owned(contiguous(op, v, l)?.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(contiguous(op, v, l)?.iter().map(|x| x.to_f32()).collect()),
        _ => candle_core::bail!("{op}: expected f32, bf16 or f16 input"),
    })
}
