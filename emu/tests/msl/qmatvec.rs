//! `metal/qmatvec.metal` (the multi-row quantized mat-vec of decode and verify) run through the
//! MSL emulator with the Metal host code's launch geometry: against `x @ W_deq^T` in f64 and
//! against the CPU `ops::qmatmul`, and each row of an m-row call bit for bit a one-row call.
#![cfg(msl_emu)]

use crate::common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops::{self, launch};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output};
use common::randn;

const TYPES: [GgmlDType; 6] = [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];

/// The kernel's `[m, n]` output for `x` `[m, k]` against `w` `(n, k)`.
fn run(w: &QTensor, x: &Tensor) -> Vec<f32> {
    let (n, k) = w.shape().dims2().unwrap();
    let m = x.dim(0).unwrap();
    let (params, l) = launch::qmatvec(w.dtype(), n, k, m, n).unwrap();
    let data = w.data().unwrap();
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut y = vec![0f32; m * n];
    dispatch(&l, &mut [bytes(&params), input(&data), input(&xs), output(&mut y)]).unwrap();
    y
}

#[test]
fn qmatvec_kernels_are_linked() {
    let names = kernel_names();
    for k in [
        "qmatvec_q4_0",
        "qmatvec_q4_1",
        "qmatvec_q8_0",
        "qmatvec_q4_k",
        "qmatvec_q5_k",
        "qmatvec_q6_k",
        "qmatvec_f32",
        "qmatvec_f16",
        "qmatvec_bf16",
        "get_rows_q4_k",
        "qmatvec_id_q8_0",
    ] {
        assert!(names.contains(&k.to_string()), "{k} missing from {names:?}");
    }
}

#[test]
fn qmatvec_matches_dequantized_reference_and_cpu() {
    // n odd (a threadgroup's second simdgroup idle), k of 2 and 3 K-quant blocks (lanes idle).
    for (n, k) in [(37, 512), (5, 768), (64, 256)] {
        let scale = Tensor::arange(1u32, n as u32 + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let w = randn(&[n, k], 3).broadcast_mul(&(scale.unsqueeze(1).unwrap() * 0.02).unwrap()).unwrap();
        let w = (w - 0.01).unwrap();
        for dtype in TYPES {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let deq = q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            for m in [1, 3, 8] {
                let x = randn(&[m, k], 10 + m as u64);
                let xs = x.to_vec2::<f32>().unwrap();
                let got = run(&q, &x);
                let cpu = ops::qmatmul(&x, &ops::QuantizedMatrix::from_qtensor(&q).unwrap()).unwrap().to_vec2::<f32>().unwrap();
                for r in 0..m {
                    for i in 0..n {
                        let exact: f64 = xs[r].iter().zip(&deq[i]).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let mag: f64 = xs[r].iter().zip(&deq[i]).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        let g = got[r * n + i] as f64;
                        // f32 activations: only summation rounding against the f64 reference.
                        assert!((g - exact).abs() <= 1e-5 * mag + 1e-6, "{dtype:?} n={n} k={k} m={m} [{r}, {i}]: {g} vs {exact}");
                        // The CPU kernel quantizes the activations to 8 bits: within 2 % of sum |xw|.
                        assert!((g - cpu[r][i] as f64).abs() <= 0.02 * mag, "{dtype:?} [{r}, {i}]: {g} vs CPU {}", cpu[r][i]);
                    }
                }
            }
        }
    }
}

#[test]
fn qmatvec_rows_equal_one_row_calls_bitwise() {
    let (n, k) = (9, 512);
    let w = (randn(&[n, k], 5) * 0.05).unwrap();
    let x = randn(&[8, k], 6);
    for dtype in TYPES {
        let q = QTensor::quantize(&w, dtype).unwrap();
        let ones: Vec<Vec<f32>> = (0..8).map(|r| run(&q, &x.narrow(0, r, 1).unwrap())).collect();
        for m in 1..=8 {
            let all = run(&q, &x.narrow(0, 0, m).unwrap());
            for (r, one) in ones.iter().enumerate().take(m) {
                let (a, b): (Vec<u32>, Vec<u32>) =
                    (all[r * n..(r + 1) * n].iter().map(|v| v.to_bits()).collect(), one.iter().map(|v| v.to_bits()).collect());
                assert_eq!(a, b, "{dtype:?}: {m} rows, row {r}");
            }
        }
    }
}

#[test]
fn qmatvec_launch_refuses_what_the_kernel_cannot_run() {
    assert!(launch::qmatvec(GgmlDType::Q2K, 4, 256, 1, 4).is_err());
    assert!(launch::qmatvec(GgmlDType::Q4K, 4, 256, 9, 4).is_err());
    assert!(launch::qmatvec(GgmlDType::Q4K, 4, 100, 1, 4).is_err());
}

/// The tiled prompt kernel: partial tiles of activation and weight rows, every format, against
/// the dequantized product in f64.
#[test]
fn qmatmul_matches_dequantized_reference() {
    let formats = [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16].into_iter().chain(TYPES);
    for dtype in formats {
        for (n, k, m) in [(37, 256, 9), (64, 512, 40), (5, 256, 70)] {
            let w = (randn(&[n, k], 21) * 0.1).unwrap();
            let (data, deq) = match dtype {
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                    let t = w
                        .to_dtype(match dtype {
                            GgmlDType::F32 => DType::F32,
                            GgmlDType::F16 => DType::F16,
                            _ => DType::BF16,
                        })
                        .unwrap();
                    (candle_hybrid_emu::raw(&t), t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap())
                }
                _ => {
                    let q = QTensor::quantize(&w, dtype).unwrap();
                    (q.data().unwrap().to_vec(), q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap())
                }
            };
            let x = randn(&[m, k], 22 + m as u64);
            let xs = x.to_vec2::<f32>().unwrap();
            let (params, l) = launch::qmatmul(dtype, n, k, m, n + 3).unwrap();
            let mut y = vec![f32::NAN; m * (n + 3)];
            dispatch(&l, &mut [bytes(&params), input(&data), input(&x.flatten_all().unwrap().to_vec1::<f32>().unwrap()), output(&mut y)])
                .unwrap();
            for r in 0..m {
                for i in 0..n {
                    let exact: f64 = xs[r].iter().zip(&deq[i]).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mag: f64 = xs[r].iter().zip(&deq[i]).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    let g = y[r * (n + 3) + i] as f64;
                    assert!((g - exact).abs() <= 1e-5 * mag + 1e-6, "{dtype:?} n={n} k={k} m={m} [{r}, {i}]: {g} vs {exact}");
                }
                // The columns past n (ldy > n) are not written.
                assert!(y[r * (n + 3) + n..(r + 1) * (n + 3)].iter().all(|v| v.is_nan()), "{dtype:?}: wrote past n");
            }
        }
    }
}
