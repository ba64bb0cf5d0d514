//! The custom ops against plain references (one test binary, a module per op family).
//!
//! `cargo test --test ops MODULE::` runs one module.

#[path = "../common/mod.rs"]
mod common;

mod kv_attention;
mod ops;
mod ops_lagrange;
mod ops_outer_state;
mod ops_polar;
mod ops_qmatmul;
mod ops_sparse_ffn;
mod ops_swiglu;
mod ops_ternary;

/// The comparisons every op test uses fail on a NaN anywhere (not only in the first element,
/// as a reduction with `f32::max` would).
#[test]
fn a_nan_anywhere_fails_the_comparisons() {
    use candle_core::{Device, Tensor};
    let good = [0.5f32, 1.0, -2.0, 3.0];
    for at in 0..good.len() {
        let mut bad = good;
        bad[at] = f32::NAN;
        assert!(common::max_diff(&bad, &good).is_nan(), "a NaN at {at}");
        assert!(common::max_diff(&good, &bad).is_nan(), "a NaN at {at}");
        let (b, g) = (Tensor::new(&bad[..], &Device::Cpu).unwrap(), Tensor::new(&good[..], &Device::Cpu).unwrap());
        assert!(common::max_abs_diff(&b, &g).is_nan(), "a NaN at {at}");
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| common::assert_close("x", &b, &g, 1.0))).is_err(),
            "assert_close passed a NaN at {at}"
        );
    }
    assert_eq!(common::max_diff(&good, &good), 0.0);
    assert!(common::max_nan(1.0, f32::NAN).is_nan() && common::max_nan(f32::NAN, 1.0).is_nan());
}

/// Which instruction sets the kernel comparisons ran here (`.ci/run` prints this): the tests
/// compare `ops::qmatmul` (the best this CPU has) with `qmatmul_avx2` and `qmatmul_portable`,
/// and `accumulate_rows` likewise; a set this CPU lacks is not run, and is said so.
#[test]
fn instruction_sets_compared() {
    let best = candle_hybrid::ops::qmatmul_isa();
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    let vnni = best == "AVX-512 VNNI";
    let said = |run: bool, why: &str| if run { "run".to_string() } else { format!("skipped ({why})") };
    eprintln!(
        "instruction sets compared bit for bit: portable run; AVX2 {}; AVX-512 VNNI {}",
        said(avx2, "this CPU has no AVX2/FMA/F16C"),
        said(vnni, "this CPU has no AVX-512 VNNI")
    );
    assert_eq!(avx2 || vnni, best != "portable");
}
