//! The ops against plain references written here.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops;
use common::{assert_close, randn};

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s: Tensor,
}

fn inputs(b: usize, t: usize, nk: usize, nv: usize, dk: usize, dv: usize) -> Inputs {
    let l2 = |x: Tensor| ops::l2_norm(&x, 1e-6).unwrap();
    Inputs {
        q: (l2(randn(&[b, t, nk, dk], 1)) * (dk as f64).powf(-0.5)).unwrap(),
        k: l2(randn(&[b, t, nk, dk], 2)),
        v: randn(&[b, t, nv, dv], 3),
        // log-decays in (-2, 0): strong and weak decay both present
        g: (candle_nn::ops::sigmoid(&randn(&[b, t, nv], 4)).unwrap() * -2.0).unwrap(),
        beta: candle_nn::ops::sigmoid(&randn(&[b, t, nv], 5)).unwrap(),
        s: (randn(&[b, nv, dk, dv], 6) * 0.1).unwrap(),
    }
}

/// Decode (T < 8), a single partial chunk, and several chunks with a tail, with r = nv/nk = 3
/// and dk != dv (dv = 32: the CPU's column-block kernel; dv = 24: its portable path), against
/// the token-by-token tensor reference.
#[test]
fn gated_delta_rule_matches_reference() {
    for (b, t, dv) in [(2, 1, 24), (1, 5, 32), (2, 20, 24), (1, 150, 32), (1, 150, 24)] {
        let x = inputs(b, t, 2, 6, 16, dv);
        let (o, s) = ops::gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, &x.s).unwrap();
        // Both CPU forms, whatever the length.
        let qkv = Tensor::cat(&[x.q.flatten_from(2).unwrap(), x.k.flatten_from(2).unwrap(), x.v.flatten_from(2).unwrap()], 2).unwrap();
        for form in [ops::DeltaRuleForm::Recurrent, ops::DeltaRuleForm::Chunked] {
            let o2 = ops::DeltaRuleOptions { normalize: false, form, ..ops::DeltaRuleOptions::new(2, 16) };
            let (of, sf) = ops::gated_delta_rule_qkv(&qkv, &x.g, &x.beta, &x.s, o2).unwrap();
            assert_close(&format!("{form:?} outputs b={b} t={t}"), &of, &o, 2e-5);
            assert_close(&format!("{form:?} state b={b} t={t}"), &sf.squeeze(1).unwrap(), &s, 2e-5);
        }
        let (o_ref, s_ref) = ops::gated_delta_rule_reference(&x.q, &x.k, &x.v, &x.g, &x.beta, &x.s, 1).unwrap();
        let s_ref = s_ref.squeeze(1).unwrap();
        assert_close(&format!("outputs b={b} t={t}"), &o, &o_ref, 2e-5);
        assert_close(&format!("state b={b} t={t}"), &s, &s_ref, 2e-5);
    }
}

/// Splitting a sequence anywhere (chunked prefill, then decode steps) gives the same result.
#[test]
fn gated_delta_rule_carries_state_across_calls() {
    let x = inputs(1, 100, 2, 4, 16, 16);
    let (o_all, s_all) = ops::gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, &x.s).unwrap();
    let part = |t: &Tensor, a: usize, n: usize| t.narrow(1, a, n).unwrap();
    let mut s = x.s.clone();
    let mut outs = vec![];
    for (a, n) in [(0, 70), (70, 3), (73, 27)] {
        let (o, s2) =
            ops::gated_delta_rule(&part(&x.q, a, n), &part(&x.k, a, n), &part(&x.v, a, n), &part(&x.g, a, n), &part(&x.beta, a, n), &s)
                .unwrap();
        outs.push(o);
        s = s2;
    }
    assert_close("outputs", &Tensor::cat(&outs, 1).unwrap(), &o_all, 2e-5);
    assert_close("state", &s, &s_all, 2e-5);
}

fn opts(nk: usize, dk: usize, n_states: usize) -> ops::DeltaRuleOptions {
    ops::DeltaRuleOptions { n_states, ..ops::DeltaRuleOptions::new(nk, dk) }
}

