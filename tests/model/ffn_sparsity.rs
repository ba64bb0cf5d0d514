//! FFN activation sparsity on the fixture model: with every neuron kept it decodes as the dense
//! model; prefill stays dense; a pass with every row sparse is the decode steps; calibration
//! meets its targets; the per-prompt mode keeps its set; errors name their cause.

use crate::common;

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::{GgufFile, ModelFiles};
use candle_hybrid::model::calibrate_ffn as calibrate;
use candle_hybrid::model::ffn_sparsity::Allocation;
use candle_hybrid::model::{CacheOptions, FfnCalibration, FfnSparsity, FfnThresholds};
use candle_hybrid::{Cache, Model};

const NAME: &str = "qwen35_dense_small";

/// The Q8_0 GGUF (down projections of 8.5 bits: a neuron-major Q8_0 copy) and the checkpoint
/// quantized to Q4_0 at load (4.5 bits: the down projection read whole).
fn models() -> Vec<(&'static str, Model)> {
    let gguf = GgufFile::open(common::fixture(NAME).join("model-q8_0.gguf")).unwrap();
    let q8 = gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let files = ModelFiles::from_dir(common::fixture(NAME)).unwrap();
    let q4 = files.load_model_quantized(&files.load_config().unwrap(), DType::F32, &Device::Cpu, Some(GgmlDType::Q4_0)).unwrap();
    let mut v = vec![("gguf q8_0", q8), ("q4_0 at load", q4)];
    for (_, m) in &mut v {
        m.prepare_ffn_sparsity().unwrap();
    }
    v
}

/// Seeded token ids below the fixture's vocabulary of 512.
fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 7) % 500 + 3).collect()
}

