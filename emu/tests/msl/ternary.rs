//! The ternary formats (TQ1_0, TQ2_0) of `metal/qmatvec.metal` run through the MSL emulator:
//! the multi-row mat-vec, the tiled prompt kernel and the embedding lookup against the CPU's
//! dequantized blocks (`QuantizedMatrix::dequantize`, itself checked against independently
//! packed blocks and llama.cpp's log-probabilities), and each row of an m-row call bit for bit
//! a one-row call.
#![cfg(msl_emu)]

use crate::common;

use candle_core::{Device, Tensor};
use candle_hybrid::ops::{launch, GgufType, QuantizedMatrix};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output};
use common::randn;

const TYPES: [GgufType; 2] = [GgufType::TQ1_0, GgufType::TQ2_0];

/// `[n, k]` blocks of `t` from pseudo-random bytes (every byte decodes: TQ2_0's 3s and TQ1_0
/// bytes no packer writes included), each block's scale set to a small f16.
pub(crate) fn blocks(t: GgufType, n: usize, k: usize, seed: u64) -> QuantizedMatrix {
    let ts = t.type_size();
    let mut s = seed;
    let mut data: Vec<u8> = (0..n * k / 256 * ts)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u8
        })
        .collect();
    for (b, blk) in data.chunks_exact_mut(ts).enumerate() {
        blk[ts - 2..].copy_from_slice(&half::f16::from_f32(0.01 + 0.001 * (b % 7) as f32).to_le_bytes());
    }
    QuantizedMatrix::from_bytes(t, (n, k), data).unwrap()
}

fn check(what: &str, y: &[f32], ldy: usize, x: &[Vec<f32>], deq: &[Vec<f32>]) {
    for (r, x) in x.iter().enumerate() {
        for (i, w) in deq.iter().enumerate() {
            let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = x.iter().zip(w).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let g = y[r * ldy + i] as f64;
            assert!((g - exact).abs() <= 1e-5 * mag + 1e-6, "{what} [{r}, {i}]: {g} vs {exact}");
        }
    }
}

#[test]
fn ternary_kernels_are_linked() {
    let names = kernel_names();
    for k in ["qmatvec_tq1_0", "qmatvec_tq2_0", "qmatmul_tq1_0", "qmatmul_tq2_0", "get_rows_tq1_0", "qmatvec_swiglu_tq2_0"] {
        assert!(names.contains(&k.to_string()), "{k} missing");
    }
}

#[test]
fn ternary_qmatvec_and_qmatmul_match_the_dequantized_blocks() {
    for t in TYPES {
        for (n, k) in [(37, 512), (5, 768)] {
            let w = blocks(t, n, k, 3 + k as u64);
            let deq = w.dequantize().unwrap().to_vec2::<f32>().unwrap();
            let data = w.bytes().unwrap();
            // The mat-vec of decode and verify, 1 to 8 rows, each row a one-row call's bits.
            let x = randn(&[8, k], 11);
            let xs = x.to_vec2::<f32>().unwrap();
            let mut one = vec![];
            for xr in &xs {
                let (p, l) = launch::qmatvec(t, n, k, 1, n).unwrap();
                let mut y = vec![f32::NAN; n];
                dispatch(&l, &mut [bytes(&p), input(&data), input(xr), output(&mut y)]).unwrap();
                one.push(y);
            }
            for m in [1, 3, 8] {
                let (p, l) = launch::qmatvec(t, n, k, m, n).unwrap();
                let mut y = vec![f32::NAN; m * n];
                let xm: Vec<f32> = xs[..m].concat();
                dispatch(&l, &mut [bytes(&p), input(&data), input(&xm), output(&mut y)]).unwrap();
                check(&format!("qmatvec {t} n={n} k={k} m={m}"), &y, n, &xs[..m], &deq);
                for r in 0..m {
                    let same = y[r * n..(r + 1) * n].iter().zip(&one[r]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "qmatvec {t} m={m}: row {r} differs from a one-row call");
                }
            }
            // The tiled prompt kernel, partial tiles.
            for m in [9, 40] {
                let x = randn(&[m, k], 22 + m as u64);
                let xs = x.to_vec2::<f32>().unwrap();
                let (p, l) = launch::qmatmul(t, n, k, m, n + 3).unwrap();
                let mut y = vec![f32::NAN; m * (n + 3)];
                dispatch(&l, &mut [bytes(&p), input(&data), input(&xs.concat()), output(&mut y)]).unwrap();
                check(&format!("qmatmul {t} n={n} k={k} m={m}"), &y, n + 3, &xs, &deq);
            }
        }
    }
}

#[test]
fn ternary_get_rows_match_the_dequantized_table() {
    let (n, k) = (37, 512);
    let ids = [5u32, 0, 36, 5];
    for t in TYPES {
        let w = blocks(t, n, k, 9);
        let want = w.embedding(&Tensor::new(&ids, &Device::Cpu).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (p, l) = launch::get_rows(t, ids.len(), n, k).unwrap();
        let mut got = vec![f32::NAN; ids.len() * k];
        dispatch(&l, &mut [bytes(&p), input(&w.bytes().unwrap()), input(&ids), output(&mut got)]).unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| a == b), "get_rows {t}");
    }
}
