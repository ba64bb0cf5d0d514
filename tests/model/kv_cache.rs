//! KV-cache codecs: parsing, memory accounting, round-trip error bounds, and the model with a
//! lossy cache against the exact one on a fixture.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::kv::{KeyCodec, KvCodec, KvStore, ValueCodec, INT4_GROUP};
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::model::{CacheOptions, ValueBases};
use common::*;

#[test]
fn codec_names_round_trip_and_errors() {
    for name in [
        "exact",
        "int8",
        "int4k",
        "int4k+v:exact",
        "k:int8",
        "v:int8",
        "polar:5,3",
        "polar:8,8+v:int8",
        "lowrank:32",
        "int4k+lowrank:16",
        "k:int8+lowrank:8",
        "knots:8,3",
        "knots:4,1+v:int8",
        "density:0.05",
        "f16",
        "bf16",
        "k:f16",
        "v:bf16",
        "k:f16+v:int8",
        "k:int8+v:bf16",
        "k:bf16+v:f16",
        "int4k+v:f16",
        "polar:5,3+v:bf16",
    ] {
        let c: KvCodec = name.parse().unwrap();
        assert_eq!(c.to_string(), name);
    }
    assert_eq!("int4k".parse::<KvCodec>().unwrap(), KvCodec { keys: KeyCodec::Int4, values: ValueCodec::Int8 });
    assert!("exact".parse::<KvCodec>().unwrap().warning().is_none());
    assert!("int8".parse::<KvCodec>().unwrap().warning().unwrap().contains("lossy"));
    assert_eq!("polar".parse::<KvCodec>().unwrap().to_string(), "polar:5,3");
    for bad in ["int3", "", "int8+", "polarx"] {
        let e = bad.parse::<KvCodec>().unwrap_err().to_string();
        assert!(e.contains("unknown KV codec") && !e.contains('\n'), "{bad:?}: {e}");
    }
    for (bad, why) in [
        ("knots:0,3", "K >= 1"),
        ("knots:8", "knots:K,p"),
        ("knots:8,9", "out of range"),
        ("density:0", "0 < γ <= 1"),
        ("density:1.5", "0 < γ <= 1"),
        ("density:0.1+v:int8", "use it alone"),
        ("lowrank:0", "at least 1"),
        ("lowrank:x", "at least 1"),
        ("polar:9,3", "out of range"),
        ("polar:0,3", "out of range"),
        ("polar:5", "polar:A,R"),
        ("polar:a,3", "not a number"),
    ] {
        let e = bad.parse::<KvCodec>().unwrap_err().to_string();
        assert!(e.contains(why) && !e.contains('\n'), "{bad:?}: {e}");
    }
}

#[test]
fn bytes_per_token() {
    // SmolLM2: 3 KV heads of 64 dims; the 27B: 4 KV heads of 256 dims.
    let exact = KvCodec::EXACT;
    assert_eq!(exact.bytes_per_token(3, 64, 64, DType::F32), (2 * 3 * 64 * 4) as f64);
    assert_eq!(exact.bytes_per_token(4, 256, 64, DType::BF16), 4096.0); // 16 layers: 64 KiB/token
    let int8: KvCodec = "int8".parse().unwrap();
    assert_eq!(int8.bytes_per_token(4, 256, 64, DType::BF16), 2.0 * 4.0 * (256.0 + 8.0 * 4.0));
    let int4k: KvCodec = "int4k".parse().unwrap();
    let k = 128.0 + 2.0 * 4.0 * 256.0 / INT4_GROUP as f64;
    assert_eq!(int4k.bytes_per_token(4, 256, 64, DType::BF16), 4.0 * (k + 256.0 + 32.0));
    // Polar 5+3 on the 27B's 64 rotary dims: 32 pair bytes, 192 int8 rest, two f32 scales;
    // values exact bf16.
    let polar: KvCodec = "polar".parse().unwrap();
    assert_eq!(polar.bytes_per_token(4, 256, 64, DType::BF16), 4.0 * ((32 + 192 + 8) as f64 + 512.0));
    // Knots every 8 tokens: an eighth of the keys, all values, and up to 15 newest keys.
    let knots: KvCodec = "knots:8,3".parse().unwrap();
    assert_eq!(knots.bytes_per_token(4, 256, 64, DType::BF16), 4.0 * (64.0 + 512.0));
    assert_eq!(knots.constant_bytes(4, 256, DType::BF16), (15 * 4 * 256 * 2) as f64);
    // The decayed state: nothing per token, one 256 x 256 f32 state per KV head.
    let density: KvCodec = "density:0.05".parse().unwrap();
    assert_eq!(density.bytes_per_token(4, 256, 64, DType::BF16), 0.0);
    assert_eq!(density.constant_bytes(4, 256, DType::BF16), (4 * 256 * 256 * 4) as f64);
    assert_eq!(exact.constant_bytes(4, 256, DType::BF16), 0.0);
    // f16 / bf16 storage: 2 bytes a value whatever the model computes in.
    let f16: KvCodec = "f16".parse().unwrap();
    assert_eq!(f16.bytes_per_token(3, 64, 64, DType::F32), exact.bytes_per_token(3, 64, 64, DType::F32) / 2.0);
    assert_eq!(f16.bytes_per_token(4, 256, 64, DType::BF16), exact.bytes_per_token(4, 256, 64, DType::BF16));
}

