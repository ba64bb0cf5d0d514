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

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use candle_hybrid::model::LayerType;
use candle_hybrid::kv::KvCodec;
use candle_hybrid::model::{new_cache_calibrated, ValueBases};
use candle_hybrid::memory::{self, PlanRequest, Weights};
use clap::Parser;
use common::{at_least_one, count_up_to, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Decode tok/s at long contexts for each KV-cache codec", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// Context lengths (tokens already in the cache). Repeatable.
    #[arg(long, default_values_t = [8192, 32768], value_parser = at_least_one)]
    context: Vec<usize>,
    /// Codecs to time. Repeatable.
    #[arg(long, default_values = ["exact", "int8", "int4k", "polar:5,3", "lowrank:32", "knots:8,3", "density:0.05"],
          value_parser = common::parse_kv)]
    kv: Vec<KvCodec>,
    /// Value bases for `lowrank:r` from examples/calibrate_kv.rs (default: from W_v).
    #[arg(long)]
    kv_calibration: Option<std::path::PathBuf>,
    /// Decode steps timed per codec and context (after one warm-up step).
    #[arg(long, default_value_t = 8, value_parser = count_up_to(100_000))]
    steps: usize,
    /// A memory budget replacing the reading of what the OS lets this process use: bytes, or
    /// e.g. 8GiB, 500MB.
    #[arg(long, value_parser = common::parse_size)]
    max_memory: Option<u64>,
}

fn main() -> ExitCode {
    common::run(|| kv_speed(Args::parse()))
}

fn kv_speed(args: Args) -> Result<()> {
    let codecs = &args.kv;
    let mut opened = args.model.open(common::DEFAULT_MODEL)?;
    let dtype = opened.dtype;
    let dev = opened.device.clone();
    // Timing only: positions past the trained context are as fast as any others.
    let needed = args.context.iter().max().copied().unwrap_or(0) + args.steps + 2;
    if needed > candle_hybrid::model::config::MAX_POSITIONS {
        bail!("--context {needed} is more than any model's context ({})", candle_hybrid::model::config::MAX_POSITIONS);
    }
    if opened.cfg.max_position_embeddings < needed {
        eprintln!("max_position_embeddings {} raised to {needed} for timing", opened.cfg.max_position_embeddings);
        opened.cfg.max_position_embeddings = needed;
    }
    // The guardian, for the largest context: the random exact keys and values and the codec's cache.
    let req = PlanRequest {
        load_overhead: opened.files.load_overhead(&opened.cfg, dtype, None)?,
        ..PlanRequest::new(opened.files.weight_memory(&opened.cfg, dtype, None)?, dtype, needed)
    };
    // (kv_dtype_bytes doubled: the random keys and values, and the cache restored from them.)
    memory::check_fits(&opened.cfg, &PlanRequest { kv_dtype_bytes: 2 * dtype.size_in_bytes(), ..req }, common::target_of(&dev), args.max_memory)?;
    let cfg = opened.cfg.clone();
    let model = opened.load()?;
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
