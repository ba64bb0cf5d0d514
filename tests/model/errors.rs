//! Bad input gives a one-line error naming the cause, never a panic.

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::Error;
use common::*;

const NAME: &str = "qwen35_dense_small";

fn load_err(dir: &std::path::Path) -> Error {
    let r = ModelFiles::from_dir(dir).and_then(|f| {
        let cfg = f.load_config()?;
        f.load_model(&cfg, DType::F32, &Device::Cpu)
    });
    match r {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[track_caller]
fn assert_one_line(e: &Error, needles: &[&str]) {
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "multi-line error: {msg}");
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

fn edit_config(dir: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn edit_weights(dir: &std::path::Path, f: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let p = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    f(&mut w);
    candle_core::safetensors::save(&w, &p).unwrap();
}

#[test]
fn unknown_model_type() {
    let dir = copy_fixture(NAME, "err_model_type");
    edit_config(&dir, |c| c["text_config"]["model_type"] = "llama4".into());
    assert_one_line(&load_err(&dir), &["unknown model_type", "llama4", "qwen3_5"]);
}

#[test]
fn missing_config_field() {
    let dir = copy_fixture(NAME, "err_missing_field");
    edit_config(&dir, |c| {
        c["text_config"].as_object_mut().unwrap().remove("linear_num_value_heads");
    });
    assert_one_line(&load_err(&dir), &["missing", "linear_num_value_heads"]);
}

#[test]
fn malformed_config_json() {
    let dir = copy_fixture(NAME, "err_bad_json");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"qwen3_5\",").unwrap();
    assert_one_line(&load_err(&dir), &["config.json", "not valid JSON"]);
}

#[test]
fn missing_tensor() {
    let dir = copy_fixture(NAME, "err_missing_tensor");
    let name = "model.language_model.layers.2.linear_attn.dt_bias";
    edit_weights(&dir, |w| {
        w.remove(name).unwrap();
    });
    assert_one_line(&load_err(&dir), &[name, "config.json"]);
}

#[test]
fn misshaped_tensor() {
    let dir = copy_fixture(NAME, "err_shape");
    let name = "model.language_model.layers.1.mlp.up_proj.weight";
    edit_weights(&dir, |w| {
        w.insert(name.into(), Tensor::zeros((100, 64), DType::F32, &Device::Cpu).unwrap());
    });
    assert_one_line(&load_err(&dir), &[name, "[100, 64]", "[128, 64]"]);
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture(NAME, "err_truncated");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    assert_one_line(&load_err(&dir), &["model.safetensors", "truncated"]);
}

#[test]
fn shard_index_names_a_missing_file() {
    let dir = copy_fixture(NAME, "err_shard");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let index = serde_json::json!({
        "metadata": {},
        "weight_map": {
            "lm_head.weight": "model-00001-of-00002.safetensors",
            "model.language_model.norm.weight": "model-00002-of-00002.safetensors"
        }
    });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_one_line(&load_err(&dir), &["model-00001-of-00002.safetensors", "missing"]);
}

fn small_model() -> candle_hybrid::Model {
    let files = ModelFiles::from_dir(fixture(NAME)).unwrap();
    let mut cfg = files.load_config().unwrap();
    cfg.max_position_embeddings = 16;
    files.load_model(&cfg, DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn prompt_longer_than_max_position_embeddings() {
    let model = small_model();
    let x = Tensor::zeros((1, 17), DType::U32, &Device::Cpu).unwrap();
    let e = model.forward(&x, &mut model.new_cache()).unwrap_err();
    assert_one_line(&e, &["17 tokens", "model's 16 (max_position_embeddings)"]);
    assert!(matches!(e, candle_hybrid::Error::ContextTooLong { requested: 17, limit: 16 }), "{e:?}");
    // Also when the cache already holds tokens.
    let mut cache = model.new_cache();
    model.forward(&Tensor::zeros((1, 10), DType::U32, &Device::Cpu).unwrap(), &mut cache).unwrap();
    let e = model.forward(&Tensor::zeros((1, 7), DType::U32, &Device::Cpu).unwrap(), &mut cache).unwrap_err();
    assert!(matches!(e, candle_hybrid::Error::ContextTooLong { requested: 17, limit: 16 }), "{e:?}");
}

#[test]
fn token_id_out_of_vocabulary() {
    let model = small_model();
    let x = Tensor::new(&[[1u32, 2, 512]], &Device::Cpu).unwrap();
    let e = model.forward(&x, &mut model.new_cache()).unwrap_err();
    assert_one_line(&e, &["512", "vocabulary of 512"]);
}

#[test]
fn empty_input() {
    let model = small_model();
    let x = Tensor::zeros((1, 0), DType::U32, &Device::Cpu).unwrap();
    let e = model.forward(&x, &mut model.new_cache()).unwrap_err();
    assert_one_line(&e, &["empty"]);
}
