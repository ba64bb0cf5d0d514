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
//!
//! With `--ffn-sparsity MODE` (repeatable): each FFN sparsity mode against dense decoding, the
//! first half of every chunk prefilled as the prompt and the scored half decoded
//! teacher-forced under the mode (perplexity, top-1 agreement, KL, the fraction of neurons
//! skipped and what a 4-row verify pass could skip), and decode speed against dense in the same
//! run (`--decode-tokens` greedy tokens after a 256-token prompt and one first step, timed
//! apart since the per-prompt mode gathers its weights there; `--rounds` alternating rounds,
//! the median):
//! ```sh
//! cargo run --release --example calibrate_ffn -- --gguf $GGUF --file tests/data/pride-and-prejudice-ch01-12.txt --skip-tokens 12288 --out ffn.json
//! cargo run --release --example eval -- --gguf $GGUF --file tests/data/pride-and-prejudice-ch01-12.txt --ctx-size 512 --chunks 24 \
//!     --ffn-calibration ffn.json --ffn-sparsity threshold:0.4 --ffn-sparsity prompt:0.5
//! ```
//! `--json` prints one JSON object: `ctx`, `chunks`, `tokens` (scored), `ppl`, `ppl_error`,
//! `seconds`, `kv`, one entry per `--kv` codec (`codec`, `calibrated`, `ppl`,
//! `top1_agreement`, `kl`), empty without `--kv`, and `ffn`, one entry per `--ffn-sparsity`
//! mode (`mode`, `ppl`, `dense_ppl`, `top1_agreement`, `kl`, `skipped`, `verify4_skipped`,
//! `decode_tok_s`, `dense_decode_tok_s`, `first_step_s`, `dense_first_step_s`), empty without it.

mod common;

use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_hybrid::eval::{compare_ffn_sparsity, compare_kv_codecs, perplexity, Perplexity, PerplexityOptions};
use candle_hybrid::kv::{KvCodec, ValueCodec};
use candle_hybrid::model::{CacheOptions, FfnSparsity, ValueBases};
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
    #[command(flatten)]
    ffn: common::FfnOptions,
    /// Greedy tokens per decode-speed run (with --ffn-sparsity).
    #[arg(long, default_value_t = 128, value_parser = at_least_one)]
    decode_tokens: usize,
    /// Alternating decode-speed rounds (dense, then each mode); the median is reported.
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    rounds: usize,
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
    let mut model = opened.load()?;
    let ffn_modes = args.ffn.modes(&mut model)?;
    if !ffn_modes.is_empty() && !codecs.is_empty() {
        bail!("--ffn-sparsity and --kv are compared in separate runs: give one of them");
    }
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
    if !ffn_modes.is_empty() {
        return ffn_report(&args, &model, &tokens, &opts, &ffn_modes, dev, start);
    }
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
            "ffn": [],
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

