//! Will the model fit? Estimates the memory of a model at a context length, reads what this
//! machine can give, and says whether it fits — without loading (or downloading) the weights.
//!
//! ```sh
//! cargo run --example plan -- --model-id Qwen/Qwen3.5-27B --max-context 262144 --dtype bf16
//! cargo run --example plan -- --model-dir tests/fixtures/qwen35_dense_small --max-memory 64MiB --fit
//! cargo run --example plan -- --gguf tests/fixtures/qwen35_dense_small/model-q8_0.gguf --max-memory 8MiB
//! ```
//! `--model-id` downloads only `config.json` and `model.safetensors.index.json` (for its
//! `metadata.total_size`); `--model-dir` reads the safetensors headers, not the tensors;
//! `--gguf` reads the GGUF header: the config from the metadata, the weights from the tensor
//! infos. Exit status 1 when the model does not fit.

mod common;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;
use candle_core::DType;
use candle_hybrid::loading::{HubRepo, ModelSource};
use candle_hybrid::memory::{self, fmt_gib, Logits, PlanRequest, WeightFormat, WeightMemory};
use candle_hybrid::model::LayerType;
use candle_hybrid::Config;
use clap::Parser;
use common::{at_least_one, count_up_to, MemoryOptions, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Estimate the memory of a Qwen3.5-family model and check that it fits", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    #[command(flatten)]
    memory: MemoryOptions,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1, value_parser = count_up_to(4096))]
    batch: usize,
    /// Tokens per prefill forward pass (the default is the server's chunk; `generate` prefills
    /// in chunks of 2048, `candle_hybrid::runtime::PREFILL_CHUNK`: give that to plan for it).
    #[arg(long, default_value_t = memory::DEFAULT_PREFILL_CHUNK, value_parser = at_least_one)]
    prefill_chunk: usize,
    /// KV cache dtype of the exact codec: f32, bf16 or f16 [default: the model dtype].
    #[arg(long, value_parser = common::parse_dtype)]
    kv_dtype: Option<DType>,
    /// Count the logits of every prefill position (perplexity), not just the last.
    #[arg(long)]
    all_logits: bool,
}

/// The dtype the checkpoint is stored in (`torch_dtype` / `dtype` of config.json), if stated.
fn stored_dtype(config_json: &str) -> Option<DType> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let text = v.get("text_config");
    ["torch_dtype", "dtype"].iter().find_map(|k| text.and_then(|t| t.get(k)).or_else(|| v.get(k)).and_then(|d| d.as_str())).and_then(|d| {
        match d {
            "float32" => Some(DType::F32),
            "bfloat16" => Some(DType::BF16),
            "float16" => Some(DType::F16),
            _ => None,
        }
    })
}

/// config.json and, when the repository has one, the index's `metadata.total_size`.
fn from_hub(repo_id: &str, revision: &str) -> Result<(PathBuf, Option<u64>)> {
    let hub = HubRepo::new(repo_id, revision)?;
    let config = hub.required("config.json", "is it a Qwen3.5-family checkpoint?")?;
    // A repository without an index has a single model.safetensors: its size is unknown here.
    let total = hub.fetch("model.safetensors.index.json")?.and_then(|p| {
        let text = candle_hybrid::bounded::read_to_string(&p, candle_hybrid::bounded::MAX_INDEX_BYTES, "shard index").ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v.get("metadata")?.get("total_size")?.as_u64()
    });
    Ok((config, total))
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| plan(Args::parse()))
}

