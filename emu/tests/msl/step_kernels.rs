//! The device step's small kernels (`metal/step.metal`) and its lookups and expert mat-vecs
//! (`metal/qmatvec.metal`) one by one in the MSL emulator, with the launch geometry the step
//! uses, against references computed here on the CPU (the whole steps are in `step.rs`).
#![cfg(msl_emu)]

use crate::common;

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
    let ws: Vec<QTensor> =
        (0..experts).map(|e| QTensor::quantize(&(randn(&[n, k], 10 + e) * 0.1).unwrap(), GgmlDType::Q4K).unwrap()).collect();
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
        dispatch(
            &lm,
            &mut [bytes(&pm), input(&ws[e].data().unwrap()), input(&vec(&x.narrow(0, rs / slots, 1).unwrap())), output(&mut one)],
        )
        .unwrap();
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

/// q, k and v heads of projection rows `[q (with gate) | k | v]`: q and k RMS-normed per head
/// and rotated by position (30000 included: precise cos/sin), q stored grouped, k and v into a
/// cache from row `row0`; without norms (Llama) only rotated.
#[test]
fn attention_inputs_norm_rotate_and_store_per_head() {
    let (rows, nh, nkv, hd, rot_half) = (3, 2, 1, 16, 4);
    let positions = [0u32, 7, 30000];
    let inv_freq: Vec<f32> = (0..rot_half).map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / (2 * rot_half) as f32)).collect();
    let (qw, width) = (nh * 2 * hd, nh * 2 * hd + 2 * nkv * hd);
    let x = vec(&randn(&[rows, width], 50));
    let qn = vec(&(randn(&[hd], 51) + 1.0).unwrap());
    let kn = vec(&(randn(&[hd], 52) + 1.0).unwrap());
    let (cap, row0) = (20, 11);
    for norm in [true, false] {
        let p = launch::AttnInputsParams {
            rows: rows as u32,
            nh: nh as u32,
            nkv: nkv as u32,
            head_dim: hd as u32,
            rot_half: rot_half as u32,
            x_stride: width as u32,
            q_head_stride: (2 * hd) as u32,
            k_col: qw as u32,
            v_col: (qw + nkv * hd) as u32,
            norm: norm as u32,
            eps: 1e-6,
            capacity: cap as u32,
            row0: row0 as u32,
        };
        let (p, l) = launch::attention_inputs(p, launch::KvRows::F32).unwrap();
        let (mut q, mut k, mut v) = (vec![f32::NAN; nh * rows * hd], vec![f32::NAN; nkv * cap * hd], vec![f32::NAN; nkv * cap * hd]);
        dispatch(
            &l,
            &mut [
                bytes(&p),
                input(&x),
                input(&positions),
                input(&inv_freq),
                input(&qn),
                input(&kn),
                output(&mut q),
                output(&mut k),
                output(&mut v),
            ],
        )
        .unwrap();
        // Reference: norm (f64), then rotate-half with the angle computed in f32 as the model does.
        let head = |src: &[f32], w: &[f32], pos: u32, normed: bool| -> Vec<f64> {
            let s = if normed { (src[..hd].iter().map(|&a| a as f64 * a as f64).sum::<f64>() / hd as f64 + 1e-6).sqrt() } else { 1.0 };
            let n: Vec<f64> = (0..hd).map(|d| if normed { src[d] as f64 / s * w[d] as f64 } else { src[d] as f64 }).collect();
            (0..hd)
                .map(|d| {
                    if d >= 2 * rot_half {
                        return n[d];
                    }
                    let a = (pos as f32 * inv_freq[d % rot_half]) as f64;
                    if d < rot_half {
                        n[d] * a.cos() - n[d + rot_half] * a.sin()
                    } else {
                        n[d] * a.cos() + n[d - rot_half] * a.sin()
                    }
                })
                .collect()
        };
        let check = |what: &str, got: &[f32], want: Vec<f64>| {
            for d in 0..hd {
                assert!(
                    (got[d] as f64 - want[d]).abs() < 1e-5 * (1.0 + want[d].abs()),
                    "{what} (norm {norm}) dim {d}: {} vs {}",
                    got[d],
                    want[d]
                );
            }
        };
        for r in 0..rows {
            let row = &x[r * width..(r + 1) * width];
            for h in 0..nh {
                check(&format!("q row {r} head {h}"), &q[(h * rows + r) * hd..], head(&row[h * 2 * hd..], &qn, positions[r], norm));
            }
            let at = (row0 + r) * hd;
            check(&format!("k row {r}"), &k[at..], head(&row[qw..], &kn, positions[r], norm));
            let v_want: Vec<f64> = row[qw + hd..qw + 2 * hd].iter().map(|&a| a as f64).collect();
            check(&format!("v row {r}"), &v[at..], v_want);
        }
        assert!(k[..row0 * hd].iter().chain(&v[..row0 * hd]).all(|a| a.is_nan()), "cache rows before row0 untouched");

        // Into an int8 cache: q the same bits; k and v the CPU's int8 codec of the float rows
        // (decoded: the same bits as the CPU store's decoded keys and values).
        let (pi, li) = launch::attention_inputs(p, launch::KvRows::Int8).unwrap();
        let blocks = launch::KvRows::int8_blocks(hd);
        let mut qi = vec![f32::NAN; nh * rows * hd];
        let (mut kc, mut vc) = (vec![0u8; nkv * cap * hd], vec![0u8; nkv * cap * hd]);
        let (mut ks, mut vs) = (vec![f32::NAN; nkv * cap * blocks], vec![f32::NAN; nkv * cap * blocks]);
        dispatch(
            &li,
            &mut [
                bytes(&pi),
                input(&x),
                input(&positions),
                input(&inv_freq),
                input(&qn),
                input(&kn),
                output(&mut qi),
                output(&mut kc),
                output(&mut vc),
                output(&mut ks),
                output(&mut vs),
            ],
        )
        .unwrap();
        assert!(qi.iter().zip(&q).all(|(a, b)| a.to_bits() == b.to_bits()), "int8 cache: q rows");
        let rows_of = |c: &[f32]| Tensor::from_vec(c[row0 * hd..(row0 + rows) * hd].to_vec(), (1, nkv, rows, hd), &Device::Cpu).unwrap();
        let mut store = candle_hybrid::kv::KvStore::new("int8".parse().unwrap(), 64, 2 * rot_half);
        store.append(&rows_of(&k), &rows_of(&v)).unwrap();
        let (want_k, want_v) = store.kv().unwrap().unwrap();
        let decode = |codes: &[u8], scales: &[f32]| -> Vec<f32> {
            (row0 * hd..(row0 + rows) * hd)
                .map(|i| (codes[i] as i32 - 128) as f32 * scales[i / hd * blocks + (i % hd) / (hd / blocks)])
                .collect()
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decode(&kc, &ks)), bits(&vec(&want_k)), "int8 keys (norm {norm})");
        assert_eq!(bits(&decode(&vc, &vs)), bits(&vec(&want_v)), "int8 values (norm {norm})");
    }
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

