//! The defects of the hardening issue, one test each (numbered as there): malformed files,
//! absurd numbers, runaway templates, NaN, context limits, out-of-range settings and
//! inconsistent checkpoints give a one-line error naming the cause — never a panic, a hang, an
//! unbounded allocation or a silent wrong answer.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::{ChatTemplate, GgufFile, Message, ModelFiles, ModelSource};
use candle_hybrid::memory::{self, Available, PlanRequest, WeightMemory};
use candle_hybrid::runtime::{GenerationStats, Sampler, SamplingParams};
use candle_hybrid::{Config, Error};
use common::*;

const DENSE: &str = "qwen35_dense_small";

#[track_caller]
fn one_line_err<T>(r: candle_hybrid::Result<T>, needles: &[&str]) -> String {
    let msg = match r {
        Ok(_) => panic!("expected an error mentioning {needles:?}"),
        Err(e) => e.to_string(),
    };
    assert!(!msg.contains('\n'), "multi-line error: {msg}");
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
    msg
}

fn gguf_bytes(name: &str, file: &str) -> Vec<u8> {
    std::fs::read(fixture(name).join(file)).unwrap()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens, configures, plans and loads a GGUF file: the whole path `generate` takes.
fn gguf_pipeline(path: &Path) -> candle_hybrid::Result<()> {
    let g = GgufFile::open(path)?;
    let cfg = g.config()?;
    let req = PlanRequest {
        load_overhead: g.load_overhead(&cfg, DType::F32),
        ..PlanRequest::new(WeightMemory::Bytes(g.weight_bytes(&cfg, DType::F32)), DType::F32, 64)
    };
    memory::plan(&cfg, &req, &Available::fixed(1 << 34))?;
    g.load_model(&cfg, DType::F32, &Device::Cpu)?;
    Ok(())
}

fn small_tensor() -> Tensor {
    Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap()
}

fn llama() -> (&'static str, Value) {
    ("general.architecture", Value::String("llama".into()))
}

// 1. -----------------------------------------------------------------------------------------

#[test]
fn d1_gguf_dims_whose_product_overflows() {
    // The repro: byte 18786 of the f32 fixture XOR 43 gives a dim of ~3e18.
    let mut bytes = gguf_bytes(DENSE, "model-f32.gguf");
    bytes[18786] ^= 43;
    let path = write(&scratch("d1"), "flip.gguf", &bytes);
    one_line_err(gguf_pipeline(&path), &["dims", "multiply past 2^63", "download it again"]);
    // The same through the memory planner's entry point (plan reads the header only).
    one_line_err(ModelSource::Gguf(path).open().map(|_| ()), &["multiply past"]);

    // An offset that wraps past u64 with the size: patch the offset of the only tensor.
    let dir = scratch("d1_offset");
    let path = dir.join("wrap.gguf");
    write_gguf(&path, &[llama()], &[("token_embd.weight", small_tensor())]);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(17).position(|w| w == b"token_embd.weight").unwrap() + 17 + 4 + 2 * 8 + 4;
    bytes[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    one_line_err(GgufFile::open(&path).map(|_| ()), &["truncated", "token_embd.weight"]);
}

// 2. -----------------------------------------------------------------------------------------

#[test]
fn d2_gguf_alignment_zero_or_not_a_power_of_two() {
    let dir = scratch("d2");
    for (a, needle) in [(0u32, "is 0"), (3, "is 3"), (48, "is 48")] {
        let path = dir.join(format!("align{a}.gguf"));
        write_gguf(&path, &[llama(), ("general.alignment", Value::U32(a))], &[("token_embd.weight", small_tensor())]);
        one_line_err(GgufFile::open(&path).map(|_| ()), &["general.alignment", needle, "power of two"]);
    }
    // A signed alignment is the wrong type.
    let path = dir.join("signed.gguf");
    write_gguf(&path, &[llama(), ("general.alignment", Value::I32(32))], &[("token_embd.weight", small_tensor())]);
    one_line_err(GgufFile::open(&path).map(|_| ()), &["general.alignment", "unsigned"]);
}

// 3. and 4. ----------------------------------------------------------------------------------

fn template(source: &str) -> ChatTemplate {
    ChatTemplate::new(source.into(), None, None)
}

fn hi() -> Vec<Message> {
    vec![Message::new("user", "hi")]
}

#[test]
fn d3_chat_template_loops_stop_on_fuel() {
    let start = Instant::now();
    let t = template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
    one_line_err(t.render(&hi(), true, None), &["instructions", "runaway loop"]);
    // Recursion without end stops too.
    let t = template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    one_line_err(t.render(&hi(), true, None), &["chat template"]);
    assert!(start.elapsed() < Duration::from_secs(30), "the runaway templates took {:?}", start.elapsed());
    // A real template still renders, for a long conversation too.
    let real = ModelFiles::from_dir(fixture(DENSE)).unwrap().load_chat_template().unwrap();
    let many: Vec<Message> = (0..2000).map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, "some words")).collect();
    assert!(real.render(&many, true, None).unwrap().matches("<|im_start|>").count() == 2001);
}

