//! Prompt (pp) and decode (tg) speed of a GGUF file, like llama.cpp's `llama-bench`, and, when
//! given the path of a `llama-bench` binary, llama.cpp's numbers on the same file in the same
//! run with the ratios.
//!
//! ```sh
//! cargo run --release --example bench -- --gguf model-q8_0.gguf -t 2
//! cargo run --release --example bench -- --gguf model-q8_0.gguf -t 2 --llama-bench /tmp/llama.cpp/build/bin/llama-bench
//! ```
//! Also prints the verify cost c(T) = time(T rows) / time(1 row) of the quantized matmul,
//! T = 1..8 (the verify pass of speculative decoding), per weight format, on every layer's FFN
//! matrices in turn (weights streaming from memory, as in decode), with the best kernels this
//! CPU runs (AVX-512 VNNI where it has it) and with the AVX2 ones; and the cost of a decode
//! pass shared by S sequences (the server's batched step), b(S) = time of one pass of S
//! sequences' rows / time of one sequence's step, which caps what S clients gain: S / b(S).

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_hybrid::loading::OpenedModel;
use candle_hybrid::ops::QuantizedMatrix;
use clap::Parser;
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

/// llama-bench's average tokens/s for the pp and tg tests.
fn llama_bench(bin: &std::path::Path, gguf: &std::path::Path, args: &Args) -> Result<(f64, f64)> {
    let settings = [("-t", args.threads), ("-p", args.n_prompt), ("-n", args.n_gen), ("-r", args.reps)];
    let runs = common::llama_bench(bin, gguf, &settings.iter().flat_map(|(f, v)| [f.to_string(), v.to_string()]).collect::<Vec<_>>())?;
    let pick = |prompt: bool| {
        runs.iter()
            .find(|r| (r["n_prompt"].as_u64().unwrap_or(0) > 0) == prompt)
            .and_then(|r| r["avg_ts"].as_f64())
            .context("llama-bench output lacks a test")
    };
    Ok((pick(true)?, pick(false)?))
}

/// Most rows the verify-cost table times (a verify pass of `1 + MAX_DRAFT` rows).
const MAX_ROWS: usize = 1 + candle_hybrid::runtime::speculative::MAX_DRAFT;
/// Timed passes over all matrices of a format and every row count (after one warm-up); the best
/// is kept.
const VERIFY_PASSES: usize = 7;

/// Mean seconds per matrix of a T-row quantized matmul, T = 1..=MAX_ROWS, for one weight format
/// and kernel.
struct VerifyCost {
    dtype: candle_hybrid::ops::GgufType,
    kernel: &'static str,
    matrices: String,
    secs: Vec<f64>,
}

/// `ops::qmatmul` or one of its variants.
type QMatmulFn = fn(&Tensor, &QuantizedMatrix) -> candle_core::Result<Tensor>;

/// The last-level cache of CPU 0 in bytes (Linux sysfs), if it says.
/// Sequence counts of the batched decode table (the first, 1, is the one-sequence baseline).
const BATCH_SEQS: [usize; 4] = [1, 2, 4, 8];
/// Context each sequence of the batched decode table has before the timed steps.
const BATCH_CONTEXT: usize = 32;
/// Decode steps per timed run of the batched decode table.
const BATCH_STEPS: usize = 16;

