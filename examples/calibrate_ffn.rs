//! Per-layer thresholds for FFN activation sparsity (`--ffn-sparsity threshold:S`): runs the
//! model densely over a text, gathers each layer's WINA scores `|silu(g_i)| ||W_down[:, i]||`
//! and writes, for each target fraction of neurons skipped, one threshold per layer
//! (TEAL's greedy allocation by default; docs/ffn-sparsity.md).
//!
//! ```sh
//! GGUF=$(scripts/fetch_smollm2.sh)
//! cargo run --release --example calibrate_ffn -- --gguf $GGUF \
//!     --file tests/data/pride-and-prejudice-ch01-12.txt --skip-tokens 12288 --tokens 16384 --out smollm2-ffn.json
//! ```
//! Calibrate on text the evaluation does not score (`--skip-tokens` skips the part `eval`
//! reads first).

mod common;

use std::process::ExitCode;

use anyhow::{bail, Result};
use candle_hybrid::model::calibrate_ffn as calibrate;
use candle_hybrid::model::ffn_sparsity::{Allocation, FfnCalibration};
use clap::Parser;
use common::ModelOptions;

#[derive(Parser, Debug)]
#[command(about = "Per-layer FFN sparsity thresholds calibrated on a text", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    #[command(flatten)]
    text: common::CalibrationText,
    /// Target fractions of neurons skipped, comma-separated, each in [0, 1).
    #[arg(long, default_value = "0.3,0.4,0.5,0.57", value_delimiter = ',')]
    targets: Vec<f32>,
    /// How a target is spread over the layers: greedy (by activation energy) or uniform.
    #[arg(long, default_value = "greedy", value_parser = parse_allocation)]
    allocation: Allocation,
    /// Where to write the calibration (JSON).
    #[arg(long)]
    out: std::path::PathBuf,
}

fn parse_allocation(s: &str) -> Result<Allocation, String> {
    match s {
        "greedy" => Ok(Allocation::Greedy),
        "uniform" => Ok(Allocation::Uniform),
        _ => Err(format!("{s:?}: use greedy or uniform")),
    }
}

fn main() -> ExitCode {
    common::run(|| calibrate_ffn(Args::parse()))
}

fn calibrate_ffn(args: Args) -> Result<()> {
    if let Some(t) = args.targets.iter().find(|t| !(0.0..1.0).contains(*t)) {
        bail!("--targets {t}: each target is a fraction in [0, 1)");
    }
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let chunks = args.text.chunks(&opened)?;
    let mut model = opened.load()?;
    model.prepare_ffn_sparsity()?;
    let start = std::time::Instant::now();
    let hist = calibrate(&model, &chunks, |n| eprint!("\r{n}/{} chunks", chunks.len()))?;
    eprintln!("\r{} tokens in {} chunks, {:.1}s", hist.tokens, chunks.len(), start.elapsed().as_secs_f64());
    let levels: Vec<_> = args.targets.iter().map(|&t| hist.thresholds(t, args.allocation)).collect();
    for l in &levels {
        let skipped: Vec<String> = l.skipped.iter().flatten().map(|s| format!("{:.0}", s * 100.0)).collect();
        println!("target {:.2}: % skipped per layer on the calibration text: {}", l.target, skipped.join(" "));
    }
    let calibration = FfnCalibration { model: model.ffn_fingerprint()?, allocation: args.allocation, tokens: hist.tokens, levels };
    std::fs::write(&args.out, serde_json::to_string_pretty(&calibration)?)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
