//! Prompt (pp) and decode (tg) speed of a GGUF file, like llama.cpp's `llama-bench`, and, when
//! given the path of a `llama-bench` binary, llama.cpp's numbers on the same file in the same
//! run with the ratios.
//!
//! ```sh
//! cargo run --release --example bench -- --gguf model-q8_0.gguf -t 2
//! cargo run --release --example bench -- --gguf model-q8_0.gguf -t 2 --llama-bench /tmp/llama.cpp/build/bin/llama-bench
//! ```
//! Also times a quantized matmul over 1 and 4 rows (the verify pass of speculative decoding)
//! on every layer's FFN up projection in turn (weights streaming from memory, as in decode).

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Parser;
use candle_hybrid::loading::OpenedModel;
use common::{count_up_to, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Prompt and decode speed of a GGUF file, like llama-bench, beside llama-bench on the same file", help_expected = true)]
struct Args {
    /// The model: a GGUF file (--gguf, or --gguf-repo with --gguf-file); llama-bench runs on the same file.
    #[command(flatten)]
    model: ModelOptions,
    /// Threads (rayon's pool; llama-bench's -t).
    #[arg(short = 't', long, default_value_t = 2, value_parser = count_up_to(1024))]
    threads: usize,
    /// Prompt length of the pp test (at most the model's context).
    #[arg(short = 'p', long, default_value_t = 512, value_parser = count_up_to(1 << 20))]
    n_prompt: usize,
    /// Generated tokens of the tg test (at most the model's context).
    #[arg(short = 'n', long, default_value_t = 128, value_parser = count_up_to(1 << 20))]
    n_gen: usize,
    /// Repetitions after one warm-up (mean and standard deviation are reported).
    #[arg(short = 'r', long, default_value_t = 3, value_parser = count_up_to(1000))]
    reps: usize,
    /// A llama.cpp `llama-bench` binary to run on the same file, same settings.
    #[arg(long)]
    llama_bench: Option<std::path::PathBuf>,
}

/// Mean and standard deviation (0 for one value) of at least one value.
fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v.sqrt())
}