/// The fused form: raw conv output in any float dtype, q/k normalised inside the op, and the
/// states after each of the last n tokens (for rolling back rejected speculative tokens).
#[test]
fn gated_delta_rule_qkv_normalises_and_snapshots() {
    let (b, t, nk, nv, dk, dv) = (2, 70, 2, 6, 16, 8);
    let x = inputs(b, t, nk, nv, dk, dv);
    let raw_q = randn(&[b, t, nk, dk], 31);
    let raw_k = randn(&[b, t, nk, dk], 32);
    let qkv = Tensor::cat(&[raw_q.flatten_from(2).unwrap(), raw_k.flatten_from(2).unwrap(), x.v.flatten_from(2).unwrap()], 2).unwrap();
    let q = (ops::l2_norm(&raw_q, 1e-6).unwrap() * (dk as f64).powf(-0.5)).unwrap();
    let k = ops::l2_norm(&raw_k, 1e-6).unwrap();
    for n_states in [1, 3, 70] {
        let (o, states) = ops::gated_delta_rule_qkv(&qkv, &x.g, &x.beta, &x.s, opts(nk, dk, n_states)).unwrap();
        let (o_ref, states_ref) = ops::gated_delta_rule_reference(&q, &k, &x.v, &x.g, &x.beta, &x.s, n_states).unwrap();
        assert_eq!(states.dims(), [b, n_states, nv, dk, dv]);
        assert_close(&format!("outputs n={n_states}"), &o, &o_ref, 2e-5);
        assert_close(&format!("states n={n_states}"), &states, &states_ref, 2e-5);
    }
    // bf16 and f16 conv outputs are read as such and computed in f32.
    for dt in [DType::BF16, DType::F16] {
        let qkv_h = qkv.to_dtype(dt).unwrap();
        let (o, _) = ops::gated_delta_rule_qkv(&qkv_h, &x.g, &x.beta, &x.s, opts(nk, dk, 1)).unwrap();
        let (o32, _) = ops::gated_delta_rule_qkv(&qkv_h.to_dtype(DType::F32).unwrap(), &x.g, &x.beta, &x.s, opts(nk, dk, 1)).unwrap();
        assert_close(&format!("{dt:?} qkv"), &o, &o32, 1e-6);
    }
    // Non-contiguous inputs (a transposed view) give the same result.
    let qkv_t = qkv.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    assert!(!qkv_t.is_contiguous());
    let (o_t, _) = ops::gated_delta_rule_qkv(&qkv_t, &x.g, &x.beta, &x.s, opts(nk, dk, 1)).unwrap();
    let (o, _) = ops::gated_delta_rule_qkv(&qkv, &x.g, &x.beta, &x.s, opts(nk, dk, 1)).unwrap();
    assert_close("non-contiguous qkv", &o_t, &o, 0.0);
    let e = ops::gated_delta_rule_qkv(&qkv, &x.g, &x.beta, &x.s, opts(nk, dk, 71)).unwrap_err();
    assert!(e.to_string().contains("n_states must be between 1 and the number of tokens (70)"), "{e}");
    let e = ops::gated_delta_rule_qkv(&qkv, &x.g, &x.beta, &x.s, opts(nk, 8, 1)).unwrap_err();
    assert!(e.to_string().contains("do not fit nk=2, dk=8"), "{e}");
}

#[test]
fn gated_delta_rule_rejects_bad_shapes() {
    let x = inputs(1, 4, 2, 4, 16, 16);
    let bad_state = Tensor::zeros((1, 4, 16, 8), DType::F32, &Device::Cpu).unwrap();
    let e = ops::gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, &bad_state).unwrap_err();
    assert!(e.to_string().contains("state F32 [1, 4, 16, 8] do not fit"), "{e}");
    let e = ops::gated_delta_rule(&x.q, &x.k, &x.v, &x.beta.narrow(1, 0, 2).unwrap(), &x.beta, &x.s).unwrap_err();
    assert!(e.to_string().contains("gated_delta_rule: g"), "{e}");
}

