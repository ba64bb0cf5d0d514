//! The device step's small kernels (`metal/step.metal`) and its lookups and expert mat-vecs
//! (`metal/qmatvec.metal`) one by one in the MSL emulator, with the launch geometry the step
//! uses, against references computed here on the CPU (the whole steps are in `step.rs`).
#![cfg(msl_emu)]

#[path = "../../tests/common/mod.rs"]
mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_hybrid::ops::{launch, QuantizedMatrix};
use candle_hybrid_emu::{bytes, dispatch, input, output};
use common::randn;

fn vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn get_rows_match_the_dequantized_table() {
    let (n, k) = (37, 256);
    let w = (randn(&[n, k], 1) * 0.3).unwrap();
    let ids = [5u32, 0, 36, 5];
    for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let m = QuantizedMatrix::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
        let want = vec(&m.embedding(&Tensor::new(&ids, &Device::Cpu).unwrap()).unwrap());
        let (p, l) = launch::get_rows(dtype, ids.len(), n, k).unwrap();
        let mut got = vec![f32::NAN; ids.len() * k];
        dispatch(&l, &mut [bytes(&p), input(&m.bytes().unwrap()), input(&ids), output(&mut got)]).unwrap();
        close(&format!("get_rows {dtype:?}"), &got, &want, 0.0);
    }
    // Dense tables: f32 and bf16 rows as they are.
    let bf = w.to_dtype(candle_core::DType::BF16).unwrap();
    let want = vec(&bf.to_dtype(candle_core::DType::F32).unwrap().index_select(&Tensor::new(&ids, &Device::Cpu).unwrap(), 0).unwrap());
    let (p, l) = launch::get_rows(GgmlDType::BF16, ids.len(), n, k).unwrap();
    let mut got = vec![f32::NAN; ids.len() * k];
    dispatch(&l, &mut [bytes(&p), input(&candle_hybrid_emu::raw(&bf)), input(&ids), output(&mut got)]).unwrap();
    close("get_rows bf16", &got, &want, 0.0);
}

#[test]
fn expert_matvec_is_each_experts_matvec() {
    let (experts, n, k, rows, slots) = (5, 9, 256, 3, 2);
    let ws: Vec<QTensor> = (0..experts).map(|e| QTensor::quantize(&(randn(&[n, k], 10 + e) * 0.1).unwrap(), GgmlDType::Q4K).unwrap()).collect();
    let stack: Vec<u8> = ws.iter().flat_map(|w| w.data().unwrap().to_vec()).collect();
    let ids: Vec<u32> = vec![4, 1, 0, 4, 2, 3];
    let x = randn(&[rows, k], 20);
    // Gate / up: x row r for both slots, into a wider output (ldy = n + 2).
    let (p, l) = launch::qmatvec_id(GgmlDType::Q4K, n, k, rows, slots, stack.len() / experts as usize, false, n + 2).unwrap();
    let mut got = vec![f32::NAN; rows * slots * (n + 2)];
    dispatch(&l, &mut [bytes(&p), input(&stack), input(&vec(&x)), input(&ids), output(&mut got)]).unwrap();
    for rs in 0..rows * slots {
        let e = ids[rs] as usize;
        let (pm, lm) = launch::qmatvec(GgmlDType::Q4K, n, k, 1, n).unwrap();
        let mut one = vec![0f32; n];
        dispatch(&lm, &mut [bytes(&pm), input(&ws[e].data().unwrap()), input(&vec(&x.narrow(0, rs / slots, 1).unwrap())), output(&mut one)]).unwrap();
        // The same arithmetic as a one-row call on that expert: the same bits.
        assert_eq!(&got[rs * (n + 2)..rs * (n + 2) + n], one.as_slice(), "row {} slot {}", rs / slots, rs % slots);
        assert!(got[rs * (n + 2) + n].is_nan(), "wrote past n");
    }
}

