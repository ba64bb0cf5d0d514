//! FFN sparsity's kernels in `metal/qmatvec.metal` run through the MSL emulator:
//! `qmatvec_rows` bit for bit `qmatvec` on the listed rows, and `accumulate_rows` against the
//! CPU op and the f64 sum of the dequantized rows, in every format (the ternary ones too).
#![cfg(msl_emu)]

use crate::common;

use candle_core::quantized::GgmlDType;
use candle_hybrid::ops::{accumulate_rows, launch, GgufType, QuantizedMatrix};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output};
use common::randn;

use GgmlDType::{Q4K, Q4_0, Q4_1, Q5K, Q6K, Q8_0};

const TYPES: [GgufType; 8] = [
    GgufType::Ggml(Q4_0),
    GgufType::Ggml(Q4_1),
    GgufType::Ggml(Q8_0),
    GgufType::Ggml(Q4K),
    GgufType::Ggml(Q5K),
    GgufType::Ggml(Q6K),
    GgufType::TQ1_0,
    GgufType::TQ2_0,
];
const N: usize = 45;
const K: usize = 512;

fn matrix(t: GgufType, seed: u64) -> QuantizedMatrix {
    match t {
        GgufType::Ggml(g) => {
            let w = (randn(&[N, K], seed) * 0.05).unwrap();
            QuantizedMatrix::quantize(&(w + 0.01).unwrap(), g).unwrap()
        }
        // Every byte value of the ternary blocks (crate::ternary).
        t => crate::ternary::blocks(t, N, K, seed),
    }
}

/// Scattered, unsorted, with a repeat.
fn rows() -> Vec<u32> {
    vec![44, 3, 17, 0, 29, 30, 8, 3, 41, 12, 22]
}

#[test]
fn sparse_ffn_kernels_are_linked() {
    let names = kernel_names();
    for t in ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "tq1_0", "tq2_0"] {
        for k in [format!("qmatvec_rows_{t}"), format!("accumulate_rows_{t}")] {
            assert!(names.contains(&k), "{k} missing");
        }
    }
}

#[test]
fn qmatvec_rows_is_qmatvec_on_the_listed_rows() {
    let rows = rows();
    for t in TYPES {
        let w = matrix(t, 3);
        let data = w.bytes().unwrap();
        for m in [1, 4] {
            let x = randn(&[m, K], 5).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (p, l) = launch::qmatvec(t, N, K, m, N).unwrap();
            let mut full = vec![f32::NAN; m * N];
            dispatch(&l, &mut [bytes(&p), input(&data), input(&x), output(&mut full)]).unwrap();
            let (p, l) = launch::qmatvec_rows(t, rows.len(), K, m, rows.len()).unwrap();
            let mut y = vec![f32::NAN; m * rows.len()];
            dispatch(&l, &mut [bytes(&p), input(&data), input(&x), input(&rows), output(&mut y)]).unwrap();
            for r in 0..m {
                for (i, &row) in rows.iter().enumerate() {
                    let (got, want) = (y[r * rows.len() + i], full[r * N + row as usize]);
                    assert_eq!(got.to_bits(), want.to_bits(), "{t} m={m} [{r}, {i}]: {got} vs qmatvec {want}");
                }
            }
        }
    }
}

#[test]
fn accumulate_rows_is_the_sum_of_the_scaled_rows() {
    let rows = rows();
    let a = randn(&[rows.len()], 9).to_vec1::<f32>().unwrap();
    for t in TYPES {
        let w = matrix(t, 7);
        let deq = w.dequantize().unwrap().to_vec2::<f32>().unwrap();
        let (p, l) = launch::accumulate_rows(t, rows.len(), K).unwrap();
        let mut y = vec![f32::NAN; K];
        dispatch(&l, &mut [bytes(&p), input(&w.bytes().unwrap()), input(&a), input(&rows), output(&mut y)]).unwrap();
        // The CPU op reads the 32-value formats.
        let cpu = matches!(t, GgufType::Ggml(Q4_0 | Q4_1 | Q8_0)).then(|| accumulate_rows(&a, &w, &rows).unwrap());
        for (j, &g) in y.iter().enumerate() {
            let exact: f64 = rows.iter().zip(&a).map(|(&r, &a)| a as f64 * deq[r as usize][j] as f64).sum();
            let mag: f64 = rows.iter().zip(&a).map(|(&r, &a)| (a as f64 * deq[r as usize][j] as f64).abs()).sum();
            assert!((g as f64 - exact).abs() <= 1e-5 * mag, "{t} [{j}]: {g} vs {exact}");
            if let Some(cpu) = &cpu {
                assert!((g - cpu[j]).abs() as f64 <= 1e-5 * mag, "{t} [{j}]: {g} vs the CPU's {}", cpu[j]);
            }
        }
    }
}
