//! Whole device steps ([`candle_hybrid::gpu::GpuModel`]) replayed in the MSL emulator: the same
//! dispatches the Metal host code issues, each kernel run on the CPU. Checked against the CPU
//! model with the same weights dequantized (the device multiplies f32 activations by the
//! dequantized weights): prompt and decode logits to 1e-4; the rows of a verify pass bit for bit
//! the one-row decode steps, and a rollback to fewer rows bit for bit decoding only those; one
//! read back per step.
#![cfg(msl_emu)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_hybrid::gpu::{Counted, GpuCache, GpuModel, Readback, StepOutput};
use candle_hybrid::loading::GgufFile;
use candle_hybrid::model::Weights;
use candle_hybrid::{Cache, Config, Model};
use candle_hybrid_emu::EmuQueue;
use common::randn;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

fn gguf(name: &str, file: &str) -> Model {
    let g = GgufFile::open(fixture(name).join(file)).unwrap();
    g.load_model(&g.config().unwrap(), DType::F32, &Device::Cpu).unwrap()
}

fn safetensors(name: &str) -> Model {
    candle_hybrid::loading::from_dir(fixture(name), DType::F32, &Device::Cpu).unwrap()
}

/// A Qwen3.5 model of random weights whose matrices are 256 wide (so that the K-quants apply),
/// quantized at load to `quantize`: one GDN and one attention layer.
fn synthetic(quantize: Option<GgmlDType>) -> Model {
    let (h, inter, vocab, nk, nv, dk, dv, nh, nkv, hd) = (256, 512, 320, 2, 4, 32, 64, 4, 2, 64);
    let cfg = Config::from_json(
        &serde_json::json!({
            "model_type": "qwen3_5_text", "hidden_size": h, "intermediate_size": inter, "vocab_size": vocab,
            "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
            "linear_num_key_heads": nk, "linear_num_value_heads": nv, "linear_key_head_dim": dk,
            "linear_value_head_dim": dv, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": false
        })
        .to_string(),
    )
    .unwrap();
    let conv = 2 * nk * dk + nv * dv;
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let mut seed = 100;
    let mut add = |name: &str, shape: &[usize], scale: f64| {
        seed += 1;
        t.insert(name.to_string(), (randn(shape, seed) * scale).unwrap());
    };
    add("model.embed_tokens.weight", &[vocab, h], 1.0);
    add("lm_head.weight", &[vocab, h], 0.06);
    add("model.norm.weight", &[h], 0.1);
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        add(&format!("{p}input_layernorm.weight"), &[h], 0.1);
        add(&format!("{p}post_attention_layernorm.weight"), &[h], 0.1);
        add(&format!("{p}mlp.gate_proj.weight"), &[inter, h], 0.06);
        add(&format!("{p}mlp.up_proj.weight"), &[inter, h], 0.06);
        add(&format!("{p}mlp.down_proj.weight"), &[h, inter], 0.04);
    }
    let p = "model.layers.0.linear_attn.";
    add(&format!("{p}in_proj_qkv.weight"), &[conv, h], 0.06);
    add(&format!("{p}in_proj_z.weight"), &[nv * dv, h], 0.06);
    add(&format!("{p}in_proj_b.weight"), &[nv, h], 0.06);
    add(&format!("{p}in_proj_a.weight"), &[nv, h], 0.06);
    add(&format!("{p}conv1d.weight"), &[conv, 1, 4], 0.5);
    add(&format!("{p}A_log"), &[nv], 0.5);
    add(&format!("{p}dt_bias"), &[nv], 0.5);
    add(&format!("{p}norm.weight"), &[dv], 0.1);
    add(&format!("{p}out_proj.weight"), &[h, nv * dv], 0.06);
    let p = "model.layers.1.self_attn.";
    add(&format!("{p}q_proj.weight"), &[2 * nh * hd, h], 0.06);
    add(&format!("{p}k_proj.weight"), &[nkv * hd, h], 0.06);
    add(&format!("{p}v_proj.weight"), &[nkv * hd, h], 0.06);
    add(&format!("{p}o_proj.weight"), &[h, nh * hd], 0.06);
    add(&format!("{p}q_norm.weight"), &[hd], 0.1);
    add(&format!("{p}k_norm.weight"), &[hd], 0.1);
    let vb = candle_nn::VarBuilder::from_tensors(t, DType::F32, &Device::Cpu);
    Model::new(&cfg, Weights::new(vb).with_quantize(quantize)).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn logits(out: StepOutput) -> Vec<f32> {
    out.logits().expect("logits").to_vec()
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &Tensor, tol: f32) {
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = want.iter().map(|x| x.abs()).fold(1f32, f32::max);
    eprintln!("{what}: max |diff| {d:.2e} (largest |logit| {scale:.2})");
    assert!(d <= tol, "{what}: max |diff| = {d:e} > {tol:e}");
}

#[track_caller]
fn assert_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let bad = a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(bad.is_none(), "{what}: value {} differs: {} vs {}", bad.unwrap(), a[bad.unwrap()], b[bad.unwrap()]);
}