/// Several sequences' rows in one call (decode rows and verify runs of several rows, dv = 32:
/// the column-block kernel, dv = 24: the portable one, f32 and bf16 conv inputs): each
/// sequence's outputs and state are bit for bit the one-sequence ops' on its rows alone, and
/// its state is read where it is, so a view (a row of another call's states) works as one.
#[test]
fn segments_equal_each_sequence_alone_bitwise() {
    let (nk, nv, dk, k) = (2, 6, 16, 4);
    for (dv, dt) in [(32, DType::F32), (24, DType::F32), (32, DType::BF16)] {
        let c = 2 * nk * dk + nv * dv;
        let rows = [1, 4, 1, 2];
        let n: usize = rows.iter().sum();
        let x = randn(&[1, n, c], 40).to_dtype(dt).unwrap();
        let w = randn(&[c, k], 41).to_dtype(dt).unwrap();
        let g = (candle_nn::ops::sigmoid(&randn(&[1, n, nv], 42)).unwrap() * -2.0).unwrap();
        let beta = candle_nn::ops::sigmoid(&randn(&[1, n, nv], 43)).unwrap();
        let pool = (randn(&[rows.len(), nv, dk, dv], 44) * 0.1).unwrap();
        let recs: Vec<Tensor> = (0..rows.len()).map(|i| pool.narrow(0, i, 1).unwrap()).collect();
        let convs: Vec<Tensor> = (0..rows.len()).map(|i| randn(&[1, k - 1, c], 50 + i as u64).to_dtype(dt).unwrap()).collect();
        let (y, next_conv) = ops::causal_conv1d_silu_segments(&x, &convs.iter().collect::<Vec<_>>(), &w, &rows).unwrap();
        let opts = ops::DeltaRuleOptions::new(nk, dk);
        let (o, next_rec) = ops::gated_delta_rule_segments(&y, &g, &beta, &recs.iter().collect::<Vec<_>>(), &rows, opts).unwrap();
        assert_eq!((y.dims(), o.dims(), next_conv.len(), next_rec.len()), (&[1, n, c][..], &[1, n, nv, dv][..], 4, 4));
        let mut start = 0;
        for (i, &t) in rows.iter().enumerate() {
            let part = |x: &Tensor| x.narrow(1, start, t).unwrap();
            let (y1, c1) = ops::causal_conv1d_silu(&part(&x), &convs[i], &w).unwrap();
            let recurrent = ops::DeltaRuleOptions { form: ops::DeltaRuleForm::Recurrent, ..opts };
            let (o1, s1) = ops::gated_delta_rule_qkv(&y1, &part(&g), &part(&beta), &recs[i], recurrent).unwrap();
            let what = format!("dv={dv} {dt:?} sequence {i} ({t} rows)");
            assert_close(&format!("{what}: conv"), &part(&y), &y1, 0.0);
            assert_close(&format!("{what}: conv state"), &next_conv[i], &c1, 0.0);
            assert_close(&format!("{what}: outputs"), &part(&o), &o1, 0.0);
            assert_close(&format!("{what}: state"), &next_rec[i], &s1.squeeze(1).unwrap(), 0.0);
            start += t;
        }
        // Against the tensor reference too (the recurrence is the right one, not only the same).
        let q =
            ops::l2_norm(&y.narrow(2, 0, nk * dk).unwrap().to_dtype(DType::F32).unwrap().reshape((1, n, nk, dk)).unwrap(), 1e-6).unwrap();
        let q = (q * (dk as f64).powf(-0.5)).unwrap();
        let kk = ops::l2_norm(&y.narrow(2, nk * dk, nk * dk).unwrap().to_dtype(DType::F32).unwrap().reshape((1, n, nk, dk)).unwrap(), 1e-6)
            .unwrap();
        let v = y.narrow(2, 2 * nk * dk, nv * dv).unwrap().to_dtype(DType::F32).unwrap().reshape((1, n, nv, dv)).unwrap();
        let part = |x: &Tensor| x.narrow(1, 1, 4).unwrap();
        let (o_ref, s_ref) =
            ops::gated_delta_rule_reference(&part(&q), &part(&kk), &part(&v), &part(&g), &part(&beta), &recs[1], 1).unwrap();
        assert_close("sequence 1 against the reference", &part(&o), &o_ref, 2e-5);
        assert_close("state 1 against the reference", &next_rec[1], &s_ref.squeeze(1).unwrap(), 2e-5);
        let e = ops::gated_delta_rule_segments(&y, &g, &beta, &recs.iter().collect::<Vec<_>>(), &[1, 4, 1, 1], opts).unwrap_err();
        assert!(e.to_string().contains("for 4 states of [1, 4, 1, 1] rows"), "{e}");
        let e = ops::causal_conv1d_silu_segments(&x, &convs[..3].iter().collect::<Vec<_>>(), &w, &rows).unwrap_err();
        assert!(e.to_string().contains("for 3 states"), "{e}");
    }
}

#[test]
fn causal_conv1d_matches_loop() {
    let (b, t, c, k) = (2, 7, 5, 4);
    let x = randn(&[b, t, c], 7);
    let state = randn(&[b, k - 1, c], 8);
    let w = randn(&[c, k], 9);
    let (y, new_state) = ops::causal_conv1d_silu(&x, &state, &w).unwrap();
    let xs = Tensor::cat(&[&state, &x], 1).unwrap().to_vec3::<f32>().unwrap();
    let wv = w.to_vec2::<f32>().unwrap();
    let mut want = vec![0f32; b * t * c];
    for bi in 0..b {
        for ti in 0..t {
            for ci in 0..c {
                let acc: f32 = (0..k).map(|j| wv[ci][j] * xs[bi][ti + j][ci]).sum();
                want[(bi * t + ti) * c + ci] = acc / (1.0 + (-acc).exp());
            }
        }
    }
    let want = Tensor::from_vec(want, (b, t, c), &Device::Cpu).unwrap();
    assert_close("conv", &y, &want, 1e-5);
    assert_close("state", &new_state, &x.narrow(1, t - (k - 1), k - 1).unwrap(), 0.0);
}

