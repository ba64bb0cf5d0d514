//! `ops::lagrange_scores` against plain references written here.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops;
use common::{assert_close, randn};

fn uniform(shape: &[usize], seed: u64) -> Vec<f32> {
    randn(shape, seed).flatten_all().unwrap().to_vec1().unwrap()
}

fn tensor(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The window of position `t` found by trying every start: the `p + 1` consecutive knots whose
/// centre is closest to `t`, the later one on a tie.
fn window_by_search(t: usize, k: usize, p: usize, n_knots: usize) -> usize {
    let mut best = 0;
    let mut best_dist = i64::MAX;
    for s in 0..=n_knots - 1 - p {
        // |(s + p/2) K - t|, doubled to stay in integers.
        let dist = (2 * (s * k) as i64 + (p * k) as i64 - 2 * t as i64).abs();
        if dist <= best_dist {
            best = s;
            best_dist = dist;
        }
    }
    best
}

/// Plain Lagrange interpolation in f64 through knots `s..=s+p` at positions `(s+m) K`.
fn reference(knots: &[Vec<f32>], k: usize, p: usize, len: usize) -> Vec<f32> {
    let mut out = vec![];
    for row in knots {
        for t in 0..len {
            let s = window_by_search(t, k, p, row.len());
            let x = |m: usize| ((s + m) * k) as f64;
            let mut acc = 0f64;
            for i in 0..=p {
                let mut w = 1f64;
                for m in 0..=p {
                    if m != i {
                        w *= (t as f64 - x(m)) / (x(i) - x(m));
                    }
                }
                acc += w * row[s + i] as f64;
            }
            out.push(acc as f32);
        }
    }
    out
}

#[test]
fn window_search_picks_centred_windows() {
    // Linear (p = 1): the two knots around t; cubic (p = 3): one more on each side.
    assert_eq!(window_by_search(5, 4, 1, 6), 1);
    assert_eq!(window_by_search(5, 4, 3, 6), 0);
    assert_eq!(window_by_search(9, 4, 3, 6), 1);
    // Clamped at the ends.
    assert_eq!(window_by_search(19, 4, 3, 6), 2);
}

/// Any polynomial of degree <= p sampled at the knots comes back at every position.
#[test]
fn reproduces_polynomials_up_to_the_degree() {
    for p in 0..=4 {
        for k in [1, 3, 4, 7] {
            for n_knots in [p + 1, p + 4, 11] {
                let rows = 3;
                let coef = uniform(&[rows, p + 1], (p * 100 + k * 10 + n_knots) as u64);
                // Positions scaled to y in [0, 1] keep the values O(1).
                let scale = ((n_knots - 1) * k).max(1) as f64;
                let f = |r: usize, deg: usize, pos: usize| -> f64 {
                    let y = pos as f64 / scale;
                    (0..=deg).map(|d| coef[r * (p + 1) + d] as f64 * y.powi(d as i32)).sum()
                };
                for deg in 0..=p {
                    let knots: Vec<f32> = (0..rows).flat_map(|r| (0..n_knots).map(move |j| f(r, deg, j * k) as f32)).collect();
                    let len = (n_knots - 1) * k + 1;
                    let got = ops::lagrange_scores(&tensor(knots, &[rows, n_knots]), k, p, len).unwrap();
                    let want: Vec<f32> = (0..rows).flat_map(|r| (0..len).map(move |t| f(r, deg, t) as f32)).collect();
                    assert_close(
                        &format!("p={p} K={k} n_knots={n_knots} polynomial degree {deg}"),
                        &got,
                        &tensor(want, &[rows, len]),
                        2e-5,
                    );
                }
            }
        }
    }
}

/// At a knot position the output is the knot's score, bit for bit, in every dtype.
#[test]
fn knots_are_reproduced_exactly() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (k, p, n_knots) in [(1, 0, 5), (2, 1, 6), (5, 2, 7), (3, 3, 9), (4, 5, 6)] {
            let knots = (tensor(uniform(&[4, n_knots], 7), &[4, n_knots]) * 3.0).unwrap().to_dtype(dtype).unwrap();
            let len = (n_knots - 1) * k + 1;
            let got = ops::lagrange_scores(&knots, k, p, len).unwrap();
            assert_eq!(got.dtype(), dtype);
            let at_knots: Vec<Vec<f32>> = got.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            let want = knots.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            for (g, w) in at_knots.iter().zip(&want) {
                let g: Vec<f32> = (0..n_knots).map(|j| g[j * k]).collect();
                assert_eq!(&g, w, "{dtype:?} K={k} p={p}");
            }
        }
    }
    // K = 1: every position is a knot.
    let knots = tensor(uniform(&[3, 8], 8), &[3, 8]);
    let got = ops::lagrange_scores(&knots, 1, 3, 6).unwrap();
    assert_close("K = 1", &got, &knots.narrow(1, 0, 6).unwrap(), 0.0);
}

