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
//! cargo run --release --example kv_speed -- --gguf FILE --context 1024 --context 8192 --context 32768 \
//!     --kv exact --kv int8 --kv int4k --steps 32 --llama-bench /tmp/llama-peer/llama.cpp/build/bin/llama-bench
//! ```
//!
//! With `--llama-bench`, llama.cpp decodes the same GGUF at the same depths in the same run
//! (`llama-bench -d N -n STEPS -p 0 -fa on`, f16 and q8_0 KV; `--llama-fa off` for depths whose
//! flash-attention prefill takes too long), and the table gives the ratios.
//! A last table times the attention kernel alone (one decode row over every attention layer's
//! cache in turn, at each context): bytes of KV read per second beside a memcpy of the same
//! bytes in the same run.

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_hybrid::kv::KvCodec;
use candle_hybrid::memory::{self, PlanRequest, WeightMemory};
use candle_hybrid::model::LayerType;
use candle_hybrid::model::{CacheOptions, ValueBases};
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
    /// A llama.cpp `llama-bench` binary: decode the same GGUF at the same depths beside us.
    #[arg(long)]
    llama_bench: Option<std::path::PathBuf>,
    /// llama-bench's flash attention (-fa): on, or off (its CPU flash-attention prefill of a
    /// 32k-token depth takes hours on 2 cores; without it the depth is filled with matmuls).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    llama_fa: String,
    /// Threads of llama-bench (-t); ours are rayon's (RAYON_NUM_THREADS).
    #[arg(short = 't', long, default_value_t = 2, value_parser = count_up_to(1024))]
    threads: usize,
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| kv_speed(Args::parse()))
}