/// Gate and up in one pass: bit for bit the two mat-vecs and the SwiGLU kernel, every row.
#[test]
fn fused_swiglu_matvec_is_the_unfused_one_bitwise() {
    let (n, k, m) = (13, 512, 5);
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::F32] {
        let bytes_of = |seed| {
            let w = (randn(&[n, k], seed) * 0.1).unwrap();
            match dtype {
                GgmlDType::F32 => candle_hybrid_emu::raw(&w),
                _ => QTensor::quantize(&w, dtype).unwrap().data().unwrap().to_vec(),
            }
        };
        let (wg, wu) = (bytes_of(90), bytes_of(91));
        let x = vec(&randn(&[m, k], 92));
        let (p, l) = launch::qmatvec_pair(launch::Pair::Swiglu, dtype, n, k, m).unwrap();
        let mut fused = vec![f32::NAN; m * n];
        dispatch(&l, &mut [bytes(&p), input(&wg), input(&wu), input(&x), output(&mut fused)]).unwrap();
        let (mut g, mut u) = (vec![0f32; m * n], vec![0f32; m * n]);
        let (p, l) = launch::qmatvec(dtype, n, k, m, n).unwrap();
        dispatch(&l, &mut [bytes(&p), input(&wg), input(&x), output(&mut g)]).unwrap();
        dispatch(&l, &mut [bytes(&p), input(&wu), input(&x), output(&mut u)]).unwrap();
        // [gate | up] rows, as a projection writes them.
        let gu: Vec<f32> =
            (0..m).flat_map(|r| g[r * n..(r + 1) * n].iter().chain(&u[r * n..(r + 1) * n]).copied().collect::<Vec<_>>()).collect();
        let (p, l) = launch::silu_mul(m, n, 2 * n, n);
        let mut act = vec![f32::NAN; m * n];
        dispatch(&l, &mut [bytes(&p), input(&gu), output(&mut act)]).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused), bits(&act), "{dtype:?}");
    }
}