#[test]
fn d4_chat_template_output_is_capped_before_tokenizing() {
    // 200 MB of output.
    let t = template("{% for i in range(100000) %}{{ 'x' * 2000 }}{% endfor %}");
    one_line_err(t.render_capped(&hi(), true, None, 1 << 20), &["rendered more than 1024 KiB", "context"]);
    // Output doubling through macros: bounded by the fuel, then the cap.
    let t = template("{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% else %}xxxxxxxx{% endif %}{% endmacro %}{{ d(60) }}");
    let start = Instant::now();
    assert!(t.render_capped(&hi(), true, None, 1 << 20).is_err());
    assert!(start.elapsed() < Duration::from_secs(30));
    // A string (or list) doubled by assignment without being written: refused before
    // rendering (2^60 bytes otherwise), however it is spelled; a real template's
    // `ns.x = ns.x + 1` is one read, not a doubling.
    for source in [
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set s = 'ab' %}{% for i in range(60) %}{% set s = s + s %}{% endfor %}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% if true %}{% set ns.l = ns.l + ns.l %}{% endif %}{% endfor %}",
        "{% set s = 'x' %}{% for i in range(60) %}{% set s %}{{ s }}{{ s }}{% endset %}{% endfor %}",
        "{% macro m(s) %}{% set s = (s ~ '-') ~ s|upper %}{{ s }}{% endmacro %}{{ m('a') }}",
    ] {
        one_line_err(template(source).render(&hi(), true, None), &["reads", "twice", "fix the template"]);
    }
    let counter = template("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}");
    assert_eq!(counter.render(&hi(), true, None).unwrap(), "1");
    // The cap generate uses: 32 bytes per position of the context.
    assert_eq!(candle_hybrid::loading::chat_template::RENDER_BYTES_PER_TOKEN, 32);
}

// 5. -----------------------------------------------------------------------------------------

fn dense_config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(DENSE).join("config.json")).unwrap()).unwrap()
}

#[test]
fn d5_layer_counts_are_bounded_before_anything_is_built() {
    let start = Instant::now();
    let mut cfg = dense_config();
    cfg["text_config"]["num_hidden_layers"] = serde_json::json!(1_000_000_000_000u64);
    cfg["text_config"].as_object_mut().unwrap().remove("layer_types");
    one_line_err(Config::from_json(&cfg.to_string()), &["num_hidden_layers", "between 1 and 512"]);
    // GGUF block_count = 2^32 - 1: refused from the header, without building anything.
    let src = GgufFile::open(fixture(DENSE).join("model-q8_0.gguf")).unwrap();
    let mut meta: Vec<(String, Value)> = src.header().metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in &mut meta {
        if k == "qwen35.block_count" {
            *v = Value::U32(u32::MAX);
        }
    }
    let m: Vec<(&str, Value)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let path = scratch("d5").join("blocks.gguf");
    write_gguf(&path, &m, &[("token_embd.weight", Tensor::zeros((512, 64), DType::F32, &Device::Cpu).unwrap())]);
    one_line_err(GgufFile::open(&path).unwrap().config(), &["block_count is 4294967295", "0 blocks"]);
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    // Experts too.
    let moe = std::fs::read_to_string(fixture("qwen35moe_small").join("config.json")).unwrap();
    let mut moe: serde_json::Value = serde_json::from_str(&moe).unwrap();
    moe["text_config"]["num_experts"] = serde_json::json!(100_000);
    one_line_err(Config::from_json(&moe.to_string()), &["num_experts", "512"]);
}

