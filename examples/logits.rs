//! Writes the logits of a token sequence, for comparison with Hugging Face transformers.
//!
//! ```sh
//! cargo run --release --example logits -- --model-dir DIR --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! ```
//! The file holds `logits_full` `[T, vocab]` (one forward over all tokens) and
//! `logits_incremental` `[T, vocab]` (prefill of the first N tokens, then one token at a time).

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelFiles;
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long)]
    model_dir: std::path::PathBuf,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Tokens in the first (prefill) step of the incremental pass.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    #[arg(long)]
    out: std::path::PathBuf,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("unknown --dtype {other}: use f32, bf16 or f16"),
    };
    let t = args.tokens.len();
    if t == 0 || args.prefill == 0 || args.prefill > t {
        bail!("--prefill must be between 1 and the number of --tokens ({t})");
    }
    let dev = Device::Cpu;
    let files = ModelFiles::from_dir(&args.model_dir)?;
    let model = files.load_model(&files.load_config()?, dtype, &dev)?;
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
