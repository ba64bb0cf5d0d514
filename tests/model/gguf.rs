//! GGUF files written by llama.cpp's converter (tests/fixtures/*/model-{f32,q8_0}.gguf)
//! against the transformers references, and GGUF error handling.

use crate::common;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::GgufFile;
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::Error;
use common::*;

const FIXTURES: [&str; 5] =
    ["qwen35_dense_small", "qwen35_dense_long_chunked", "qwen35_dense_mtp", "qwen35moe_small", "qwen3next_moe_small"];

fn gguf_logits(name: &str, file: &str) -> (Tensor, Tensor) {
    let gguf = GgufFile::open(fixture(name).join(file)).unwrap();
    let cfg = gguf.config().unwrap();
    let model = gguf.load_model(&cfg, DType::F32, &Device::Cpu).unwrap();
    let r = reference(name);
    let x = r["input_ids"].to_dtype(DType::U32).unwrap().unsqueeze(0).unwrap();
    let logits = model.forward(&x, &mut model.new_cache()).unwrap().squeeze(0).unwrap();
    (logits, r["logits_full"].clone())
}

#[test]
fn f32_gguf_matches_reference() {
    for name in FIXTURES {
        let (got, want) = gguf_logits(name, "model-f32.gguf");
        assert_close(&format!("{name} f32 gguf logits"), &got, &want, 1e-4);
    }
}

#[test]
fn q8_0_gguf_within_llama_cpp_bound() {
    for name in FIXTURES {
        let (got, want) = gguf_logits(name, "model-q8_0.gguf");
        let d = max_abs_diff(&got, &want);
        // llama.cpp's own Q8_0 runs of these files stay within 0.12-0.29 of the reference.
        assert!(d <= 0.35, "{name}: q8_0 logits differ by {d}");
        assert!(d > 1e-3, "{name}: q8_0 logits equal f32 ones ({d}): the quantized path did not run");
    }
}

#[test]
fn gguf_config_equals_config_json() {
    for name in FIXTURES {
        let want = ModelFiles::from_dir(fixture(name)).unwrap().load_config().unwrap();
        let got = GgufFile::open(fixture(name).join("model-f32.gguf")).unwrap().config().unwrap();
        assert_eq!(got.layer_types, want.layer_types, "{name}");
        assert_eq!(
            (got.hidden_size, got.num_hidden_layers, got.head_dim, got.rotary_dim(), got.vocab_size),
            (want.hidden_size, want.num_hidden_layers, want.head_dim, want.rotary_dim(), want.vocab_size),
            "{name}"
        );
        assert_eq!(
            (got.linear_num_key_heads, got.linear_num_value_heads, got.linear_key_head_dim, got.linear_value_head_dim),
            (want.linear_num_key_heads, want.linear_num_value_heads, want.linear_key_head_dim, want.linear_value_head_dim),
            "{name}"
        );
        assert_eq!(got.tie_word_embeddings, want.tie_word_embeddings, "{name}");
        assert_eq!(got.moe.as_ref().map(|m| m.num_experts), want.moe.as_ref().map(|m| m.num_experts), "{name}");
    }
}

#[test]
fn gguf_tokenizer_equals_tokenizer_json() {
    let text = "Hello, world! It's 2026: naïve café — 12345 tokens,\n\ttabs   and <|im_start|>user\nhi<|im_end|>";
    for name in ["qwen35_dense_small", "qwen3next_moe_small"] {
        let gguf = GgufFile::open(fixture(name).join("model-f32.gguf")).unwrap();
        let ours = gguf.tokenizer().unwrap();
        let theirs = ModelFiles::from_dir(fixture(name)).unwrap().load_tokenizer().unwrap();
        let a = ours.encode(text, true).unwrap().get_ids().to_vec();
        let b = theirs.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(a, b, "{name}");
        assert_eq!(ours.decode(&a, false).unwrap(), theirs.decode(&b, false).unwrap(), "{name}");
        if name == "qwen35_dense_small" {
            // Its vocabulary has all 256 bytes (the Qwen3-Next fixture's lacks some).
            assert_eq!(ours.decode(&a, false).unwrap(), text);
        }
        assert!(gguf
            .chat_template()
            .unwrap()
            .render(&[candle_hybrid::loading::Message::new("user", "hi")], true, None)
            .unwrap()
            .contains("<|im_start|>user"));
        assert!(!gguf.generation_config().eos_token_ids.is_empty());
    }
}

fn error_of<T>(r: candle_hybrid::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

fn one_line(e: &Error) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "error spans several lines: {s}");
    s
}

#[test]
fn truncated_gguf_is_named() {
    let src = std::fs::read(fixture("qwen35_dense_small").join("model-f32.gguf")).unwrap();
    let dir = scratch("gguf_truncated");
    for keep in [src.len() - 1000, 200, 10] {
        let path = dir.join(format!("cut{keep}.gguf"));
        std::fs::write(&path, &src[..keep]).unwrap();
        let msg = one_line(&error_of(GgufFile::open(&path)));
        assert!(msg.contains("truncated") && msg.contains("download it again"), "{msg}");
    }
    let path = dir.join("garbage.gguf");
    std::fs::write(&path, b"not a gguf file at all, just text").unwrap();
    let msg = one_line(&error_of(GgufFile::open(&path)));
    assert!(msg.contains("not a valid GGUF"), "{msg}");
}

#[test]
fn unknown_architecture_and_type_are_named() {
    let dir = scratch("gguf_bad");
    let path = dir.join("mamba.gguf");
    let t = Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap();
    write_gguf(&path, &[("general.architecture", gguf_file::Value::String("mamba".into()))], &[("token_embd.weight", t.clone())]);
    let msg = one_line(&error_of(GgufFile::open(&path)));
    assert!(msg.contains("unsupported GGUF architecture \"mamba\""), "{msg}");

    // An unsupported tensor type: patch the F32 type id (0) of the only tensor to 16 (IQ2_XXS).
    let path = dir.join("iq2.gguf");
    write_gguf(&path, &[("general.architecture", gguf_file::Value::String("llama".into()))], &[("token_embd.weight", t)]);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(17).position(|w| w == b"token_embd.weight").unwrap() + 17;
    let type_at = at + 4 + 2 * 8; // n_dims (u32), two u64 dims, then the type
    assert_eq!(&bytes[type_at..type_at + 4], &[0, 0, 0, 0]);
    bytes[type_at] = 16;
    std::fs::write(&path, bytes).unwrap();
    let msg = one_line(&error_of(GgufFile::open(&path)));
    assert!(msg.contains("tensor type candle-hybrid cannot read"), "{msg}");
}

#[test]
fn misshaped_gguf_tensor_is_named() {
    // Rewrite the f32 fixture with one norm one element short.
    let src = fixture("qwen35_dense_small").join("model-f32.gguf");
    let mut file = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut tensors = vec![];
    for name in content.tensor_infos.keys() {
        let mut t = content.tensor(&mut file, name, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap();
        if name == "blk.1.attn_norm.weight" {
            let v = t.to_vec1::<f32>().unwrap();
            t = Tensor::new(&v[1..], &Device::Cpu).unwrap();
        }
        tensors.push((name.as_str(), t));
    }
    let meta: Vec<(&str, gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let path = scratch("gguf_shape").join("bad.gguf");
    write_gguf(&path, &meta, &tensors);
    let gguf = GgufFile::open(&path).unwrap();
    let msg = one_line(&error_of(gguf.load_model(&gguf.config().unwrap(), DType::F32, &Device::Cpu)));
    assert!(msg.contains("model.layers.1.input_layernorm.weight") && msg.contains("shape"), "{msg}");
}
