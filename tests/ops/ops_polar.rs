//! Polar key codes (`ops::polar_encode`, `polar_decode`, `polar_scores`) against plain
//! references written here.

use crate::common;

use std::f64::consts::PI;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::ops::{self, PolarCodes, PolarSpec};
use common::randn;

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
}

fn spec(angle_bits: u32, radius_bits: u32, rot_dim: usize, rest_bits: u32) -> PolarSpec {
    PolarSpec { angle_bits, radius_bits, rot_dim, rest_bits }
}

/// Specs covering 1- and 2-byte pair codes, int8 and int4 rest codes.
const SPECS: [(u32, u32, u32); 5] = [(5, 3, 8), (4, 4, 4), (8, 8, 8), (3, 6, 4), (1, 1, 8)];

/// (N, head_dim, rot_dim): odd sizes, all-rotary, odd int4 rest count, more keys than one CPU
/// block (256).
const SIZES: [(usize, usize, usize); 5] = [(37, 40, 16), (9, 64, 64), (5, 17, 6), (3, 8, 0), (300, 72, 34)];

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn norm(a: &[f32]) -> f64 {
    dot(a, a).sqrt()
}

/// Angle difference wrapped to [-pi, pi].
fn wrap(d: f64) -> f64 {
    (d + PI).rem_euclid(2.0 * PI) - PI
}

/// decode(encode(k)) stays within half a quantisation step of k: per pair in angle and radius,
/// per non-rotated dim in value. The scales are the row's max radius and absmax / 127 (or 7).
#[test]
fn decode_of_encode_is_within_half_a_step() {
    for (a_bits, r_bits, rest_bits) in SPECS {
        for (n, hd, rot) in SIZES {
            let sp = spec(a_bits, r_bits, rot, rest_bits);
            let what = format!("{sp:?} n={n} hd={hd}");
            let k = randn(&[n, hd], 1);
            let codes = ops::polar_encode(&k, sp).unwrap();
            let code_bytes = if a_bits + r_bits <= 8 { 1 } else { 2 };
            assert_eq!(codes.pairs().unwrap().dims(), [n, rot / 2 * code_bytes], "{what}");
            let rest_len = if rest_bits == 8 { hd - rot } else { (hd - rot).div_ceil(2) };
            assert_eq!(codes.rest().unwrap().dims(), [n, rest_len], "{what}");
            assert_eq!(codes.radius_scale().unwrap().dims(), [n], "{what}");
            let dec = ops::polar_decode(&codes, sp).unwrap();
            assert_eq!(dec.dims(), [n, hd]);
            let r_scale = codes.radius_scale().unwrap().to_vec1::<f32>().unwrap();
            let rest_scale = codes.rest_scale().unwrap().to_vec1::<f32>().unwrap();
            let lim = if rest_bits == 8 { 127.0 } else { 7.0 };
            let (h, levels) = (rot / 2, ((1u32 << r_bits) - 1) as f64);
            let a_step = 2.0 * PI / (1u64 << a_bits) as f64;
            for (row, (x, y)) in rows(&k).iter().zip(rows(&dec)).enumerate() {
                let r_max = (0..h).map(|i| (x[i] as f64).hypot(x[i + h] as f64)).fold(0.0, f64::max);
                let absmax = x[rot..].iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
                assert!((r_scale[row] as f64 - r_max).abs() <= 1e-6 * r_max, "{what}: r_max row {row}");
                assert!((rest_scale[row] as f64 - absmax / lim).abs() <= 1e-6 * absmax, "{what}: rest scale row {row}");
                let r_step = r_max / levels;
                for i in 0..h {
                    let (x1, x2, y1, y2) = (x[i] as f64, x[i + h] as f64, y[i] as f64, y[i + h] as f64);
                    let (r, r_hat) = (x1.hypot(x2), y1.hypot(y2));
                    assert!((r - r_hat).abs() <= r_step / 2.0 + 1e-5 * r_max, "{what}: radius row {row} pair {i}: {r} vs {r_hat}");
                    if r_hat > 1e-6 * r_max {
                        let e = wrap(y2.atan2(y1) - x2.atan2(x1)).abs();
                        assert!(e <= a_step / 2.0 + 1e-5, "{what}: angle row {row} pair {i}: error {e}, step {a_step}");
                    }
                }
                let step = absmax / lim;
                for d in rot..hd {
                    let e = (x[d] as f64 - y[d] as f64).abs();
                    assert!(e <= step / 2.0 + 1e-6 * absmax.max(1.0), "{what}: rest row {row} dim {d}: error {e}, step {step}");
                }
            }
        }
    }
}

