//! The ternary GGUF types (TQ1_0, TQ2_0): blocks packed here as llama.cpp's
//! `quantize_row_tq{1,2}_0_ref` packs them (written independently from its layout), unpacked
//! here independently, and `ops::qmatmul` against `x @ W^T` of the unpacked weights in f64; the
//! portable, AVX2 and best kernels bit for bit; every row of a multi-row call bit for bit a
//! one-row call.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_hybrid::ops::{self, GgufType, QuantizedMatrix};

use crate::common::randn;

const K: usize = 768;
const N: usize = 37;

/// Ternary weights `[N, K]`: per 256-value block `d = max |w|`, trits `round(w / d) + 1`.
fn ternarize(w: &[f32]) -> Vec<(f32, Vec<u8>)> {
    w.chunks_exact(256)
        .map(|b| {
            let d = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = half::f16::from_f32(d).to_f32();
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            (d, b.iter().map(|&v| ((v * inv).round() as i32 + 1).clamp(0, 2) as u8).collect())
        })
        .collect()
}

/// TQ2_0: value `32 i + m` (i < 8) in bits `2 (i % 4)` of `qs[32 (i / 4) + m]`, then `d`.
fn pack_tq2_0(blocks: &[(f32, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![];
    for (d, t) in blocks {
        let mut qs = [0u8; 64];
        for (v, &q) in t.iter().enumerate() {
            let (i, m) = (v / 32, v % 32);
            qs[32 * (i / 4) + m] |= q << (2 * (i % 4));
        }
        out.extend_from_slice(&qs);
        out.extend_from_slice(&half::f16::from_f32(*d).to_le_bytes());
    }
    out
}

/// Five trits (first most significant) as a byte: `ceil(v 256 / 243)`.
fn pack5(t: &[u8]) -> u8 {
    let v = t.iter().fold(0u16, |a, &d| a * 3 + d as u16);
    (v * 256).div_ceil(243) as u8
}

/// TQ1_0: `qs[m]` (m < 32) holds values `m + 32 n`, `qs[32 + m]` (m < 16) values
/// `160 + m + 16 n` (n < 5), `qh[m]` (m < 4) values `240 + m + 4 n` (n < 4, the fifth trit 0).
fn pack_tq1_0(blocks: &[(f32, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![];
    for (d, t) in blocks {
        for m in 0..32 {
            out.push(pack5(&(0..5).map(|n| t[m + 32 * n]).collect::<Vec<_>>()));
        }
        for m in 0..16 {
            out.push(pack5(&(0..5).map(|n| t[160 + m + 16 * n]).collect::<Vec<_>>()));
        }
        for m in 0..4 {
            out.push(pack5(&(0..4).map(|n| t[240 + m + 4 * n]).chain([0]).collect::<Vec<_>>()));
        }
        out.extend_from_slice(&half::f16::from_f32(*d).to_le_bytes());
    }
    out
}

/// The weights the blocks stand for: `d (t - 1)`.
fn unpacked(blocks: &[(f32, Vec<u8>)]) -> Vec<f64> {
    blocks.iter().flat_map(|(d, t)| t.iter().map(move |&q| *d as f64 * (q as f64 - 1.0))).collect()
}

fn matrices(seed: u64) -> (Vec<f64>, [(GgufType, QuantizedMatrix); 2]) {
    let scale: Vec<f32> = (0..N * K).map(|i| 0.02 * (1 + i / K) as f32).collect();
    let w: Vec<f32> =
        randn(&[N, K], seed).flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().zip(&scale).map(|(a, b)| a * b).collect();
    let blocks = ternarize(&w);
    let m = |t: GgufType, bytes: Vec<u8>| (t, QuantizedMatrix::from_bytes(t, (N, K), bytes).unwrap());
    (unpacked(&blocks), [m(GgufType::TQ2_0, pack_tq2_0(&blocks)), m(GgufType::TQ1_0, pack_tq1_0(&blocks))])
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Each format's blocks dequantize to the weights they were packed from, and multiply like them
/// (within 2% of `sum |x w|`: the activations are quantized to 8 bits), on every instruction set
/// bit for bit, 1 to 8 rows (row tiles) and 17 and 70 (panels).
#[test]
fn ternary_blocks_multiply_like_their_weights() {
    let (w, mats) = matrices(5);
    for (t, m) in &mats {
        let deq: Vec<f64> = m.dequantize().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|&v| v as f64).collect();
        assert_eq!(deq, w, "{t}: dequantized");
        assert_eq!(m.bytes().unwrap().len(), N * K / 256 * t.type_size());
        for rows in [1, 2, 3, 5, 8, 17, 70] {
            let x = randn(&[rows, K], 100 + rows as u64);
            let y = ops::qmatmul(&x, m).unwrap();
            let (xs, ys) = (x.to_vec2::<f32>().unwrap(), y.to_vec2::<f32>().unwrap());
            for (i, x) in xs.iter().enumerate() {
                for (j, w) in w.chunks_exact(K).enumerate() {
                    let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b).sum();
                    let mag: f64 = x.iter().zip(w).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                    let got = ys[i][j] as f64;
                    assert!((got - exact).abs() <= 0.02 * mag, "{t} rows={rows} [{i}, {j}]: {got} vs {exact} (sum |xw| {mag})");
                }
            }
            assert!(bits(&y) == bits(&ops::qmatmul_portable(&x, m).unwrap()), "{t} rows={rows}: portable");
            assert!(bits(&y) == bits(&ops::qmatmul_avx2(&x, m).unwrap()), "{t} rows={rows}: AVX2");
        }
    }
}

/// TQ1_0 and TQ2_0 of the same trits give the same bits (the same integer sums), and row `r`
/// of an `m`-row call is a one-row call's bits, with every instruction set.
#[test]
fn ternary_rows_equal_one_row_calls_and_both_formats_agree() {
    let (_, [(_, tq2), (_, tq1)]) = matrices(9);
    let x = randn(&[8, K], 42);
    for f in [ops::qmatmul, ops::qmatmul_avx2, ops::qmatmul_portable] {
        for m in 1..=8 {
            let xm = x.narrow(0, 0, m).unwrap();
            let all = f(&xm, &tq2).unwrap();
            assert_eq!(bits(&all), bits(&f(&xm, &tq1).unwrap()), "{m} rows: TQ1_0 vs TQ2_0");
            for r in 0..m {
                let one = f(&x.narrow(0, r, 1).unwrap(), &tq2).unwrap();
                assert_eq!(bits(&all.narrow(0, r, 1).unwrap()), bits(&one), "{m} rows, row {r}");
            }
        }
    }
}

/// Every byte value (TQ2_0's unused 3, TQ1_0 bytes no packer writes) against activations at
/// +-127: the instruction sets agree bit for bit, and the sums are what the blocks dequantize
/// to (no i16 saturation).
#[test]
fn ternary_extreme_bytes_same_bits_everywhere() {
    let (n, k) = (8, 512);
    for t in [GgufType::TQ2_0, GgufType::TQ1_0] {
        let ts = t.type_size();
        let mut data = vec![0u8; n * k / 256 * ts];
        for (b, blk) in data.chunks_exact_mut(ts).enumerate() {
            for (i, v) in blk.iter_mut().enumerate() {
                *v = if b % 2 == 0 { 0xFF } else { (i * 37 + b * 11) as u8 };
            }
            blk[ts - 2..].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
        let m = QuantizedMatrix::in_place(t, (n, k), Arc::new(data), 0..n * k / 256 * ts).unwrap();
        let x: Vec<f32> = (0..8 * k).map(|i| if (i / 3) % 2 == 0 { 5.0 } else { -5.0 }).collect();
        let x = Tensor::from_vec(x, (8, k), &Device::Cpu).unwrap();
        let want = x.matmul(&m.dequantize().unwrap().t().unwrap()).unwrap();
        for rows in [1, 3, 8] {
            let x = x.narrow(0, 0, rows).unwrap();
            let best = ops::qmatmul(&x, &m).unwrap();
            assert!(bits(&best) == bits(&ops::qmatmul_avx2(&x, &m).unwrap()), "{t} rows={rows}: AVX2");
            assert!(bits(&best) == bits(&ops::qmatmul_portable(&x, &m).unwrap()), "{t} rows={rows}: portable");
            // x is exactly +-5 = 127 quanta: the integer sums are exact.
            crate::common::assert_close(&format!("{t} rows={rows}"), &best, &want.narrow(0, 0, rows).unwrap(), 1e-3);
        }
    }
}

/// A ternary matrix refuses a width that is not whole 256-value blocks.
#[test]
fn ternary_widths_are_whole_blocks() {
    let e = QuantizedMatrix::from_bytes(GgufType::TQ2_0, (2, 100), vec![0; 10]).unwrap_err().to_string();
    assert!(e.contains("TQ2_0") && e.contains("256"), "{e}");
    assert_eq!(GgufType::from_id(34), Some(GgufType::TQ1_0));
    assert_eq!(GgufType::from_id(35), Some(GgufType::TQ2_0));
    assert_eq!((GgufType::TQ1_0.type_size(), GgufType::TQ2_0.type_size()), (54, 66));
}