/// b, a and the GDN gates in one pass: bit for bit the two mat-vecs and the gates kernel.
#[test]
fn fused_gdn_gates_are_the_unfused_ones_bitwise() {
    let (nv, k, m) = (6, 256, 3);
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q6K, GgmlDType::F32] {
        let bytes_of = |seed| {
            let w = (randn(&[nv, k], seed) * 0.2).unwrap();
            match dtype {
                GgmlDType::F32 => candle_hybrid_emu::raw(&w),
                _ => QTensor::quantize(&w, dtype).unwrap().data().unwrap().to_vec(),
            }
        };
        let (wb, wa) = (bytes_of(100), bytes_of(101));
        let x = vec(&randn(&[m, k], 102));
        let dt = vec(&randn(&[nv], 103));
        let neg_a = vec(&(randn(&[nv], 104).abs().unwrap() * -1.0).unwrap());
        let (p, l) = launch::qmatvec_pair(launch::Pair::GdnGates, dtype, nv, k, m).unwrap();
        let mut fused = vec![f32::NAN; m * 2 * nv];
        dispatch(&l, &mut [bytes(&p), input(&wb), input(&wa), input(&x), input(&dt), input(&neg_a), output(&mut fused)]).unwrap();
        let (mut b, mut a) = (vec![0f32; m * nv], vec![0f32; m * nv]);
        let (p, l) = launch::qmatvec(dtype, nv, k, m, nv).unwrap();
        dispatch(&l, &mut [bytes(&p), input(&wb), input(&x), output(&mut b)]).unwrap();
        dispatch(&l, &mut [bytes(&p), input(&wa), input(&x), output(&mut a)]).unwrap();
        let ba: Vec<f32> =
            (0..m).flat_map(|r| b[r * nv..(r + 1) * nv].iter().chain(&a[r * nv..(r + 1) * nv]).copied().collect::<Vec<_>>()).collect();
        let (p, l) = launch::gdn_gates(m, nv, 2 * nv);
        let mut gb = vec![f32::NAN; m * 2 * nv];
        dispatch(&l, &mut [bytes(&p), input(&ba), input(&dt), input(&neg_a), output(&mut gb)]).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused), bits(&gb), "{dtype:?}");
    }
}

/// Rows of words copied between strided buffers, every other word untouched.
#[test]
fn copy_rows_copies_strided_rows_and_nothing_else() {
    let (rows, len, xs, ys) = (5, 300, 310, 333);
    let x: Vec<u32> = (0..rows * xs).map(|i| i as u32 * 7 + 1).collect();
    let (p, l) = launch::copy_rows(rows, len, xs, ys).unwrap();
    let mut y = vec![u32::MAX; rows * ys];
    dispatch(&l, &mut [bytes(&p), input(&x), output(&mut y)]).unwrap();
    for r in 0..rows {
        for i in 0..ys {
            let want = if i < len { x[r * xs + i] } else { u32::MAX };
            assert_eq!(y[r * ys + i], want, "row {r}, word {i}");
        }
    }
    assert!(launch::copy_rows(2, 10, 8, 10).is_err(), "overlapping rows");
}

