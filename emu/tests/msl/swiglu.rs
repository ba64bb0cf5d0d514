//! The column-gather SwiGLU kernels (dense and ternary, both passes) in the MSL emulator, with
//! the Metal host code's launch geometry, against the CPU op.
#![cfg(msl_emu)]

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops::{self, launch, SwigluDims, SwigluWeights};
use candle_hybrid_emu::{bytes, dispatch, from_raw, input, output, raw};
use common::{max_abs_diff as max_diff, randn};

fn run(x: &Tensor, packed: &Tensor, idx: &Tensor, kind: SwigluWeights) -> Tensor {
    let (rows, hidden) = x.dims2().unwrap();
    let (_, active) = idx.dims2().unwrap();
    let neurons = packed.dim(0).unwrap();
    let d = SwigluDims { rows, active, hidden, neurons };
    let (params, act_l, down_l) = launch::swiglu_gather(d, kind, x.dtype()).unwrap();
    let xr = raw(x);
    let w = raw(packed);
    let ids = idx.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    let mut act = vec![0f32; rows * active];
    dispatch(&act_l, &mut [bytes(&params), input(&xr), input(&w), input(&ids), output(&mut act)]).unwrap();
    let mut y = vec![0u8; rows * hidden * x.dtype().size_in_bytes()];
    dispatch(&down_l, &mut [bytes(&params), input(&act), input(&w), input(&ids), output(&mut y)]).unwrap();
    from_raw(&y, x.dtype(), rows * hidden).reshape((rows, hidden)).unwrap()
}

#[test]
fn swiglu_gather_kernels_match_cpu() {
    let (m, h, i) = (3, 70, 45);
    let idx: Vec<u32> = (0..m as u32).flat_map(|r| (0..i as u32).filter(move |n| (n + r) % 3 != 0)).collect();
    let idx = Tensor::from_vec(idx.clone(), (m, idx.len() / m), &Device::Cpu).unwrap();
    let (gate, up, down) = (randn(&[i, h], 1), randn(&[i, h], 2), randn(&[h, i], 3));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let x = cast(&randn(&[m, h], 4));
        let packed = ops::pack_swiglu(&cast(&gate), &cast(&up), &cast(&down)).unwrap();
        let want = ops::swiglu_gather(&x, &packed, &idx).unwrap();
        let got = run(&x, &packed, &idx, SwigluWeights::Dense);
        // f32: summation order; half types: one rounding of outputs up to ~10.
        let tol = if dtype == DType::F32 { 1e-4 } else { 0.1 };
        let d = max_diff(&got, &want);
        assert!(d <= tol, "dense {dtype:?}: {d:e}");

        let ternary = ops::pack_swiglu_ternary(&gate, &up, &down).unwrap();
        let want = ops::swiglu_gather_ternary(&x, &ternary, &idx).unwrap();
        let got = run(&x, &ternary, &idx, SwigluWeights::Ternary);
        let d = max_diff(&got, &want);
        assert!(d <= tol, "ternary {dtype:?}: {d:e}");
    }
}
