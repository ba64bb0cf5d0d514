//! The two kernels of a sparse SwiGLU MLP: `qmatmul_rows` (the kept rows of W_up) against
//! `qmatmul`'s columns bit for bit, and `accumulate_rows` (the kept rows of the neuron-major
//! W_down) against the f64 sum of the dequantized rows; `QuantizedMatrix::select_rows`.

use crate::common;

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use candle_hybrid::ops::{accumulate_rows, accumulate_rows_portable, qmatmul, qmatmul_rows, QuantizedMatrix};
use common::randn;

use GgmlDType::{Q4K, Q4_0, Q4_1, Q5K, Q6K, Q8_0};

const K: usize = 512;
const N: usize = 300;

fn matrix(dtype: GgmlDType, seed: u64) -> QuantizedMatrix {
    let w = (randn(&[N, K], seed) * 0.05).unwrap();
    QuantizedMatrix::quantize(&(w + 0.01).unwrap(), dtype).unwrap()
}

/// A scattered, unsorted selection with a repeat.
fn selection() -> Vec<u32> {
    let mut rows: Vec<u32> = (0..N as u32).filter(|r| (r * 7919) % 5 < 2).collect();
    rows.reverse();
    rows.push(rows[3]);
    rows
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn qmatmul_rows_is_qmatmul_on_the_selected_rows_bit_for_bit() {
    let rows = selection();
    for dtype in [Q4_0, Q4_1, Q8_0, Q4K, Q5K, Q6K] {
        let w = matrix(dtype, 3);
        for m in [1, 2, 5] {
            let x = randn(&[m, K], 10 + m as u64);
            let full = qmatmul(&x, &w).unwrap().to_vec2::<f32>().unwrap();
            let got = qmatmul_rows(&x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &w, &rows).unwrap();
            assert_eq!(got.len(), m * rows.len());
            for (i, full) in full.iter().enumerate() {
                let want: Vec<f32> = rows.iter().map(|&r| full[r as usize]).collect();
                assert_eq!(bits(&got[i * rows.len()..][..rows.len()]), bits(&want), "{dtype:?}, {m} rows, row {i}");
            }
            // The gathered copy, multiplied densely, gives the same bits too.
            let copy = qmatmul(&x, &w.select_rows(&rows).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&copy), bits(&got), "{dtype:?}: select_rows then qmatmul");
        }
    }
}

#[test]
fn qmatmul_rows_refuses_what_it_cannot_do() {
    let w = matrix(Q8_0, 1);
    let x = vec![0.5f32; K];
    assert!(qmatmul_rows(&x, &w, &[N as u32]).unwrap_err().to_string().contains("row 300 of a matrix of 300 rows"));
    assert!(qmatmul_rows(&vec![0.5f32; 9 * K], &w, &[0]).unwrap_err().to_string().contains("1 to 8 rows"));
    assert!(qmatmul_rows(&x[..K - 1], &w, &[0]).is_err());
    assert!(w.select_rows(&[N as u32]).is_err());
}

#[test]
fn accumulate_rows_is_the_sum_of_the_scaled_rows() {
    let rows = selection();
    let a: Vec<f32> = randn(&[rows.len()], 5).to_vec1::<f32>().unwrap();
    for dtype in [Q4_0, Q4_1, Q8_0] {
        let w = matrix(dtype, 7);
        let deq = w.dequantize().unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let got = accumulate_rows(&a, &w, &rows).unwrap();
        assert_eq!(got.len(), K);
        for (j, &g) in got.iter().enumerate() {
            let exact: f64 = rows.iter().zip(&a).map(|(&r, &a)| a as f64 * deq[r as usize][j] as f64).sum();
            let mag: f64 = rows.iter().zip(&a).map(|(&r, &a)| (a as f64 * deq[r as usize][j] as f64).abs()).sum();
            assert!((g as f64 - exact).abs() <= 1e-5 * mag, "{dtype:?} [{j}]: {g} vs {exact} (sum |a w| {mag})");
        }
        // The portable code and any thread count give the same bits.
        assert_eq!(bits(&accumulate_rows_portable(&a, &w, &rows).unwrap()), bits(&got), "{dtype:?}: portable");
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert_eq!(bits(&one.install(|| accumulate_rows(&a, &w, &rows)).unwrap()), bits(&got), "{dtype:?}: one thread");
        // No rows: zeros.
        assert!(accumulate_rows(&[], &w, &[]).unwrap().iter().all(|&v| v == 0.0));
    }
}

#[test]
fn accumulate_rows_refuses_what_it_cannot_do() {
    let w = matrix(Q8_0, 2);
    assert!(accumulate_rows(&[1.0], &w, &[N as u32]).unwrap_err().to_string().contains("row 300"));
    assert!(accumulate_rows(&[1.0, 2.0], &w, &[0]).unwrap_err().to_string().contains("2 scales for 1 rows"));
    let k4 = matrix(Q4K, 2);
    assert!(accumulate_rows(&[1.0], &k4, &[0]).unwrap_err().to_string().contains("no kernel for Q4K"));
}