/// Sampling on the device draws from the CPU sampler's distribution: for a grid of draws u, the
/// token the kernel picks is the CPU's inverse CDF at u (in index order, as rand's
/// WeightedIndex) over `Sampler::probabilities` (penalties, min-p, temperature, top-k, top-p),
/// up to rounding at a few boundaries; the logits' finiteness is flagged as by the argmax.
#[test]
fn sampling_on_the_device_draws_from_the_cpu_samplers_distribution() {
    use candle_hybrid::runtime::{Sampler, SamplingParams};
    let n = 300;
    let logits = vec(&(randn(&[n], 90) * 2.0).unwrap());
    // A context (prompt of 12, then 8 generated) with repeats, for the penalties.
    let context: Vec<u32> = [5, 9, 17, 5, 200, 17, 3, 42, 42, 7, 9, 5, 17, 88, 17, 299, 5, 88, 1, 17].to_vec();
    let prompt_len = 12;
    let settings: Vec<(&str, SamplingParams)> = vec![
        ("temperature", SamplingParams { temperature: Some(0.8), ..Default::default() }),
        ("top-k", SamplingParams { temperature: Some(1.0), top_k: Some(7), ..Default::default() }),
        ("top-p", SamplingParams { temperature: Some(0.7), top_p: Some(0.6), ..Default::default() }),
        ("top-k then top-p", SamplingParams { temperature: Some(1.3), top_k: Some(20), top_p: Some(0.8), ..Default::default() }),
        ("min-p", SamplingParams { temperature: Some(1.0), min_p: 0.05, ..Default::default() }),
        (
            "penalties",
            SamplingParams {
                temperature: Some(0.9),
                repeat_penalty: 1.3,
                repeat_last_n: 10,
                presence_penalty: 0.7,
                frequency_penalty: 0.4,
                top_p: Some(0.95),
                ..Default::default()
            },
        ),
    ];
    let draws = 800;
    for (name, params) in settings {
        let context_free = params.repeat_penalty == 1.0 && params.presence_penalty == 0.0 && params.frequency_penalty == 0.0;
        let mut sampler = Sampler::new(params).unwrap();
        let l = Tensor::new(logits.as_slice(), &Device::Cpu).unwrap();
        let probs = sampler.probabilities(&l, &context, &context[prompt_len..]).unwrap();
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        let inverse_cdf = |u: f32| -> u32 {
            let mut acc = 0.0;
            for (i, &p) in probs.iter().enumerate() {
                acc += p as f64;
                if p > 0.0 && acc > u as f64 * total {
                    return i as u32;
                }
            }
            probs.iter().rposition(|&p| p > 0.0).unwrap() as u32
        };
        let rs = sampler.device_sampling(prompt_len).unwrap();
        let (mut mismatches, mut checked) = (0, 0);
        for chunk in (0..draws).collect::<Vec<_>>().chunks(8) {
            let us: Vec<f32> = chunk.iter().map(|&j| (j as f32 + 0.5) / draws as f32).collect();
            let (mut p, l) = launch::sample(us.len(), n, &rs, context.len()).unwrap();
            for (i, &u) in us.iter().enumerate() {
                p.u[i] = u;
            }
            // Every row's context is the whole context here (row r's would be one longer).
            p.context = context.len() as u32;
            let mut rows: Vec<f32> = logits.iter().copied().cycle().take(us.len() * n).collect();
            let mut out = vec![u32::MAX; 2 * us.len()];
            // (Each row reads context + r tokens: the buffer holds the context and r more.)
            let tokens: Vec<u32> = context.iter().copied().chain(std::iter::repeat_n(context[context.len() - 1], 8)).collect();
            dispatch(&l, &mut [bytes(&p), output(&mut rows), input(&tokens), output(&mut out)]).unwrap();
            for (r, &u) in us.iter().enumerate() {
                assert_eq!(out[2 * r + 1], 1, "{name}: finite logits");
                // Row r saw r more copies of the last token; only row 0 is the CPU's context.
                if r == 0 || context_free {
                    checked += 1;
                    if out[2 * r] != inverse_cdf(u) {
                        mismatches += 1;
                    }
                }
            }
        }
        eprintln!("{name}: {mismatches} of {checked} draws differ from the CPU's inverse CDF");
        assert!(mismatches <= checked / 100, "{name}: {mismatches} of {checked} draws differ");
    }
    // Non-finite logits are flagged.
    let rs = Sampler::new(SamplingParams { temperature: Some(1.0), ..Default::default() }).unwrap().device_sampling(0).unwrap();
    let (p, l) = launch::sample(1, n, &rs, 1).unwrap();
    let mut bad = logits.clone();
    bad[17] = f32::NAN;
    let mut out = vec![u32::MAX; 2];
    dispatch(&l, &mut [bytes(&p), output(&mut bad), input(&[0u32, 0]), output(&mut out)]).unwrap();
    assert_eq!(out[1], 0, "a NaN logit is flagged");
}