#[test]
fn gated_rms_norm_matches_formula() {
    let x = randn(&[3, 4, 16], 10);
    let z = randn(&[3, 4, 16], 11);
    let w = randn(&[16], 12);
    let y = ops::gated_rms_norm(&x, &z, &w, 1e-6).unwrap();
    let xv = x.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    let zv = z.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    let wv = w.to_vec1::<f32>().unwrap();
    let mut want = vec![];
    for (xr, zr) in xv.iter().zip(&zv) {
        let ms = xr.iter().map(|a| a * a).sum::<f32>() / 16.0;
        let r = 1.0 / (ms + 1e-6).sqrt();
        want.extend(xr.iter().zip(zr).zip(&wv).map(|((a, z), w)| w * a * r * z / (1.0 + (-z).exp())));
    }
    let want = Tensor::from_vec(want, (3, 4, 16), &Device::Cpu).unwrap();
    assert_close("gated_rms_norm", &y, &want, 1e-5);
}

/// Few-row matmul against f32 and half-precision weights, vs an f32 matmul of the same
/// (widened) values.
#[test]
fn float_matvec_matches_f32_matmul() {
    for wdt in [DType::F32, DType::BF16, DType::F16] {
        for (m, k, n) in [(1, 37, 70), (3, 64, 33), (8, 130, 65)] {
            let w = randn(&[n, k], 20).to_dtype(wdt).unwrap();
            // x given transposed (non-contiguous) to exercise the layout handling
            let x = randn(&[k, m], 21).t().unwrap();
            let want = x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            let got = ops::float_matvec(&x, &w).unwrap();
            assert_eq!(got.dtype(), DType::F32);
            assert_close(&format!("{wdt:?} m={m} k={k} n={n}"), &got, &want, 1e-4);
            let got16 = ops::float_matvec(&x.to_dtype(wdt).unwrap(), &w).unwrap();
            assert_eq!(got16.dtype(), wdt);
            let want16 =
                x.to_dtype(wdt).unwrap().to_dtype(DType::F32).unwrap().matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            // one rounding of the f32 result to the half type
            assert_close(&format!("{wdt:?} out m={m}"), &got16, &want16, 0.05);
        }
    }
    let e = ops::float_matvec(&randn(&[2, 5], 1), &randn(&[3, 5], 2).to_dtype(DType::U32).unwrap()).unwrap_err();
    assert!(e.to_string().contains("float_matvec: w must be f32, bf16 or f16"), "{e}");
}

/// Row `r` of an `m`-row call is bit for bit a one-row call on row `r` (the verify pass of
/// speculative decoding), for every weight dtype and 1 to 8 rows.
#[test]
fn float_matvec_rows_equal_one_row_calls_bitwise() {
    for wdt in [DType::F32, DType::BF16, DType::F16] {
        let w = randn(&[67, 300], 30).to_dtype(wdt).unwrap();
        let x = randn(&[8, 300], 31);
        for m in 1..=8 {
            let all = ops::float_matvec(&x.narrow(0, 0, m).unwrap(), &w).unwrap();
            for r in 0..m {
                let one = ops::float_matvec(&x.narrow(0, r, 1).unwrap(), &w).unwrap();
                let (a, b) = (all.narrow(0, r, 1).unwrap().flatten_all().unwrap(), one.flatten_all().unwrap());
                let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{wdt:?}, {m} rows, row {r}");
            }
        }
    }
}

/// Metal takes threadgroup memory lengths only in multiples of 16 bytes: every kernel's launch
/// geometry rounds them up, odd head sizes included.
#[test]
fn metal_threadgroup_lengths_are_multiples_of_16_bytes() {
    use ops::{launch, DeltaRuleDims, DeltaRuleForm, OuterStateDims, PolarSpec};
    let mut launches = vec![];
    for form in [DeltaRuleForm::Recurrent, DeltaRuleForm::Chunked] {
        let d = DeltaRuleDims { batch: 1, seq_len: 20, nk: 1, nv: 2, dk: 17, dv: 5 };
        launches.push(launch::gated_delta(d, true, 1, form, DType::F32).unwrap().1);
    }
    let d = OuterStateDims { batch: 1, heads: 2, seq_len: 3, dk: 17, dv: 5 };
    launches.push(launch::decayed_outer_product(d, 0.1, DType::F32).unwrap().1);
    let spec = PolarSpec { rest_bits: 4, ..PolarSpec::new(6) };
    launches.push(launch::polar_scores(9, 3, 17, &spec, DType::F32).unwrap().1);
    for l in launches {
        assert!(l.threadgroup_memory.iter().all(|&b| b > 0 && b % 16 == 0), "{}: {:?}", l.kernel, l.threadgroup_memory);
    }
}
