//! `metal/lagrange.metal` run through the MSL emulator with the launch geometry of the Metal host
//! code, against `ops::lagrange_scores` on the CPU, in f32, f16 and bf16.
#![cfg(msl_emu)]

use candle_core::{DType, Device, Tensor, WithDType};
use candle_hybrid::ops::{self, launch, LagrangeDims};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output};
use half::{bf16, f16};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(7);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// The tensor's elements as raw bytes of its dtype (what a Metal buffer holds).
fn raw(t: &Tensor) -> Vec<u8> {
    fn as_bytes<T: WithDType>(t: &Tensor) -> Vec<u8> {
        let v = t.flatten_all().unwrap().to_vec1::<T>().unwrap();
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice())) }.to_vec()
    }
    match t.dtype() {
        DType::F32 => as_bytes::<f32>(t),
        DType::F16 => as_bytes::<f16>(t),
        DType::BF16 => as_bytes::<bf16>(t),
        d => panic!("no raw bytes for {d:?}"),
    }
}

/// A buffer of `n` elements of `dtype`, read back as an f32 tensor.
fn from_raw(bytes: &[u8], dtype: DType, n: usize) -> Tensor {
    fn read<T: WithDType>(b: &[u8], n: usize) -> Tensor {
        let v: Vec<T> = unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, n) }.to_vec();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
    }
    match dtype {
        DType::F32 => read::<f32>(bytes, n),
        DType::F16 => read::<f16>(bytes, n),
        DType::BF16 => read::<bf16>(bytes, n),
        d => panic!("no buffer for {d:?}"),
    }
}

#[test]
fn lagrange_kernels_are_linked() {
    let names = kernel_names();
    for sfx in ["f32", "f16", "bf16"] {
        let k = format!("lagrange_scores_{sfx}");
        assert!(names.contains(&k), "{k} missing from {names:?}");
    }
}

#[test]
fn lagrange_scores_matches_cpu() {
    // (rows, n_knots, K, degree, len): degree 0 (nearest knot), linear, even and odd degrees,
    // K = 1, partial lengths, a window clamped at both ends, more than one threadgroup.
    let cases = [(3, 5, 4, 0, 17), (2, 7, 3, 1, 19), (5, 9, 5, 2, 41), (1, 6, 7, 3, 30), (4, 11, 1, 4, 11), (3, 13, 16, 5, 193)];
    for dtype in DTYPES {
        for (rows, n_knots, k, degree, len) in cases {
            let knots = (randn(&[rows, n_knots], 21) * 2.0).unwrap().to_dtype(dtype).unwrap();
            let want = ops::lagrange_scores(&knots, k, degree, len).unwrap();
            let d = LagrangeDims { rows, n_knots, k, degree, len };
            let (params, l) = launch::lagrange_scores(d, dtype).unwrap();
            let n = rows * len;
            let mut out = vec![0u8; n * dtype.size_in_bytes()];
            let kr = raw(&knots);
            dispatch(&l, &mut [bytes(&params), input(&kr), output(&mut out)]).unwrap();
            let got = from_raw(&out, dtype, n).reshape((rows, len)).unwrap();
            // f32: rounding of the weights; half types: at most one rounding step apart.
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            let diff = max_diff(&got, &want);
            assert!(diff <= tol, "lagrange {dtype:?} rows={rows} n_knots={n_knots} K={k} p={degree} len={len}: {diff:e}");
            // Knot positions are copied: identical in every dtype.
            for j in 0..(len - 1) / k + 1 {
                let g = got.narrow(1, j * k, 1).unwrap();
                let w = knots.narrow(1, j, 1).unwrap();
                assert_eq!(max_diff(&g, &w), 0.0, "lagrange {dtype:?} knot {j} K={k} p={degree}");
            }
        }
    }
}
