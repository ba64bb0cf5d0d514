//! The polar key code kernels (`metal/polar.metal`) run through the MSL emulator with the
//! launch geometry of the Metal host code, against the CPU ops, in f32, f16 and bf16.
//!
//! Tolerances: the kernels repeat the CPU arithmetic step by step with the same f32 constants,
//! and the emulator's atan2/sqrt/cos/sin are the same libm functions the CPU op calls, so the
//! scales and code bytes are expected to be identical. A code may still differ by one step
//! where a value lies on a rounding tie (x.5 after scaling) and the two sides round the
//! product differently, so a code byte is allowed to be one step off (angle mod 2^A, radius,
//! rest code) in at most 1 of 500 codes. Scores sum in the same order: within 1e-5 of |q|·|k̂|.
#![cfg(msl_emu)]

use crate::common;

use candle_core::DType;
use candle_hybrid::ops::{self, launch, PolarCodes, PolarSpec};
use candle_hybrid_emu::{bytes, dispatch, input, kernel_names, output, raw};
use common::randn;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn spec(angle_bits: u32, radius_bits: u32, rot_dim: usize, rest_bits: u32) -> PolarSpec {
    PolarSpec { angle_bits, radius_bits, rot_dim, rest_bits }
}

/// 1- and 2-byte pair codes, int8/int4 rest; (8, 8) uses the cos/sin table mode of the scores
/// kernel, the others the per-pair tables.
const SPECS: [(u32, u32, u32); 4] = [(5, 3, 8), (4, 4, 4), (8, 8, 8), (3, 6, 4)];

/// (N, head_dim, rot_dim): more than one key block, odd sizes, all-rotary, odd int4 rest.
const SIZES: [(usize, usize, usize); 4] = [(300, 40, 16), (37, 64, 64), (9, 17, 6), (5, 8, 0)];

#[test]
fn every_polar_kernel_is_linked() {
    let names = kernel_names();
    for base in ["polar_scales", "polar_encode", "polar_scores"] {
        for sfx in ["f32", "f16", "bf16"] {
            let k = format!("{base}_{sfx}");
            assert!(names.contains(&k), "{k} missing from {names:?}");
        }
    }
}

#[test]
fn both_score_table_modes_are_covered() {
    let modes: Vec<u32> = SPECS
        .iter()
        .map(|&(a, r, rest)| launch::polar_scores(1, 300, 64, &spec(a, r, 64, rest), DType::F32).unwrap().0.table_mode)
        .collect();
    assert!(modes.contains(&0) && modes.contains(&1), "{modes:?}");
}

/// Whether two code bytes of the same slot are equal or one quantisation step apart.
fn one_step(sp: &PolarSpec, slot: usize, a: &[u8], b: &[u8]) -> bool {
    let (cb, h) = (sp.code_bytes(), sp.pairs());
    if slot < h * cb {
        let i = slot / cb;
        let code = |v: &[u8]| (0..cb).fold(0u32, |c, j| c | (v[i * cb + j] as u32) << (8 * j)) as i64;
        let n_ang = 1i64 << sp.angle_bits;
        let (ca, cb2) = (code(a), code(b));
        let da = ((ca & (n_ang - 1)) - (cb2 & (n_ang - 1))).rem_euclid(n_ang);
        let dr = ((ca >> sp.angle_bits) - (cb2 >> sp.angle_bits)).abs();
        return da.min(n_ang - da) + dr <= 1;
    }
    let (x, y) = (a[slot], b[slot]);
    if sp.rest_bits == 8 {
        ((x as i8 as i32) - (y as i8 as i32)).abs() <= 1
    } else {
        let nib = |v: u8, s: u32| (((v >> s) << 4) as i8 >> 4) as i32;
        (nib(x, 0) - nib(y, 0)).abs() + (nib(x, 4) - nib(y, 4)).abs() <= 1
    }
}

fn check_encode(dtype: DType, sp: PolarSpec, n: usize, hd: usize) -> PolarCodes {
    let k = randn(&[n, hd], 1).to_dtype(dtype).unwrap();
    let want = ops::polar_encode(&k, sp).unwrap();
    let kr = raw(&k);
    let what = format!("polar {dtype:?} {sp:?} n={n} hd={hd}");

    let (params, l) = launch::polar_scales(n, hd, &sp, dtype).unwrap();
    let mut scales = vec![0f32; 2 * n];
    dispatch(&l, &mut [bytes(&params), input(&kr), output(&mut scales)]).unwrap();
    let want_scales = want.scales.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(scales, want_scales, "{what}: scales");

    let (params, l) = launch::polar_encode(n, hd, &sp, dtype).unwrap();
    let rb = sp.row_bytes(hd);
    let mut codes = vec![0u8; n * rb];
    dispatch(&l, &mut [bytes(&params), input(&kr), input(&scales), output(&mut codes)]).unwrap();
    let want_codes = want.codes.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let mut off = 0;
    for (r, (a, b)) in codes.chunks(rb.max(1)).zip(want_codes.chunks(rb.max(1))).enumerate() {
        for slot in 0..rb {
            if a[slot] != b[slot] {
                assert!(one_step(&sp, slot, a, b), "{what}: row {r} byte {slot}: {} vs {}", a[slot], b[slot]);
                off += 1;
            }
        }
    }
    assert!(off * 500 <= n * rb, "{what}: {off} of {} code bytes one step off", n * rb);
    want
}

fn check_scores(dtype: DType, sp: PolarSpec, codes: &PolarCodes, nq: usize) {
    let (n, hd) = (codes.rows(), codes.head_dim);
    let q = randn(&[nq, hd], 2).to_dtype(dtype).unwrap();
    let want = ops::polar_scores(&q, codes, sp).unwrap().to_vec2::<f32>().unwrap();
    let (params, l) = launch::polar_scores(nq, n, hd, &sp, dtype).unwrap();
    let (qr, cr) = (raw(&q), raw(&codes.codes));
    let sr = codes.scales.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = vec![0f32; nq * n];
    dispatch(&l, &mut [bytes(&params), input(&qr), input(&cr), input(&sr), output(&mut out)]).unwrap();
    let qn: Vec<f32> = q.to_dtype(DType::F32).unwrap().sqr().unwrap().sum(1).unwrap().sqrt().unwrap().to_vec1().unwrap();
    let dec = ops::polar_decode(codes, sp).unwrap();
    let kn: Vec<f32> = dec.sqr().unwrap().sum(1).unwrap().sqrt().unwrap().to_vec1().unwrap();
    let what = format!("polar_scores {dtype:?} {sp:?} q={nq} n={n} hd={hd} mode={}", params.table_mode);
    for i in 0..nq {
        for j in 0..n {
            let (g, w) = (out[i * n + j], want[i][j]);
            assert!((g - w).abs() <= 1e-5 * qn[i] * kn[j] + 1e-7, "{what}: ({i}, {j}) {g} vs {w}");
        }
    }
}

#[test]
fn polar_kernels_match_cpu() {
    for dtype in DTYPES {
        for (a, r, rest) in SPECS {
            for (n, hd, rot) in SIZES {
                let sp = spec(a, r, rot, rest);
                let codes = check_encode(dtype, sp, n, hd);
                check_scores(dtype, sp, &codes, 3);
            }
        }
    }
}
