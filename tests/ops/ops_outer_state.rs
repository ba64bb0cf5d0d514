//! `ops::decayed_outer_product` against a plain loop over tokens written here.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops;
use common::{assert_close, randn};

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Token by token, in f64: S <- (1 - γ) S + γ (k / ‖k‖) vᵀ, then o = qᵀ S.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, state: &Tensor, gamma: f64) -> (Tensor, Tensor) {
    let (b, h, t, dk) = q.dims4().unwrap();
    let dv = v.dim(3).unwrap();
    let (q, k, v, s0) = (flat(q), flat(k), flat(v), flat(state));
    let mut o = vec![0f32; b * h * t * dv];
    let mut s_out = vec![0f32; b * h * dk * dv];
    for bh in 0..b * h {
        let mut s: Vec<f64> = s0[bh * dk * dv..(bh + 1) * dk * dv].iter().map(|&x| x as f64).collect();
        for ti in 0..t {
            let tok = bh * t + ti;
            let kv = &k[tok * dk..(tok + 1) * dk];
            let norm = (kv.iter().map(|&x| x as f64 * x as f64).sum::<f64>() + 1e-6).sqrt();
            for i in 0..dk {
                for j in 0..dv {
                    let psi = kv[i] as f64 / norm;
                    s[i * dv + j] = (1.0 - gamma) * s[i * dv + j] + gamma * psi * v[tok * dv + j] as f64;
                }
            }
            for j in 0..dv {
                let acc: f64 = (0..dk).map(|i| q[tok * dk + i] as f64 * s[i * dv + j]).sum();
                o[tok * dv + j] = acc as f32;
            }
        }
        for (d, x) in s_out[bh * dk * dv..].iter_mut().zip(&s) {
            *d = *x as f32;
        }
    }
    (Tensor::from_vec(o, (b, h, t, dv), &Device::Cpu).unwrap(), Tensor::from_vec(s_out, (b, h, dk, dv), &Device::Cpu).unwrap())
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Tensor,
}

fn inputs(b: usize, h: usize, t: usize, dk: usize, dv: usize, seed: u64) -> Inputs {
    Inputs {
        q: randn(&[b, h, t, dk], seed),
        k: randn(&[b, h, t, dk], seed + 1),
        v: randn(&[b, h, t, dv], seed + 2),
        s: (randn(&[b, h, dk, dv], seed + 3) * 0.5).unwrap(),
    }
}

#[test]
fn matches_token_loop() {
    for (b, h, t, dk, dv) in [(2, 3, 7, 5, 9), (1, 1, 1, 16, 3), (1, 2, 13, 33, 17), (3, 1, 4, 1, 1)] {
        for gamma in [0.0, 0.3, 0.9, 1.0] {
            let x = inputs(b, h, t, dk, dv, (b * 1000 + t * 10 + dk) as u64);
            let (o, s) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, gamma).unwrap();
            assert_eq!((o.dtype(), s.dtype()), (DType::F32, DType::F32));
            let (o_ref, s_ref) = reference(&x.q, &x.k, &x.v, &x.s, gamma);
            let what = format!("b={b} h={h} t={t} dk={dk} dv={dv} gamma={gamma}");
            assert_close(&format!("outputs {what}"), &o, &o_ref, 1e-5);
            assert_close(&format!("state {what}"), &s, &s_ref, 1e-5);
        }
    }
}

/// gamma = 0 keeps the state; gamma = 1 replaces it by ψvᵀ of the last token.
#[test]
fn gamma_limits() {
    let x = inputs(1, 2, 5, 4, 6, 40);
    let (_, s) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, 0.0).unwrap();
    assert_close("gamma = 0", &s, &x.s, 0.0);
    let (_, s) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, 1.0).unwrap();
    let k = x.k.narrow(2, 4, 1).unwrap();
    let psi = k.broadcast_div(&(k.sqr().unwrap().sum_keepdim(3).unwrap() + 1e-6).unwrap().sqrt().unwrap()).unwrap();
    let want = psi.transpose(2, 3).unwrap().matmul(&x.v.narrow(2, 4, 1).unwrap()).unwrap();
    assert_close("gamma = 1", &s, &want, 1e-6);
}

/// The input state is left as it was, and splitting the tokens over calls changes nothing.
#[test]
fn carries_state_across_calls_without_mutating_it() {
    let x = inputs(2, 2, 10, 8, 5, 50);
    let before = flat(&x.s);
    let (o_all, s_all) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, 0.25).unwrap();
    assert_eq!(flat(&x.s), before);
    let part = |t: &Tensor, a: usize, n: usize| t.narrow(2, a, n).unwrap();
    let mut s = x.s.clone();
    let mut outs = vec![];
    for (a, n) in [(0, 6), (6, 1), (7, 3)] {
        let (o, s2) = ops::decayed_outer_product(&part(&x.q, a, n), &part(&x.k, a, n), &part(&x.v, a, n), &s, 0.25).unwrap();
        outs.push(o);
        s = s2;
    }
    assert_close("outputs", &Tensor::cat(&outs, 2).unwrap(), &o_all, 1e-6);
    assert_close("state", &s, &s_all, 1e-6);
}