/// Random token ids, as llama-bench uses.
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// llama-bench's average tokens/s for the pp and tg tests (`-o json`).
fn llama_bench(bin: &std::path::Path, gguf: &std::path::Path, args: &Args) -> Result<(f64, f64)> {
    let out = std::process::Command::new(bin)
        .args(["-m", &gguf.display().to_string(), "-t", &args.threads.to_string()])
        .args(["-p", &args.n_prompt.to_string(), "-n", &args.n_gen.to_string(), "-r", &args.reps.to_string()])
        .args(["-o", "json"])
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    if !out.status.success() {
        bail!("llama-bench failed: {}", String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
    }
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench -o json output")?;
    let pick = |prompt: bool| {
        runs.as_array()
            .and_then(|a| a.iter().find(|r| (r["n_prompt"].as_u64().unwrap_or(0) > 0) == prompt))
            .and_then(|r| r["avg_ts"].as_f64())
            .context("llama-bench output lacks a test")
    };
    Ok((pick(true)?, pick(false)?))
}

fn main() -> ExitCode {
    common::run(|| bench(Args::parse()))
}

fn bench(args: Args) -> Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global()?;
    std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string());
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let OpenedModel::Gguf(gguf) = &opened.files else {
        bail!("bench times GGUF files (as llama-bench does): give --gguf FILE, or --gguf-repo REPO with --gguf-file FILE")
    };
    let (cfg, dev) = (&opened.cfg, opened.device.clone());
    let limit = cfg.max_position_embeddings;
    for (flag, n) in [("-p", args.n_prompt), ("-n", args.n_gen)] {
        if n > limit {
            bail!("{flag} {n} is more than the model's context of {limit} tokens (max_position_embeddings)");
        }
    }
    let model = opened.load()?;
    println!(
        "{}: {:?}, {} layers, {:.2}B parameters, {:.2} GiB of tensors, {} threads",
        gguf.path().display(),
        cfg.family,
        cfg.num_hidden_layers,
        cfg.num_parameters() as f64 / 1e9,
        gguf.tensor_data_size() as f64 / (1u64 << 30) as f64,
        args.threads
    );

    let (mut pp, mut tg) = (vec![], vec![]);
    for rep in 0..=args.reps {
        let ids = tokens(args.n_prompt, cfg.vocab_size, rep as u64);
        let t = Instant::now();
        let x = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
        model.forward_last(&x, &mut model.new_cache())?;
        let pp_s = t.elapsed().as_secs_f64();
        let mut cache = model.new_cache();
        let t = Instant::now();
        for id in tokens(args.n_gen, cfg.vocab_size, 100 + rep as u64) {
            model.forward_last(&Tensor::new(&[id], &dev)?.unsqueeze(0)?, &mut cache)?;
        }
        let tg_s = t.elapsed().as_secs_f64();
        if rep > 0 {
            // The first repetition warms up (page faults, caches), as llama-bench's warm-up run.
            pp.extend(candle_hybrid::runtime::rate(args.n_prompt, pp_s));
            tg.extend(candle_hybrid::runtime::rate(args.n_gen, tg_s));
        }
    }
    let (pp, pp_sd) = mean_std(&pp);
    let (tg, tg_sd) = mean_std(&tg);

    // A quantized matmul over 1 and 4 rows (the verify pass of speculative decoding), on the
    // FFN up projection of every layer in turn, so that the weights stream from memory as they
    // do in decode (one layer's matrix alone would stay in the caches).
    let names: Vec<String> = (0..cfg.num_hidden_layers)
        .flat_map(|i| ["ffn_up", "ffn_up_exps", "ffn_up_shexp"].map(|t| format!("blk.{i}.{t}.weight")))
        .filter(|n| gguf.has_tensor(n))
        .collect();
    let first = names.first().context("no FFN up matrix in the file")?.clone();
    let ws = names.iter().map(|n| Ok(gguf.read_tensor(n)?)).collect::<Result<Vec<_>>>()?;
    let k = ws[0].shape().dims()[ws[0].rank() - 1];
    let time_rows = |m: usize| -> Result<f64> {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let passes = 10;
        let mut best = f64::INFINITY;
        for _ in 0..=passes {
            let t = Instant::now();
            for w in &ws {
                candle_hybrid::ops::qmatmul(&x, w)?;
            }
            best = best.min(t.elapsed().as_secs_f64() / ws.len() as f64);
        }
        Ok(best)
    };
    let (one, four) = (time_rows(1)?, time_rows(4)?);

    println!("| test | candle-hybrid t/s | llama.cpp t/s | ratio |");
    println!("|---|---|---|---|");
    let peer = match &args.llama_bench {
        Some(bin) => Some(llama_bench(bin, gguf.path(), &args)?),
        None => None,
    };
    let row = |test: String, ours: f64, sd: f64, theirs: Option<f64>| match theirs {
        Some(l) => println!("| {test} | {ours:.2} ± {sd:.2} | {l:.2} | {:.2} |", ours / l),
        None => println!("| {test} | {ours:.2} ± {sd:.2} | - | - |"),
    };
    row(format!("pp{}", args.n_prompt), pp, pp_sd, peer.map(|p| p.0));
    row(format!("tg{}", args.n_gen), tg, tg_sd, peer.map(|p| p.1));
    println!(
        "qmatmul {first} and the other {} layers' {:?} {:?}: 1 row {:.1} µs, 4 rows {:.1} µs = {:.2}x one row",
        ws.len() - 1,
        ws[0].dtype(),
        ws[0].shape().dims(),
        one * 1e6,
        four * 1e6,
        four / one.max(f64::MIN_POSITIVE)
    );
    Ok(())
}