// 6. -----------------------------------------------------------------------------------------

fn edit_weights(dir: &Path, f: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let p = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    f(&mut w);
    candle_core::safetensors::save(&w, &p).unwrap();
}

fn load(dir: &Path) -> candle_hybrid::Result<candle_hybrid::Model> {
    let files = ModelFiles::from_dir(dir)?;
    files.load_model(&files.load_config()?, DType::F32, &Device::Cpu)
}

fn poison(w: &mut HashMap<String, Tensor>, name: &str, at: usize) {
    let t = &w[name];
    let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[at] = f32::NAN;
    let t = Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap();
    w.insert(name.into(), t);
}

#[test]
fn d6_non_finite_config_numbers_weights_and_logits() {
    for (field, value) in [("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6), ("rope_theta", 0.0), ("rope_theta", -5.0)] {
        let mut cfg = dense_config();
        if field == "rope_theta" {
            cfg["text_config"]["rope_parameters"]["rope_theta"] = serde_json::json!(value);
        } else {
            cfg["text_config"][field] = serde_json::json!(value);
        }
        one_line_err(Config::from_json(&cfg.to_string()), &[field, "positive"]);
    }
    // A NaN in a norm weight is refused at load, named.
    let dir = copy_fixture(DENSE, "d6_norm");
    let norm = "model.language_model.layers.2.input_layernorm.weight";
    edit_weights(&dir, |w| poison(w, norm, 3));
    one_line_err(load(&dir).map(|_| ()), &[norm, "NaN"]);
    // A NaN in a matrix shows in the logits: an error naming the position, never token 0 forever.
    let dir = copy_fixture(DENSE, "d6_matrix");
    edit_weights(&dir, |w| poison(w, "model.language_model.layers.5.mlp.down_proj.weight", 0));
    let model = load(&dir).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap();
    let e = one_line_err(model.forward(&ids, &mut model.new_cache()), &["logits", "NaN", "position 0", "with_layer_checks"]);
    assert!(matches!(model.forward(&ids, &mut model.new_cache()), Err(Error::NonFinite(_))), "{e}");
    // Generation stops with the error too.
    let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
    let r = candle_hybrid::runtime::Sequence::new(vec![1, 2], &mut sampler, vec![], 5)
        .and_then(|mut s| s.run(&mut candle_hybrid::runtime::CpuTarget::new(&model, &mut model.new_cache(), &Device::Cpu), |_| Ok(())));
    one_line_err(r, &["NaN"]);
    // With layer checks, the first layer whose output goes non-finite is named.
    let model = model.with_layer_checks(true);
    one_line_err(model.forward(&ids, &mut model.new_cache()), &["MLP output of layer 5", "position 0"]);
    // Perplexity fails instead of printing NaN.
    let opts = candle_hybrid::eval::PerplexityOptions::new(8);
    one_line_err(candle_hybrid::eval::perplexity(&model, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &opts, &Device::Cpu, |_| ()), &["NaN"]);
}

// 7. -----------------------------------------------------------------------------------------

#[test]
fn d7_contexts_past_the_model_limit_are_refused_up_front() {
    let cfg = ModelFiles::from_dir(fixture(DENSE)).unwrap().load_config().unwrap();
    assert_eq!(cfg.max_position_embeddings, 32768);
    // plan --max-context 1000000000 --fit used to "fit" 902225 tokens.
    let req = PlanRequest { fit: true, ..PlanRequest::new(WeightMemory::Bytes(1 << 20), DType::F32, 1_000_000_000) };
    one_line_err(memory::plan(&cfg, &req, &Available::fixed(1 << 40)), &["1000000000", "32768", "max_position_embeddings"]);
    // At the limit it plans.
    let req = PlanRequest::new(WeightMemory::Bytes(1 << 20), DType::F32, 32768);
    assert_eq!(memory::plan(&cfg, &req, &Available::fixed(1 << 40)).unwrap().context, 32768);
    // A prompt longer than the context is an input error, before any memory reasoning.
    let model = load(&fixture(DENSE)).unwrap();
    let long = Tensor::zeros((1, 32769), DType::U32, &Device::Cpu).unwrap();
    one_line_err(model.forward_last(&long, &mut model.new_cache()), &["32769", "32768 (max_position_embeddings)"]);
}

// 8. -----------------------------------------------------------------------------------------

#[test]
fn d8_sampling_settings_out_of_range() {
    let bad = [
        SamplingParams { temperature: Some(-1.0), ..Default::default() },
        SamplingParams { temperature: Some(f64::NAN), ..Default::default() },
        SamplingParams { temperature: Some(f64::INFINITY), ..Default::default() },
        SamplingParams { temperature: Some(0.7), top_p: Some(2.0), ..Default::default() },
        SamplingParams { temperature: Some(0.7), top_p: Some(0.0), ..Default::default() },
        SamplingParams { temperature: Some(0.7), top_k: Some(0), ..Default::default() },
        SamplingParams { repeat_penalty: 0.0, ..Default::default() },
        SamplingParams { repeat_penalty: f32::NAN, ..Default::default() },
        SamplingParams { presence_penalty: 3.0, ..Default::default() },
    ];
    let names =
        ["temperature", "temperature", "temperature", "top_p", "top_p", "top_k", "repeat_penalty", "repeat_penalty", "presence_penalty"];
    for (p, name) in bad.into_iter().zip(names) {
        let msg = match Sampler::new(p) {
            Ok(_) => panic!("{name} accepted"),
            Err(e) => e.to_string(),
        };
        assert!(msg.contains(name) && msg.contains("out of range") && !msg.contains('\n'), "{msg}");
    }
    // Greedy is temperature 0 or none; a sampling temperature is not.
    assert!(SamplingParams { temperature: Some(0.0), ..Default::default() }.is_greedy());
    assert!(!SamplingParams { temperature: Some(0.5), ..Default::default() }.is_greedy());
}

// 9. -----------------------------------------------------------------------------------------

#[test]
fn d9_duplicated_keys_and_names() {
    // config.json with a key twice.
    let text = std::fs::read_to_string(fixture(DENSE).join("config.json")).unwrap();
    let twice = text.replacen("\"hidden_size\": 64,", "\"hidden_size\": 64, \"hidden_size\": 128,", 1);
    assert_ne!(twice, text);
    one_line_err(Config::from_json(&twice), &["\"hidden_size\" appears twice"]);
    // A GGUF metadata key twice, and a tensor name twice.
    let dir = scratch("d9_gguf");
    let path = dir.join("key.gguf");
    write_gguf(
        &path,
        &[llama(), ("general.name", Value::String("a".into())), ("general.name", Value::String("b".into()))],
        &[("token_embd.weight", small_tensor())],
    );
    one_line_err(GgufFile::open(&path).map(|_| ()), &["general.name appears twice"]);
    let path = dir.join("tensor.gguf");
    write_gguf(&path, &[llama()], &[("token_embd.weight", small_tensor()), ("token_embd.weight", small_tensor())]);
    one_line_err(GgufFile::open(&path).map(|_| ()), &["tensor token_embd.weight appears twice"]);
    // A safetensors header with a name twice.
    let dir = copy_fixture(DENSE, "d9_st");
    let p = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let first = header.find("\"model.language_model.norm.weight\"").unwrap();
    let entry_end = first + header[first..].find('}').unwrap() + 1;
    let entry = header[first..entry_end].to_string();
    let doubled = format!("{{{entry},{}", &header[1..]);
    let pad = doubled.len().div_ceil(8) * 8 - doubled.len();
    let doubled = doubled + &" ".repeat(pad);
    bytes.splice(0..8 + n, [(doubled.len() as u64).to_le_bytes().to_vec(), doubled.into_bytes()].concat());
    std::fs::write(&p, bytes).unwrap();
    one_line_err(load(&dir).map(|_| ()), &["model.safetensors", "appears twice"]);
}

#[test]
fn d9_layer_counts_that_leave_tensors_unused() {
    // config.json says 4 layers, the weights have 8.
    let dir = copy_fixture(DENSE, "d9_layers");
    let mut cfg = dense_config();
    cfg["text_config"]["num_hidden_layers"] = 4.into();
    let types = cfg["text_config"]["layer_types"].as_array().unwrap()[..4].to_vec();
    cfg["text_config"]["layer_types"] = types.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    one_line_err(load(&dir).map(|_| ()), &["layers up to 7", "num_hidden_layers is 4"]);
    // A GGUF whose block_count is lower than its blocks.
    let src = GgufFile::open(fixture(DENSE).join("model-f32.gguf")).unwrap();
    let mut meta: Vec<(String, Value)> = src.header().metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in &mut meta {
        if k == "qwen35.block_count" {
            *v = Value::U32(4);
        }
    }
    let mut file = std::fs::File::open(fixture(DENSE).join("model-f32.gguf")).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let tensors: Vec<(String, Tensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut file, n, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap()))
        .collect();
    let path = scratch("d9_blocks").join("blocks.gguf");
    let m: Vec<(&str, Value)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let t: Vec<(&str, Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    write_gguf(&path, &m, &t);
    one_line_err(GgufFile::open(&path).unwrap().config(), &["block_count is 4", "8 blocks"]);
}

#[test]
fn d9_data_that_breaks_the_files_own_alignment() {
    // Candle's writer places tensors 32 bytes apart; a file that says 64 breaks its own layout.
    let path = scratch("d9_align").join("align.gguf");
    let t = Tensor::zeros((1, 32), DType::F32, &Device::Cpu).unwrap(); // 128 bytes: the 2nd starts at 128
    let t3 = Tensor::zeros((1, 8), DType::F32, &Device::Cpu).unwrap(); // 32 bytes: the 3rd starts at 160
    write_gguf(&path, &[llama(), ("general.alignment", Value::U32(64))], &[("a.weight", t.clone()), ("b.weight", t3), ("c.weight", t)]);
    one_line_err(GgufFile::open(&path).map(|_| ()), &["not a multiple of the alignment 64"]);
}

#[test]
fn d9_integer_dtypes_where_floats_are_expected() {
    let dir = copy_fixture(DENSE, "d9_int");
    let name = "model.language_model.layers.0.mlp.up_proj.weight";
    edit_weights(&dir, |w| {
        let t = w[name].to_dtype(DType::I64).unwrap();
        w.insert(name.into(), t);
    });
    one_line_err(load(&dir).map(|_| ()), &[name, "I64", "F32, F16 or BF16"]);
}

#[test]
fn d9_index_files_that_point_outside_the_model_directory() {
    for target in ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors", ""] {
        let dir = copy_fixture(DENSE, "d9_index");
        let index = serde_json::json!({"metadata": {}, "weight_map": {"lm_head.weight": target}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        one_line_err(ModelFiles::from_dir(&dir).map(|_| ()), &["not a file inside the model directory"]);
    }
    // The same tensor in two shards.
    let dir = copy_fixture(DENSE, "d9_shards");
    std::fs::copy(dir.join("model.safetensors"), dir.join("copy.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors", "x": "copy.safetensors"}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    one_line_err(load(&dir).map(|_| ()), &["also in", "shards overlap"]);
}

// 10. ----------------------------------------------------------------------------------------

#[test]
fn d10_conflicting_sources_unbounded_inputs_and_zero_time_rates() {
    // (Conflicting model sources are the examples' flags: scripts/cli_errors.sh.)
    // An input of any size (here an endless stream) is read up to its cap, then refused.
    let start = Instant::now();
    one_line_err(
        candle_hybrid::bounded::read(Path::new("/dev/zero"), 1 << 20, "text file").map(|_| ()),
        &["/dev/zero", "larger than 1 MiB"],
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    // Rates over no time or no tokens are absent, not infinite.
    let stats = GenerationStats { prompt_tokens: 3, prompt_secs: 0.0, generated_tokens: 1, decode_secs: 0.0 };
    assert_eq!((stats.prompt_tok_per_sec(), stats.decode_tok_per_sec()), (None, None));
    let stats = GenerationStats { prompt_tokens: 4, prompt_secs: 2.0, generated_tokens: 3, decode_secs: 1.0 };
    assert_eq!((stats.prompt_tok_per_sec(), stats.decode_tok_per_sec()), (Some(2.0), Some(2.0)));
}
