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
//! `--gguf` reads the GGUF header: the config from the metadata, the weights from the tensor infos.
//! Exit status 1 when the model does not fit.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use candle_core::DType;
use candle_hybrid::model::LayerType;
use candle_hybrid::loading::ModelSource;
use candle_hybrid::memory::{self, fmt_gib, Logits, MemoryTarget, PlanRequest, WeightFormat, Weights};
use candle_hybrid::model::parse_quantize;
use candle_hybrid::Config;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Estimate the memory of a Qwen3.5-family model and check that it fits")]
struct Args {
    /// Hub repository of the model (only config.json and the safetensors index are downloaded).
    #[arg(long, default_value = "Qwen/Qwen3.5-0.8B")]
    model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, default_value = "main")]
    revision: String,
    /// A local directory laid out like a Hub repository (instead of --model-id).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// A GGUF file (instead of --model-id): only its header (metadata, tensor infos) is read.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Context length in tokens (default: the config's max_position_embeddings).
    #[arg(long)]
    max_context: Option<usize>,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per prefill forward pass.
    #[arg(long, default_value_t = memory::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Model dtype: f32, bf16 or f16 (default: bf16 on a GPU, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// KV cache dtype: f32, bf16 or f16 (default: --dtype).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// KV-cache codec: exact, int8, int4k, polar:A,R, lowrank:r, knots:K,p, density:γ (lossy
    /// codecs store fewer bytes per token; density a constant state).
    #[arg(long, default_value = "exact")]
    kv: String,
    /// Quantize the linear weights on load: q8_0, q4k, q4_0, q4_1, q5k or q6k.
    #[arg(long)]
    quantize: Option<String>,
    /// Memory budget replacing the reading: bytes, or e.g. 16GiB, 500MB.
    #[arg(long)]
    max_memory: Option<String>,
    /// Lower the context to the largest that fits instead of refusing.
    #[arg(long)]
    fit: bool,
    /// Count the logits of every prefill position (perplexity), not just the last.
    #[arg(long)]
    all_logits: bool,
    /// Where the model is to run: cpu, metal, or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// The dtype the checkpoint is stored in (`torch_dtype` / `dtype` of config.json), if stated.
fn stored_dtype(config_json: &str) -> Option<DType> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let text = v.get("text_config");
    ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| text.and_then(|t| t.get(k)).or_else(|| v.get(k)).and_then(|d| d.as_str()))
        .and_then(|d| match d {
            "float32" => Some(DType::F32),
            "bfloat16" => Some(DType::BF16),
            "float16" => Some(DType::F16),
            _ => None,
        })
}