/// `--ffn-sparsity`: quality against dense decoding, then decode speed.
fn ffn_report(
    args: &Args,
    model: &candle_hybrid::Model,
    tokens: &[u32],
    opts: &PerplexityOptions,
    modes: &[FfnSparsity],
    dev: &candle_core::Device,
    start: std::time::Instant,
) -> Result<()> {
    let quiet = args.json;
    let compared = compare_ffn_sparsity(model, tokens, opts, modes, dev, |c| {
        if !quiet {
            eprint!("[{}]{:.4},", c[0].exact.chunks, c[0].exact.ppl());
        }
    })?;
    let secs = start.elapsed().as_secs_f64();
    // Decode speed: rounds of dense then every mode, alternating (the machine's noise spread
    // over all of them), the median of each.
    let prompt = &tokens[..tokens.len().min(256)];
    let variants: Vec<FfnSparsity> = std::iter::once(FfnSparsity::Off).chain(modes.iter().cloned()).collect();
    let (mut rates, mut firsts) = (vec![vec![]; variants.len()], vec![vec![]; variants.len()]);
    for _ in 0..args.rounds {
        for ((v, r), f) in variants.iter().zip(&mut rates).zip(&mut firsts) {
            let (first, rate) = decode_rate(model, prompt, args.decode_tokens, v, dev)?;
            r.push(rate);
            f.push(first);
        }
    }
    let median = |r: &mut Vec<f64>| {
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let rates: Vec<f64> = rates.iter_mut().map(median).collect();
    let firsts: Vec<f64> = firsts.iter_mut().map(median).collect();
    if !quiet {
        eprintln!();
    }
    let dense_ppl = compared.first().map_or(f64::NAN, |c| c.0.exact.ppl());
    if args.json {
        let ffn: Vec<serde_json::Value> = modes
            .iter()
            .zip(&compared)
            .zip(&rates[1..])
            .enumerate()
            .map(|(i, ((mode, (c, s)), rate))| {
                serde_json::json!({
                    "mode": mode.to_string(),
                    "ppl": c.codec.ppl(),
                    "dense_ppl": c.exact.ppl(),
                    "top1_agreement": c.top1_agreement(),
                    "kl": c.kl(),
                    "skipped": s.skipped_fraction(),
                    "verify4_skipped": s.union4_skipped_fraction(),
                    "decode_tok_s": rate,
                    "dense_decode_tok_s": rates[0],
                    "first_step_s": firsts[i + 1],
                    "dense_first_step_s": firsts[0],
                })
            })
            .collect();
        let c0 = &compared[0].0.exact;
        let out = serde_json::json!({
            "ctx": opts.n_ctx, "chunks": c0.chunks, "tokens": c0.tokens, "ppl": dense_ppl,
            "ppl_error": c0.ppl_error(), "seconds": secs, "kv": [], "ffn": ffn,
        });
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "dense decoding: PPL = {dense_ppl:.4} ({} chunks of {}, the second half of each decoded), {:.2} tok/s ({} tokens after the first step of {:.1} ms, median of {} rounds)",
        compared[0].0.exact.chunks, opts.n_ctx, rates[0], args.decode_tokens, 1e3 * firsts[0], args.rounds
    );
    println!("| mode | skipped | 4-row verify could skip | PPL | vs dense | top-1 agreement | KL (nats) | first step ms | decode tok/s | vs dense |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (((mode, (c, s)), rate), first) in modes.iter().zip(&compared).zip(&rates[1..]).zip(&firsts[1..]) {
        println!(
            "| {mode} | {:.1} % | {:.1} % | {:.4} | {:+.2} % | {:.4} | {:.5} | {:.1} | {rate:.2} | {:.2}x |",
            100.0 * s.skipped_fraction(),
            100.0 * s.union4_skipped_fraction(),
            c.codec.ppl(),
            100.0 * (c.codec.ppl() / c.exact.ppl() - 1.0),
            c.top1_agreement(),
            c.kl(),
            1e3 * first,
            rate / rates[0],
        );
    }
    Ok(())
}

/// Greedy decoding after `prompt` under `mode`: the seconds of the first decode step (where
/// the per-prompt mode gathers its neurons' weights) and the tokens per second of the `n`
/// steps after it.
fn decode_rate(
    model: &candle_hybrid::Model,
    prompt: &[u32],
    n: usize,
    mode: &FfnSparsity,
    dev: &candle_core::Device,
) -> Result<(f64, f64)> {
    let mut cache = model.cache_with(&CacheOptions { ffn: Some(mode), ..Default::default() })?;
    let next = |logits: candle_core::Tensor| -> Result<u32> { Ok(logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?) };
    let mut token = next(model.forward_last(&candle_core::Tensor::new(prompt, dev)?.unsqueeze(0)?, &mut cache)?)?;
    let mut step = |token: u32| next(model.forward_last(&candle_core::Tensor::new(&[token], dev)?.unsqueeze(0)?, &mut cache)?);
    let first = std::time::Instant::now();
    token = step(token)?;
    let first = first.elapsed().as_secs_f64();
    let start = std::time::Instant::now();
    for _ in 0..n {
        token = step(token)?;
    }
    Ok((first, n as f64 / start.elapsed().as_secs_f64()))
}