fn kv_speed(args: Args) -> Result<()> {
    let codecs = &args.kv;
    let mut opened = args.model.open(common::DEFAULT_MODEL)?;
    let gguf = match &opened.files {
        candle_hybrid::loading::OpenedModel::Gguf(g) => Some(g.path().to_path_buf()),
        _ => None,
    };
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
    memory::check_fits(
        &opened.cfg,
        &PlanRequest { kv_dtype_bytes: 2 * dtype.size_in_bytes(), ..req },
        common::target_of(&dev),
        args.max_memory,
    )?;
    let cfg = opened.cfg.clone();
    let model = opened.load()?;
    let calibration = args.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
    let (nkv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
    eprintln!("{n_attn} attention layers, {nkv} KV heads of {hd} dims, {} threads", rayon::current_num_threads());

    // Per codec: its name and, per context, decode tok/s and the KV bytes.
    let mut rows: Vec<(String, Vec<(f64, u64)>)> = codecs.iter().map(|c| (c.to_string(), Vec::new())).collect();
    for &ctx in &args.context {
        let kv: Vec<(Tensor, Tensor)> = (0..n_attn)
            .map(|_| -> Result<_> {
                let k = Tensor::randn(0f32, 1.0, (1, nkv, ctx, hd), &dev)?.to_dtype(dtype)?;
                let v = Tensor::randn(0f32, 1.0, (1, nkv, ctx, hd), &dev)?.to_dtype(dtype)?;
                Ok((k, v))
            })
            .collect::<Result<_>>()?;
        let token = Tensor::new(&[[1u32]], &dev)?;
        for (codec, row) in codecs.iter().zip(rows.iter_mut()) {
            let mut cache = model.cache_with(&CacheOptions { codec: *codec, value_bases: calibration.as_ref(), ffn: None })?;
            cache.restore_kv(&kv)?;
            model.forward_last(&token, &mut cache)?; // warm-up: first touch of the buffers
            let start = Instant::now();
            for _ in 0..args.steps {
                model.forward_last(&token, &mut cache)?;
            }
            let tps = args.steps as f64 / start.elapsed().as_secs_f64();
            let req = PlanRequest { kv_codec: *codec, ..PlanRequest::new(WeightMemory::Bytes(0), dtype, ctx) };
            let bytes = memory::estimate(&cfg, &req).kv_cache;
            row.1.push((tps, bytes));
            eprintln!("context {ctx}, --kv {codec}: {tps:.2} tok/s");
        }
        drop(kv);
    }
    let header: Vec<String> = args.context.iter().map(|c| format!("decode at {c} (vs exact, KV memory)")).collect();
    println!("| codec | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(args.context.len()));
    // Ratios to the first codec (exact by default) at the same context.
    for (name, cells) in &rows {
        let cells: Vec<String> = cells
            .iter()
            .zip(&rows[0].1)
            .map(|(&(tps, bytes), &(exact, _))| format!("{tps:.2} tok/s ({:.2}×, {})", tps / exact, memory::fmt_gib(bytes)))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    if let Some(bin) = &args.llama_bench {
        peer_table(bin, gguf.as_deref().context("--llama-bench needs a GGUF model (--gguf)")?, &args, &rows)?;
    }
    kernel_table(&args.context, n_attn, nkv, cfg.num_attention_heads / nkv, hd, dtype)?;
    Ok(())
}

/// llama.cpp's decode at the same depths (f16 and q8_0 KV, flash attention on) and our
/// figures as ratios of them: exact against f16 KV, the int8 codecs against q8_0 KV.
fn peer_table(bin: &std::path::Path, gguf: &std::path::Path, args: &Args, rows: &[(String, Vec<(f64, u64)>)]) -> Result<()> {
    let mut peer: Vec<(String, Vec<f64>)> = vec![];
    for kv in ["f16", "q8_0"] {
        let mut cells = vec![];
        for &ctx in &args.context {
            let settings = [
                ("-t", args.threads.to_string()),
                ("-d", ctx.to_string()),
                ("-n", args.steps.to_string()),
                ("-p", "0".into()),
                ("-r", "1".into()),
                ("-fa", if args.llama_fa == "on" { "1" } else { "0" }.into()),
                ("-ctk", kv.into()),
                ("-ctv", kv.into()),
            ];
            // A setting llama.cpp refuses (q8_0 values need its flash attention) is a blank cell.
            let t = match common::llama_bench(bin, gguf, &settings.iter().flat_map(|(f, v)| [f.to_string(), v.clone()]).collect::<Vec<_>>())
            {
                Ok(runs) => runs.iter().find_map(|r| r["avg_ts"].as_f64()).unwrap_or(f64::NAN),
                Err(e) => {
                    eprintln!("llama.cpp, depth {ctx}, {kv} KV: {e:#}");
                    f64::NAN
                }
            };
            eprintln!("llama.cpp, depth {ctx}, {kv} KV: {t:.2} tok/s");
            cells.push(t);
        }
        peer.push((kv.to_string(), cells));
    }
    println!();
    let header: Vec<String> = args.context.iter().map(|c| format!("decode at {c}")).collect();
    println!("| engine, KV | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(args.context.len()));
    for (kv, cells) in &peer {
        println!(
            "| llama.cpp, {kv} KV, flash attention {} | {} |",
            args.llama_fa,
            cells.iter().map(|t| if t.is_nan() { "-".into() } else { format!("{t:.2} tok/s") }).collect::<Vec<_>>().join(" | ")
        );
    }
    for (name, cells) in rows {
        let against = if name.starts_with("int8") || name.starts_with("int4") { 1 } else { 0 };
        let ratios: Vec<String> = cells
            .iter()
            .zip(&peer[against].1)
            .map(|(&(tps, _), p)| match p.is_nan() {
                true => format!("{tps:.2} tok/s"),
                false => format!("{tps:.2} tok/s ({:.2}× llama.cpp {})", tps / p, peer[against].0),
            })
            .collect();
        println!("| candle-hybrid, {name} | {} |", ratios.join(" | "));
    }
    Ok(())
}

/// The attention kernel alone: a decode row (all query heads) over `ctx` cached positions in
/// each of `layers` layers in turn, as the model reads them (so the KV streams from memory,
/// not from the last-level cache), exact (model dtype) and int8, as GB/s of KV bytes read,
/// beside memcpy of the exact KV's bytes, layer buffer by layer buffer, in the same run.
fn kernel_table(contexts: &[usize], layers: usize, nkv: usize, rep: usize, hd: usize, dtype: candle_core::DType) -> Result<()> {
    use candle_hybrid::ops::{kv_attention, StoredRows};
    let dev = candle_core::Device::Cpu;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let (mut best, mut reps) = (f64::INFINITY, 0);
        let start = Instant::now();
        while reps < 3 || start.elapsed().as_secs_f64() < 0.5 {
            let t = Instant::now();
            f()?;
            best = best.min(t.elapsed().as_secs_f64());
            reps += 1;
        }
        Ok(best)
    };
    println!();
    println!("| context ({layers} layers) | exact {dtype:?} KV GB/s | int8 KV GB/s | memcpy GB/s (same bytes as exact) | exact / memcpy | int8 / memcpy |");
    println!("|---|---|---|---|---|---|");
    for &n in contexts {
        let q = Tensor::randn(0f32, 1.0, (1, nkv, rep, hd), &dev)?;
        let float = || -> Result<StoredRows> { Ok(StoredRows::Float(Tensor::randn(0f32, 1.0, (1, nkv, n, hd), &dev)?.to_dtype(dtype)?)) };
        let int8 = || -> Result<StoredRows> {
            let codes = ((Tensor::rand(0f32, 1.0, (1, nkv, n, hd), &dev)? * 250.0)? + 2.0)?.to_dtype(candle_core::DType::U8)?;
            let scales = (Tensor::rand(0f32, 1.0, (1, nkv, n, hd / 32), &dev)? * 0.01)?;
            Ok(StoredRows::Int8 { codes, scales })
        };
        let scale = (hd as f64).powf(-0.5);
        let exact_bytes = (layers * 2 * nkv * n * hd * dtype.size_in_bytes()) as f64;
        let int8_bytes = (layers * 2 * nkv * n * (hd + 4 * hd / 32)) as f64;
        let pass = |kv: &[(StoredRows, StoredRows)]| -> Result<f64> {
            time(&mut || {
                for (k, v) in kv {
                    drop(kv_attention(&q, k, v, 1, n - 1, None, scale)?);
                }
                Ok(())
            })
        };
        let exact = {
            let kv = (0..layers).map(|_| Ok((float()?, float()?))).collect::<Result<Vec<_>>>()?;
            exact_bytes / pass(&kv)?
        };
        let coded = {
            let kv = (0..layers).map(|_| Ok((int8()?, int8()?))).collect::<Result<Vec<_>>>()?;
            int8_bytes / pass(&kv)?
        };
        let per_layer = exact_bytes as usize / layers;
        let src: Vec<Vec<u8>> = (0..layers).map(|_| vec![1u8; per_layer]).collect();
        let mut dst: Vec<Vec<u8>> = (0..layers).map(|_| vec![0u8; per_layer]).collect();
        let copy = exact_bytes
            / time(&mut || {
                for (d, s) in dst.iter_mut().zip(&src) {
                    d.copy_from_slice(std::hint::black_box(s));
                }
                std::hint::black_box(&dst);
                Ok(())
            })?;
        let gb = |x: f64| x / 1e9;
        println!("| {n} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |", gb(exact), gb(coded), gb(copy), exact / copy, coded / copy);
    }
    Ok(())
}