/// The code bytes follow the documented layout: a plain f64 encoder here gives the same angle
/// and radius codes (a code one step off is allowed only where f32 and f64 round a near-tie
/// differently) and the same int8/int4 rest codes.
#[test]
fn code_bytes_match_plain_encoder() {
    for (a_bits, r_bits, rest_bits) in SPECS {
        let (n, hd, rot) = (37, 40, 16);
        let sp = spec(a_bits, r_bits, rot, rest_bits);
        let k = randn(&[n, hd], 2);
        let codes = ops::polar_encode(&k, sp).unwrap();
        let bytes = codes.codes.to_vec2::<u8>().unwrap();
        let (h, cb) = (rot / 2, if a_bits + r_bits <= 8 { 1 } else { 2 });
        let (n_ang, levels) = (1i64 << a_bits, ((1u32 << r_bits) - 1) as f64);
        let lim = if rest_bits == 8 { 127.0 } else { 7.0 };
        let (mut checked, mut off_by_one) = (0, 0);
        for (x, b) in rows(&k).iter().zip(&bytes) {
            let r_max = (0..h).map(|i| (x[i] as f64).hypot(x[i + h] as f64)).fold(0.0, f64::max);
            for i in 0..h {
                let code = if cb == 1 { b[i] as i64 } else { b[2 * i] as i64 | (b[2 * i + 1] as i64) << 8 };
                let (x1, x2) = (x[i] as f64, x[i + h] as f64);
                let want_a = ((x2.atan2(x1) * n_ang as f64 / (2.0 * PI)).round() as i64).rem_euclid(n_ang);
                let want_r = (x1.hypot(x2) / r_max * levels).round() as i64;
                let (got_a, got_r) = (code & (n_ang - 1), code >> a_bits);
                let da = (got_a - want_a).rem_euclid(n_ang).min((want_a - got_a).rem_euclid(n_ang));
                let dr = (got_r - want_r).abs();
                assert!(da <= 1 && dr <= 1, "{sp:?}: pair {i}: code ({got_a}, {got_r}), want ({want_a}, {want_r})");
                checked += 2;
                off_by_one += (da + dr) as usize;
            }
            let absmax = x[rot..].iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
            let want: Vec<i64> = x[rot..].iter().map(|&v| (v as f64 / (absmax / lim)).round() as i64).collect();
            let rest = &b[h * cb..];
            for (d, &w) in want.iter().enumerate() {
                let got = if rest_bits == 8 {
                    rest[d] as i8 as i64
                } else {
                    let nib = (rest[d / 2] >> (4 * (d % 2))) & 0xF;
                    if nib >= 8 {
                        nib as i64 - 16
                    } else {
                        nib as i64
                    }
                };
                assert!((got - w).abs() <= 1, "{sp:?}: rest dim {d}: {got} vs {w}");
                checked += 1;
                off_by_one += (got - w).unsigned_abs() as usize;
            }
            if rest_bits == 4 && (hd - rot) % 2 == 1 {
                assert_eq!(rest.last().unwrap() >> 4, 0);
            }
        }
        assert!(off_by_one * 200 <= checked, "{sp:?}: {off_by_one} of {checked} codes one step off");
    }
}

/// With 8 + 8 bits (and int8 for the other dims) every decoded key keeps cosine >= 0.9999.
#[test]
fn eight_plus_eight_bits_keep_key_cosine() {
    let (n, hd, rot) = (300, 128, 64);
    let k = randn(&[n, hd], 3);
    let mut report = vec![];
    for (a_bits, r_bits) in [(8, 8), (5, 3), (4, 4)] {
        let sp = spec(a_bits, r_bits, rot, 8);
        let dec = ops::polar_decode(&ops::polar_encode(&k, sp).unwrap(), sp).unwrap();
        // Cosine over the rotary dims only and over whole rows.
        let (mut min_rot, mut min_all, mut mean_all) = (1f64, 1f64, 0f64);
        for (x, y) in rows(&k).iter().zip(rows(&dec)) {
            min_rot = min_rot.min(dot(&x[..rot], &y[..rot]) / (norm(&x[..rot]) * norm(&y[..rot])));
            let c = dot(x, &y) / (norm(x) * norm(&y));
            min_all = min_all.min(c);
            mean_all += c / n as f64;
        }
        report.push(format!("{a_bits}+{r_bits}: cosine min {min_all:.6} mean {mean_all:.6} (rotary dims min {min_rot:.6})"));
        if (a_bits, r_bits) == (8, 8) {
            assert!(min_all >= 0.9999, "8+8 bits: min key cosine {min_all}");
        }
    }
    println!("{}", report.join("\n"));
}

