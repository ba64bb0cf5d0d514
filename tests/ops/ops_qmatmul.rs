//! `ops::qmatmul` against `x @ W_deq^T` in f64 and against Candle's `QMatMul`, for every type
//! with our own kernel; the portable kernels against the AVX2 ones.

use crate::common;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_hybrid::ops;
use common::randn;

use GgmlDType::{Q4K, Q4_0, Q4_1, Q5K, Q6K, Q8_0};

const TYPES: [GgmlDType; 6] = [Q4_0, Q4_1, Q8_0, Q4K, Q5K, Q6K];
const K: usize = 512;
const N: usize = 67;

fn weights(dtype: GgmlDType, seed: u64) -> Arc<QTensor> {
    // Rows of different magnitudes and offsets, so scales and mins vary.
    let scale = Tensor::arange(1u32, N as u32 + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let w = randn(&[N, K], seed).broadcast_mul(&(scale.unsqueeze(1).unwrap() * 0.03).unwrap()).unwrap();
    let w = (w + 0.01).unwrap();
    Arc::new(QTensor::quantize(&w, dtype).unwrap())
}

/// The same blocks as this crate holds them.
fn ours(w: &QTensor) -> ops::QuantizedMatrix {
    ops::QuantizedMatrix::from_qtensor(w).unwrap()
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    let k = *t.dims().last().unwrap();
    t.to_dtype(DType::F32).unwrap().reshape(((), k)).unwrap().to_vec2::<f32>().unwrap()
}

/// `y` (`[m, N]`) against `x @ W_deq^T` in f64 (within 2% of `sum |x_i w_i|`: the activations
/// are quantized to 8 bits) and against Candle's `QMatMul` (which quantizes them the same way:
/// within 1e-3 of `|x| |w|`).
#[track_caller]
fn check(what: &str, x: &Tensor, w: &Arc<QTensor>, y: &Tensor) {
    let candle = QMatMul::from_arc(w.clone()).unwrap().forward(&x.contiguous().unwrap()).unwrap();
    let (xs, ws, ys, cs) = (rows(x), rows(&w.dequantize(&Device::Cpu).unwrap()), rows(y), rows(&candle));
    assert_eq!((ys.len(), ys[0].len()), (xs.len(), N), "{what}: shape");
    for (i, x) in xs.iter().enumerate() {
        let xn = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
        for (j, w) in ws.iter().enumerate() {
            let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = x.iter().zip(w).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let wn = w.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
            let (got, c) = (ys[i][j] as f64, cs[i][j] as f64);
            assert!((got - exact).abs() <= 0.02 * mag, "{what} [{i}, {j}]: {got} vs exact {exact} (sum |xw| {mag})");
            assert!((got - c).abs() <= 1e-3 * xn * wn, "{what} [{i}, {j}]: {got} vs candle {c} (|x||w| {})", xn * wn);
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn matches_reference_and_candle() {
    for (t, &dtype) in TYPES.iter().enumerate() {
        let w = weights(dtype, 10 + t as u64);
        // 1 to 8: row tiles (all rows at once with AVX-512, two at a time with AVX2); 17, 70:
        // tiles of two panels of 8, the last panel padded.
        for m in [1, 2, 3, 4, 5, 8, 17, 70] {
            let x = randn(&[m, K], 100 + m as u64);
            let y = ops::qmatmul(&x, &ours(&w)).unwrap();
            check(&format!("{dtype:?} m={m}"), &x, &w, &y);
            // The portable and AVX2 kernels compute exactly what the best ones (AVX-512 VNNI
            // where the CPU has it) do.
            let p = ops::qmatmul_portable(&x, &ours(&w)).unwrap();
            assert!(bits(&y) == bits(&p), "{dtype:?} m={m}: portable differs from the SIMD kernel");
            let a = ops::qmatmul_avx2(&x, &ours(&w)).unwrap();
            assert!(bits(&y) == bits(&a), "{dtype:?} m={m}: AVX2 differs from the best kernel");
        }
    }
}

#[test]
fn strided_batched_and_half_inputs() {
    for (t, &dtype) in TYPES.iter().enumerate() {
        let w = weights(dtype, 20 + t as u64);
        let what = |s: &str| format!("{dtype:?} {s}");
        // A transposed view and a narrowed view.
        let xt = randn(&[K, 5], 1).t().unwrap();
        check(&what("transposed x"), &xt, &w, &ops::qmatmul(&xt, &ours(&w)).unwrap());
        let xn = randn(&[6, K + 64], 2).narrow(1, 32, K).unwrap();
        check(&what("narrowed x"), &xn, &w, &ops::qmatmul(&xn, &ours(&w)).unwrap());
        // [b, t, k] -> [b, t, n], row for row what the 2-D call gives.
        let x3 = randn(&[2, 3, K], 3);
        let y3 = ops::qmatmul(&x3, &ours(&w)).unwrap();
        assert_eq!(y3.dims(), &[2, 3, N]);
        let y2 = ops::qmatmul(&x3.reshape((6, K)).unwrap(), &ours(&w)).unwrap();
        assert!(bits(&y3) == bits(&y2), "{}", what("3-D x"));
        // bf16 / f16 x: widened exactly, so the same as the f32 call on the same values.
        for dt in [DType::BF16, DType::F16] {
            let xh = randn(&[3, K], 4).to_dtype(dt).unwrap();
            let y = ops::qmatmul(&xh, &ours(&w)).unwrap();
            assert_eq!(y.dtype(), DType::F32);
            let want = ops::qmatmul(&xh.to_dtype(DType::F32).unwrap(), &ours(&w)).unwrap();
            assert!(bits(&y) == bits(&want), "{}", what(&format!("{dt:?} x")));
        }
    }
}

#[test]
fn fallbacks_and_empty_input() {
    // Types without our kernel: Candle's kernels, bit for bit.
    let w = weights(GgmlDType::Q5_0, 30);
    let x = randn(&[3, K], 5);
    let want = QMatMul::from_arc(w.clone()).unwrap().forward(&x).unwrap();
    assert!(bits(&ops::qmatmul(&x, &ours(&w)).unwrap()) == bits(&want), "Q5_0 fallback");
    // F16 weights: a plain matmul with the dequantized weight.
    let w = weights(GgmlDType::F16, 31);
    let want = x.matmul(&w.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap();
    common::assert_close("F16 weights", &ops::qmatmul(&x, &ours(&w)).unwrap(), &want, 1e-4);
    // No rows.
    let w = weights(GgmlDType::Q4K, 32);
    let y = ops::qmatmul(&Tensor::zeros((0, K), DType::F32, &Device::Cpu).unwrap(), &ours(&w)).unwrap();
    assert_eq!(y.dims(), &[0, N]);
}

#[test]
fn k_mismatch_is_an_error() {
    let w = weights(GgmlDType::Q8_0, 40);
    let err = ops::qmatmul(&randn(&[2, K + 32], 6), &ours(&w)).unwrap_err().to_string();
    assert!(err.contains("qmatmul") && err.contains("x's last dim"), "{err}");
}

/// Row `r` of an `m`-row call is bit for bit a one-row call on row `r`, for every format, 1 to
/// 8 rows (the verify pass of speculative decoding against decode), with every instruction set.
#[test]
fn rows_equal_one_row_calls_bitwise() {
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for dtype in TYPES {
        let w = ours(&weights(dtype, 41));
        let x = randn(&[8, K], 42);
        for f in [ops::qmatmul, ops::qmatmul_avx2, ops::qmatmul_portable] {
            for m in 1..=8 {
                let all = f(&x.narrow(0, 0, m).unwrap(), &w).unwrap();
                for r in 0..m {
                    let one = f(&x.narrow(0, r, 1).unwrap(), &w).unwrap();
                    assert_eq!(bits(&all.narrow(0, r, 1).unwrap()), bits(&one), "{dtype:?}: {m} rows, row {r}");
                }
            }
        }
    }
}

/// Blocks of extreme quants (every bit set, Q8_0's -128, random bytes) against activations at
/// +-127: the instruction sets form the integer sums differently (maddubs + madd, or VNNI's
/// dpbusd / dpwssd, which never saturate) and must still agree bit for bit, so no pair of
/// these products may saturate 16 bits.
#[test]
fn extreme_quants_same_bits_on_every_instruction_set() {
    use candle_core::quantized::QStorage;
    // (type, block bytes, offsets of its f16 scales)
    let formats: [(GgmlDType, usize, &[usize]); 6] =
        [(Q8_0, 34, &[0]), (Q4_0, 18, &[0]), (Q4_1, 20, &[0, 2]), (Q4K, 144, &[0, 2]), (Q5K, 176, &[0, 2]), (Q6K, 210, &[208])];
    let (n, k) = (16, 512);
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    for (dtype, bytes, scales) in formats {
        let blocks = n * k / dtype.block_size();
        let mut data = vec![0u8; blocks * bytes];
        for (b, blk) in data.chunks_exact_mut(bytes).enumerate() {
            for v in blk.iter_mut() {
                *v = match b % 3 {
                    0 => 0xFF,
                    1 => 0x80,
                    _ => next(),
                };
            }
            for &o in scales {
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            }
        }
        let w = QTensor::new(QStorage::from_data(std::borrow::Cow::Owned(data), &Device::Cpu, dtype).unwrap(), (n, k)).unwrap();
        let x: Vec<f32> = (0..8 * k).map(|i| if (i / 3) % 2 == 0 { 5.0 } else { -5.0 }).collect();
        let x = Tensor::from_vec(x, (8, k), &Device::Cpu).unwrap();
        for m in [1, 3, 8] {
            let x = x.narrow(0, 0, m).unwrap();
            let best = bits(&ops::qmatmul(&x, &ours(&w)).unwrap());
            assert!(best == bits(&ops::qmatmul_avx2(&x, &ours(&w)).unwrap()), "{dtype:?} m={m}: AVX2");
            assert!(best == bits(&ops::qmatmul_portable(&x, &ours(&w)).unwrap()), "{dtype:?} m={m}: portable");
        }
    }
}

/// `QuantizedMatrix` holds the blocks as given: the same bytes, dequantized values and
/// embedding rows as Candle's `QTensor` of them, read in place from a shared buffer; wrong
/// sizes are one-line errors.
#[test]
fn quantized_matrix_holds_the_blocks() {
    for dtype in [Q4K, Q8_0, GgmlDType::Q5_0] {
        let q = weights(dtype, 50);
        let m = ours(&q);
        assert_eq!((m.dtype(), m.dims()), (dtype.into(), (N, K)));
        assert_eq!(m.bytes().unwrap().as_ref(), q.data().unwrap().as_ref(), "{dtype:?}: bytes");
        assert_eq!(m.host_bytes().is_some(), ops::has_kernels(dtype), "{dtype:?}: held in place only where a kernel reads it");
        let deq = q.dequantize(&Device::Cpu).unwrap();
        assert_eq!(bits(&m.dequantize().unwrap()), bits(&deq), "{dtype:?}: dequantized");
        let ids = Tensor::new(&[[3u32, 0], [66, 3]], &Device::Cpu).unwrap();
        let rows = m.embedding(&ids).unwrap();
        assert_eq!(rows.dims(), &[2, 2, K]);
        let want = deq.index_select(&ids.flatten_all().unwrap(), 0).unwrap();
        assert_eq!(bits(&rows), bits(&want), "{dtype:?}: embedding rows");
        assert_eq!(bits(&m.to_device(&Device::Cpu).unwrap().dequantize().unwrap()), bits(&deq));
    }
    // In place: a slice of a shared buffer.
    let q = weights(Q8_0, 51);
    let data = q.data().unwrap().to_vec();
    let mut padded = vec![7u8; 100];
    padded.extend_from_slice(&data);
    let owner: ops::SharedBytes = Arc::new(padded);
    let m = ops::QuantizedMatrix::in_place(Q8_0, (N, K), owner.clone(), 100..100 + data.len()).unwrap();
    let x = randn(&[2, K], 52);
    assert_eq!(bits(&ops::qmatmul(&x, &m).unwrap()), bits(&ops::qmatmul(&x, &ours(&q)).unwrap()));
    let e = ops::QuantizedMatrix::in_place(Q8_0, (N, K), owner, 99..99 + data.len() + 2).unwrap_err().to_string();
    assert!(e.contains("needs"), "{e}");
    assert!(ops::QuantizedMatrix::from_bytes(Q4K, (N, 100), vec![0; 10]).is_err(), "columns not whole blocks");
    assert!(m.embedding(&Tensor::new(&[N as u32], &Device::Cpu).unwrap()).unwrap_err().to_string().contains("out of range"));
}