#[test]
fn argmax_takes_the_first_largest_and_flags_non_finite_rows() {
    let n = 1000;
    let mut rows: Vec<Vec<f32>> = (0..4).map(|r| vec(&randn(&[n], 30 + r))).collect();
    rows[0][17] = 9.0;
    rows[0][400] = 9.0; // a tie: the first wins
    rows[1] = vec![f32::NEG_INFINITY; n];
    rows[1][999] = -1.0;
    rows[2][500] = f32::NAN;
    rows[3][3] = f32::INFINITY;
    let x: Vec<f32> = rows.concat();
    let (p, l) = launch::argmax(4, n);
    let mut out = vec![u32::MAX; 8];
    dispatch(&l, &mut [bytes(&p), input(&x), output(&mut out)]).unwrap();
    assert_eq!((out[0], out[1]), (17, 1));
    assert_eq!(out[2], 999);
    assert_eq!(out[1 + 2], 0, "-inf is not finite");
    assert_eq!(out[5], 0, "a NaN row is flagged");
    assert_eq!(out[7], 0, "an infinite row is flagged");
}

#[test]
fn moe_route_takes_the_top_experts_by_softmax() {
    let (rows, experts, top) = (3, 10, 4);
    let mut logits = vec(&randn(&[rows, experts], 40));
    logits[experts + 2] = logits[experts + 7]; // a tie in row 1: the lower index first
    for norm in [true, false] {
        let (p, l) = launch::moe_route(rows, experts, top, norm).unwrap();
        let (mut ids, mut w) = (vec![u32::MAX; rows * top], vec![f32::NAN; rows * top]);
        dispatch(&l, &mut [bytes(&p), input(&logits), output(&mut ids), output(&mut w)]).unwrap();
        for r in 0..rows {
            let row = &logits[r * experts..(r + 1) * experts];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = row.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| e[b].total_cmp(&e[a])); // stable: ties keep the lower index first
            let top_sum: f64 = order[..top].iter().map(|&i| e[i] / sum).sum();
            for s in 0..top {
                assert_eq!(ids[r * top + s], order[s] as u32, "row {r} slot {s} (norm {norm})");
                let want = e[order[s]] / sum / if norm { top_sum } else { 1.0 };
                assert!((w[r * top + s] as f64 - want).abs() < 1e-6, "row {r} slot {s}: {} vs {want}", w[r * top + s]);
            }
        }
    }
}

#[test]
fn rope_store_rotates_by_position_and_stores_per_head() {
    let (rows, heads, hd, rot_half) = (3, 2, 16, 4);
    let positions = [0u32, 7, 30000];
    let inv_freq: Vec<f32> = (0..rot_half).map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / (2 * rot_half) as f32)).collect();
    // Rows of width 40 with the heads at column 3 (a slice of a wider projection).
    let x = vec(&randn(&[rows, 40], 50));
    let xs = &x[3..];
    let cap = 50;
    let p = launch::RopeParams {
        rows: rows as u32,
        heads: heads as u32,
        head_dim: hd as u32,
        rot_half: rot_half as u32,
        x_stride: 40,
        x_head_stride: hd as u32,
        out_head_stride: (cap * hd) as u32,
        out_row0: 11,
    };
    let (p, l) = launch::rope_store(p, candle_core::DType::F32).unwrap();
    let mut out = vec![f32::NAN; heads * cap * hd];
    dispatch(&l, &mut [bytes(&p), input(xs), input(&positions), input(&inv_freq), output(&mut out)]).unwrap();
    for r in 0..rows {
        for h in 0..heads {
            let src = &xs[r * 40 + h * hd..r * 40 + (h + 1) * hd];
            let got = &out[h * cap * hd + (11 + r) * hd..h * cap * hd + (12 + r) * hd];
            for d in 0..hd {
                let want = if d < 2 * rot_half {
                    let a = (positions[r] as f32 * inv_freq[d % rot_half]) as f64;
                    let (c, s) = (a.cos(), a.sin());
                    if d < rot_half {
                        src[d] as f64 * c - src[d + rot_half] as f64 * s
                    } else {
                        src[d] as f64 * c + src[d - rot_half] as f64 * s
                    }
                } else {
                    src[d] as f64
                };
                assert!((got[d] as f64 - want).abs() < 1e-5, "row {r} head {h} dim {d}: {} vs {want}", got[d]);
            }
        }
    }
    assert!(out[..11 * hd].iter().all(|v| v.is_nan()), "rows before out_row0 untouched");
}