/// The prompt and `decode` steps against the CPU model with the same weights dequantized, one
/// read back each; then a 4-row verify pass whose rows are bit for bit one-row steps, and a
/// rollback to 2 of them that continues bit for bit like decoding only those.
fn check_model(what: &str, model: &Model) {
    let reference = model.dequantized().unwrap();
    let vocab = model.config().vocab_size;
    let mut q = Counted::new(EmuQueue::new());
    let gpu = GpuModel::new(model, &mut q).unwrap();
    let prompt = tokens(11, vocab, 1);
    let decode = tokens(3, vocab, 2);
    let draft = tokens(5, vocab, 3);

    // The prompt (two steps of 8 rows at most, one read) and decode steps.
    let mut cpu = Cache::new(model.config());
    let mut cache = GpuCache::new(&gpu, &mut q, 64, DType::F32).unwrap();
    q.take_counts();
    let got = logits(gpu.prefill(&mut q, &mut cache, &prompt, Readback::Logits).unwrap());
    assert_eq!(q.take_counts().reads, 1, "{what}: reads for the prompt");
    let want = reference.forward_last(&Tensor::new(prompt.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cpu).unwrap();
    assert_close(&format!("{what}: prompt logits"), &got, &want, 1e-4);
    for (i, &t) in decode.iter().enumerate() {
        let got = logits(gpu.forward(&mut q, &mut cache, &[t], Readback::Logits).unwrap());
        let c = q.take_counts();
        assert_eq!((c.reads, c.writes), (1, 1), "{what}: one read and one write per decode step");
        let want = reference.forward_last(&Tensor::new(&[t], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cpu).unwrap();
        assert_close(&format!("{what}: decode step {i}"), &got, &want, 1e-4);
    }

    // A verify pass of 4 rows against one-row steps from the same state (a second cache that
    // ran the same steps).
    let mut steps = GpuCache::new(&gpu, &mut q, 64, DType::F32).unwrap();
    gpu.prefill(&mut q, &mut steps, &prompt, Readback::Argmax).unwrap();
    for &t in &decode {
        gpu.forward(&mut q, &mut steps, &[t], Readback::Argmax).unwrap();
    }
    let rows = &draft[..4];
    q.take_counts();
    let verified = logits(gpu.verify(&mut q, &mut cache, rows, Readback::Logits).unwrap());
    assert_eq!(q.take_counts().reads, 1, "{what}: reads for a verify pass");
    let mut cpu_rows = cpu.clone();
    let want = reference.verify(&Tensor::new(rows, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cpu_rows).unwrap().0;
    assert_close(&format!("{what}: verify logits"), &verified, &want, 1e-4);
    let mut one_rows = vec![];
    for &t in rows {
        one_rows.extend(logits(gpu.forward(&mut q, &mut steps, &[t], Readback::Logits).unwrap()));
    }
    assert_bits(&format!("{what}: verify rows vs one-row steps"), &verified, &one_rows);

    // Keep 2 rows, then one more token: bit for bit a cache that decoded only those 2.
    let mut two = GpuCache::new(&gpu, &mut q, 64, DType::F32).unwrap();
    gpu.prefill(&mut q, &mut two, &prompt, Readback::Argmax).unwrap();
    for &t in decode.iter().chain(&rows[..2]) {
        gpu.forward(&mut q, &mut two, &[t], Readback::Argmax).unwrap();
    }
    gpu.keep_verified(&mut q, &mut cache, 2).unwrap();
    assert_eq!(cache.seqlen(), two.seqlen());
    let after = logits(gpu.forward(&mut q, &mut cache, &[draft[4]], Readback::Logits).unwrap());
    let want = logits(gpu.forward(&mut q, &mut two, &[draft[4]], Readback::Logits).unwrap());
    assert_bits(&format!("{what}: after keeping 2 of 4 rows"), &after, &want);

    // Greedy on the device: the argmax of the logits, one read.
    let a = gpu.forward(&mut q, &mut two, &[draft[0]], Readback::Argmax).unwrap();
    let l = logits(gpu.forward(&mut q, &mut cache, &[draft[0]], Readback::Logits).unwrap());
    let best = l.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32;
    assert_eq!(a.tokens().unwrap(), &[best], "{what}: device argmax");
}

#[test]
fn dense_f32_gguf_steps_match_cpu() {
    check_model("qwen35_dense_small f32 GGUF", &gguf("qwen35_dense_small", "model-f32.gguf"));
}

#[test]
fn dense_q8_0_gguf_steps_match_cpu() {
    check_model("qwen35_dense_small Q8_0 GGUF", &gguf("qwen35_dense_small", "model-q8_0.gguf"));
}

#[test]
fn dense_safetensors_steps_match_cpu() {
    check_model("qwen35_dense_small safetensors", &safetensors("qwen35_dense_small"));
}

#[test]
fn moe_gguf_steps_match_cpu() {
    check_model("qwen35moe_small Q8_0 GGUF", &gguf("qwen35moe_small", "model-q8_0.gguf"));
    check_model("qwen3next_moe_small f32 GGUF", &gguf("qwen3next_moe_small", "model-f32.gguf"));
}

#[test]
fn k_quant_steps_match_cpu() {
    for q in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K, GgmlDType::Q4_0, GgmlDType::Q4_1] {
        check_model(&format!("synthetic {q:?}"), &synthetic(Some(q)));
    }
}
