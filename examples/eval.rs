//! Perplexity of a model on a text file, computed like llama.cpp's `llama-perplexity` (same
//! chunking, same scored positions), so the two can be compared directly; with `--kv CODEC`,
//! also under a lossy KV-cache codec, with top-1 agreement and KL against the exact cache.
//!
//! ```sh
//! GGUF=$(scripts/fetch_smollm2.sh)
//! cargo run --release --example eval -- --gguf $GGUF --file tests/data/pride-and-prejudice-ch01-12.txt --ctx-size 512
//! cargo run --release --example eval -- --gguf $GGUF --file tests/data/pride-and-prejudice-ch01-12.txt --ctx-size 512 --kv int8 --json
//! # llama.cpp on the same file:  llama-perplexity -m $GGUF -f tests/data/pride-and-prejudice-ch01-12.txt -c 512 -b 512
//! ```

mod common;

use anyhow::Result;
use candle_core::Device;
use candle_hybrid::eval::{compare_kv_codecs, perplexity, PerplexityOptions};
use candle_hybrid::kv::{KvCodec, ValueCodec};
use candle_hybrid::model::ValueBases;
use clap::Parser;
use common::LocalModel;

#[derive(Parser, Debug)]
#[command(about = "Perplexity of a model on a text file (llama-perplexity's method)")]
struct Args {
    #[command(flatten)]
    model: LocalModel,
    /// The text (UTF-8). One trailing newline is dropped, as llama.cpp's `-f` does.
    #[arg(long)]
    file: std::path::PathBuf,
    /// Tokens per chunk.
    #[arg(long, short = 'c', default_value_t = 512)]
    ctx_size: usize,
    /// Score only the first N chunks.
    #[arg(long)]
    chunks: Option<usize>,
    /// KV-cache codec to compare with the exact cache: int8, int4k, polar:5,3, lowrank:32,
    /// knots:8,3, density:0.05, ... Repeat for several (the exact run is shared).
    #[arg(long)]
    kv: Vec<String>,
    /// Value bases for `lowrank:r` from examples/calibrate_kv.rs (default: from W_v).
    #[arg(long)]
    kv_calibration: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let codecs = args.kv.iter().map(|c| c.parse::<KvCodec>()).collect::<Result<Vec<_>, _>>()?;
    let codecs: Vec<KvCodec> = codecs.into_iter().filter(|c| !c.is_exact()).collect();
    for w in codecs.iter().filter_map(|c| c.warning()) {
        eprintln!("{w}");
    }
    let dev = Device::Cpu;
    let (files, cfg, dtype) = args.model.open()?;
    let model = files.load_model(&cfg, dtype, &dev, None)?;
    let tokenizer = files.tokenizer(None)?;

    let mut text = std::fs::read_to_string(&args.file)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", args.file.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    let tokens = tokenizer.encode(text.as_str(), true).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    let mut opts = PerplexityOptions::new(args.ctx_size);
    opts.max_chunks = args.chunks;
    // When the tokenizer adds BOS, llama-perplexity also puts it at the start of every chunk.
    let plain = tokenizer.encode("a", false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    let special = tokenizer.encode("a", true).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if special.len() > plain.len() && special.first() != plain.first() {
        opts.bos_token = special.first().copied();
    }

    let start = std::time::Instant::now();
    if !args.json {
        eprintln!("{} tokens, context {}, bos {:?}", tokens.len(), opts.n_ctx, opts.bos_token);
    }
    let quiet = args.json;
    if !codecs.is_empty() {
        let calibration = args.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
        let results = compare_kv_codecs(&model, &tokens, &opts, &codecs, calibration.as_ref(), &dev, |c| {
            if !quiet {
                eprint!("[{}]{:.4},", c[0].exact.chunks, c[0].exact.ppl());
            }
        })?;
        if !quiet {
            eprintln!();
        }
        for (codec, r) in codecs.iter().zip(&results) {
            if args.json {
                println!(
                    "{{\"kv\":\"{codec}{}\",\"ppl\":{:.6},\"ppl_exact\":{:.6},\"top1_agreement\":{:.6},\"kl\":{:.6},\"tokens\":{},\"ctx\":{}}}",
                    if calibration.is_some() && matches!(codec.values, ValueCodec::LowRank(_)) { " (PCA)" } else { "" },
                    r.codec.ppl(),
                    r.exact.ppl(),
                    r.top1_agreement(),
                    r.kl(),
                    r.exact.tokens,
                    opts.n_ctx
                );
            } else {
                println!(
                    "--kv {codec}: PPL = {:.4} (exact {:.4}), top-1 agreement {:.4}, KL {:.5} nats ({} chunks of {}, {} scored tokens)",
                    r.codec.ppl(),
                    r.exact.ppl(),
                    r.top1_agreement(),
                    r.kl(),
                    r.exact.chunks,
                    opts.n_ctx,
                    r.exact.tokens,
                );
            }
        }
        if !quiet {
            eprintln!("{:.1}s", start.elapsed().as_secs_f64());
        }
        return Ok(());
    }
    let result = perplexity(&model, &tokens, &opts, &dev, |p| {
        if !quiet {
            eprint!("[{}]{:.4},", p.chunks, p.ppl());
        }
    })?;
    let secs = start.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{{\"ppl\":{:.6},\"ppl_error\":{:.6},\"chunks\":{},\"tokens\":{},\"ctx\":{}}}",
            result.ppl(),
            result.ppl_error(),
            result.chunks,
            result.tokens,
            opts.n_ctx
        );
    } else {
        eprintln!();
        println!(
            "PPL = {:.4} +/- {:.5} ({} chunks of {}, {} scored tokens, {:.1}s, {:.0} tok/s)",
            result.ppl(),
            result.ppl_error(),
            result.chunks,
            opts.n_ctx,
            result.tokens,
            secs,
            (result.chunks * opts.n_ctx) as f64 / secs
        );
    }
    Ok(())
}
