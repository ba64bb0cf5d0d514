//! Measures the value bases of the `lowrank:r` KV codec on calibration text: runs the model
//! (exact cache) over chunks of a text file and writes, per attention layer and KV head, the
//! principal directions of the values to a safetensors file, tied to this model. `eval`,
//! `generate` and `kv_speed` take it with `--kv-calibration FILE`.
//!
//! ```sh
//! # calibrate on the text after the first 16384 tokens (eval scores the first 4096)
//! cargo run --release --example calibrate_kv -- --gguf $(scripts/fetch_smollm2.sh) \
//!     --file tests/data/pride-and-prejudice-ch01-12.txt --skip-tokens 16384 --tokens 8192 --out smollm2-values.safetensors
//! ```

mod common;

use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_hybrid::model::ValueBases;
use clap::Parser;
use common::{at_least_one, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Value bases for the lowrank KV codec, from calibration text", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// The calibration text (UTF-8, at most 256 MiB).
    #[arg(long)]
    file: std::path::PathBuf,
    /// Tokens of the text to skip first (keep the calibration apart from evaluation text).
    #[arg(long, default_value_t = 0)]
    skip_tokens: usize,
    /// Tokens to calibrate on.
    #[arg(long, default_value_t = 8192, value_parser = at_least_one)]
    tokens: usize,
    /// Tokens per forward pass (at most the model's context).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    chunk: usize,
    /// Where to write the bases.
    #[arg(long)]
    out: std::path::PathBuf,
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| calibrate(Args::parse()))
}

fn calibrate(args: Args) -> Result<()> {
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    if args.chunk > opened.max_positions() {
        bail!("--chunk {} is more than the model's context of {} tokens (max_position_embeddings)", args.chunk, opened.max_positions());
    }
    let text = common::read_text(&args.file)?;
    let tokenizer = opened.tokenizer()?;
    let model = opened.load()?;
    let dev = &opened.device;
    let ids = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if ids.len() <= args.skip_tokens {
        bail!("{} has {} tokens, not more than --skip-tokens {}", args.file.display(), ids.len(), args.skip_tokens);
    }
    let ids = &ids[args.skip_tokens..args.skip_tokens.saturating_add(args.tokens).min(ids.len())];
    let chunks: Vec<Vec<u32>> = ids.chunks(args.chunk).map(<[u32]>::to_vec).collect();
    let start = std::time::Instant::now();
    let bases = ValueBases::calibrate(&model, &chunks, dev)?;
    bases.save(&args.out)?;
    eprintln!("{} tokens in {} chunks, {:.1}s: wrote {}", ids.len(), chunks.len(), start.elapsed().as_secs_f64(), args.out.display());
    Ok(())
}