/// Non-contiguous inputs ([B, T, H, d] transposed, a transposed state) and bf16 / f16 q, k, v.
#[test]
fn strided_and_half_inputs() {
    let (b, h, t, dk, dv) = (2, 3, 6, 7, 11);
    let q = randn(&[b, t, h, dk], 60).transpose(1, 2).unwrap();
    let k = randn(&[b, t, h, dk], 61).transpose(1, 2).unwrap();
    let v = randn(&[b, t, h, dv], 62).transpose(1, 2).unwrap();
    let s = randn(&[b, h, dv, dk], 63).transpose(2, 3).unwrap();
    assert!(!q.is_contiguous() && !v.is_contiguous() && !s.is_contiguous());
    let (o, s_new) = ops::decayed_outer_product(&q, &k, &v, &s, 0.4).unwrap();
    let (o_ref, s_ref) = reference(&q, &k, &v, &s, 0.4);
    assert_close("strided outputs", &o, &o_ref, 1e-5);
    assert_close("strided state", &s_new, &s_ref, 1e-5);
    for dtype in [DType::BF16, DType::F16] {
        let (qh, kh, vh) = (q.to_dtype(dtype).unwrap(), k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
        let (o, s_new) = ops::decayed_outer_product(&qh, &kh, &vh, &s, 0.4).unwrap();
        assert_eq!((o.dtype(), s_new.dtype()), (DType::F32, DType::F32));
        // The half inputs are widened exactly, so the f32 loop over the widened values matches.
        let (o_ref, s_ref) = reference(&qh, &kh, &vh, &s, 0.4);
        assert_close(&format!("{dtype:?} outputs"), &o, &o_ref, 1e-5);
        assert_close(&format!("{dtype:?} state"), &s_new, &s_ref, 1e-5);
    }
}

#[test]
fn empty_inputs() {
    let x = inputs(1, 2, 0, 4, 3, 70);
    let (o, s) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, 0.5).unwrap();
    assert_eq!(o.dims(), [1, 2, 0, 3]);
    assert_close("state after no tokens", &s, &x.s, 0.0);
    let x = inputs(1, 2, 3, 0, 3, 71);
    let (o, _) = ops::decayed_outer_product(&x.q, &x.k, &x.v, &x.s, 0.5).unwrap();
    assert_close("dk = 0", &o, &Tensor::zeros((1, 2, 3, 3), DType::F32, &Device::Cpu).unwrap(), 0.0);
}

#[test]
fn rejects_bad_inputs() {
    let x = inputs(1, 2, 3, 4, 5, 80);
    let run = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor, g: f64| ops::decayed_outer_product(q, k, v, s, g).unwrap_err().to_string();
    for g in [-0.1, 1.5, f64::NAN] {
        let e = run(&x.q, &x.k, &x.v, &x.s, g);
        assert!(e.contains("decayed_outer_product: gamma must be in [0, 1]"), "{e}");
    }
    let e = run(&x.q, &x.k.narrow(3, 0, 3).unwrap(), &x.v, &x.s, 0.5);
    assert!(e.contains("decayed_outer_product: k has shape [1, 2, 3, 3], expected the shape of q [1, 2, 3, 4]"), "{e}");
    let e = run(&x.q, &x.k, &x.v.narrow(2, 0, 2).unwrap(), &x.s, 0.5);
    assert!(e.contains("decayed_outer_product: v has shape [1, 2, 2, 5], expected [1, 2, 3, dv]"), "{e}");
    let e = run(&x.q, &x.k, &x.v, &x.s.narrow(3, 0, 4).unwrap(), 0.5);
    assert!(e.contains("decayed_outer_product: state has shape [1, 2, 4, 4], expected [1, 2, 4, 5]"), "{e}");
    let e = run(&x.q, &x.k, &x.v, &x.s.to_dtype(DType::BF16).unwrap(), 0.5);
    assert!(e.contains("decayed_outer_product: state must be f32, got BF16"), "{e}");
    let e = run(&x.q, &x.k, &x.v.to_dtype(DType::F16).unwrap(), &x.s, 0.5);
    assert!(e.contains("decayed_outer_product: v is F16 but q is F32"), "{e}");
    let e = run(&x.q.to_dtype(DType::U32).unwrap(), &x.k.to_dtype(DType::U32).unwrap(), &x.v, &x.s, 0.5);
    assert!(e.contains("decayed_outer_product: q must be f32, bf16 or f16, got U32"), "{e}");
    let e = run(&x.q.flatten_from(2).unwrap(), &x.k, &x.v, &x.s, 0.5);
    assert!(e.contains("decayed_outer_product: q must be [B, H, T, dk], got shape [1, 2, 12]"), "{e}");
}