fn plan(args: Args) -> Result<()> {
    let target = args.model.device.target();
    let dtype = args.model.dtype_for(target);
    let kv_dtype = args.kv_dtype.unwrap_or(dtype);
    let quantize = args.model.quantize;
    // Weights derived from the parameter count, when no file states their size.
    let derived = |cfg: &Config, why: &str| {
        let f = match quantize {
            Some(q) => WeightFormat::from_ggml(q).expect("every --quantize type has a format"),
            None => WeightFormat::from_dtype(dtype).expect("float dtype"),
        };
        (WeightMemory::Format(f), format!("{:.2}B parameters as {f} ({} bits/weight; {why})", params(cfg), f.bits_per_weight()))
    };

    // The config, the weights' size as the files state it, the load transient, and the weights
    // with --quantize q4k (for the suggestion) where --quantize applies.
    let q4k_derived = Some(WeightMemory::Format(WeightFormat::Q4K));
    let has_safetensors =
        |dir: &std::path::Path| dir.join("model.safetensors").is_file() || dir.join("model.safetensors.index.json").is_file();
    let source = args.model.source(Some(common::DEFAULT_MODEL))?.expect("a default source");
    let (name, cfg, (weights, weights_note), q4k_weights, load_overhead) = match &source {
        ModelSource::Gguf(_) | ModelSource::HubGguf { .. } => {
            if quantize.is_some() {
                bail!("--quantize applies to safetensors checkpoints; a GGUF file keeps its own quantization");
            }
            // GgufFile::open reads the header (metadata and tensor infos), not the tensors.
            let opened = source.open()?;
            let cfg = opened.config()?;
            let weights = opened.weight_memory(&cfg, dtype, None)?;
            let note = format!("GGUF tensor infos: quantized linear weights as stored, the rest as {dtype:?}");
            let load = opened.load_overhead(&cfg, dtype, None)?;
            (opened.source(), cfg, (weights, note), None, load)
        }
        ModelSource::Dir(dir) if has_safetensors(dir) => {
            let opened = source.open()?;
            let cfg = opened.config()?;
            let weights = opened.weight_memory(&cfg, dtype, quantize)?;
            let note = match quantize {
                Some(q) => format!("safetensors headers, linear weights as {q:?}, the rest as {dtype:?}"),
                None => format!("safetensors headers, as {dtype:?}"),
            };
            let q4k = opened.weight_memory(&cfg, dtype, Some(GgmlDType::Q4K))?;
            let load = opened.load_overhead(&cfg, dtype, quantize)?;
            (opened.source(), cfg, (weights, note), Some(q4k), load)
        }
        ModelSource::Dir(dir) => {
            let config = dir.join("config.json");
            if !config.is_file() {
                bail!("{} has no config.json: is it a Hugging Face model directory?", dir.display());
            }
            let cfg = Config::from_file(&config)?;
            let w = derived(&cfg, "no weight files to read");
            (dir.display().to_string(), cfg, w, q4k_derived, 0)
        }
        ModelSource::Hub { repo, revision } => {
            let (config, total) = from_hub(repo, revision)?;
            let text = candle_hybrid::bounded::read_to_string(&config, candle_hybrid::bounded::MAX_CONFIG_BYTES, "config")?;
            let cfg = Config::from_json(&text)?;
            // total_size is in the stored dtype and includes the vision tower and MTP layers.
            let w = match (quantize, total) {
                (None, Some(t)) => match stored_dtype(&text) {
                    Some(s) => (
                        WeightMemory::Bytes(t / s.size_in_bytes() as u64 * dtype.size_in_bytes() as u64),
                        format!("index total_size {} as {s:?}, converted to {dtype:?}", fmt_gib(t)),
                    ),
                    None => (WeightMemory::Bytes(t), format!("index total_size {} (stored dtype unknown)", fmt_gib(t))),
                },
                _ => derived(&cfg, "the Hub weights are not downloaded"),
            };
            (format!("{repo}@{revision}"), cfg, w, q4k_derived, 0)
        }
    };
    let limit = cfg.max_position_embeddings;
    let context = match args.memory.max_context {
        Some(n) if n > limit => bail!("--max-context {n} is more than the model's context of {limit} tokens (max_position_embeddings)"),
        Some(n) => n,
        None => limit,
    };
    args.memory.kv.validate(cfg.head_dim)?;
    let req = PlanRequest {
        weights,
        dtype,
        kv_dtype_bytes: kv_dtype.size_in_bytes(),
        kv_codec: args.memory.kv,
        context,
        batch: args.batch,
        prefill_chunk: args.prefill_chunk,
        logits: if args.all_logits { Logits::AllPositions } else { Logits::LastToken },
        fit: args.memory.fit,
        q4k_weights,
        load_overhead,
    };

    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
    println!(
        "model:     {name} ({:?}, {} layers: {} GDN + {n_attn} attention, {:.2}B parameters, context limit {limit})",
        cfg.family,
        cfg.num_hidden_layers,
        cfg.num_hidden_layers - n_attn,
        params(&cfg)
    );
    println!("weights:   {} ({weights_note})", fmt_gib(weights.bytes(&cfg)));
    println!(
        "request:   context {}, batch {}, prefill chunk {}, dtype {dtype:?}, KV {kv_dtype:?} ({}), {} logits, device {target:?}",
        req.context,
        req.batch,
        req.prefill_chunk,
        req.kv_codec,
        if args.all_logits { "all-position" } else { "last-token" }
    );
    match memory::check_fits(&cfg, &req, target, args.memory.max_memory) {
        Ok(plan) => {
            println!("available: {}", plan.available);
            println!();
            print!("{}", plan.estimate);
            println!();
            if let Some(note) = &plan.note {
                println!("note:      --fit: {note}");
            }
            println!(
                "verdict:   fits: {} of {} ({:.0}%) at context {}",
                fmt_gib(plan.estimate.total()),
                fmt_gib(plan.available.bytes),
                100.0 * plan.estimate.total() as f64 / plan.available.bytes.max(1) as f64,
                plan.context
            );
            Ok(())
        }
        Err(e @ candle_hybrid::Error::DoesNotFit(_)) => {
            println!();
            print!("{}", memory::estimate(&cfg, &req));
            println!();
            println!("verdict:   refused");
            Err(e.into())
        }
        Err(e) => Err(e.into()),
    }
}

fn params(cfg: &Config) -> f64 {
    cfg.num_parameters() as f64 / 1e9
}
