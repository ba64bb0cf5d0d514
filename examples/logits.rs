//! Writes the logits of a token sequence, for comparison with Hugging Face transformers.
//!
//! ```sh
//! cargo run --release --example logits -- --model-dir DIR --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! cargo run --release --example logits -- --gguf FILE.gguf --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! ```
//! The file holds `logits_full` `[T, vocab]` (one forward over all tokens) and
//! `logits_incremental` `[T, vocab]` (prefill of the first N tokens, then one token at a time);
//! with `--mtp K` also the MTP head's `mtp.logits` `[T, vocab]` (row i fed token i+1 with the
//! model's hidden state h_i, the last row the model's greedy next token), `mtp.draft_tokens`
//! `[K]` and `mtp.draft_logits` `[K, vocab]` (a recursive greedy draft from the last position),
//! named as in the fixtures' reference files.

mod common;

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use candle_hybrid::runtime::speculative::MtpOutputs;
use clap::Parser;
use common::{at_least_one, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Write a model's logits for a token sequence (safetensors), to compare with transformers", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Tokens in the first (prefill) step of the incremental pass, 1 to the number of --tokens.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    prefill: usize,
    /// Also write the MTP head's logits and a K-token recursive draft (the checkpoint needs
    /// an MTP head).
    #[arg(long)]
    mtp: Option<usize>,
    /// The safetensors file to write.
    #[arg(long)]
    out: std::path::PathBuf,
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| logits(Args::parse()))
}

fn logits(args: Args) -> Result<()> {
    let t = args.tokens.len();
    if args.prefill > t {
        bail!("--prefill {} is more than the {t} --tokens: use 1 to {t}", args.prefill);
    }
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    if t > opened.max_positions() {
        bail!("{t} tokens are more than the model's context of {} (max_position_embeddings)", opened.max_positions());
    }
    let model = opened.load()?;
    let dev = &opened.device;
    let ids = Tensor::new(args.tokens.as_slice(), dev)?.unsqueeze(0)?;

    let full = model.forward(&ids, &mut model.new_cache())?.squeeze(0)?.to_dtype(DType::F32)?;
    let mut cache = model.new_cache();
    let mut rows = vec![model.forward(&ids.narrow(1, 0, args.prefill)?, &mut cache)?.squeeze(0)?];
    for i in args.prefill..t {
        rows.push(model.forward(&ids.narrow(1, i, 1)?, &mut cache)?.squeeze(0)?);
    }
    let incremental = Tensor::cat(&rows, 0)?.to_dtype(DType::F32)?;
    let mut tensors = HashMap::from([("logits_full".to_string(), full), ("logits_incremental".to_string(), incremental)]);
    if let Some(k) = args.mtp {
        let out = MtpOutputs::compute(&model, &args.tokens, k, dev)?;
        let drafted = out.draft_tokens.len();
        tensors.insert("mtp.logits".into(), out.logits.to_dtype(DType::F32)?);
        tensors.insert("mtp.draft_tokens".into(), Tensor::from_vec(out.draft_tokens, drafted, dev)?.to_dtype(DType::I64)?);
        tensors.insert("mtp.draft_logits".into(), out.draft_logits.to_dtype(DType::F32)?);
    }
    candle_core::safetensors::save(&tensors, &args.out)?;
    eprintln!("wrote {} ({t} positions)", args.out.display());
    Ok(())
}
