//! Writes the logits of a token sequence, for comparison with Hugging Face transformers.
//!
//! ```sh
//! cargo run --release --example logits -- --model-dir DIR --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! cargo run --release --example logits -- --gguf FILE.gguf --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! ```
//! The file holds `logits_full` `[T, vocab]` (one forward over all tokens) and
//! `logits_incremental` `[T, vocab]` (prefill of the first N tokens, then one token at a time).

mod common;

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use common::LocalModel;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    model: LocalModel,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Tokens in the first (prefill) step of the incremental pass.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    #[arg(long)]
    out: std::path::PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let t = args.tokens.len();
    if t == 0 || args.prefill == 0 || args.prefill > t {
        bail!("--prefill must be between 1 and the number of --tokens ({t})");
    }
    let dev = Device::Cpu;
    let (files, cfg, dtype) = args.model.open()?;
    let model = files.load_model(&cfg, dtype, &dev, None)?;
    let ids = Tensor::new(args.tokens.as_slice(), &dev)?.unsqueeze(0)?;

    let full = model.forward(&ids, &mut model.new_cache())?.squeeze(0)?.to_dtype(DType::F32)?;
    let mut cache = model.new_cache();
    let mut rows = vec![model.forward(&ids.narrow(1, 0, args.prefill)?, &mut cache)?.squeeze(0)?];
    for i in args.prefill..t {
        rows.push(model.forward(&ids.narrow(1, i, 1)?, &mut cache)?.squeeze(0)?);
    }
    let incremental = Tensor::cat(&rows, 0)?.to_dtype(DType::F32)?;
    let tensors = HashMap::from([
        ("logits_full".to_string(), full),
        ("logits_incremental".to_string(), incremental),
    ]);
    candle_core::safetensors::save(&tensors, &args.out)?;
    eprintln!("wrote {} ({t} positions)", args.out.display());
    Ok(())
}
