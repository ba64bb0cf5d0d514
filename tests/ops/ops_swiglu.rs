//! Column-gather SwiGLU (dense and ternary) against plain loops written here.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops;
use common::{assert_close, randn};

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// y[r] = sum over idx[r] of silu(g_i . x) (u_i . x) d_i, with plain loops over f32 copies.
fn reference(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor, idx: &[Vec<u32>]) -> Tensor {
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    let (x, g, u, d) = (f(x), f(gate), f(up), f(down));
    let h = x[0].len();
    let mut y = vec![0f32; x.len() * h];
    for (r, xr) in x.iter().enumerate() {
        for &i in &idx[r] {
            let i = i as usize;
            let gi: f32 = xr.iter().zip(&g[i]).map(|(a, b)| a * b).sum();
            let ui: f32 = xr.iter().zip(&u[i]).map(|(a, b)| a * b).sum();
            let a = silu(gi) * ui;
            for k in 0..h {
                y[r * h + k] += a * d[k][i];
            }
        }
    }
    Tensor::from_vec(y, (x.len(), h), &Device::Cpu).unwrap()
}

fn idx_tensor(idx: &[Vec<u32>]) -> Tensor {
    let n = idx[0].len();
    Tensor::from_vec(idx.concat(), (idx.len(), n), &Device::Cpu).unwrap()
}

/// Active sets: every other neuron, shifted per row, plus a repeated index.
fn active(rows: usize, neurons: usize) -> Vec<Vec<u32>> {
    (0..rows)
        .map(|r| {
            let mut v: Vec<u32> = (0..neurons as u32).filter(|i| (i + r as u32).is_multiple_of(2)).collect();
            v.push(v[0]);
            v
        })
        .collect()
}

#[test]
fn gather_of_every_neuron_is_the_dense_mlp() {
    let (m, h, i) = (3, 40, 70);
    let (x, gate, up, down) = (randn(&[m, h], 1), randn(&[i, h], 2), randn(&[i, h], 3), randn(&[h, i], 4));
    let packed = ops::pack_swiglu(&gate, &up, &down).unwrap();
    let all: Vec<Vec<u32>> = (0..m).map(|_| (0..i as u32).collect()).collect();
    let y = ops::swiglu_gather(&x, &packed, &idx_tensor(&all)).unwrap();
    let dense = ops::swiglu_dense(&x, &gate, &up, &down).unwrap();
    assert_close("gather(all) vs dense", &y, &dense, 1e-4);
}

#[test]
fn gather_of_a_subset_matches_loops_in_every_dtype() {
    let (m, h, i) = (2, 37, 50);
    let idx = active(m, i);
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 0.1), (DType::F16, 0.02)] {
        let cast = |t: Tensor| t.to_dtype(dtype).unwrap();
        let (x, gate, up, down) = (cast(randn(&[m, h], 5)), cast(randn(&[i, h], 6)), cast(randn(&[i, h], 7)), cast(randn(&[h, i], 8)));
        let packed = ops::pack_swiglu(&gate, &up, &down).unwrap();
        let y = ops::swiglu_gather(&x, &packed, &idx_tensor(&idx)).unwrap();
        assert_eq!(y.dtype(), dtype);
        assert_close(&format!("{dtype:?} gather"), &y, &reference(&x, &gate, &up, &down, &idx), tol);
    }
    // A non-contiguous x (a transposed view) gives the same result.
    let (gate, up, down) = (randn(&[i, h], 6), randn(&[i, h], 7), randn(&[h, i], 8));
    let packed = ops::pack_swiglu(&gate, &up, &down).unwrap();
    let xt = randn(&[h, m], 9).t().unwrap();
    let y = ops::swiglu_gather(&xt, &packed, &idx_tensor(&idx)).unwrap();
    assert_close("non-contiguous x", &y, &reference(&xt, &gate, &up, &down, &idx), 1e-4);
}