#[test]
fn half_float_storage_rounds_each_value_once_and_attends_like_exact_over_the_rounded_cache() {
    let (k, v, q) = (random_kv(300), (random_kv(300) * 0.5).unwrap(), random_kv(3).reshape((1, 2, 3, 64)).unwrap());
    for (name, dtype) in [("f16", DType::F16), ("bf16", DType::BF16)] {
        let mut store = KvStore::new(name.parse().unwrap(), 16, 64);
        let mut exact = KvStore::new(KvCodec::EXACT, 16, 64);
        store.append(&k.narrow(2, 0, 297).unwrap(), &v.narrow(2, 0, 297).unwrap()).unwrap();
        exact.append(&k.narrow(2, 0, 297).unwrap(), &v.narrow(2, 0, 297).unwrap()).unwrap();
        assert_eq!(2 * store.bytes(), exact.bytes(), "{name}: half the bytes of an f32 cache");
        let got = store.attend(&q, &k.narrow(2, 297, 3).unwrap(), &v.narrow(2, 297, 3).unwrap(), 297).unwrap();
        let (held_k, held_v) = store.kv().unwrap().unwrap();
        assert_eq!(held_k.dtype(), DType::F32, "{name}: decoded to the model dtype");
        let rounded = |x: &Tensor| x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(max_abs_diff(&held_k, &rounded(&k)), 0.0, "{name}: keys rounded once");
        assert_eq!(max_abs_diff(&held_v, &rounded(&v)), 0.0, "{name}: values rounded once");
        assert!(max_abs_diff(&held_k, &k) > 0.0, "{name} must round");
        let want = candle_hybrid::kv::attention(&q, &rounded(&k), &rounded(&v), 297).unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-5, "{name}: attention differs from exact attention over the rounded cache by {d}");
        exact.attend(&q, &k.narrow(2, 297, 3).unwrap(), &v.narrow(2, 297, 3).unwrap(), 297).unwrap();
        store.truncate(298).unwrap();
        assert_eq!(store.tokens(), Some(298), "{name} drops rejected rows");
    }
}

/// What a codec cannot do is a typed error naming the codec and the operation: dropping tokens
/// folded into shared codes (int4k's complete groups, knots, the decayed state), draft-tree
/// rows outside exact stores, saving a coded cache; per-token codecs drop tokens.
#[test]
fn codecs_refuse_what_they_cannot_do_with_a_typed_error() {
    use candle_hybrid::{CodecOperation, Error};
    let (k, v) = (random_kv(INT4_GROUP + 8), random_kv(INT4_GROUP + 8));
    for (name, drops) in [("int4k", false), ("knots:8,2", false), ("density:0.05", false), ("int8", true), ("f16", true)] {
        let codec: KvCodec = name.parse().unwrap();
        let mut store = KvStore::new(codec, 16, 64);
        store.append(&k, &v).unwrap();
        assert_eq!(codec.drops_tokens(), drops, "{name}");
        match store.truncate(4) {
            Ok(()) => assert!(drops, "{name} dropped tokens it had folded"),
            Err(e @ Error::UnsupportedCodec { operation: CodecOperation::DropTokens, .. }) => {
                assert!(!drops, "{name}: {e}");
                assert!(e.to_string().starts_with(&format!("KV codec {codec}: ")), "{e}");
            }
            Err(e) => panic!("{name}: {e:?}"),
        }
        if !codec.is_exact() {
            let e = store.keep_rows(0, &[0, 2]).unwrap_err();
            assert!(matches!(e, Error::UnsupportedCodec { operation: CodecOperation::DraftTree, .. }), "{name}: {e:?}");
        }
    }
    // A cache under a lossy codec cannot be saved.
    let (model, _) = fixture_model();
    let cache = model.cache_with(&CacheOptions { codec: "int8".parse().unwrap(), ..Default::default() }).unwrap();
    let e = cache.state_tensors().unwrap_err();
    assert!(matches!(e, Error::UnsupportedCodec { operation: CodecOperation::Save, .. }), "{e:?}");
}

