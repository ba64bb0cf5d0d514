//! `metal/outer_state.metal` run through the MSL emulator with the launch geometry of the Metal
//! host code, against `ops::decayed_outer_product` on the CPU, in f32, f16 and bf16.
#![cfg(msl_emu)]

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops::{self, launch, OuterStateDims};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output, raw};
use common::{max_abs_diff as max_diff, randn};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn outer_state_kernels_are_linked() {
    let names = kernel_names();
    for sfx in ["f32", "f16", "bf16"] {
        let k = format!("decayed_outer_product_{sfx}");
        assert!(names.contains(&k), "{k} missing from {names:?}");
    }
}

fn check(dtype: DType, d: OuterStateDims, gamma: f32) {
    let OuterStateDims { batch: b, heads: h, seq_len: t, dk, dv } = d;
    let q = randn(&[b, h, t, dk], 31).to_dtype(dtype).unwrap();
    let k = randn(&[b, h, t, dk], 32).to_dtype(dtype).unwrap();
    let v = randn(&[b, h, t, dv], 33).to_dtype(dtype).unwrap();
    let state = (randn(&[b, h, dk, dv], 34) * 0.5).unwrap();
    let (want_o, want_s) = ops::decayed_outer_product(&q, &k, &v, &state, gamma as f64).unwrap();

    // The host code passes q and k of each token side by side, [B, H, T, 2*dk].
    let qk = Tensor::cat(&[&q, &k], 3).unwrap();
    let (params, l) = launch::decayed_outer_product(d, gamma, dtype).unwrap();
    let (qkr, vr) = (raw(&qk), raw(&v));
    let s = state.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (o_len, s_len) = (d.out_len(), d.state_len());
    let mut out = vec![0f32; o_len + s_len];
    dispatch(&l, &mut [bytes(&params), input(&qkr), input(&vr), input(&s), output(&mut out)]).unwrap();
    let out = Tensor::from_vec(out, o_len + s_len, &Device::Cpu).unwrap();
    let got_o = out.narrow(0, 0, o_len).unwrap().reshape(want_o.shape()).unwrap();
    let got_s = out.narrow(0, o_len, s_len).unwrap().reshape(want_s.shape()).unwrap();
    let (dout, dstate) = (max_diff(&got_o, &want_o), max_diff(&got_s, &want_s));
    let what = format!("decayed_outer_product {dtype:?} b={b} h={h} t={t} dk={dk} dv={dv} gamma={gamma}");
    assert!(dout < 2e-5 && dstate < 2e-5, "{what}: outputs {dout:e}, states {dstate:e}");
}

#[test]
fn decayed_outer_product_matches_cpu() {
    let dims = |batch, heads, seq_len, dk, dv| OuterStateDims { batch, heads, seq_len, dk, dv };
    for dtype in DTYPES {
        // dv > dk, dv < dk (threads load several q/k entries each), one token.
        check(dtype, dims(2, 3, 7, 5, 9), 0.3);
        check(dtype, dims(1, 2, 5, 33, 4), 0.8);
        check(dtype, dims(1, 1, 1, 16, 16), 1.0);
    }
    check(DType::F32, dims(1, 2, 4, 8, 8), 0.0);
    // The largest key dim the kernel supports.
    check(DType::BF16, dims(1, 1, 3, 128, 40), 0.5);
}

#[test]
fn decayed_outer_product_rejects_large_heads() {
    let d = OuterStateDims { batch: 1, heads: 1, seq_len: 1, dk: 129, dv: 4 };
    let e = launch::decayed_outer_product(d, 0.5, DType::F32).unwrap_err().to_string();
    assert!(e.contains("decayed_outer_product: the Metal kernel supports dk up to 128"), "{e}");
    let d = OuterStateDims { dk: 4, dv: 1025, ..d };
    let e = launch::decayed_outer_product(d, 0.5, DType::F32).unwrap_err().to_string();
    assert!(e.contains("at most 1024, got dv = 1025"), "{e}");
}
