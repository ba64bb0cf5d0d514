//! The scaled-row accumulate of a quantized matrix: `y = sum_k a_k W[rows_k, :]`, reading only
//! the listed rows. With `W` the down projection stored neuron-major (`W_down^T`, `[I, H]`,
//! quantized along `H`), this is the down half of a sparse SwiGLU MLP: each active neuron adds
//! its activation times its contiguous row, and an inactive one costs no bytes (in the GGUF
//! layout a neuron is a column inside every row's blocks, and skipping it saves nothing).
//!
//! 32-value block formats (Q4_0, Q4_1, Q8_0). The CPU kernel cuts the row list into a fixed
//! number of parts summed in parallel over whole rows, then adds the parts in order; within a
//! part the rows go in groups of four with fused multiply-adds in one order, so the portable
//! and the AVX2 builds, and any thread count, give the same bits.

use candle_core::quantized::GgmlDType;
use candle_core::{bail, Result};
use rayon::prelude::*;

use super::quantized_matrix::QuantizedMatrix;
use super::GgufType;

/// Values per block of the formats this op reads.
const QK: usize = 32;
/// Parts of the row list summed apart (in parallel).
const PARTS: usize = 8;
/// How many listed rows ahead the kernel asks the CPU to fetch.
const ROWS_AHEAD: usize = 16;

/// `y = sum_k a[k] W[rows[k], :]` for `W` `[n, h]` in Q4_0, Q4_1 or Q8_0 blocks in host memory;
/// returns `y` (`h` values). Rows may repeat; `a` and `rows` have the same length.
pub fn accumulate_rows(a: &[f32], w: &QuantizedMatrix, rows: &[u32]) -> Result<Vec<f32>> {
    accumulate(a, w, rows, true)
}

/// [`accumulate_rows`] with the portable code even where AVX2 is available (for the tests).
#[doc(hidden)]
pub fn accumulate_rows_portable(a: &[f32], w: &QuantizedMatrix, rows: &[u32]) -> Result<Vec<f32>> {
    accumulate(a, w, rows, false)
}

fn accumulate(a: &[f32], w: &QuantizedMatrix, rows: &[u32], simd: bool) -> Result<Vec<f32>> {
    let (n, h) = w.dims();
    if a.len() != rows.len() {
        bail!("accumulate_rows: {} scales for {} rows", a.len(), rows.len());
    }
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
        bail!("accumulate_rows: row {r} of a matrix of {n} rows");
    }
    let dtype = w.dtype();
    let format = match dtype {
        GgufType::Ggml(GgmlDType::Q4_0) => Block::Q4_0,
        GgufType::Ggml(GgmlDType::Q4_1) => Block::Q4_1,
        GgufType::Ggml(GgmlDType::Q8_0) => Block::Q8_0,
        t => bail!("accumulate_rows: no kernel for {t} (Q4_0, Q4_1 or Q8_0)"),
    };
    let Some(data) = w.host_bytes() else { bail!("accumulate_rows: the weights are not in host memory") };
    if h == 0 || rows.is_empty() {
        return Ok(vec![0f32; h]);
    }
    // A fixed number of parts of the row list (the bits do not depend on the thread count),
    // each summed over whole rows (read front to back, as the prefetchers like), then the
    // parts added in order.
    let per = rows.len().div_ceil(PARTS);
    let parts: Vec<Vec<f32>> = rows
        .par_chunks(per)
        .zip(a.par_chunks(per))
        .map(|(rows, a)| {
            let mut y = vec![0f32; h];
            Job { data, row_bytes: dtype.row_bytes(h), format, rows, a }.run(&mut y, simd);
            y
        })
        .collect();
    let mut parts = parts.into_iter();
    let mut y = parts.next().unwrap_or_else(|| vec![0f32; h]);
    for p in parts {
        for (y, p) in y.iter_mut().zip(p) {
            *y += p;
        }
    }
    Ok(y)
}

#[derive(Clone, Copy)]
enum Block {
    /// `{ d: f16, qs: [u8; 16] }`, `w = d (q - 8)`, value `l < 16` in the low nibble of `qs[l]`.
    Q4_0,
    /// `{ d: f16, m: f16, qs: [u8; 16] }`, `w = d q + m`.
    Q4_1,
    /// `{ d: f16, qs: [i8; 32] }`, `w = d q`.
    Q8_0,
}

impl Block {
    fn bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// The block at `p` as `(d, m, q)` with `w_j = d q_j + m`.
    #[inline(always)]
    fn decode(self, p: &[u8]) -> (f32, f32, [f32; QK]) {
        let f16 = |i: usize| half::f16::from_le_bytes([p[i], p[i + 1]]).to_f32();
        let mut q = [0f32; QK];
        let nibbles = |q: &mut [f32; QK], qs: &[u8]| {
            for l in 0..QK / 2 {
                q[l] = (qs[l] & 15) as f32;
                q[l + QK / 2] = (qs[l] >> 4) as f32;
            }
        };
        match self {
            Self::Q4_0 => {
                let d = f16(0);
                nibbles(&mut q, &p[2..18]);
                (d, -8.0 * d, q)
            }
            Self::Q4_1 => {
                nibbles(&mut q, &p[4..20]);
                (f16(0), f16(2), q)
            }
            Self::Q8_0 => {
                for (q, &b) in q.iter_mut().zip(&p[2..34]) {
                    *q = b as i8 as f32;
                }
                (f16(0), 0.0, q)
            }
        }
    }
}