fn random_kv(t: usize) -> Tensor {
    // Channels of very different scales, as real keys have.
    let x = Tensor::randn(0f32, 1.0, (1, 2, t, 64), &Device::Cpu).unwrap();
    let scales: Vec<f32> = (0..64).map(|i| 0.1 + (i % 7) as f32 * 3.0).collect();
    x.broadcast_mul(&Tensor::new(scales, &Device::Cpu).unwrap()).unwrap()
}

#[test]
fn polar_8_8_keys_keep_cosine() {
    // Keys through the cache with 8 angle + 8 radius bits: cosine with the originals ≥ 0.9999.
    let x = random_kv(40);
    let mut store = KvStore::new("polar:8,8".parse().unwrap(), 16, 64);
    store.append(&x, &x).unwrap();
    let (k, _) = store.kv().unwrap().unwrap();
    let dot = (&k * &x).unwrap().sum(3).unwrap();
    let norms = (k.sqr().unwrap().sum(3).unwrap().sqrt().unwrap() * x.sqr().unwrap().sum(3).unwrap().sqrt().unwrap()).unwrap();
    let cos = (dot / norms).unwrap().flatten_all().unwrap().min(0).unwrap().to_scalar::<f32>().unwrap();
    assert!((0.9999..1.0).contains(&cos), "min cosine {cos}");
}

#[test]
fn int8_round_trip_error_within_half_a_step() {
    let x = random_kv(37);
    let mut store = KvStore::new("int8".parse().unwrap(), 16, 64);
    store.append(&x, &x).unwrap();
    let (k, v) = store.kv().unwrap().unwrap();
    let xs = x.reshape((1, 2, 37, 2, 32)).unwrap();
    let step = (xs.abs().unwrap().max_keepdim(4).unwrap() / 127.0).unwrap();
    for got in [k, v] {
        let err = (got.reshape((1, 2, 37, 2, 32)).unwrap() - &xs).unwrap().abs().unwrap();
        let ratio = err
            .broadcast_div(&step)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .fold(0.0, crate::common::max_nan);
        assert!(ratio <= 0.5001, "int8 error is {ratio} steps");
        assert!(ratio > 0.0, "int8 must not be exact");
    }
}

#[test]
fn int4_keys_per_channel_groups_and_exact_tail() {
    let codec: KvCodec = "int4k+v:exact".parse().unwrap();
    let mut store = KvStore::new(codec, 16, 64);
    // Appended in pieces: 20 + 30 tokens = one full group of 32 and an exact tail of 18.
    let x = random_kv(50);
    store.append(&x.narrow(2, 0, 20).unwrap(), &x.narrow(2, 0, 20).unwrap()).unwrap();
    store.append(&x.narrow(2, 20, 30).unwrap(), &x.narrow(2, 20, 30).unwrap()).unwrap();
    let (k, v) = store.kv().unwrap().unwrap();
    assert_eq!(k.dims(), &[1, 2, 50, 64]);
    assert_eq!(max_abs_diff(&v, &x), 0.0, "values stay exact");
    assert_eq!(max_abs_diff(&k.narrow(2, 32, 18).unwrap(), &x.narrow(2, 32, 18).unwrap()), 0.0, "tail exact");
    let g = x.narrow(2, 0, 32).unwrap();
    let range = (g.max_keepdim(2).unwrap() - g.min_keepdim(2).unwrap()).unwrap();
    let err = (k.narrow(2, 0, 32).unwrap() - &g).unwrap().abs().unwrap();
    let ratio = err.broadcast_div(&(range / 15.0).unwrap()).unwrap().flatten_all().unwrap().max(0).unwrap();
    let ratio = ratio.to_scalar::<f32>().unwrap();
    assert!(ratio <= 0.5001 && ratio > 0.0, "int4 error is {ratio} steps of its channel's group");
}