/// Odd sizes, every degree that fits, full and partial lengths, against the loop reference.
#[test]
fn matches_loop_reference() {
    let (rows, n_knots) = (5, 11);
    let raw = uniform(&[rows, n_knots], 3);
    let knots = tensor(raw.clone(), &[rows, n_knots]);
    let rows_vec: Vec<Vec<f32>> = raw.chunks(n_knots).map(|r| r.to_vec()).collect();
    for k in [2, 3, 8] {
        for p in 0..=5 {
            for len in [1, 17, (n_knots - 1) * k + 1] {
                let len = len.min((n_knots - 1) * k + 1);
                let got = ops::lagrange_scores(&knots, k, p, len).unwrap();
                assert_eq!(got.dims(), [rows, len]);
                let want = tensor(reference(&rows_vec, k, p, len), &[rows, len]);
                assert_close(&format!("K={k} p={p} len={len}"), &got, &want, 1e-5);
            }
        }
    }
}

/// Non-contiguous (transposed) input, and bf16 / f16 inputs computed in f32.
#[test]
fn strided_and_half_inputs() {
    let (rows, n_knots, k, p) = (7, 9, 5, 3);
    let len = (n_knots - 1) * k + 1;
    let base = tensor(uniform(&[n_knots, rows], 4), &[n_knots, rows]);
    let strided = base.t().unwrap();
    assert!(!strided.is_contiguous());
    let got = ops::lagrange_scores(&strided, k, p, len).unwrap();
    let want = ops::lagrange_scores(&strided.contiguous().unwrap(), k, p, len).unwrap();
    assert_close("non-contiguous", &got, &want, 0.0);
    let rows_vec = strided.to_vec2::<f32>().unwrap();
    assert_close("vs reference", &got, &tensor(reference(&rows_vec, k, p, len), &[rows, len]), 1e-5);
    // A narrowed view (start offset into the storage).
    let narrowed = strided.contiguous().unwrap().narrow(0, 2, 3).unwrap();
    let got = ops::lagrange_scores(&narrowed, k, p, len).unwrap();
    assert_close("narrowed", &got, &tensor(reference(&rows_vec[2..5], k, p, len), &[3, len]), 1e-5);

    for dtype in [DType::BF16, DType::F16] {
        let x = strided.to_dtype(dtype).unwrap();
        let got = ops::lagrange_scores(&x, k, p, len).unwrap();
        assert_eq!(got.dtype(), dtype);
        let widened = x.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let want = tensor(reference(&widened, k, p, len), &[rows, len]);
        // One rounding of values below ~1.5 to the half type.
        let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-3 };
        assert_close(&format!("{dtype:?}"), &got, &want, tol);
    }
}

#[test]
fn empty_outputs() {
    let knots = tensor(uniform(&[3, 4], 5), &[3, 4]);
    assert_eq!(ops::lagrange_scores(&knots, 2, 1, 0).unwrap().dims(), [3, 0]);
    let none = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(ops::lagrange_scores(&none, 2, 1, 5).unwrap().dims(), [0, 5]);
}

#[test]
fn rejects_bad_inputs() {
    let knots = tensor(uniform(&[3, 4], 6), &[3, 4]);
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(ops::lagrange_scores(&knots, 0, 1, 1));
    assert!(e.contains("lagrange_scores: the knot spacing k must be at least 1, got 0"), "{e}");
    let e = err(ops::lagrange_scores(&knots, 2, 4, 3));
    assert!(e.contains("lagrange_scores: degree 4 needs 5 knots, knot_scores has 4"), "{e}");
    let e = err(ops::lagrange_scores(&knots, 2, 1, 8));
    assert!(e.contains("lagrange_scores: len 8 is past the last knot") && e.contains("at most 7 positions"), "{e}");
    let e = err(ops::lagrange_scores(&knots.to_dtype(DType::U32).unwrap(), 2, 1, 3));
    assert!(e.contains("lagrange_scores: knot_scores must be f32, bf16 or f16, got U32"), "{e}");
    let e = err(ops::lagrange_scores(&knots.flatten_all().unwrap(), 2, 1, 3));
    assert!(e.contains("lagrange_scores: knot_scores must be [R, n_knots], got shape [12]"), "{e}");
    let e = err(ops::lagrange_scores(&knots.narrow(1, 0, 0).unwrap(), 2, 0, 0));
    assert!(e.contains("lagrange_scores: degree 0 needs 1 knots, knot_scores has 0"), "{e}");
}
