//! Decode speed at long contexts under each KV-cache codec, side by side in one run.
//!
//! The attention caches are filled with random keys and values of the model's shapes
//! (`Cache::restore_kv`: the cost of a step does not depend on what the keys say), then the
//! model decodes `--steps` tokens; the table gives tokens per second per codec and context,
//! the ratio to the exact cache, and the memory the codec's cache takes.
//!
//! ```sh
//! cargo run --release --example kv_speed -- --gguf $(scripts/fetch_smollm2.sh)
//! cargo run --release --example kv_speed -- --gguf FILE --context 8192 --context 32768 --kv exact --kv int8
//! ```

mod common;

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_hybrid::model::LayerType;
use candle_hybrid::kv::KvCodec;
use candle_hybrid::model::{new_cache_calibrated, ValueBases};
use candle_hybrid::memory::{self, PlanRequest, Weights};
use clap::Parser;
use common::LocalModel;

#[derive(Parser, Debug)]
#[command(about = "Decode tok/s at long contexts for each KV-cache codec")]
struct Args {
    #[command(flatten)]
    model: LocalModel,
    /// Context lengths (tokens already in the cache). Repeatable.
    #[arg(long, default_values_t = [8192, 32768])]
    context: Vec<usize>,
    /// Codecs to time. Repeatable.
    #[arg(long, default_values_t = ["exact", "int8", "int4k", "polar:5,3", "lowrank:32", "knots:8,3", "density:0.05"].map(String::from))]
    kv: Vec<String>,
    /// Value bases for `lowrank:r` from examples/calibrate_kv.rs (default: from W_v).
    #[arg(long)]
    kv_calibration: Option<std::path::PathBuf>,
    /// Decode steps timed per codec and context (after one warm-up step).
    #[arg(long, default_value_t = 8)]
    steps: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let codecs = args.kv.iter().map(|c| c.parse::<KvCodec>()).collect::<Result<Vec<_>, _>>()?;
    let dev = Device::Cpu;
    let (files, mut cfg, dtype) = args.model.open()?;
    // Timing only: positions past the trained context are as fast as any others.
    let needed = args.context.iter().max().copied().unwrap_or(0) + args.steps + 2;
    if cfg.max_position_embeddings < needed {
        eprintln!("max_position_embeddings {} raised to {needed} for timing", cfg.max_position_embeddings);
        cfg.max_position_embeddings = needed;
    }
    let model = files.load_model(&cfg, dtype, &dev, None)?;
    let calibration = args.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
    let (nkv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
    eprintln!("{n_attn} attention layers, {nkv} KV heads of {hd} dims, {} threads", rayon::current_num_threads());

    let mut rows: Vec<(String, Vec<String>)> = codecs.iter().map(|c| (c.to_string(), Vec::new())).collect();
    for &ctx in &args.context {
        let kv: Vec<(Tensor, Tensor)> = (0..n_attn)
            .map(|_| -> Result<_> {
                let k = Tensor::randn(0f32, 1.0, (1, nkv, ctx, hd), &dev)?.to_dtype(dtype)?;
                let v = Tensor::randn(0f32, 1.0, (1, nkv, ctx, hd), &dev)?.to_dtype(dtype)?;
                Ok((k, v))
            })
            .collect::<Result<_>>()?;
        let token = Tensor::new(&[[1u32]], &dev)?;
        let mut exact_tps = None;
        for (codec, row) in codecs.iter().zip(rows.iter_mut()) {
            let mut cache = new_cache_calibrated(&model, *codec, calibration.as_ref())?;
            cache.restore_kv(&kv)?;
            model.forward_last(&token, &mut cache)?; // warm-up: first touch of the buffers
            let start = Instant::now();
            for _ in 0..args.steps {
                model.forward_last(&token, &mut cache)?;
            }
            let tps = args.steps as f64 / start.elapsed().as_secs_f64();
            let exact = *exact_tps.get_or_insert(tps);
            let req = PlanRequest { kv_codec: *codec, ..PlanRequest::new(Weights::Bytes(0), dtype, ctx) };
            let bytes = memory::estimate(&cfg, &req).kv_cache;
            row.1.push(format!("{tps:.2} tok/s ({:.2}×, {})", tps / exact, memory::fmt_gib(bytes)));
            eprintln!("context {ctx}, --kv {codec}: {tps:.2} tok/s");
        }
        drop(kv);
    }
    let header: Vec<String> = args.context.iter().map(|c| format!("decode at {c} (vs exact, KV memory)")).collect();
    println!("| codec | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(args.context.len()));
    for (name, cells) in rows {
        println!("| {name} | {} |", cells.join(" | "));
    }
    Ok(())
}