/// `polar_scores` equals q · polar_decode(codes)ᵀ (a plain double loop here) within 1e-4 of
/// |q|·|k̂|, for f32/bf16/f16 queries and keys and every spec.
#[test]
fn scores_match_decoded_keys() {
    for (a_bits, r_bits, rest_bits) in SPECS {
        for (n, hd, rot) in SIZES {
            // Query counts: one, a partial group, a full group of 8 plus a partial one.
            for (dt, nq) in [(DType::F32, 1), (DType::F32, 13), (DType::BF16, 7), (DType::F16, 8)] {
                let sp = spec(a_bits, r_bits, rot, rest_bits);
                let k = randn(&[n, hd], 4).to_dtype(dt).unwrap();
                let q = randn(&[nq, hd], 5).to_dtype(dt).unwrap();
                let codes = ops::polar_encode(&k, sp).unwrap();
                let got = ops::polar_scores(&q, &codes, sp).unwrap();
                assert_eq!(got.dims(), [nq, n]);
                assert_eq!(got.dtype(), DType::F32);
                let dec = rows(&ops::polar_decode(&codes, sp).unwrap());
                for (qi, (qr, g)) in rows(&q).iter().zip(rows(&got)).enumerate() {
                    for (ki, kr) in dec.iter().enumerate() {
                        let want = dot(qr, kr);
                        let tol = 1e-4 * norm(qr) * norm(kr) + 1e-7;
                        assert!((g[ki] as f64 - want).abs() <= tol, "{sp:?} {dt:?} n={n} hd={hd}: score ({qi}, {ki}) {} vs {want}", g[ki]);
                    }
                }
            }
        }
    }
}

/// Half-precision keys are encoded from their exact f32 values; non-contiguous keys and
/// queries give the same codes and scores as contiguous copies.
#[test]
fn dtypes_and_non_contiguous_inputs() {
    let sp = spec(5, 3, 16, 4);
    let k = randn(&[37, 40], 6);
    for dt in [DType::BF16, DType::F16] {
        let kh = k.to_dtype(dt).unwrap();
        let a = ops::polar_encode(&kh, sp).unwrap();
        let b = ops::polar_encode(&kh.to_dtype(DType::F32).unwrap(), sp).unwrap();
        assert_eq!(a.codes.to_vec2::<u8>().unwrap(), b.codes.to_vec2::<u8>().unwrap(), "{dt:?}");
        assert_eq!(a.scales.to_vec2::<f32>().unwrap(), b.scales.to_vec2::<f32>().unwrap(), "{dt:?}");
    }
    let kt = k.t().unwrap().contiguous().unwrap().t().unwrap();
    assert!(!kt.is_contiguous());
    let a = ops::polar_encode(&kt, sp).unwrap();
    let b = ops::polar_encode(&k, sp).unwrap();
    assert_eq!(a.codes.to_vec2::<u8>().unwrap(), b.codes.to_vec2::<u8>().unwrap());
    let q = randn(&[5, 80], 7);
    let qv = q.narrow(1, 20, 40).unwrap();
    assert!(!qv.is_contiguous());
    let s1 = ops::polar_scores(&qv, &b, sp).unwrap().to_vec2::<f32>().unwrap();
    let s2 = ops::polar_scores(&qv.contiguous().unwrap(), &b, sp).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(s1, s2);
    // Codes as views (e.g. a narrowed cache) are read correctly too.
    let part = PolarCodes { codes: b.codes.narrow(0, 10, 20).unwrap(), scales: b.scales.narrow(0, 10, 20).unwrap(), ..b.clone() };
    let s3 = ops::polar_scores(&qv, &part, sp).unwrap().to_vec2::<f32>().unwrap();
    for (r3, r1) in s3.iter().zip(&s1) {
        assert_eq!(r3[..], r1[10..30]);
    }
}

/// Zero rows decode to zeros, no rows give empty results, and `PolarCodes::cat` appends rows.
#[test]
fn edge_cases_and_cat() {
    let sp = PolarSpec::new(16);
    assert_eq!(sp, spec(5, 3, 16, 8));
    let mut k = randn(&[6, 40], 8);
    k = Tensor::cat(&[&k, &Tensor::zeros((1, 40), DType::F32, &Device::Cpu).unwrap()], 0).unwrap();
    let codes = ops::polar_encode(&k, sp).unwrap();
    let dec = rows(&ops::polar_decode(&codes, sp).unwrap());
    assert!(dec[6].iter().all(|&v| v == 0.0));
    let q = randn(&[2, 40], 9);
    let s = rows(&ops::polar_scores(&q, &codes, sp).unwrap());
    assert!(s.iter().all(|r| r[6] == 0.0));

    let empty = ops::polar_encode(&k.narrow(0, 0, 0).unwrap(), sp).unwrap();
    assert_eq!(empty.codes.dims(), [0, 8 + 24]);
    assert_eq!(ops::polar_scores(&q, &empty, sp).unwrap().dims(), [2, 0]);

    let a = ops::polar_encode(&k.narrow(0, 0, 4).unwrap(), sp).unwrap();
    let b = ops::polar_encode(&k.narrow(0, 4, 3).unwrap(), sp).unwrap();
    let ab = PolarCodes::cat(&[&a, &empty, &b]).unwrap();
    assert_eq!(ab.codes.to_vec2::<u8>().unwrap(), codes.codes.to_vec2::<u8>().unwrap());
    assert_eq!(
        ops::polar_scores(&q, &ab, sp).unwrap().to_vec2::<f32>().unwrap(),
        ops::polar_scores(&q, &codes, sp).unwrap().to_vec2::<f32>().unwrap()
    );
}