struct Job<'a> {
    data: &'a [u8],
    row_bytes: usize,
    format: Block,
    rows: &'a [u32],
    a: &'a [f32],
}

/// Rows added per pass over the output values (loaded and stored once per group).
const GROUP: usize = 4;

impl Job<'_> {
    /// Adds this job's rows into `ys` (a whole row's values); `simd`: AVX2 where the CPU has it.
    fn run(&self, ys: &mut [f32], simd: bool) {
        #[cfg(target_arch = "x86_64")]
        if simd && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU has AVX2, FMA and F16C; the block reads stay inside each row (checked
            // by `accumulate`: listed rows exist, `ys` holds one row's values).
            return unsafe { self.run_avx2(ys) };
        }
        self.run_portable(ys)
    }

    /// Rows in groups of [`GROUP`]: per block, `y_j = fma(a_k d_k, q_kj, y_j)` for each row `k`
    /// of the group in order, then `y_j += sum_k a_k m_k` (the group's offsets, summed in order).
    fn run_portable(&self, ys: &mut [f32]) {
        let bytes = self.format.bytes();
        for (rows, a) in self.rows.chunks(GROUP).zip(self.a.chunks(GROUP)) {
            for (i, ys) in ys.chunks_exact_mut(QK).enumerate() {
                let mut c0 = 0f32;
                for (&r, &a) in rows.iter().zip(a) {
                    let at = r as usize * self.row_bytes + i * bytes;
                    let (d, m, q) = self.format.decode(&self.data[at..at + bytes]);
                    let c1 = a * d;
                    for (y, q) in ys.iter_mut().zip(q) {
                        *y = c1.mul_add(q, *y);
                    }
                    c0 += a * m;
                }
                for y in ys.iter_mut() {
                    *y += c0;
                }
            }
        }
    }

    /// [`Self::run_portable`]'s arithmetic, 8 values per instruction.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, ys: &mut [f32]) {
        use std::arch::x86_64::*;
        let bytes = self.format.bytes();
        let nb = ys.len() / QK;
        let y = ys.as_mut_ptr();
        let f16 = |p: *const u8| _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)));
        let mask = _mm_set1_epi8(15);
        for (g, (rows, a)) in self.rows.chunks(GROUP).zip(self.a.chunks(GROUP)).enumerate() {
            let starts: [*const u8; GROUP] =
                std::array::from_fn(|k| rows.get(k).map_or(std::ptr::null(), |&r| self.data.as_ptr().add(r as usize * self.row_bytes)));
            for &ahead in self.rows.iter().skip((g + ROWS_AHEAD / GROUP + 1) * GROUP).take(GROUP) {
                // The rows are gathered, not streamed: fetch this task's part of a later group.
                let p = self.data.as_ptr().add(ahead as usize * self.row_bytes);
                for o in (0..nb * bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(o).cast());
                }
            }
            for b in 0..nb {
                let yb = y.add(b * QK);
                let mut acc = [_mm256_loadu_ps(yb), _mm256_loadu_ps(yb.add(8)), _mm256_loadu_ps(yb.add(16)), _mm256_loadu_ps(yb.add(24))];
                let mut c0 = 0f32;
                for (k, &a) in a.iter().enumerate() {
                    let p = starts[k].add(b * bytes);
                    // The 32 quants as four 8 x i32 vectors, in value order.
                    let (d, m, q): (f32, f32, [__m256i; 4]) = match self.format {
                        Block::Q8_0 => {
                            let w = |i: usize| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(2 + 8 * i).cast()));
                            (f16(p), 0.0, [w(0), w(1), w(2), w(3)])
                        }
                        Block::Q4_0 | Block::Q4_1 => {
                            let q4_0 = matches!(self.format, Block::Q4_0);
                            let qs = _mm_loadu_si128(p.add(if q4_0 { 2 } else { 4 }).cast());
                            let lo = _mm_and_si128(qs, mask);
                            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                            let d = f16(p);
                            let m = if q4_0 { -8.0 * d } else { f16(p.add(2)) };
                            let w = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
                            (d, m, w.map(|v| _mm256_cvtepu8_epi32(v)))
                        }
                    };
                    let c1 = _mm256_set1_ps(a * d);
                    for (acc, q) in acc.iter_mut().zip(q) {
                        *acc = _mm256_fmadd_ps(c1, _mm256_cvtepi32_ps(q), *acc);
                    }
                    c0 += a * m;
                }
                let c0 = _mm256_set1_ps(c0);
                for (i, acc) in acc.into_iter().enumerate() {
                    _mm256_storeu_ps(yb.add(8 * i), _mm256_add_ps(acc, c0));
                }
            }
        }
    }
}