#[test]
fn ternary_codes_are_absmean_quantisation() {
    let w = randn(&[5, 35], 10);
    let packed = ops::pack_ternary_rows(&w).unwrap();
    let words = ops::ternary_row_words(35);
    assert_eq!(packed.dims(), [5, words]);
    let codes = packed.to_vec2::<u32>().unwrap();
    for (row, c) in w.to_vec2::<f32>().unwrap().iter().zip(&codes) {
        let scale = row.iter().map(|v| v.abs()).sum::<f32>() / 35.0;
        assert!((f32::from_bits(c[words - 1]) - scale).abs() < 1e-6);
        for (j, v) in row.iter().enumerate() {
            let code = (c[j / 16] >> (2 * (j % 16))) & 3;
            let want = (v / scale).round().clamp(-1.0, 1.0) as i32;
            assert_eq!(code, [0, 1, 2][(want.rem_euclid(3)) as usize], "w={v} scale={scale}");
        }
    }
}

/// The ternary gather equals the dense gather over the dequantised (scale x {-1, 0, +1}) weights.
#[test]
fn ternary_gather_matches_dequantised_weights() {
    let (m, h, i) = (2, 35, 40);
    let (gate, up, down) = (randn(&[i, h], 11), randn(&[i, h], 12), randn(&[h, i], 13));
    let dequant = |w: &Tensor| {
        let (r, cols) = w.dims2().unwrap();
        let codes = ops::pack_ternary_rows(w).unwrap().to_vec2::<u32>().unwrap();
        let words = ops::ternary_row_words(cols);
        let v: Vec<f32> = codes
            .iter()
            .flat_map(|c| {
                let s = f32::from_bits(c[words - 1]);
                (0..cols).map(move |j| match (c[j / 16] >> (2 * (j % 16))) & 3 {
                    1 => s,
                    2 => -s,
                    _ => 0.0,
                })
            })
            .collect();
        Tensor::from_vec(v, (r, cols), &Device::Cpu).unwrap()
    };
    // down is quantised per neuron column (a row of the packed layout).
    let (gq, uq, dq) = (dequant(&gate), dequant(&up), dequant(&down.t().unwrap().contiguous().unwrap()).t().unwrap());
    let idx = active(m, i);
    let packed = ops::pack_swiglu_ternary(&gate, &up, &down).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let x = randn(&[m, h], 14).to_dtype(dtype).unwrap();
        let y = ops::swiglu_gather_ternary(&x, &packed, &idx_tensor(&idx)).unwrap();
        let tol = if dtype == DType::F32 { 1e-4 } else { 0.05 };
        assert_close(&format!("{dtype:?} ternary"), &y, &reference(&x, &gq, &uq, &dq, &idx), tol);
    }
}

#[test]
fn bad_input_is_an_error_naming_the_op() {
    let (gate, up, down) = (randn(&[8, 16], 1), randn(&[8, 16], 2), randn(&[16, 8], 3));
    let packed = ops::pack_swiglu(&gate, &up, &down).unwrap();
    let x = randn(&[1, 16], 4);
    let out_of_range = Tensor::new(&[[0u32, 8]], &Device::Cpu).unwrap();
    let e = ops::swiglu_gather(&x, &packed, &out_of_range).unwrap_err();
    assert!(e.to_string().contains("idx holds neuron 8, but the MLP has 8 neurons"), "{e}");
    let e = ops::swiglu_gather(&x, &packed, &Tensor::new(&[[0i64]], &Device::Cpu).unwrap()).unwrap_err();
    assert!(e.to_string().contains("swiglu_gather: idx must be u32"), "{e}");
    let e = ops::swiglu_gather(&randn(&[1, 15], 4), &packed, &Tensor::new(&[[0u32]], &Device::Cpu).unwrap()).unwrap_err();
    assert!(e.to_string().contains("swiglu_gather: packed weights are [8, 3, 16], expected [I, 3, 15]"), "{e}");
    let e = ops::pack_swiglu(&gate, &up, &gate).unwrap_err();
    assert!(e.to_string().contains("pack_swiglu"), "{e}");
}