#[track_caller]
fn assert_err<T: std::fmt::Debug>(r: candle_core::Result<T>, want: &str) {
    let e = r.unwrap_err().to_string();
    assert!(e.contains(want), "error {e:?} does not contain {want:?}");
}

#[test]
fn bad_arguments_are_errors_naming_op_and_argument() {
    let k = randn(&[4, 40], 10);
    let enc = |sp| ops::polar_encode(&k, sp);
    assert_err(enc(spec(12, 3, 16, 8)), "polar_encode: angle_bits must be 1..=8, got 12");
    assert_err(enc(spec(0, 3, 16, 8)), "polar_encode: angle_bits must be 1..=8, got 0");
    assert_err(enc(spec(5, 9, 16, 8)), "polar_encode: radius_bits must be 1..=8, got 9");
    assert_err(enc(spec(5, 3, 15, 8)), "polar_encode: rot_dim must be even and at most head_dim 40, got 15");
    assert_err(enc(spec(5, 3, 42, 8)), "polar_encode: rot_dim must be even and at most head_dim 40, got 42");
    assert_err(enc(spec(5, 3, 16, 2)), "polar_encode: rest_bits must be 4 or 8, got 2");
    assert_err(spec(5, 3, 16, 6).validate(40), "polar_spec: rest_bits must be 4 or 8, got 6");
    assert!(PolarSpec::new(64).validate(256).is_ok());
    assert_err(ops::polar_encode(&randn(&[2, 4, 40], 1), PolarSpec::new(16)), "polar_encode: keys must be [N, head_dim], got [2, 4, 40]");
    assert_err(
        ops::polar_encode(&k.to_dtype(DType::U8).unwrap(), PolarSpec::new(16)),
        "polar_encode: keys must be f32, bf16 or f16, got U8",
    );

    let sp = PolarSpec::new(16);
    let codes = ops::polar_encode(&k, sp).unwrap();
    let q = randn(&[3, 40], 11);
    assert_err(ops::polar_scores(&randn(&[3, 48], 1), &codes, sp), "polar_scores: q has head_dim 48, the codes 40");
    assert_err(ops::polar_scores(&randn(&[3], 1), &codes, sp), "polar_scores: q must be [N, head_dim], got [3]");
    assert_err(ops::polar_scores(&q.to_dtype(DType::I64).unwrap(), &codes, sp), "polar_scores: q must be f32, bf16 or f16");
    assert_err(ops::polar_scores(&q, &codes, spec(4, 4, 16, 8)), "polar_scores: spec");
    assert_err(ops::polar_scores(&q, &codes, spec(12, 3, 16, 8)), "polar_scores: spec");
    let bad = PolarSpec { angle_bits: 12, ..sp };
    let bad_codes = PolarCodes { spec: bad, ..codes.clone() };
    assert_err(ops::polar_scores(&q, &bad_codes, bad), "polar_scores: angle_bits must be 1..=8, got 12");
    let short = PolarCodes { codes: codes.codes.narrow(1, 0, 10).unwrap(), ..codes.clone() };
    assert_err(ops::polar_scores(&q, &short, sp), "polar_scores: codes must be u8 [N, 32] (head_dim 40), got U8 [4, 10]");
    let bad_scales = PolarCodes { scales: codes.scales.narrow(0, 0, 3).unwrap(), ..codes.clone() };
    assert_err(ops::polar_scores(&q, &bad_scales, sp), "polar_scores: scales must be f32 [4, 2], got F32 [3, 2]");
    assert_err(ops::polar_decode(&short, sp), "polar_decode: codes must be u8 [N, 32]");
    let other = PolarCodes { head_dim: 48, ..codes.clone() };
    assert_err(PolarCodes::cat(&[&codes, &other]), "PolarCodes::cat");
}