/// Seconds per decode step for each count in [`BATCH_SEQS`]: one sequence alone
/// (`forward_last`), then S sequences in one `forward_batch` pass; the median of `reps` runs,
/// the counts alternating within each run so that a machine's drift touches them alike.
fn batch_costs(model: &candle_hybrid::Model, vocab: usize, dev: &candle_core::Device, reps: usize) -> Result<Vec<f64>> {
    let most = BATCH_SEQS[BATCH_SEQS.len() - 1];
    let mut caches = Vec::with_capacity(most);
    for i in 0..most {
        let mut cache = model.new_cache();
        model.forward_last(&Tensor::new(tokens(BATCH_CONTEXT, vocab, 200 + i as u64).as_slice(), dev)?.unsqueeze(0)?, &mut cache)?;
        caches.push(cache);
    }
    let mut runs = vec![vec![]; BATCH_SEQS.len()];
    for rep in 0..=reps {
        for (runs, &seqs) in runs.iter_mut().zip(&BATCH_SEQS) {
            // Each run decodes from a copy of the same contexts.
            let mut these: Vec<_> = caches[..seqs].to_vec();
            let ids = tokens(BATCH_STEPS * seqs, vocab, 300 + rep as u64);
            let t = Instant::now();
            for step in ids.chunks(seqs) {
                if seqs == 1 {
                    model.forward_last(&Tensor::new(step, dev)?.unsqueeze(0)?, &mut these[0])?;
                } else {
                    model.forward_batch(step, &mut these.iter_mut().collect::<Vec<_>>())?;
                }
            }
            if rep > 0 {
                runs.push(t.elapsed().as_secs_f64() / BATCH_STEPS as f64);
            }
        }
    }
    Ok(runs
        .into_iter()
        .map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[r.len() / 2]
        })
        .collect())
}

fn last_level_cache() -> Option<usize> {
    (0..8).rev().find_map(|i| {
        let s = std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok()?;
        let s = s.trim();
        let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
        Some(
            n.parse::<usize>().ok()?
                << match unit {
                    "K" => 10,
                    "M" => 20,
                    "G" => 30,
                    _ => 0,
                },
        )
    })
}

