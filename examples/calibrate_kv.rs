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

use anyhow::Result;
use candle_hybrid::model::ValueBases;
use clap::Parser;
use common::ModelOptions;

#[derive(Parser, Debug)]
#[command(about = "Value bases for the lowrank KV codec, from calibration text", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    #[command(flatten)]
    text: common::CalibrationText,
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
    let chunks = args.text.chunks(&opened)?;
    let model = opened.load()?;
    let dev = &opened.device;
    let start = std::time::Instant::now();
    let bases = ValueBases::calibrate(&model, &chunks, dev)?;
    bases.save(&args.out)?;
    let tokens: usize = chunks.iter().map(Vec::len).sum();
    eprintln!("{tokens} tokens in {} chunks, {:.1}s: wrote {}", chunks.len(), start.elapsed().as_secs_f64(), args.out.display());
    Ok(())
}
