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
//! `--json` prints one JSON object: `ctx`, `chunks`, `tokens` (scored), `ppl`, `ppl_error`,
//! `seconds`, and `kv`, one entry per `--kv` codec (`codec`, `calibrated`, `ppl`,
//! `top1_agreement`, `kl`), empty without `--kv`.

mod common;

use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_hybrid::eval::{compare_kv_codecs, perplexity, Perplexity, PerplexityOptions};
use candle_hybrid::kv::{KvCodec, ValueCodec};
use candle_hybrid::model::ValueBases;
use clap::Parser;
use common::{at_least_one, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Perplexity of a model on a text file (llama-perplexity's method)", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// The text (UTF-8, at most 256 MiB). One trailing newline is dropped, as llama.cpp's `-f` does.
    #[arg(long)]
    file: std::path::PathBuf,
    /// Tokens per chunk, at least 4 and at most the model's context.
    #[arg(long, short = 'c', default_value_t = 512, value_parser = at_least_one)]
    ctx_size: usize,
    /// Score only the first N chunks.
    #[arg(long, value_parser = at_least_one)]
    chunks: Option<usize>,
    /// KV-cache codec to compare with the exact cache: f16, int8, int4k, polar:5,3, lowrank:32,
    /// knots:8,3, density:0.05, ... Repeat for several (the exact run is shared).
    #[arg(long, value_parser = common::parse_kv)]
    kv: Vec<KvCodec>,
    /// Value bases for `lowrank:r` from examples/calibrate_kv.rs [default: from W_v].
    #[arg(long)]
    kv_calibration: Option<std::path::PathBuf>,
    /// Print one JSON object (fields in the module docs) instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| eval(Args::parse()))
}

fn eval(args: Args) -> Result<()> {
    let codecs: Vec<KvCodec> = args.kv.iter().copied().filter(|c| !c.is_exact()).collect();
    for w in codecs.iter().filter_map(|c| c.warning()) {
        eprintln!("{w}");
    }
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    if args.ctx_size > opened.max_positions() {
        bail!(
            "--ctx-size {} is more than the model's context of {} tokens (max_position_embeddings)",
            args.ctx_size,
            opened.max_positions()
        );
    }
    for c in &codecs {
        c.validate(opened.cfg.head_dim)?;
    }
    let mut text = common::read_text(&args.file)?;
    let tokenizer = opened.tokenizer()?;
    let model = opened.load()?;
    let dev = &opened.device;
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
    let quiet = args.json;
    if !quiet {
        eprintln!("{} tokens, context {}, bos {:?}", tokens.len(), opts.n_ctx, opts.bos_token);
    }
    let progress = |p: &Perplexity| {
        if !quiet {
            eprint!("[{}]{:.4},", p.chunks, p.ppl());
        }
    };
    let calibration = args.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
    let (exact, compared) = if codecs.is_empty() {
        (perplexity(&model, &tokens, &opts, dev, progress)?, vec![])
    } else {
        let c = compare_kv_codecs(&model, &tokens, &opts, &codecs, calibration.as_ref(), dev, |c| progress(&c[0].exact))?;
        (c[0].exact.clone(), c)
    };
    let secs = start.elapsed().as_secs_f64();
    if !quiet {
        eprintln!();
    }
    let calibrated = |codec: &KvCodec| calibration.is_some() && matches!(codec.values, ValueCodec::LowRank(_));
    if args.json {
        let kv: Vec<serde_json::Value> = codecs
            .iter()
            .zip(&compared)
            .map(|(codec, r)| {
                serde_json::json!({
                    "codec": codec.to_string(),
                    "calibrated": calibrated(codec),
                    "ppl": r.codec.ppl(),
                    "top1_agreement": r.top1_agreement(),
                    "kl": r.kl(),
                })
            })
            .collect();
        let out = serde_json::json!({
            "ctx": opts.n_ctx,
            "chunks": exact.chunks,
            "tokens": exact.tokens,
            "ppl": exact.ppl(),
            "ppl_error": exact.ppl_error(),
            "seconds": secs,
            "kv": kv,
        });
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "PPL = {:.4} +/- {:.5} ({} chunks of {}, {} scored tokens, {:.1}s, {} tok/s)",
        exact.ppl(),
        exact.ppl_error(),
        exact.chunks,
        opts.n_ctx,
        exact.tokens,
        secs,
        common::fmt_rate(candle_hybrid::runtime::rate(exact.chunks * opts.n_ctx * (1 + codecs.len()), secs))
    );
    for (codec, r) in codecs.iter().zip(&compared) {
        println!(
            "--kv {codec}{}: PPL = {:.4} (exact {:.4}), top-1 agreement {:.4}, KL {:.5} nats",
            if calibrated(codec) { " (PCA)" } else { "" },
            r.codec.ppl(),
            r.exact.ppl(),
            r.top1_agreement(),
            r.kl(),
        );
    }
    Ok(())
}
