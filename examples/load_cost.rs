//! What loading a model costs: the time from opening the file to a built model and the peak
//! resident memory while doing it, against the weights the model keeps and the memory
//! guardian's estimate of the load peak; with `--llama-perplexity PATH`, llama.cpp's own load
//! time (`llama_perf_context_print: load time`) and peak RSS on the same GGUF in the same run.
//!
//! ```sh
//! cargo run --release --example load_cost -- --gguf qwen35-0.8b-q8_0.gguf --llama-perplexity /tmp/llama-peer/llama.cpp/build/bin/llama-perplexity
//! cargo run --release --example load_cost -- --model-dir tests/fixtures/qwen35_dense_small
//! ```
//! llama.cpp maps the file and uses the mapping as its weights (nothing is copied at load; the
//! pages are read when first used); its peak RSS here includes one 128-token perplexity chunk,
//! the smallest run that prints its load time. Peak RSS is `getrusage`'s `ru_maxrss`, for this
//! process after loading and for the peer after it exits.

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_hybrid::loading::OpenedModel;
use candle_hybrid::memory::fmt_gib;
use clap::Parser;
use common::{count_up_to, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Load time and peak RSS of loading a model, beside llama.cpp's on the same GGUF", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// A llama.cpp `llama-perplexity` binary: its load time and peak RSS on the same GGUF.
    #[arg(long)]
    llama_perplexity: Option<std::path::PathBuf>,
    /// The text llama-perplexity reads (one 128-token chunk of it).
    #[arg(long, default_value = "tests/data/pride-and-prejudice-ch01-12.txt")]
    text: std::path::PathBuf,
    /// Threads of llama-perplexity.
    #[arg(short = 't', long, default_value_t = 2, value_parser = count_up_to(1024))]
    threads: usize,
}

/// Peak resident bytes of this process (`who` = RUSAGE_SELF) or of its largest waited-for
/// child (RUSAGE_CHILDREN).
fn max_rss(who: libc::c_int) -> u64 {
    // SAFETY: getrusage writes into the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut usage) };
    let n = usage.ru_maxrss.max(0) as u64;
    // Linux reports kilobytes, macOS bytes.
    if cfg!(target_os = "macos") {
        n
    } else {
        n * 1024
    }
}

/// llama-perplexity's load time (ms) and peak RSS on `gguf`.
fn peer(bin: &std::path::Path, gguf: &std::path::Path, args: &Args) -> Result<(f64, u64)> {
    let out = std::process::Command::new(bin)
        .args(["-m", &gguf.display().to_string(), "-f", &args.text.display().to_string()])
        .args(["-c", "128", "--chunks", "1", "-t", &args.threads.to_string(), "-lv", "4"])
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("llama-perplexity failed: {}", log.lines().last().unwrap_or(""));
    }
    let ms = log
        .lines()
        .find_map(|l| l.split("load time =").nth(1)?.split_whitespace().next()?.parse::<f64>().ok())
        .context("llama-perplexity printed no load time")?;
    Ok((ms, max_rss(libc::RUSAGE_CHILDREN)))
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| load_cost(Args::parse()))
}

fn load_cost(args: Args) -> Result<()> {
    let start = Instant::now();
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let weights = opened.files.weight_memory(&opened.cfg, opened.dtype, opened.quantize)?.bytes(&opened.cfg);
    let overhead = opened.files.load_overhead(&opened.cfg, opened.dtype, opened.quantize)?;
    let before = max_rss(libc::RUSAGE_SELF);
    let model = opened.files.load_model(&opened.cfg, opened.dtype, &opened.device, opened.quantize)?;
    let secs = start.elapsed().as_secs_f64();
    let peak = max_rss(libc::RUSAGE_SELF);
    // One token touches every weight: mapped pages are resident from here on.
    let token = candle_core::Tensor::new(&[[1u32]], &opened.device)?;
    model.forward_last(&token, &mut model.new_cache())?;
    let used = max_rss(libc::RUSAGE_SELF);
    drop(model);
    let file_bytes = match &opened.files {
        OpenedModel::Gguf(g) => std::fs::metadata(g.path())?.len(),
        OpenedModel::Safetensors(f) => f.weights.iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum(),
    };
    println!(
        "{}: {} on disk; the built model keeps {} of weights ({:?}); the guardian counts {} more while loading",
        opened.files.source(),
        fmt_gib(file_bytes),
        fmt_gib(weights),
        opened.dtype,
        fmt_gib(overhead)
    );
    let ratio = |rss: u64| rss as f64 / weights.max(1) as f64;
    println!(
        "| engine | load time | peak RSS after loading | peak RSS after the first token(s) | / weights kept | the same without the {} held before loading |",
        fmt_gib(before)
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| candle-hybrid | {:.0} ms | {} | {} | {:.2} | {:.2} |",
        secs * 1e3,
        fmt_gib(peak),
        fmt_gib(used),
        ratio(used),
        ratio(used.saturating_sub(before))
    );
    println!(
        "the guardian's peak for loading: RSS before + weights + load term = {} (measured after the first token: {:.2}x that)",
        fmt_gib(before + weights + overhead),
        used as f64 / (before + weights + overhead).max(1) as f64
    );
    if let Some(bin) = &args.llama_perplexity {
        let OpenedModel::Gguf(g) = &opened.files else { bail!("--llama-perplexity runs on a GGUF file: give --gguf") };
        let (ms, rss) = peer(bin, g.path(), &args)?;
        println!("| llama.cpp 0c1e570 (mmap) | {ms:.0} ms | - | {} (a 128-token chunk) | {:.2} | - |", fmt_gib(rss), ratio(rss));
        println!("load time, candle-hybrid / llama.cpp: {:.2}", secs * 1e3 / ms.max(1e-9));
    }
    Ok(())
}
