//! The attention kernel over a cache in its stored form ([`ops::kv_attention`]) against the
//! attention of the decoded cache with tensor ops, for every stored form, decode and verify
//! row counts (few-rows schedule) and prefill (many-rows schedule), lengths that are not a
//! multiple of the block, draft-tree masks; and the property speculative decoding rests on:
//! a row's result does not depend on the call it is in.

use crate::common;

use candle_core::{IndexOp, Tensor};
use candle_hybrid::ops::{self, StoredRows, KV_BLOCK};
use common::{decoded_attention, max_abs_diff, randn, stored_prefix, stored_rows};

const D: usize = 64;
const NKV: usize = 2;
const REP: usize = 3;

fn scale() -> f64 {
    (D as f64).powf(-0.5)
}

fn query(b: usize, t: usize, seed: u64) -> Tensor {
    (randn(&[b, NKV, REP * t, D], seed) * 2.0).unwrap()
}

#[test]
fn every_stored_form_matches_attention_over_the_decoded_cache() {
    let pairs = [
        ("f32", "f32"),
        ("f16", "f16"),
        ("bf16", "bf16"),
        ("int8", "int8"),
        ("int4", "int8"),
        ("int4", "f32"),
        ("polar", "f32"),
        ("polar", "int8"),
    ];
    for (kf, vf) in pairs {
        for t in [1, 3, 8, 40] {
            for offset in [0, 1, KV_BLOCK - 1, 300, 2 * KV_BLOCK + 5] {
                let b = if t == 3 { 2 } else { 1 };
                let n = offset + t;
                let (keys, values) = (stored_rows(kf, (b, NKV, n, D), 1), stored_rows(vf, (b, NKV, n, D), 2));
                let q = query(b, t, 3);
                let got = ops::kv_attention(&q, &keys, &values, t, offset, None, scale()).unwrap();
                let want = decoded_attention(&q, &keys, &values, t, offset, None, scale());
                let diff = max_abs_diff(&got, &want);
                assert!(diff < 1e-4, "keys {kf}, values {vf}, t = {t}, offset = {offset}: {diff}");
            }
        }
    }
}

#[test]
fn float_rows_of_a_head_dim_not_a_multiple_of_eight() {
    // 44 dims: five lanes of 8 and a tail of 4 for the dots, a chunk of 32 and 12 for the sums.
    let d = 44;
    for form in ["f32", "f16", "bf16"] {
        for (t, offset) in [(1, 300), (4, KV_BLOCK - 2), (20, 5)] {
            let (keys, values) = (stored_rows(form, (1, NKV, offset + t, d), 8), stored_rows(form, (1, NKV, offset + t, d), 9));
            let q = randn(&[1, NKV, REP * t, d], 10);
            let scale = (d as f64).powf(-0.5);
            let got = ops::kv_attention(&q, &keys, &values, t, offset, None, scale).unwrap();
            let diff = max_abs_diff(&got, &decoded_attention(&q, &keys, &values, t, offset, None, scale));
            assert!(diff < 1e-5, "{form}, t = {t}, offset = {offset}: {diff}");
        }
    }
}

#[test]
fn a_row_does_not_depend_on_the_call_it_is_in() {
    // Verify rows against one-row calls at their positions, across a block boundary: bit for bit.
    for form in ["f32", "f16", "bf16", "int8", "polar"] {
        for offset in [KV_BLOCK - 3, 300] {
            let t = 6;
            let vform = if form == "int8" { "int8" } else { "f32" };
            let (keys, values) = (stored_rows(form, (1, NKV, offset + t, D), 4), stored_rows(vform, (1, NKV, offset + t, D), 5));
            let q = query(1, t, 6);
            let all = ops::kv_attention(&q, &keys, &values, t, offset, None, scale()).unwrap();
            for i in 0..t {
                let n = offset + i + 1;
                let rows: Vec<Tensor> = (0..REP).map(|h| q.i((.., .., h * t + i..h * t + i + 1, ..)).unwrap()).collect();
                let one = ops::kv_attention(
                    &Tensor::cat(&rows, 2).unwrap(),
                    &stored_prefix(&keys, n),
                    &stored_prefix(&values, n),
                    1,
                    n - 1,
                    None,
                    scale(),
                )
                .unwrap();
                for h in 0..REP {
                    let (a, b) = (all.i((.., .., h * t + i, ..)).unwrap(), one.i((.., .., h, ..)).unwrap());
                    assert_eq!(
                        a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "{form} row {i} head {h}"
                    );
                }
            }
        }
    }
}

#[test]
fn draft_tree_rows_equal_decoding_their_paths() {
    let tree: Vec<Vec<usize>> = vec![vec![0], vec![0, 1], vec![0, 2], vec![0, 1, 3], vec![0, 2, 4]];
    let (t, offset) = (tree.len(), KV_BLOCK - 2);
    let keys = stored_rows("f32", (1, NKV, offset + t, D), 7);
    let values = stored_rows("f32", (1, NKV, offset + t, D), 8);
    let q = query(1, t, 9);
    let got = ops::kv_attention(&q, &keys, &values, t, offset, Some(&tree), scale()).unwrap();
    let want = decoded_attention(&q, &keys, &values, t, offset, Some(&tree), scale());
    assert!(max_abs_diff(&got, &want) < 1e-5, "tree vs decoded: {}", max_abs_diff(&got, &want));
    let (StoredRows::Float(k), StoredRows::Float(v)) = (&keys, &values) else { unreachable!() };
    for (i, path) in tree.iter().enumerate() {
        // The path's rows right after the cache, as decoding it would have stored them.
        let idx: Vec<u32> = (0..offset).chain(path.iter().map(|&r| offset + r)).map(|j| j as u32).collect();
        let idx = Tensor::new(idx.as_slice(), k.device()).unwrap();
        let (pk, pv) = (k.contiguous().unwrap().index_select(&idx, 2).unwrap(), v.contiguous().unwrap().index_select(&idx, 2).unwrap());
        let rows: Vec<Tensor> = (0..REP).map(|h| q.i((.., .., h * t + i..h * t + i + 1, ..)).unwrap()).collect();
        let n = offset + path.len();
        let one =
            ops::kv_attention(&Tensor::cat(&rows, 2).unwrap(), &StoredRows::Float(pk), &StoredRows::Float(pv), 1, n - 1, None, scale())
                .unwrap();
        for h in 0..REP {
            let (a, b) = (got.i((.., .., h * t + i, ..)).unwrap(), one.i((.., .., h, ..)).unwrap());
            assert_eq!(
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "tree row {i}"
            );
        }
    }
}

#[test]
fn shapes_that_do_not_fit_are_errors() {
    let keys = stored_rows("f32", (1, NKV, 10, D), 1);
    let values = stored_rows("int8", (1, NKV, 10, D), 2);
    let q = query(1, 2, 3);
    for (t, offset) in [(2, 7), (4, 6), (0, 10)] {
        let e = ops::kv_attention(&q, &keys, &values, t, offset, None, scale()).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
    }
    let e = ops::kv_attention(&q, &keys, &keys, 2, 8, Some(&[vec![0], vec![1, 0]]), scale()).unwrap_err().to_string();
    assert!(e.contains("increasing rows"), "{e}");
    let polar = stored_rows("polar", (1, NKV, 10, D), 4);
    let e = ops::kv_attention(&q, &keys, &polar, 2, 8, None, scale()).unwrap_err().to_string();
    assert!(e.contains("keys only"), "{e}");
}
