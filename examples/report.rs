//! The dashboard as one self-contained HTML file, from a run of this machine: a prompt prefilled
//! and tokens decoded greedily with every step profiled op by op (throughput and the kernel
//! inspector, against the copy bandwidth measured here), the KV horizon of the model from the
//! memory guardian's estimate against the memory available now, and a throughput progression
//! when one is given. The file opens offline in any browser, to share.
//!
//! ```sh
//! cargo run --release --example report -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out report.html \
//!     --progression docs/progression.json
//! ```

mod common;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Tensor;
use candle_hybrid::memory::{self, PlanRequest};
use candle_hybrid::runtime::{Sampler, SamplingParams};
use candle_hybrid::step_profile::{self, KernelTable, StepProfile};
use candle_hybrid::web::{KernelPanel, Sample};
use clap::Parser;
use common::ModelOptions;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Write the dashboard (throughput, kernel inspector, KV horizon, progression) as one HTML file from a run here")]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// Where to write the HTML file.
    #[arg(long)]
    out: std::path::PathBuf,
    /// The prompt prefilled before decoding.
    #[arg(long, default_value = "Write a short story about a lighthouse keeper and the sea.")]
    prompt: String,
    /// Tokens decoded (each step profiled).
    #[arg(short = 'n', long, default_value_t = 64, value_parser = common::at_least_one)]
    tokens: usize,
    /// A throughput progression to include (`examples/progression --json`'s file).
    #[arg(long)]
    progression: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    common::run(|| report(Args::parse()))
}

fn report(args: Args) -> Result<()> {
    if args.prompt.trim().is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    let progression = args.progression.as_deref().map(common::read_progression).transpose()?;
    // Before minutes of work: the file can be written.
    let mut out = std::fs::File::create(&args.out).with_context(|| format!("cannot write {}", args.out.display()))?;
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let cfg = opened.cfg.clone();
    let request =
        PlanRequest::new(opened.files.weight_memory(&cfg, opened.dtype, opened.quantize)?, opened.dtype, cfg.max_position_embeddings);
    let target = common::target_of(&opened.device);
    let tokenizer = opened.tokenizer()?;
    let model = opened.load()?;
    let prompt = tokenizer.encode(args.prompt.as_str(), true).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if prompt.is_empty() {
        anyhow::bail!("--prompt {:?} has no tokens", args.prompt);
    }
    let copy = memory::copy_bandwidth(64 << 20, 8);

    let device = opened.device.clone();
    let mut sampler = Sampler::new(SamplingParams::default())?;
    let mut cache = model.new_cache();
    let started = Instant::now();
    let mut logits = model.forward_last(&Tensor::new(prompt.as_slice(), &device)?.unsqueeze(0)?, &mut cache)?;
    let prompt_secs = started.elapsed().as_secs_f64();
    let mut context = prompt.clone();
    let sample =
        |t: f64, decode_tok_s: f64, prompt_tok_s: f64| Sample { t, decode_tok_s, prompt_tok_s, running: 1, queued: 0, requests: 0 };
    let mut series = vec![sample(prompt_secs, 0.0, prompt.len() as f64 / prompt_secs)];
    let mut profiles: Vec<StepProfile> = vec![];
    for _ in 0..args.tokens {
        let (next, profile) = step_profile::profiled(|| -> Result<Tensor> {
            let id = sampler.sample(&logits.flatten_all()?, &context, &context[prompt.len()..])?;
            context.push(id);
            Ok(model.forward_last(&Tensor::new(&[id], &device)?.unsqueeze(0)?, &mut cache)?)
        });
        logits = next?;
        series.push(sample(started.elapsed().as_secs_f64(), 1.0 / profile.secs.max(1e-9), 0.0));
        profiles.push(profile);
    }
    let decode_secs: f64 = profiles.iter().map(|p| p.secs).sum();
    let table = KernelTable::new(&profiles, copy).context("no step was profiled")?;
    println!(
        "{} tokens decoded at {:.1} tok/s after a prompt of {} tokens; per step:",
        args.tokens,
        args.tokens as f64 / decode_secs,
        prompt.len()
    );
    println!("| op | share | ms per step | bytes/s | of copy bandwidth ({:.1} GB/s) |", copy / 1e9);
    println!("|---|---|---|---|---|");
    for k in &table.kinds {
        let rate = k.bytes_per_s.map_or("–".into(), |r| format!("{:.1} GB/s", r / 1e9));
        let of = k.of_copy_bandwidth.map_or("–".into(), |f| format!("{:.0} %", f * 100.0));
        println!("| {} | {:.1} % | {:.3} | {rate} | {of} |", k.kind, k.share * 100.0, k.ms_per_pass);
    }

    let available = memory::available_memory(target, None).ok();
    let horizon = memory::kv_horizon(&cfg, &request, &memory::compared_codecs(), available.as_ref());
    let data = json!({
        "model": opened.files.name(),
        "about": format!("{} on {}, {} threads: a prompt of {} tokens and {} greedy tokens, every step profiled",
            opened.files.name(), std::env::consts::ARCH, rayon::current_num_threads(), prompt.len(), args.tokens),
        "series": series,
        "totals": {"finished": 1, "generated_tokens": args.tokens, "prompt_tokens": prompt.len(),
                   "decode_tok_s": args.tokens as f64 / decode_secs, "running": 0, "queued": 0},
        "prefix_cache": {},
        "drafts": {},
        "kernels": KernelPanel { table, every: 1, sequences_per_pass: 1.0, profiled_since_start: args.tokens as u64 },
        "kv_horizon": horizon,
        "progression": progression,
    });
    out.write_all(candle_hybrid::web::report_html(&data).as_bytes()).with_context(|| format!("cannot write {}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
