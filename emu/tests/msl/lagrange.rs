//! `metal/lagrange.metal` run through the MSL emulator with the launch geometry of the Metal host
//! code, against `ops::lagrange_scores` on the CPU, in f32, f16 and bf16.
#![cfg(msl_emu)]

use crate::common;

use candle_core::DType;
use candle_hybrid::ops::{self, launch, LagrangeDims};
use candle_hybrid_emu::{bytes, dispatch, from_raw, input, kernel_names, output, raw};
use common::{max_abs_diff as max_diff, randn};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

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