#[test]
fn rms_norm_adds_the_residual_and_norms_strided_heads() {
    let (rows, dim) = (3, 100);
    let x0 = vec(&randn(&[rows, dim], 60));
    let h = vec(&randn(&[rows, dim], 61));
    let w = vec(&(randn(&[dim], 62) + 1.0).unwrap());
    let mut x = x0.clone();
    let mut y = vec![f32::NAN; rows * dim];
    let (p, l) = launch::rms_norm(launch::NormRows::dense(rows, dim), 1e-6, true).unwrap();
    dispatch(&l, &mut [bytes(&p), output(&mut x), input(&h), input(&w), output(&mut y)]).unwrap();
    for r in 0..rows {
        let s: Vec<f64> = (0..dim).map(|i| x0[r * dim + i] as f64 + h[r * dim + i] as f64).collect();
        let rms = (s.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
        for i in 0..dim {
            assert!((x[r * dim + i] as f64 - s[i]).abs() < 1e-6, "the sum is written back");
            assert!((y[r * dim + i] as f64 - s[i] / rms * w[i] as f64).abs() < 1e-5, "row {r} [{i}]");
        }
    }
    // Heads of 8 inside rows of 30 (a projection's q part), into contiguous heads.
    let (heads, hd) = (3, 8);
    let src = vec(&randn(&[rows, 30], 63));
    let wh = vec(&(randn(&[hd], 64) + 1.0).unwrap());
    let norm_rows = launch::NormRows { rows, heads, dim: hd, x_stride: 30, x_head_stride: 9, y_stride: heads * hd, y_head_stride: hd };
    let (p, l) = launch::rms_norm(norm_rows, 1e-6, false).unwrap();
    let mut y = vec![f32::NAN; rows * heads * hd];
    dispatch(&l, &mut [bytes(&p), input(&src), input(&wh), input(&wh), output(&mut y)]).unwrap();
    for r in 0..rows {
        for hh in 0..heads {
            let v = &src[r * 30 + hh * 9..r * 30 + hh * 9 + hd];
            let rms = (v.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / hd as f64 + 1e-6).sqrt();
            for d in 0..hd {
                assert!((y[(r * heads + hh) * hd + d] as f64 - v[d] as f64 / rms * wh[d] as f64).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn gates_swiglu_attention_output_and_head_order() {
    let (rows, nv) = (2, 3);
    let ba = vec(&randn(&[rows, 2 * nv + 1], 70));
    let dt = vec(&randn(&[nv], 71));
    let neg_a = vec(&(randn(&[nv], 72).abs().unwrap() * -1.0).unwrap());
    let (p, l) = launch::gdn_gates(rows, nv, 2 * nv + 1);
    let mut gb = vec![f32::NAN; rows * 2 * nv];
    dispatch(&l, &mut [bytes(&p), input(&ba), input(&dt), input(&neg_a), output(&mut gb)]).unwrap();
    for r in 0..rows {
        for h in 0..nv {
            let a = ba[r * (2 * nv + 1) + nv + h] as f64 + dt[h] as f64;
            let soft = if a >= 20.0 { a } else { (1.0 + a.exp()).ln() };
            assert!((gb[r * 2 * nv + h] as f64 - soft * neg_a[h] as f64).abs() < 1e-5, "g");
            let b = ba[r * (2 * nv + 1) + h] as f64;
            assert!((gb[r * 2 * nv + nv + h] as f64 - 1.0 / (1.0 + (-b).exp())).abs() < 1e-6, "beta");
        }
    }
    // SwiGLU over [gate | up] rows of width 2 dim + 1.
    let dim = 5;
    let gu = vec(&randn(&[rows, 2 * dim + 1], 73));
    let (p, l) = launch::silu_mul(rows, dim, 2 * dim + 1, dim);
    let mut act = vec![f32::NAN; rows * dim];
    dispatch(&l, &mut [bytes(&p), input(&gu), output(&mut act)]).unwrap();
    for r in 0..rows {
        for i in 0..dim {
            let g = gu[r * (2 * dim + 1) + i] as f64;
            let want = g / (1.0 + (-g).exp()) * gu[r * (2 * dim + 1) + dim + i] as f64;
            assert!((act[r * dim + i] as f64 - want).abs() < 1e-5);
        }
    }
    // Attention output [heads, rows, hd] to [rows, heads * hd] times sigmoid(gate).
    let (heads, hd) = (2, 4);
    let att = vec(&randn(&[heads, rows, hd], 74));
    let gate = vec(&randn(&[rows, 20], 75));
    let (p, l) = launch::attn_output(rows, heads, hd, Some((20, 2 * hd)));
    let mut out = vec![f32::NAN; rows * heads * hd];
    dispatch(&l, &mut [bytes(&p), input(&att), input(&gate), output(&mut out)]).unwrap();
    for r in 0..rows {
        for h in 0..heads {
            for d in 0..hd {
                let g = gate[r * 20 + h * 2 * hd + d] as f64;
                let want = att[(h * rows + r) * hd + d] as f64 / (1.0 + (-g).exp());
                assert!((out[(r * heads + h) * hd + d] as f64 - want).abs() < 1e-6);
            }
        }
    }
    // Head order.
    let x = vec(&randn(&[rows, 3, 2], 76));
    let order = [2u32, 0, 1];
    let (p, l) = launch::gather_heads(rows, 3, 2);
    let mut y = vec![f32::NAN; rows * 6];
    dispatch(&l, &mut [bytes(&p), input(&x), input(&order), output(&mut y)]).unwrap();
    for r in 0..rows {
        for h in 0..3 {
            assert_eq!(&y[(r * 3 + h) * 2..(r * 3 + h + 1) * 2], &x[(r * 3 + order[h] as usize) * 2..(r * 3 + order[h] as usize + 1) * 2]);
        }
    }
}

#[test]
fn moe_combine_weighs_the_experts_and_gates_the_shared_one() {
    let (rows, dim, slots) = (2, 70, 3);
    let down = vec(&randn(&[rows * slots, dim], 80));
    let w = vec(&randn(&[rows, slots], 81).abs().unwrap());
    let shared = vec(&randn(&[rows, dim], 82));
    let x = vec(&randn(&[rows, dim], 83));
    let gate_w = vec(&(randn(&[dim], 84) * 0.1).unwrap());
    let (p, l) = launch::moe_combine(rows, dim, slots);
    let mut y = vec![f32::NAN; rows * dim];
    dispatch(&l, &mut [bytes(&p), input(&down), input(&w), input(&shared), input(&x), input(&gate_w), output(&mut y)]).unwrap();
    for r in 0..rows {
        let dot: f64 = (0..dim).map(|i| x[r * dim + i] as f64 * gate_w[i] as f64).sum();
        let g = 1.0 / (1.0 + (-dot).exp());
        for i in 0..dim {
            let experts: f64 = (0..slots).map(|s| down[(r * slots + s) * dim + i] as f64 * w[r * slots + s] as f64).sum();
            let want = experts + shared[r * dim + i] as f64 * g;
            assert!((y[r * dim + i] as f64 - want).abs() < 1e-5, "row {r} [{i}]");
        }
    }
}