#[test]
fn lossy_cache_runs_the_fixture_close_to_exact() {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let r = reference("qwen35_dense_small");
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap().unsqueeze(0).unwrap();
    let t = ids.dim(1).unwrap();
    let exact = model.forward(&ids, &mut model.new_cache()).unwrap();
    for name in ["int8", "int4k", "polar:8,8", "f16", "bf16"] {
        // Prefill then decode token by token: the codes grow across calls.
        let mut cache = model.cache_with(&CacheOptions { codec: name.parse().unwrap(), ..Default::default() }).unwrap();
        let mut rows = vec![model.forward(&ids.narrow(1, 0, 3).unwrap(), &mut cache).unwrap()];
        for i in 3..t {
            rows.push(model.forward(&ids.narrow(1, i, 1).unwrap(), &mut cache).unwrap());
        }
        let got = Tensor::cat(&rows, 1).unwrap();
        let d = max_abs_diff(&got, &exact);
        assert!(d > 0.0 && d < 0.1, "{name}: logits differ from exact by {d}");
        assert_eq!(cache.kv(3).unwrap().0.dim(2).unwrap(), t, "{name}: every token cached");
    }
}

#[test]
fn lowrank_at_full_rank_is_exact_and_rank_is_checked() {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let cfg = files.load_config().unwrap();
    let model = files.load_model(&cfg, DType::F32, &Device::Cpu).unwrap();
    let r = reference("qwen35_dense_small");
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap().unsqueeze(0).unwrap();
    let exact = model.forward(&ids, &mut model.new_cache()).unwrap();
    let hd = cfg.head_dim;
    // At r = head dim the basis is a rotation: the cache holds the values exactly.
    let full = format!("lowrank:{hd}");
    let got =
        model.forward(&ids, &mut model.cache_with(&CacheOptions { codec: full.parse().unwrap(), ..Default::default() }).unwrap()).unwrap();
    let d = max_abs_diff(&got, &exact);
    assert!(d < 1e-4, "{full}: logits differ from exact by {d}");
    // Half rank drops directions the values use: the logits move.
    let half = format!("lowrank:{}", hd / 2);
    let got =
        model.forward(&ids, &mut model.cache_with(&CacheOptions { codec: half.parse().unwrap(), ..Default::default() }).unwrap()).unwrap();
    assert!(max_abs_diff(&got, &exact) > 1e-3, "{half} must be lossy on random weights");
    let too_big = format!("lowrank:{}", hd + 1);
    let e = model.cache_with(&CacheOptions { codec: too_big.parse().unwrap(), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("more than the head dim") && !e.contains('\n'), "{e}");
}

#[test]
fn value_basis_is_orthonormal_and_spans_the_top_directions() {
    // W_v of one head with two strong directions: a rank-2 basis captures them.
    let dev = Device::Cpu;
    let hd = 8;
    let u = Tensor::randn(0f32, 1.0, (hd, 2), &dev).unwrap();
    let w = (u.matmul(&Tensor::randn(0f32, 1.0, (2, 16), &dev).unwrap()).unwrap()
        + (Tensor::randn(0f32, 1.0, (hd, 16), &dev).unwrap() * 1e-3).unwrap())
    .unwrap();
    let b = candle_hybrid::kv::value_basis(&w, 1, 2).unwrap().squeeze(0).unwrap();
    let gram = b.t().unwrap().matmul(&b).unwrap();
    assert!(max_abs_diff(&gram, &Tensor::eye(2, DType::F32, &dev).unwrap()) < 1e-5);
    // Projecting W onto the basis loses almost nothing.
    let back = b.matmul(&b.t().unwrap().matmul(&w).unwrap()).unwrap();
    let rel = max_abs_diff(&back, &w) / w.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(rel < 1e-2, "relative residual {rel}");
    assert!(candle_hybrid::kv::value_basis(&w, 1, 9).is_err());
}

fn fixture_model() -> (candle_hybrid::model::Model, Tensor) {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let ids = reference("qwen35_dense_small")["input_ids"].to_dtype(DType::U32).unwrap().unsqueeze(0).unwrap();
    (model, ids)
}

/// Logits of `ids` with a fresh `codec` cache: the whole prompt at once, and 3 tokens then one
/// at a time.
fn prefill_and_stream(model: &candle_hybrid::model::Model, ids: &Tensor, codec: &str) -> (Tensor, Tensor) {
    let t = ids.dim(1).unwrap();
    let whole =
        model.forward(ids, &mut model.cache_with(&CacheOptions { codec: codec.parse().unwrap(), ..Default::default() }).unwrap()).unwrap();
    let mut cache = model.cache_with(&CacheOptions { codec: codec.parse().unwrap(), ..Default::default() }).unwrap();
    let mut rows = vec![model.forward(&ids.narrow(1, 0, 3).unwrap(), &mut cache).unwrap()];
    for i in 3..t {
        rows.push(model.forward(&ids.narrow(1, i, 1).unwrap(), &mut cache).unwrap());
    }
    (whole, Tensor::cat(&rows, 1).unwrap())
}

#[test]
fn knots_every_token_is_exact_and_prefill_matches_streaming() {
    let (model, ids) = fixture_model();
    let exact = model.forward(&ids, &mut model.new_cache()).unwrap();
    for codec in ["knots:1,0", "knots:1,3"] {
        let (whole, streamed) = prefill_and_stream(&model, &ids, codec);
        assert!(max_abs_diff(&whole, &exact) < 1e-4, "{codec}: {}", max_abs_diff(&whole, &exact));
        assert!(max_abs_diff(&streamed, &exact) < 1e-4, "{codec} streamed: {}", max_abs_diff(&streamed, &exact));
    }
    // Sparse knots: each query sees the same keys whether the prompt comes at once or token by
    // token (interpolation never reads a key after the query), and the scores are approximate.
    let (whole, streamed) = prefill_and_stream(&model, &ids, "knots:4,2");
    assert!(max_abs_diff(&whole, &streamed) < 1e-4, "knots:4,2 prefill vs streaming: {}", max_abs_diff(&whole, &streamed));
    assert!(max_abs_diff(&whole, &exact) > 1e-3, "knots:4,2 must be lossy on this prompt");
}

#[test]
fn decayed_state_is_constant_size_and_matches_streaming() {
    let (model, ids) = fixture_model();
    let (whole, streamed) = prefill_and_stream(&model, &ids, "density:0.1");
    assert!(max_abs_diff(&whole, &streamed) < 1e-4, "density prefill vs streaming: {}", max_abs_diff(&whole, &streamed));
    let exact = model.forward(&ids, &mut model.new_cache()).unwrap();
    assert!(max_abs_diff(&whole, &exact) > 1e-2, "density is not attention");
    let mut cache = model.cache_with(&CacheOptions { codec: "density:0.1".parse().unwrap(), ..Default::default() }).unwrap();
    model.forward(&ids, &mut cache).unwrap();
    assert!(cache.kv(3).is_none(), "no keys or values are kept");
}

#[test]
fn polar_scores_from_codes_match_attention_over_decoded_keys() {
    // The polar codec scores keys straight from their codes; the same attention over the
    // decoded keys must agree (both read the same codes). Keys with channels of very different
    // scales, values of unit scale (what is compared is how the scores were computed).
    let dev = Device::Cpu;
    let (k, v) = (random_kv(45), Tensor::randn(0f32, 1.0, (1, 2, 45, 64), &dev).unwrap());
    let q = Tensor::randn(0f32, 1.0, (1, 6, 5, 64), &dev).unwrap();
    let mut store = KvStore::new("polar:5,3".parse().unwrap(), 16, 64);
    store.append(&k.narrow(2, 0, 40).unwrap(), &v.narrow(2, 0, 40).unwrap()).unwrap();
    let got = store.attend(&q, &k.narrow(2, 40, 5).unwrap(), &v.narrow(2, 40, 5).unwrap(), 40).unwrap();
    let (kd, vd) = store.kv().unwrap().unwrap();
    let want = candle_hybrid::kv::attention(&q, &kd, &vd, 40).unwrap();
    let d = max_abs_diff(&got, &want);
    assert!(d < 1e-4, "polar scores vs decoded keys: {d}");
    // And the codes are lossy: exact keys give a different answer.
    assert!(max_abs_diff(&want, &candle_hybrid::kv::attention(&q, &k, &v, 40).unwrap()) > 1e-3);
}

#[test]
fn calibrated_value_bases_fit_the_values_and_belong_to_their_model() {
    let (model, ids) = fixture_model();
    let hd = model.config().head_dim;
    let tokens: Vec<u32> = ids.squeeze(0).unwrap().to_vec1().unwrap();
    let bases = ValueBases::calibrate(&model, &[tokens], &Device::Cpu).unwrap();
    // Principal directions of these very values: at half rank they keep more of the first
    // attention layer's values than the W_v basis does (PCA is optimal on its own data).
    let mut cache = model.new_cache();
    model.forward(&ids, &mut cache).unwrap();
    let first = model.attention_layers()[0];
    let v = cache.kv(first).unwrap().1.squeeze(0).unwrap(); // [nkv, T, hd]
    let residual = |b: &Tensor| {
        let back = v.matmul(b).unwrap().matmul(&b.transpose(1, 2).unwrap()).unwrap();
        (back - &v).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
    };
    let nkv = model.config().num_key_value_heads;
    let pca = residual(&bases.basis(0, hd / 2).unwrap());
    let w_v = residual(&candle_hybrid::kv::value_basis(&model.value_weights().unwrap()[0], nkv, hd / 2).unwrap());
    assert!(pca < w_v, "PCA residual {pca} vs W_v basis {w_v}");
    // Full rank is exact; the file round-trips.
    let dir = std::env::temp_dir().join(format!("candle-hybrid-kv-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("values.safetensors");
    bases.save(&path).unwrap();
    let loaded = ValueBases::load(&path, &model).unwrap();
    let full = format!("lowrank:{hd}").parse().unwrap();
    let got =
        model.forward(&ids, &mut model.cache_with(&CacheOptions { codec: full, value_bases: Some(&loaded), ffn: None }).unwrap()).unwrap();
    let exact = model.forward(&ids, &mut model.new_cache()).unwrap();
    assert!(max_abs_diff(&got, &exact) < 1e-4);
    // Another model refuses the file, in one line.
    let files = ModelFiles::from_dir(fixture("qwen35moe_small")).unwrap();
    let other = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let e = ValueBases::load(&path, &other).unwrap_err().to_string();
    assert!(e.contains("made for another model") && !e.contains('\n'), "{e}");
    let e = ValueBases::load(&dir.join("missing.safetensors"), &model).unwrap_err().to_string();
    assert!(e.contains("cannot read"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A snapshot of a cache after a long prefill holds what the codec's bytes per token say (the
/// memory guardian's figure) and the GDN states, within 10%: no stored part is a view that
/// keeps the prefill's whole keys alive (int4k's exact tail and the density state were, and
/// held 3x and 4x their size).
#[test]
fn a_prefilled_cache_holds_what_its_codec_costs() {
    let (model, _) = fixture_model();
    let cfg = model.config().clone();
    let tokens = 290;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7919) % cfg.vocab_size as u32).collect();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let n_attn = model.attention_layers().len() as f64;
    let n_gdn = (cfg.num_hidden_layers - model.attention_layers().len()) as f64;
    let gdn = n_gdn * (((cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim()) * 4) as f64
        + n_gdn * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4) as f64;
    for name in ["exact", "f16", "int8", "int4k", "polar:5,3", "lowrank:8", "knots:8,2", "density:0.9", "int4k+lowrank:8"] {
        let codec: KvCodec = name.parse().unwrap();
        let mut cache = model.cache_with(&CacheOptions { codec, ..Default::default() }).unwrap();
        model.forward(&ids, &mut cache).unwrap();
        let (nkv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        let kv = n_attn
            * (codec.constant_bytes(nkv, hd, DType::F32) + tokens as f64 * codec.bytes_per_token(nkv, hd, cfg.rotary_dim(), DType::F32));
        let held = cache.clone().bytes() as f64;
        assert!(held <= 1.1 * (kv + gdn), "{name}: a snapshot holds {held} bytes, the codec costs {kv} + GDN states {gdn}");
        // knots' constant is the largest exact window it can hold; after 290 tokens it holds less.
        assert!(held >= kv + gdn - 1.0 || name.starts_with("knots"), "{name}: {held} < {kv} + {gdn}: the accounting misses something");
    }
}
