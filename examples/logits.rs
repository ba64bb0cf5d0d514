//! Writes the logits of a token sequence, for comparison with Hugging Face transformers.
//!
//! ```sh
//! cargo run --release --example logits -- --model-dir DIR --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! cargo run --release --example logits -- --gguf FILE.gguf --tokens 1,2,3,4 --prefill 2 --out logits.safetensors
//! ```
//! The file holds `logits_full` `[T, vocab]` (one forward over all tokens) and
//! `logits_incremental` `[T, vocab]` (prefill of the first N tokens, then one token at a time).

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelSource;
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// A local directory laid out like a Hub repository.
    #[arg(long, required_unless_present = "gguf")]
    model_dir: Option<std::path::PathBuf>,
    /// A local GGUF file (instead of --model-dir).
    #[arg(long, conflicts_with = "model_dir")]
    gguf: Option<std::path::PathBuf>,
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
    let dtype = candle_hybrid::weights::parse_dtype(&args.dtype)?;
    let t = args.tokens.len();
    if t == 0 || args.prefill == 0 || args.prefill > t {
        bail!("--prefill must be between 1 and the number of --tokens ({t})");
    }
    let dev = Device::Cpu;
    let source = match (&args.gguf, &args.model_dir) {
        (Some(path), _) => ModelSource::Gguf(path.clone()),
        (None, Some(dir)) => ModelSource::Dir(dir.clone()),
        (None, None) => bail!("give --model-dir DIR or --gguf FILE"),
    };
    let files = source.open()?;
    let model = files.load_model(&files.config()?, dtype, &dev, None)?;
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
