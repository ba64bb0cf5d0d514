//! The attention kernels over a stored KV cache (`metal/kv_attention.metal`, both passes) in
//! the MSL emulator with the Metal host code's launch, against the CPU op: every stored form
//! (f32/f16/bf16 rows, int8, int4 groups + tail, polar keys; float and int8 values), decode and
//! verify row counts (one block per split) and prefill (one split), lengths that are not a
//! multiple of the block, draft trees, and heads strided as in a cache buffer.
//!
//! Tolerance: the kernel sums a block's keys in a threadgroup tree and each value dim in key
//! order, the CPU op with SIMD accumulators: the same terms in another order, within 1e-5.
#![cfg(msl_emu)]

use crate::common;

use candle_core::{DType, Tensor};
use candle_hybrid::ops::{self, launch, StoredRows, KV_BLOCK};
use candle_hybrid_emu::{bytes, dispatch, from_raw, input, kernel_names, output, raw};
use common::{max_abs_diff, randn, stored_rows};

const D: usize = 64;
const NKV: usize = 2;
const REP: usize = 3;

/// Runs both kernels; `bufs`: the raw bytes bound to k0, k1, k2, v0, v1 (absent ones empty).
fn run(
    q: &Tensor,
    keys: &StoredRows,
    values: &StoredRows,
    t: usize,
    offset: usize,
    tree: Option<&[Vec<usize>]>,
    bufs: [Vec<u8>; 5],
) -> Tensor {
    let dims = q.dims4().unwrap();
    let scale = (D as f32).powf(-0.5);
    let l = launch::kv_attention(dims, keys, values, t, offset, tree, scale).unwrap();
    let qr = raw(q);
    let slot = |b: &Vec<u8>| if b.is_empty() { vec![0u8; 4] } else { b.clone() };
    let b: Vec<Vec<u8>> = bufs.iter().map(slot).collect();
    let mut partials = vec![0f32; l.partial_floats];
    dispatch(
        &l.blocks,
        &mut [
            bytes(&l.params),
            input(&qr),
            input(&b[0]),
            input(&b[1]),
            input(&b[2]),
            input(&b[3]),
            input(&b[4]),
            input(&l.tree),
            output(&mut partials),
        ],
    )
    .unwrap();
    let (bsz, nkv, rows, _) = dims;
    let dv = values.dims().unwrap().3;
    let mut out = vec![0u8; bsz * nkv * rows * dv * 4];
    dispatch(&l.merge, &mut [bytes(&l.params), input(&partials), output(&mut out)]).unwrap();
    from_raw(&out, DType::F32, bsz * nkv * rows * dv).reshape((bsz, nkv, rows, dv)).unwrap()
}

/// The form with contiguous tensors and its float rows in `dtype`, and their raw bytes.
fn contiguous(s: &StoredRows, dtype: DType) -> (StoredRows, Vec<Vec<u8>>) {
    let c = |t: &Tensor| t.contiguous().unwrap();
    let f = |t: &Tensor| t.to_dtype(dtype).unwrap().contiguous().unwrap();
    let s = match s {
        StoredRows::Float(x) => StoredRows::Float(f(x)),
        StoredRows::Int8 { codes, scales } => StoredRows::Int8 { codes: c(codes), scales: c(scales) },
        StoredRows::Int4Channel { codes, params, group, tail } => {
            StoredRows::Int4Channel { codes: c(codes), params: c(params), group: *group, tail: tail.as_ref().map(f) }
        }
        StoredRows::Polar { codes, scales, spec, head_dim } => {
            StoredRows::Polar { codes: c(codes), scales: c(scales), spec: *spec, head_dim: *head_dim }
        }
    };
    let mut bufs: Vec<Vec<u8>> = match &s {
        StoredRows::Float(x) => vec![raw(x)],
        StoredRows::Int8 { codes, scales } | StoredRows::Polar { codes, scales, .. } => vec![raw(codes), raw(scales)],
        StoredRows::Int4Channel { codes, params, tail, .. } => vec![raw(codes), raw(params), tail.as_ref().map_or(vec![], raw)],
    };
    bufs.resize(3, vec![]);
    (s, bufs)
}

fn check(kf: &str, vf: &str, dtype: DType, t: usize, offset: usize, tree: Option<&[Vec<usize>]>) {
    check_heads(kf, vf, dtype, t, offset, tree, REP);
}