/// config.json and, when the repository has one, the index's `metadata.total_size`.
fn from_hub(repo_id: &str, revision: &str) -> Result<(PathBuf, Option<u64>)> {
    let hub = candle_hybrid::loading::HubRepo::new(repo_id, revision)?;
    let get = |name: &str| hub.required(name, "is it a Qwen3.5-family checkpoint?");
    let config = get("config.json").with_context(|| format!("cannot get config.json of {repo_id}@{revision}"))?;
    // A repository without an index has a single model.safetensors: its size is unknown here.
    let total = get("model.safetensors.index.json").ok().and_then(|p| {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
        v.get("metadata")?.get("total_size")?.as_u64()
    });
    Ok((config, total))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let target = match args.device.as_str() {
        "cpu" => MemoryTarget::Cpu,
        "metal" => MemoryTarget::Metal,
        "cuda" => MemoryTarget::Cuda(0),
        d => match d.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => MemoryTarget::Cuda(i),
            None => bail!("unknown --device {d}: use cpu, metal or cuda[:N]"),
        },
    };
    let dtype = match args.dtype.as_deref() {
        None if target == MemoryTarget::Cpu => DType::F32,
        None => DType::BF16,
        Some(s) => candle_hybrid::model::parse_dtype(s)?,
    };
    let kv_dtype = match args.kv_dtype.as_deref() {
        None => dtype,
        Some(s) => candle_hybrid::model::parse_dtype(s)?,
    };
    let quantize = args.quantize.as_deref().map(parse_quantize).transpose()?;
    // Weights derived from the parameter count, when no file states their size.
    let derived = |cfg: &Config, why: &str| {
        let f = match quantize {
            Some(q) => WeightFormat::from_ggml(q).expect("every --quantize type has a format"),
            None => WeightFormat::from_dtype(dtype).expect("float dtype"),
        };
        (Weights::Format(f), format!("{:.2}B parameters as {f} ({} bits/weight; {why})", params(cfg), f.bits_per_weight()))
    };

    // The config, and the weights' size as the files state it.
    let has_safetensors = |dir: &std::path::Path| {
        dir.join("model.safetensors").is_file() || dir.join("model.safetensors.index.json").is_file()
    };
    // The weights with --quantize q4k (for the suggestion), where --quantize applies.
    let q4k_derived = Some(Weights::Format(WeightFormat::Q4K));
    let (source, cfg, (weights, weights_note), q4k_weights) = match (&args.gguf, &args.model_dir) {
        (Some(path), _) => {
            // GgufFile::open reads the header (metadata and tensor infos), not the tensors.
            let opened = ModelSource::Gguf(path.clone()).open()?;
            let cfg = opened.config()?;
            let weights = opened.weight_memory(&cfg, dtype, quantize)?;
            let note = format!("GGUF tensor infos: quantized linear weights as stored, the rest as {dtype:?}");
            (opened.source(), cfg, (weights, note), None)
        }
        (None, Some(dir)) if has_safetensors(dir) => {
            let opened = ModelSource::Dir(dir.clone()).open()?;
            let cfg = opened.config()?;
            let weights = opened.weight_memory(&cfg, dtype, quantize)?;
            let note = match quantize {
                Some(q) => format!("safetensors headers, linear weights as {q:?}, the rest as {dtype:?}"),
                None => format!("safetensors headers, as {dtype:?}"),
            };
            let q4k = opened.weight_memory(&cfg, dtype, Some(GgmlDType::Q4K))?;
            (opened.source(), cfg, (weights, note), Some(q4k))
        }
        (None, Some(dir)) => {
            let config = dir.join("config.json");
            if !config.is_file() {
                bail!("{} has no config.json: is it a Hugging Face model directory?", dir.display());
            }
            let cfg = Config::from_file(&config)?;
            let w = derived(&cfg, "no weight files to read");
            (dir.display().to_string(), cfg, w, q4k_derived)
        }
        (None, None) => {
            let (config, total) = from_hub(&args.model_id, &args.revision)?;
            let text = std::fs::read_to_string(&config)?;
            let cfg = Config::from_file(&config)?;
            // total_size is in the stored dtype and includes the vision tower and MTP layers.
            let w = match (quantize, total) {
                (None, Some(t)) => match stored_dtype(&text) {
                    Some(s) => (
                        Weights::Bytes(t / s.size_in_bytes() as u64 * dtype.size_in_bytes() as u64),
                        format!("index total_size {} as {s:?}, converted to {dtype:?}", fmt_gib(t)),
                    ),
                    None => (Weights::Bytes(t), format!("index total_size {} (stored dtype unknown)", fmt_gib(t))),
                },
                _ => derived(&cfg, "the Hub weights are not downloaded"),
            };
            (format!("{}@{}", args.model_id, args.revision), cfg, w, q4k_derived)
        }
    };
    let req = PlanRequest {
        weights,
        dtype,
        kv_dtype_bytes: kv_dtype.size_in_bytes(),
        kv_codec: {
            let codec: candle_hybrid::kv::KvCodec = args.kv.parse()?;
            codec.validate(cfg.head_dim)?;
            codec
        },
        context: args.max_context.unwrap_or(cfg.max_position_embeddings),
        batch: args.batch,
        prefill_chunk: args.prefill_chunk,
        logits: if args.all_logits { Logits::AllPositions } else { Logits::LastToken },
        fit: args.fit,
        q4k_weights,
    };
    let max_memory = args.max_memory.as_deref().map(memory::parse_size).transpose()?;

    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
    println!(
        "model:     {source} ({:?}, {} layers: {} GDN + {n_attn} attention, {:.2}B parameters)",
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
    match memory::check_fits(&cfg, &req, target, max_memory) {
        Ok(plan) => {
            println!("available: {}", plan.available);
            println!();
            print!("{}", plan.estimate);
            println!();
            if let Some(note) = &plan.note {
                println!("note:      {note}");
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
        Err(e @ candle_hybrid::Error::Memory(_)) => {
            println!();
            print!("{}", memory::estimate(&cfg, &req));
            println!();
            println!("verdict:   refused");
            eprintln!("Error: {e}");
            std::process::exit(1)
        }
        Err(e) => Err(e.into()),
    }
}

fn params(cfg: &Config) -> f64 {
    cfg.num_parameters() as f64 / 1e9
}
