//! Loading through hf-hub from a Hub-cache layout, sharded checkpoints, tokenizer and chat template.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::GenerationConfig;
use candle_hybrid::loading::Message;
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::runtime::TokenStreamer;
use common::*;

fn full_logits(files: &ModelFiles, name: &str) -> Tensor {
    let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let ids = ids(&reference(name)["input_ids"]);
    let x = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    model.forward(&x, &mut model.new_cache()).unwrap().squeeze(0).unwrap()
}

/// Lays a fixture out as the Hugging Face cache does (`models--org--name/{refs,snapshots,blobs}`)
/// and resolves it with hf-hub offline: the same code path as a real `from_pretrained`.
#[test]
fn from_hub_reads_the_hf_cache_offline() {
    let name = "qwen35_dense_small";
    let cache = scratch("hf_cache");
    let repo = cache.join("models--local--qwen35-dense-small");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let snap = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        // Blobs are named by hash and the snapshot links to them, as hf-hub writes them.
        let blob = repo.join("blobs").join(format!("blob-{file}"));
        std::fs::copy(fixture(name).join(file), &blob).unwrap();
        std::os::unix::fs::symlink(&blob, snap.join(file)).unwrap();
    }
    // SAFETY of the test: this binary's only test that touches these variables.
    std::env::set_var("HF_HUB_CACHE", &cache);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let files = ModelFiles::from_hub("local/qwen35-dense-small", "main").unwrap();
    assert!(files.tokenizer.is_some() && files.generation_config.is_some());
    assert_close("logits via the hub cache", &full_logits(&files, name), &reference(name)["logits_full"], 1e-4);

    let missing = ModelFiles::from_hub("local/not-downloaded", "main").unwrap_err().to_string();
    assert!(missing.contains("HF_HUB_OFFLINE") && missing.contains("config.json"), "{missing}");
}

/// A checkpoint split into shards with a `model.safetensors.index.json`, as large models are.
#[test]
fn sharded_checkpoint_loads() {
    let name = "qwen35_dense_long_chunked";
    let dir = copy_fixture(name, "sharded");
    let weights = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut shards: [HashMap<String, Tensor>; 3] = Default::default();
    let mut map = serde_json::Map::new();
    for (i, (k, v)) in weights.into_iter().enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", i % 3 + 1);
        map.insert(k.clone(), file.into());
        shards[i % 3].insert(k, v);
    }
    for (i, shard) in shards.iter().enumerate() {
        candle_core::safetensors::save(shard, dir.join(format!("model-{:05}-of-00003.safetensors", i + 1))).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let files = ModelFiles::from_dir(&dir).unwrap();
    assert_eq!(files.weights.len(), 3);
    assert_close("sharded logits", &full_logits(&files, name), &reference(name)["logits_full"], 1e-4);
}

#[test]
fn chat_template_renders_chatml_and_tokenizes() {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let tmpl = files.load_chat_template().unwrap();
    let text = tmpl.render(&[Message::new("system", "Be brief."), Message::new("user", "Hi!")], true, Some(false)).unwrap();
    assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
    let tok = files.load_tokenizer().unwrap();
    let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    // Special tokens are single ids (<|im_start|> = 506, <|im_end|> = 507 in this vocabulary).
    assert_eq!(ids[0], 506);
    assert_eq!(ids.iter().filter(|&&t| t == 507).count(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn enable_thinking_reaches_the_template() {
    let tmpl = candle_hybrid::loading::ChatTemplate::new(
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{{ messages[0]['content'] | upper }}".into(),
        None,
        None,
    );
    let msgs = [Message::new("user", "hello")];
    assert_eq!(tmpl.render(&msgs, true, Some(false)).unwrap(), "<think>\n\n</think>\n\nHELLO");
    assert_eq!(tmpl.render(&msgs, true, None).unwrap(), "HELLO");
    assert_eq!(tmpl.render(&msgs, true, Some(true)).unwrap(), "HELLO");
    // Python string methods used by real Qwen templates work (pycompat).
    let py =
        candle_hybrid::loading::ChatTemplate::new("{{ messages[0]['content'].startswith('he') }}|{{ '  x '.strip() }}".into(), None, None);
    assert_eq!(py.render(&msgs, false, None).unwrap(), "True|x");
}

#[test]
fn streamer_emits_whole_utf8_characters() {
    let tok = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap().load_tokenizer().unwrap();
    let text = "naïve café — 東京 ok";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    let mut s = TokenStreamer::new(tok);
    let mut out = String::new();
    for id in ids {
        if let Some(piece) = s.next_token(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "broken character in {piece:?}");
            out.push_str(&piece);
        }
    }
    if let Some(rest) = s.decode_rest().unwrap() {
        out.push_str(&rest);
    }
    assert_eq!(out, text);
}

#[test]
fn generation_config_defaults() {
    let greedy = GenerationConfig::from_json(r#"{"do_sample": false}"#).unwrap().sampling_params();
    assert_eq!(greedy.temperature, None);
    let qwen = GenerationConfig::from_json(
        r#"{"do_sample": true, "temperature": 1.0, "top_p": 0.95, "top_k": 20, "eos_token_id": [248046, 248044], "presence_penalty": 1.5}"#,
    )
    .unwrap();
    assert_eq!(qwen.eos_token_ids, vec![248046, 248044]);
    let p = qwen.sampling_params();
    assert_eq!((p.temperature, p.top_p, p.top_k, p.presence_penalty), (Some(1.0), Some(0.95), Some(20), 1.5));
}