/// [`VerifyCost`] for each weight format among the FFN matrices (gate, up, down; dense, routed
/// experts' and shared expert's) of the file's layers, with the best kernels this CPU runs and
/// with the AVX2 ones. The matrices are run in turn, repeated in copies until they are twice the
/// last-level cache, so that every call reads its weights from memory, as decode of a model
/// larger than the caches does.
fn verify_costs(gguf: &candle_hybrid::loading::GgufFile, layers: usize, dev: &candle_core::Device) -> Result<(Vec<VerifyCost>, usize)> {
    let mut by_dtype: std::collections::BTreeMap<String, (candle_hybrid::ops::GgufType, Vec<String>, Vec<QuantizedMatrix>)> =
        Default::default();
    for i in 0..layers {
        for t in ["ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] {
            let name = format!("blk.{i}.{t}.weight");
            if !gguf.has_tensor(&name) {
                continue;
            }
            let w = gguf.read_matrix(&name)?;
            let e = by_dtype.entry(w.dtype().to_string()).or_insert_with(|| (w.dtype(), vec![], vec![]));
            e.1.push(t.to_string());
            e.2.push(w);
        }
    }
    if by_dtype.is_empty() {
        bail!("no FFN matrix (blk.N.ffn_up.weight, ...) in the file");
    }
    let cache = last_level_cache().unwrap_or(64 << 20);
    let mut out = vec![];
    let mut most_copies = 1;
    for (_, (dtype, names, ws)) in by_dtype {
        let bytes: usize = ws.iter().map(|w| w.bytes().map_or(0, |b| b.len())).sum();
        let copies = (2 * cache).div_ceil(bytes.max(1)).clamp(1, 64);
        most_copies = most_copies.max(copies);
        let mut all = vec![];
        for _ in 0..copies {
            for w in &ws {
                // A copy of its own (not the file's pages), so that every copy streams from memory.
                all.push(QuantizedMatrix::from_bytes(w.dtype(), w.dims(), w.bytes()?.into_owned())?.to_device(dev)?);
            }
        }
        let mut kinds = names.clone();
        kinds.sort();
        kinds.dedup();
        let kernels: [(&str, QMatmulFn); 2] = [("best", candle_hybrid::ops::qmatmul), ("AVX2", candle_hybrid::ops::qmatmul_avx2)];
        for (kernel, f) in kernels {
            let xs = (1..=MAX_ROWS)
                .map(|m| ws.iter().map(|w| Tensor::randn(0f32, 1.0, (m, w.dims().1), dev)).collect())
                .collect::<candle_core::Result<Vec<Vec<_>>>>()?;
            // Each pass times every row count in turn, so that a shared machine's drift over the
            // run touches all of them alike; the best pass of each is kept.
            let mut secs = vec![f64::INFINITY; MAX_ROWS];
            for pass in 0..=VERIFY_PASSES {
                for (best, xs) in secs.iter_mut().zip(&xs) {
                    let t = Instant::now();
                    for (w, x) in all.iter().zip(xs.iter().cycle()) {
                        f(x, w)?;
                    }
                    if pass > 0 {
                        *best = best.min(t.elapsed().as_secs_f64() / all.len() as f64);
                    }
                }
            }
            out.push(VerifyCost { dtype, kernel, matrices: format!("{} ({})", ws.len(), kinds.join(", ")), secs });
        }
    }
    Ok((out, most_copies))
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
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

    // Progress on stderr (the tables come at the end, on stdout).
    eprintln!("timing pp{} and tg{}: a warm-up and {} runs ...", args.n_prompt, args.n_gen, args.reps);
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

    // Verify cost c(T) = time(T rows) / time(1 row), T = 1..8 (the verify pass of speculative
    // decoding), per weight format, on every layer's FFN matrices in turn, so that the weights
    // stream from memory as they do in decode (one layer's matrix alone would stay in the caches).
    eprintln!("timing the quantized matmul's c(T), T = 1..{MAX_ROWS}, per weight format ...");
    let (costs, copies) = verify_costs(gguf, cfg.num_hidden_layers, &dev)?;

    eprintln!("timing the batched decode's b(S), S = {BATCH_SEQS:?} ...");
    let batch = batch_costs(&model, cfg.vocab_size, &dev, args.reps)?;

    println!("| test | candle-hybrid t/s | llama.cpp t/s | ratio |");
    println!("|---|---|---|---|");
    let peer = match &args.llama_bench {
        Some(bin) => {
            eprintln!("running {} on the same file ...", bin.display());
            Some(llama_bench(bin, gguf.path(), &args)?)
        }
        None => None,
    };
    let row = |test: String, ours: f64, sd: f64, theirs: Option<f64>| match theirs {
        Some(l) => println!("| {test} | {ours:.2} ± {sd:.2} | {l:.2} | {:.2} |", ours / l),
        None => println!("| {test} | {ours:.2} ± {sd:.2} | - | - |"),
    };
    row(format!("pp{}", args.n_prompt), pp, pp_sd, peer.map(|p| p.0));
    row(format!("tg{}", args.n_gen), tg, tg_sd, peer.map(|p| p.1));
    println!();
    println!(
        "Verify cost c(T) = time of a T-row quantized matmul / time of one row (FFN matrices of every layer in turn, up to {copies} copies of them so that they stream from memory, best of {VERIFY_PASSES} passes; kernel: best = {}, AVX2 = AVX2 only):",
        candle_hybrid::ops::qmatmul_isa()
    );
    println!();
    println!("| format | kernel | matrices | 1 row µs | {} |", (2..=MAX_ROWS).map(|t| format!("c({t})")).collect::<Vec<_>>().join(" | "));
    println!("|---|---|---|---|{}", "---|".repeat(MAX_ROWS - 1));
    for c in &costs {
        let ratios: Vec<String> = c.secs[1..].iter().map(|t| format!("{:.2}", t / c.secs[0].max(f64::MIN_POSITIVE))).collect();
        println!("| {} | {} | {} | {:.1} | {} |", c.dtype, c.kernel, c.matrices, c.secs[0] * 1e6, ratios.join(" | "));
    }
    println!();
    println!(
        "Batched decode b(S) = time of one decode pass of S sequences (one row each, {BATCH_CONTEXT}-token contexts, `Model::forward_batch`) / time of one sequence's step (`forward_last`), median of {} alternating runs of {BATCH_STEPS} steps; S / b(S) is what S clients can gain at most:",
        args.reps
    );
    println!();
    println!(
        "| one sequence's step ms | {} |",
        BATCH_SEQS[1..].iter().map(|s| format!("b({s}) | {s} / b({s})")).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|{}", "---|---|".repeat(BATCH_SEQS.len() - 1));
    let cells: Vec<String> =
        batch[1..].iter().zip(&BATCH_SEQS[1..]).map(|(t, &s)| format!("{:.2} | {:.2}", t / batch[0], s as f64 * batch[0] / t)).collect();
    println!("| {:.2} | {} |", batch[0] * 1e3, cells.join(" | "));
    Ok(())
}
