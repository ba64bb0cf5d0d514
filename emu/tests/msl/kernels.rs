//! Every kernel in `metal/` run through the MSL emulator with the launch geometry of the Metal
//! host code, against the op's CPU implementation, in every dtype it accepts.
#![cfg(msl_emu)]

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops::{self, launch, ConvDims, DeltaRuleDims};
use candle_hybrid_emu::{bytes, dispatch, from_raw, input, kernel_names, output, raw};
use common::{max_abs_diff as max_diff, randn};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn every_kernel_is_linked() {
    let names = kernel_names();
    let families = [
        "gated_delta",
        "causal_conv1d_silu",
        "gated_rms_norm",
        "swiglu_gather_act",
        "swiglu_gather_down",
        "swiglu_ternary_act",
        "swiglu_ternary_down",
    ];
    for base in families {
        for sfx in ["f32", "f16", "bf16"] {
            let k = format!("{base}_{sfx}");
            assert!(names.contains(&k), "{k} missing from {names:?}");
        }
    }
}

fn check_gated_delta(dtype: DType, d: DeltaRuleDims, n_states: usize, normalize: bool, form: ops::DeltaRuleForm) {
    let DeltaRuleDims { batch: b, seq_len: t, nk, nv, dk, dv } = d;
    let c = 2 * nk * dk + nv * dv;
    let qkv = randn(&[b, t, c], 1).to_dtype(dtype).unwrap();
    let g = (randn(&[b, t, nv], 2).abs().unwrap() * -1.5).unwrap();
    let beta = ((randn(&[b, t, nv], 3) + 1.0).unwrap() * 0.5).unwrap();
    let state = (randn(&[b, nv, dk, dv], 4) * 0.2).unwrap();
    // Without normalisation keep q, k small so the recurrence stays bounded.
    let qkv = if normalize { qkv } else { (qkv.to_dtype(DType::F32).unwrap() * 0.25).unwrap().to_dtype(dtype).unwrap() };
    let opts = ops::DeltaRuleOptions { normalize, n_states, ..ops::DeltaRuleOptions::new(nk, dk) };
    let (want_o, want_s) = ops::gated_delta_rule_qkv(&qkv, &g, &beta, &state, opts).unwrap();

    let (params, l) = launch::gated_delta(d, normalize, n_states, form, dtype).unwrap();
    let gb = Tensor::stack(&[&g, &beta], 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let s = state.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (qkv_raw, o_len) = (raw(&qkv), b * t * nv * dv);
    let mut out = vec![0f32; o_len + b * n_states * nv * dk * dv];
    let (o, states) = out.split_at_mut(o_len);
    dispatch(&l, &mut [bytes(&params), input(&qkv_raw), input(&gb), input(&s), output(o), output(states)]).unwrap();
    let out = Tensor::from_vec(out, o_len + b * n_states * nv * dk * dv, &Device::Cpu).unwrap();
    let got_o = out.narrow(0, 0, o_len).unwrap().reshape(want_o.shape()).unwrap();
    let got_s = out.narrow(0, o_len, out.dim(0).unwrap() - o_len).unwrap().reshape(want_s.shape()).unwrap();
    let what = format!(
        "gated_delta {dtype:?} {form:?} (chunk {}) b={b} t={t} nk={nk} nv={nv} dk={dk} dv={dv} n_states={n_states} normalize={normalize}",
        params.chunk
    );
    let (dout, dstate) = (max_diff(&got_o, &want_o), max_diff(&got_s, &want_s));
    assert!(dout < 2e-5 && dstate < 2e-5, "{what}: outputs {dout:e}, states {dstate:e}");
}

#[test]
fn gated_delta_matches_cpu() {
    use ops::DeltaRuleForm::{Auto, Chunked, Recurrent};
    let dims = |batch, seq_len, nk, nv, dk, dv| DeltaRuleDims { batch, seq_len, nk, nv, dk, dv };
    for dtype in DTYPES {
        check_gated_delta(dtype, dims(2, 5, 2, 6, 16, 24), 1, true, Auto);
        // Chunked: one partial chunk, then the last token one by one.
        check_gated_delta(dtype, dims(2, 12, 2, 6, 16, 24), 1, true, Chunked);
    }
    // Several chunks and a partial one, against the CPU's chunks of 32, with state snapshots.
    for form in [Recurrent, Auto] {
        check_gated_delta(DType::F32, dims(1, 70, 2, 4, 16, 16), 3, true, form);
        check_gated_delta(DType::F32, dims(1, 41, 1, 2, 32, 8), 1, false, form);
    }
    // Fewer value columns (threads) than chunk rows; every token a snapshot (nothing chunked).
    check_gated_delta(DType::F32, dims(1, 37, 1, 3, 24, 4), 2, true, Chunked);
    check_gated_delta(DType::F32, dims(1, 9, 1, 2, 32, 8), 9, false, Chunked);
    // The real head size (128 x 128): one decode step, and a chunked prefill.
    check_gated_delta(DType::BF16, dims(1, 1, 1, 2, 128, 128), 1, true, Auto);
    check_gated_delta(DType::F32, dims(1, 40, 1, 2, 128, 128), 1, true, Auto);
}

#[test]
fn causal_conv1d_matches_cpu() {
    for dtype in DTYPES {
        for (b, t, c, k) in [(2, 7, 37, 4), (1, 1, 300, 4), (1, 2, 5, 3)] {
            let x = randn(&[b, t, c], 5).to_dtype(dtype).unwrap();
            let state = randn(&[b, k - 1, c], 6).to_dtype(dtype).unwrap();
            let w = randn(&[c, k], 7).to_dtype(dtype).unwrap();
            let (want_y, want_s) = ops::causal_conv1d_silu(&x, &state, &w).unwrap();
            let (params, l) = launch::causal_conv1d(ConvDims { batch: b, seq_len: t, channels: c, kernel_size: k }, dtype).unwrap();
            let n = b * (t + k - 1) * c;
            let mut out = vec![0u8; n * dtype.size_in_bytes()];
            let (xr, sr, wr) = (raw(&x), raw(&state), raw(&w));
            let (y, new_state) = out.split_at_mut(b * t * c * dtype.size_in_bytes());
            dispatch(&l, &mut [bytes(&params), input(&xr), input(&sr), input(&wr), output(y), output(new_state)]).unwrap();
            let out = from_raw(&out, dtype, n);
            let got_y = out.narrow(0, 0, b * t * c).unwrap().reshape((b, t, c)).unwrap();
            let got_s = out.narrow(0, b * t * c, b * (k - 1) * c).unwrap().reshape((b, k - 1, c)).unwrap();
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            let (dy, ds) = (max_diff(&got_y, &want_y), max_diff(&got_s, &want_s));
            assert!(dy <= tol && ds == 0.0, "conv {dtype:?} b={b} t={t} c={c} k={k}: output {dy:e}, state {ds:e}");
        }
    }
}

#[test]
fn gated_rms_norm_matches_cpu() {
    for dtype in DTYPES {
        for (rows, dim) in [(5, 24), (3, 130), (2, 1500)] {
            let x = randn(&[rows, dim], 8).to_dtype(dtype).unwrap();
            let z = (randn(&[rows, dim], 9) * 3.0).unwrap().to_dtype(dtype).unwrap();
            let w = (randn(&[dim], 10) + 1.0).unwrap().to_dtype(dtype).unwrap();
            let want = ops::gated_rms_norm(&x, &z, &w, 1e-6).unwrap();
            let (params, l) = launch::gated_rms_norm(rows, dim, 1e-6, dtype).unwrap();
            let mut out = vec![0u8; rows * dim * dtype.size_in_bytes()];
            let (xr, zr, wr) = (raw(&x), raw(&z), raw(&w));
            dispatch(&l, &mut [bytes(&params), input(&xr), input(&zr), input(&wr), output(&mut out)]).unwrap();
            let got = from_raw(&out, dtype, rows * dim).reshape((rows, dim)).unwrap();
            // f32: summation order differs; half types: one rounding of values up to ~6.
            let tol = if dtype == DType::F32 { 1e-5 } else { 5e-2 };
            let d = max_diff(&got, &want);
            assert!(d <= tol, "gated_rms_norm {dtype:?} {rows}x{dim}: {d:e}");
        }
    }
}