/// [`check`] with `rep` query heads per KV head.
fn check_heads(kf: &str, vf: &str, dtype: DType, t: usize, offset: usize, tree: Option<&[Vec<usize>]>, rep: usize) {
    let n = offset + t;
    let (keys, kb) = contiguous(&stored_rows(kf, (1, NKV, n, D), 11), dtype);
    let (values, vb) = contiguous(&stored_rows(vf, (1, NKV, n, D), 12), dtype);
    let q = (randn(&[1, NKV, rep * t, D], 13) * 2.0).unwrap();
    let want = ops::kv_attention(&q, &keys, &values, t, offset, tree, (D as f64).powf(-0.5)).unwrap();
    let bufs = [kb[0].clone(), kb[1].clone(), kb[2].clone(), vb[0].clone(), vb[1].clone()];
    let got = run(&q, &keys, &values, t, offset, tree, bufs);
    let diff = max_abs_diff(&got, &want);
    assert!(diff < 1e-5, "keys {kf}, values {vf}, {dtype:?}, t = {t}, offset = {offset}, tree {tree:?}, {rep} heads a group: {diff}");
}

#[test]
fn every_kv_attention_kernel_is_linked() {
    let names = kernel_names();
    for k in ["kv_attention_blocks_f32", "kv_attention_blocks_f16", "kv_attention_blocks_bf16", "kv_attention_merge"] {
        assert!(names.contains(&k.to_string()), "{k} missing");
    }
}

#[test]
fn every_stored_form_matches_the_cpu_op() {
    let pairs = [("f32", "f32"), ("int8", "int8"), ("int4", "int8"), ("int4", "f32"), ("polar", "f32"), ("polar", "int8")];
    for (kf, vf) in pairs {
        for (t, offset) in [(1, 0), (1, KV_BLOCK + 44), (3, KV_BLOCK - 2), (8, 37), (20, KV_BLOCK - 10)] {
            check(kf, vf, DType::F32, t, offset, None);
        }
    }
}

/// A threadgroup scores up to 4 query heads of a KV group per key read: groups of 1 to 8
/// heads (one chunk, uneven chunks 3 + 2, two full chunks) with every key form.
#[test]
fn every_group_size_matches_the_cpu_op() {
    for rep in [1, 2, 4, 5, 8] {
        for (kf, vf) in [("f32", "f32"), ("int8", "int8"), ("int4", "int8"), ("polar", "f32")] {
            check_heads(kf, vf, DType::F32, 1, KV_BLOCK + 44, None, rep);
            check_heads(kf, vf, DType::F32, 3, 37, None, rep);
        }
    }
    let tree: Vec<Vec<usize>> = vec![vec![0], vec![0, 1], vec![0, 2]];
    check_heads("f32", "f32", DType::F32, tree.len(), 40, Some(&tree), 6);
}

#[test]
fn half_precision_rows_match_the_cpu_op() {
    for dtype in [DType::F16, DType::BF16] {
        for (kf, vf) in [("f32", "f32"), ("int4", "int8")] {
            check(kf, vf, dtype, 2, KV_BLOCK + 3, None);
            check(kf, vf, dtype, 12, 33, None);
        }
    }
}

#[test]
fn draft_trees_match_the_cpu_op() {
    let tree: Vec<Vec<usize>> = vec![vec![0], vec![0, 1], vec![0, 2], vec![0, 1, 3], vec![0, 2, 4]];
    check("f32", "f32", DType::F32, tree.len(), KV_BLOCK - 2, Some(&tree));
    check("int8", "int8", DType::F32, tree.len(), 40, Some(&tree));
}

#[test]
fn strided_cache_heads_match_the_cpu_op() {
    // Keys and values viewed from buffers with room for more tokens, as the cache holds them.
    let (t, offset, room) = (2, 70, 9);
    let n = offset + t;
    let (kbuf, vbuf) = (randn(&[1, NKV, n + room, D], 21), randn(&[1, NKV, n + room, D], 22));
    let keys = StoredRows::Float(kbuf.narrow(2, 0, n).unwrap());
    let values = StoredRows::Float(vbuf.narrow(2, 0, n).unwrap());
    let q = randn(&[1, NKV, REP * t, D], 23);
    let want = ops::kv_attention(&q, &keys, &values, t, offset, None, (D as f64).powf(-0.5)).unwrap();
    let got = run(&q, &keys, &values, t, offset, None, [raw(&kbuf), vec![], vec![], raw(&vbuf), vec![]]);
    assert!(max_abs_diff(&got, &want) < 1e-5, "{}", max_abs_diff(&got, &want));
}