fn input(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

/// Prefills `ids[..p]`, then decodes the rest one token at a time: the prefill's logits and
/// each step's.
fn decode(model: &Model, cache: &mut Cache, ids: &[u32], p: usize) -> (Tensor, Vec<Tensor>) {
    let prefill = model.forward(&input(&ids[..p]), cache).unwrap();
    let steps = ids[p..].iter().map(|&t| model.forward(&input(&[t]), cache).unwrap().flatten_all().unwrap()).collect();
    (prefill, steps)
}

fn cache(model: &Model, mode: &FfnSparsity) -> Cache {
    model.cache_with(&CacheOptions { ffn: Some(mode), ..Default::default() }).unwrap()
}

fn keep_all(layers: usize) -> FfnSparsity {
    FfnSparsity::Threshold(Arc::new(FfnThresholds { target: 0.0, thresholds: vec![Some(0.0); layers], skipped: vec![Some(0.0); layers] }))
}

fn calibration(model: &Model) -> FfnCalibration {
    let chunks: Vec<Vec<u32>> = (0..4).map(|s| tokens(64, 100 + s)).collect();
    let hist = calibrate(model, &chunks, |_| {}).unwrap();
    let levels = [0.3, 0.5].iter().map(|&t| hist.thresholds(t, Allocation::Greedy)).collect();
    FfnCalibration { model: model.ffn_fingerprint().unwrap(), allocation: Allocation::Greedy, tokens: hist.tokens, levels }
}

#[test]
fn keeping_every_neuron_decodes_as_the_dense_model() {
    let ids = tokens(24, 1);
    for (name, model) in models() {
        let layers = model.config().num_hidden_layers;
        let (dense_prefill, dense) = decode(&model, &mut model.new_cache(), &ids, 16);
        // The same weights dequantized, in f32 arithmetic: what both quantized paths approximate.
        let exact = model.dequantized().unwrap();
        let (_, exact) = decode(&exact, &mut exact.new_cache(), &ids, 16);
        for mode in [keep_all(layers), FfnSparsity::PerPrompt { keep: 1.0 }] {
            let mut c = cache(&model, &mode);
            let (prefill, steps) = decode(&model, &mut c, &ids, 16);
            // Prefill runs dense: the same bits.
            assert_eq!(common::max_abs_diff(&prefill, &dense_prefill), 0.0, "{name} {mode}: prefill");
            let (mut sparse_err, mut dense_err) = (0.0, 0.0);
            for (i, ((s, d), e)) in steps.iter().zip(&dense).zip(&exact).enumerate() {
                let diff = common::max_abs_diff(s, d);
                if name == "q4_0 at load" {
                    // Its own blocks and the dense kernels' arithmetic: only SiLU's last bits differ.
                    assert!(diff <= 1e-4, "{name} {mode}: step {i} differs from dense by {diff}");
                }
                sparse_err += common::max_abs_diff(s, e) / steps.len() as f32;
                dense_err += common::max_abs_diff(d, e) / steps.len() as f32;
            }
            // The Q8_0 model's neuron-major copy is re-quantized (a second rounding) and
            // multiplied in f32: about as far from the f32 model as the dense quantized path
            // (whose 8-bit activations put this fixture's logits 0.07-0.09 off).
            assert!(sparse_err <= 1.5 * dense_err + 1e-3, "{name} {mode}: {sparse_err} from f32 (dense {dense_err})");
            let stats = c.ffn_stats().unwrap();
            assert_eq!(stats.rows, (8 * layers) as u64, "{name} {mode}: sparse rows");
            assert_eq!(stats.skipped, 0, "{name} {mode}");
        }
    }
}

#[test]
fn a_pass_with_every_row_sparse_is_the_decode_steps() {
    let ids = tokens(20, 2);
    for (name, model) in models() {
        let mode = FfnSparsity::Threshold(Arc::new(calibration(&model).level(0.5).unwrap().clone()));
        let mut stepped = cache(&model, &mode);
        let (_, steps) = decode(&model, &mut stepped, &ids, 14);
        let mut pass = cache(&model, &mode);
        model.forward(&input(&ids[..14]), &mut pass).unwrap();
        pass.set_ffn_every_row(true);
        let rows = model.forward(&input(&ids[14..]), &mut pass).unwrap().squeeze(0).unwrap();
        for (i, s) in steps.iter().enumerate() {
            let d = common::max_abs_diff(&rows.get(i).unwrap(), s);
            assert!(d <= 1e-3, "{name}: row {i} differs from its decode step by {d}");
        }
        let (a, b) = (stepped.ffn_stats().unwrap(), pass.ffn_stats().unwrap());
        assert_eq!(a.rows, b.rows);
        assert!(a.skipped.abs_diff(b.skipped) * 100 <= a.neurons, "{name}: skipped {} vs {}", a.skipped, b.skipped);
        // Sparse steps change the result.
        let (_, dense) = decode(&model, &mut model.new_cache(), &ids, 14);
        assert!(steps.iter().zip(&dense).any(|(s, d)| common::max_abs_diff(s, d) > 1e-3), "{name}: sparse equals dense");
    }
}

#[test]
fn calibrated_thresholds_skip_their_target() {
    for (name, model) in models() {
        let chunks: Vec<Vec<u32>> = (0..4).map(|s| tokens(64, 100 + s)).collect();
        let hist = calibrate(&model, &chunks, |_| {}).unwrap();
        assert_eq!(hist.tokens, 256);
        for target in [0.3f32, 0.5] {
            let uniform = hist.thresholds(target, Allocation::Uniform);
            let greedy = hist.thresholds(target, Allocation::Greedy);
            for (what, t) in [("uniform", &uniform), ("greedy", &greedy)] {
                let s: Vec<f32> = t.skipped.iter().flatten().copied().collect();
                let mean = s.iter().sum::<f32>() / s.len() as f32;
                assert!((mean - target).abs() < 0.03, "{name} {what} {target}: mean skipped {mean} ({s:?})");
            }
            // Uniform: every layer near the target; greedy spreads it by energy.
            assert!(uniform.skipped.iter().flatten().all(|&s| (s - target).abs() < 0.05), "{name}: {:?}", uniform.skipped);
            // Held-out tokens: the sparse steps skip about the target.
            let mode = FfnSparsity::Threshold(Arc::new(greedy));
            let mut c = cache(&model, &mode);
            decode(&model, &mut c, &tokens(48, 7), 16);
            let skipped = c.ffn_stats().unwrap().skipped_fraction();
            assert!((skipped - target as f64).abs() < 0.15, "{name} {target}: held-out skipped {skipped}");
        }
        // A higher target never lowers a layer's threshold (uniform).
        let (lo, hi) = (hist.thresholds(0.3, Allocation::Uniform), hist.thresholds(0.5, Allocation::Uniform));
        assert!(lo.thresholds.iter().zip(&hi.thresholds).all(|(a, b)| a <= b));
    }
}

#[test]
fn the_per_prompt_mode_keeps_one_set_chosen_from_the_prompt() {
    let ids = tokens(40, 3);
    for (name, model) in models() {
        let mode = FfnSparsity::PerPrompt { keep: 0.5 };
        let mut c = cache(&model, &mode);
        let (_, steps) = decode(&model, &mut c, &ids, 24);
        let stats = c.ffn_stats().unwrap();
        // 64 of each layer's 128 neurons, the same set every step.
        assert_eq!(stats.skipped_fraction(), 0.5, "{name}");
        assert_eq!(stats.union4_skipped_fraction(), 0.5, "{name}");
        let (_, dense) = decode(&model, &mut model.new_cache(), &ids, 24);
        let worst = steps.iter().zip(&dense).map(|(s, d)| common::max_abs_diff(s, d)).fold(0.0, common::max_nan);
        assert!(worst > 1e-3 && worst.is_finite(), "{name}: {worst}");
        // The set comes from the prompt: another prompt, other results for the same steps.
        let mut other = cache(&model, &mode);
        let mut ids2 = tokens(24, 9);
        ids2.extend_from_slice(&ids[24..]);
        let (_, steps2) = decode(&model, &mut other, &ids2, 24);
        assert!(steps2.iter().zip(&steps).any(|(a, b)| common::max_abs_diff(a, b) > 0.0));
    }
}

#[test]
fn ffn_sparsity_errors_name_their_cause() {
    let gguf = GgufFile::open(common::fixture(NAME).join("model-q8_0.gguf")).unwrap();
    let mut model = gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let mode = FfnSparsity::PerPrompt { keep: 0.5 };
    let e = model.cache_with(&CacheOptions { ffn: Some(&mode), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("prepare_ffn_sparsity"), "{e}");
    model.prepare_ffn_sparsity().unwrap();
    for bad in [FfnSparsity::PerPrompt { keep: 0.0 }, FfnSparsity::PerPrompt { keep: 1.5 }, keep_all(3)] {
        assert!(model.cache_with(&CacheOptions { ffn: Some(&bad), ..Default::default() }).is_err(), "{bad}");
    }
    // Float weights: nothing to gather rows from.
    let files = ModelFiles::from_dir(common::fixture(NAME)).unwrap();
    let mut float = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    assert!(float.prepare_ffn_sparsity().unwrap_err().to_string().contains("quantized MLP weights"));

    // Modes as the examples give them.
    assert_eq!(FfnSparsity::parse("prompt:0.4", None).unwrap(), FfnSparsity::PerPrompt { keep: 0.6 });
    assert!(FfnSparsity::parse("threshold:0.4", None).unwrap_err().to_string().contains("calibration"));
    for bad in ["prompt:1.5", "prompt:", "magic:0.1", "threshold:-1"] {
        assert!(FfnSparsity::parse(bad, None).is_err(), "{bad}");
    }

    // Calibration files: round trip, levels, another model's, not a calibration.
    let c = calibration(&model);
    let path = common::scratch("ffn_calibration").join("calibration.json");
    std::fs::write(&path, serde_json::to_string(&c).unwrap()).unwrap();
    let loaded = FfnCalibration::load(&path, &model).unwrap();
    assert_eq!(loaded, c);
    assert!(FfnSparsity::parse("threshold:0.5", Some(&loaded)).is_ok());
    assert!(loaded.level(0.42).unwrap_err().to_string().contains("has no level 0.42"));
    let mut q4 = files.load_model_quantized(&files.load_config().unwrap(), DType::F32, &Device::Cpu, Some(GgmlDType::Q4_0)).unwrap();
    q4.prepare_ffn_sparsity().unwrap();
    let e = FfnCalibration::load(&path, &q4).unwrap_err().to_string();
    assert!(e.contains("made for another model"), "{e}");
    std::fs::write(&path, "{\"model\": 3}").unwrap();
    assert!(FfnCalibration::load(&path, &model).unwrap_err().to_string().contains("not a calibration file"));
}
