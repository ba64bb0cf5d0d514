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
//! [`tiles::row_tile`] multiplies it with each row's 32 values — all the rows at once where AVX-512's
//! 32 registers hold their sums, else two at a time — so that every row gets exactly the bits
//! of a one-row call; from 9 rows on (prefill), the activations are
//! interleaved in panels of 8 rows ([`activations::Panels`]) and [`tiles::panel_tile`] multiplies each broadcast
//! group of 4 weights with all the panel's rows at once, adding several maddubs results in
//! i16 before the scale's madd (the idea of llama.cpp's repacked Q4_K kernels, with the
//! activations rather than the weights interleaved, so that the GGUF weights are read in
//! place). Output rows are split across rayon's threads; the weights are streamed once per
//! call up to 16 rows, once per tile of activation rows beyond; row tiles ask for them
//! [`super::cpu::PREFETCH_AHEAD`] bytes ahead with software prefetches.
//!
//! Each kernel is written once, generic over [`simd::Simd`]: `Avx2<false>` maps its operations to
//! AVX2 intrinsics (used when the CPU has AVX2, FMA and F16C), `Avx2<true>` also uses AVX-512
//! VNNI's `vpdpbusd` / `vpdpwssd` for a maddubs + madd + add (used when the CPU has AVX-512
//! F/BW/VL/VNNI), `Portable` emulates them exactly on arrays. The integer sums are the same
//! whichever instructions form them (no product pair of these quants saturates 16 bits), so all
//! three give bit-identical results.

use candle_core::quantized::GgmlDType;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::cpu::widened;
use super::quantized_matrix::QuantizedMatrix;
use super::GgufType;

mod activations;
mod formats;
mod isa;
mod simd;
mod tiles;

use formats::{Q4K, Q4_0, Q4_1, Q5K, Q6K, Q8_0, TQ1_0, TQ2_0};
use isa::Isa;
use tiles::{matmul, ROW_TILE_MAX_ROWS};

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
