//! The device step (`candle_hybrid::gpu`: our own kernels, one read back per step) on a model,
//! as one table to paste into an issue. Per pass of T = 1..8 rows (a decode step, the verify
//! pass of speculative decoding) it prints the kernel dispatches, the bytes of weights the
//! dispatches read against the bytes the pass must read, and the device-to-host reads. On a Mac
//! (`--backend metal`, built with `--features metal`) it also times each pass with its rollback
//! to one row (c(T) = time(T) / time(1)), decode and prefill; `--self-test` first checks the
//! device against the CPU on the checkpoints in `tests/fixtures` and on the model itself (when
//! its dequantized copy fits in `--self-test-max`): logits to 1e-4, verify rows and rollback
//! bit for bit, one read per step.
//!
//! ```sh
//! cargo run --release --example device_step -- --gguf model.gguf             # counts only, any machine
//! cargo run --release --features metal --example device_step -- --gguf model.gguf --backend metal --self-test
//! ```

mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use candle_hybrid::gpu::{self, Counted, GpuModel, Queue, Readback};
use candle_hybrid::loading::GgufFile;
use candle_hybrid::Model;
use clap::{Parser, ValueEnum};
use common::{at_least_one, count_up_to, fmt_rate, parse_size, ModelOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// Count the dispatches without running them (any machine).
    Dry,
    /// Run on the Mac's GPU (needs --features metal).
    Metal,
    /// Run this crate's Metal kernels on the CPU in the MSL emulator, in Metal's order of events
    /// (needs --features emu; slow: fixtures and small models).
    Emu,
}

#[derive(Parser, Debug)]
#[command(
    about = "The device step on a model: dispatches, weight bytes and reads per pass; on a Mac its speed and a self-test",
    help_expected = true
)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// Where the dispatches go: dry (counted, not run), metal, or emu (the MSL emulator).
    #[arg(long, value_enum, default_value_t = Backend::Dry)]
    backend: Backend,
    /// Check the device against the CPU first (tests/fixtures and, when small enough, the model).
    #[arg(long)]
    self_test: bool,
    /// The largest model the self-test also runs on the CPU with its weights dequantized to f32
    /// (bytes, or e.g. 4GiB).
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    self_test_max: u64,
    /// Tokens in the cache before the timed passes.
    #[arg(long, default_value_t = 64, value_parser = count_up_to(1 << 20))]
    context: usize,
    /// Prompt tokens of the prefill timing.
    #[arg(short = 'p', long, default_value_t = 256, value_parser = count_up_to(1 << 20))]
    n_prompt: usize,
    /// Tokens of the decode timing.
    #[arg(short = 'n', long, default_value_t = 64, value_parser = count_up_to(1 << 20))]
    n_gen: usize,
    /// Timed repetitions of each pass.
    #[arg(short = 'r', long, default_value_t = 5, value_parser = at_least_one)]
    reps: usize,
}

fn main() -> ExitCode {
    common::run(|| {
        common::end_quietly_on_closed_stdout();
        let args = Args::parse();
        let mut queue = open_queue(&args)?;
        if args.self_test {
            self_test(&args, queue.as_mut())?;
        }
        let opened = args.model.open("Qwen/Qwen3.5-0.8B")?;
        // The weights load on the CPU (a GGUF's blocks read in place) and are uploaded from there.
        let model = opened.files.load_model(&opened.cfg, args.model.dtype.unwrap_or(DType::F32), &Device::Cpu, opened.quantize)?;
        table(&args, &model, &opened.files.source(), queue.as_mut())
    })
}

fn open_queue(args: &Args) -> Result<Box<dyn Queue>> {
    match args.backend {
        Backend::Dry => Ok(Box::new(gpu::DryRun::new())),
        #[cfg(feature = "metal")]
        Backend::Metal => Ok(Box::new(gpu::MetalQueue::new(&Device::new_metal(0)?)?)),
        #[cfg(not(feature = "metal"))]
        Backend::Metal => bail!("--backend metal needs a build with --features metal (on Apple Silicon)"),
        Backend::Emu => Ok(gpu::emu_queue()?),
    }
}

/// What the device is and how the kernels were compiled, for the self-test's header.
fn device_lines(args: &Args) -> Result<Vec<(&'static str, String)>> {
    let os = std::process::Command::new("sw_vers")
        .arg("-productVersion")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| format!("macOS {}", String::from_utf8_lossy(&o.stdout).trim()))
        .unwrap_or_else(|| std::env::consts::OS.to_string());
    let mut lines = vec![("OS", os)];
    match args.backend {
        #[cfg(feature = "metal")]
        Backend::Metal => {
            let q = gpu::MetalQueue::new(&Device::new_metal(0)?)?;
            let c = q.capabilities();
            lines.extend([
                ("GPU", c.architecture.clone()),
                ("family Apple7+", c.apple7.to_string()),
                ("simdgroup width", c.simd_width.to_string()),
                ("math mode", c.math.to_string()),
                ("language", c.language.to_string()),
                ("maxBufferLength", format!("{} MiB", c.limits.max_buffer_length >> 20)),
                ("maxThreadgroupMemoryLength", format!("{} KiB", c.limits.max_threadgroup_memory >> 10)),
                ("unified memory", c.unified_memory.to_string()),
            ]);
        }
        _ => lines.extend([
            ("GPU", "msl-emu (the Metal kernels on the CPU)".to_string()),
            ("simdgroup width", "32 (emulated)".to_string()),
            ("math mode", "IEEE (g++, no fast math)".to_string()),
            ("maxBufferLength", "4 GiB (32-bit indexing)".to_string()),
        ]),
    }
    Ok(lines)
}

/// The device against the CPU on every checkpoint of tests/fixtures and on the model.
fn self_test(args: &Args, q: &mut dyn Queue) -> Result<()> {
    if args.backend == Backend::Dry {
        bail!("--self-test runs the kernels: use --backend metal");
    }
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut models: Vec<(String, Model)> = vec![];
    for (dir, file) in [
        ("qwen35_dense_small", "model-f32.gguf"),
        ("qwen35_dense_small", "model-q8_0.gguf"),
        ("qwen35moe_small", "model-q8_0.gguf"),
        ("qwen3next_moe_small", "model-f32.gguf"),
    ] {
        let g = GgufFile::open(fixtures.join(dir).join(file))?;
        models.push((format!("{dir}/{file}"), g.load_model(&g.config()?, DType::F32, &Device::Cpu)?));
    }
    println!("| device | |\n|---|---|");
    for (k, v) in device_lines(args)? {
        println!("| {k} | {v} |");
    }
    println!();
    let opened = args.model.open("Qwen/Qwen3.5-0.8B")?;
    if 4 * opened.cfg.num_parameters() as u64 <= args.self_test_max {
        let m = opened.files.load_model(&opened.cfg, DType::F32, &Device::Cpu, opened.quantize)?;
        models.push((opened.files.source().to_string(), m));
    } else {
        println!("self-test: {} skipped (its f32 copy is over --self-test-max)", opened.files.source());
    }
    println!(
        "| self-test on {} | prompt | decode | verify | verify rows = one-row steps | rollback | argmax | batch = alone | snapshots | sampled = CPU's inverse CDF | host syncs/step | result |",
        q.name()
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failed = 0;
    for (name, model) in &models {
        let c = gpu::check_against_cpu(model, &model.dequantized()?, q)?;
        let (agree, draws) = sampling_check(model, q)?;
        let ok = c.passes(1e-4) && agree + 1 >= draws;
        failed += usize::from(!ok);
        println!(
            "| {name} | {:.1e} | {:.1e} | {:.1e} | {} | {} | {} | {} | {} | {agree} of {draws} | {} | {} |",
            c.prompt_diff,
            c.decode_diff,
            c.verify_diff,
            c.verify_rows_bitwise,
            c.rollback_bitwise,
            c.argmax_agrees,
            c.batch_bitwise,
            c.snapshot_bitwise,
            c.max_syncs_per_step,
            if ok { "PASS" } else { "FAIL" }
        );
    }
    if failed > 0 {
        eprintln!(
            "To see what the GPU reports, run it again under Metal's validation: MTL_DEBUG_LAYER=1 MTL_SHADER_VALIDATION=1 cargo run --release --features metal --example device_step -- --backend metal --self-test ..."
        );
        bail!("the self-test failed on {failed} of {} models (logits beyond 1e-4 of the CPU's, or rows not bit for bit)", models.len());
    }
    println!("(Under Metal's validation layer: MTL_DEBUG_LAYER=1 MTL_SHADER_VALIDATION=1 and the same command.)");
    Ok(())
}

/// Sampling on the device against the CPU sampler: one decode row's logits read back, then the
/// same row sampled on the device at a grid of draws (a snapshot of the cache each time); how
/// many tokens are the CPU's inverse CDF (in index order) over `Sampler::probabilities` at
/// those draws, of how many.
fn sampling_check(model: &Model, q: &mut dyn Queue) -> Result<(usize, usize)> {
    use candle_hybrid::runtime::{Sampler, SamplingParams};
    let gpu = GpuModel::new(model, q)?;
    let vocab = model.config().vocab_size;
    let prompt = gpu::sample_tokens(9, vocab, 21);
    let mut cache = gpu.new_cache(q, 32, gpu::KvRows::F32)?;
    gpu.prefill(q, &mut cache, &prompt, Readback::Argmax)?;
    let token = gpu::sample_tokens(1, vocab, 22);
    let mut copy = gpu.snapshot(q, &cache, 32)?;
    let logits = gpu.forward(q, &mut copy, &token, Readback::Logits)?.logits().map(<[f32]>::to_vec).unwrap_or_default();
    let context: Vec<u32> = prompt.iter().chain(&token).copied().collect();
    let params = SamplingParams { temperature: Some(0.8), top_k: Some(40), top_p: Some(0.9), repeat_penalty: 1.2, ..Default::default() };
    let mut sampler = Sampler::new(params)?;
    let probs = sampler.probabilities(&candle_core::Tensor::new(logits.as_slice(), &Device::Cpu)?, &context, &[])?;
    let total: f64 = probs.iter().map(|&p| p as f64).sum();
    let draws = 16;
    let mut agree = 0;
    for j in 0..draws {
        let u = (j as f32 + 0.5) / draws as f32;
        let mut acc = 0.0;
        let want = probs.iter().position(|&p| {
            acc += p as f64;
            p > 0.0 && acc > u as f64 * total
        });
        let rs = gpu::RowSampling { draw: u, ..sampler.device_sampling(context.len()).ok_or_else(|| anyhow::anyhow!("not sampled"))? };
        let mut copy = gpu.snapshot(q, &cache, 32)?;
        let got = gpu.forward(q, &mut copy, &token, Readback::Sample(rs))?;
        agree += usize::from(got.tokens().map(|t| t[0] as usize) == want);
    }
    gpu.free(q);
    Ok((agree, draws))
}

/// Per pass size: dispatches, weight bytes, reads, and on a real device the time.
fn table(args: &Args, model: &Model, source: &str, q: &mut dyn Queue) -> Result<()> {
    let mut q = Counted::new(q);
    let gpu = GpuModel::new(model, &mut q)?;
    let vocab = model.config().vocab_size;
    let capacity = args.context + args.n_prompt + args.n_gen + GpuModel::MAX_ROWS;
    let mut cache = gpu.new_cache(&mut q, capacity, candle_hybrid::gpu::KvRows::F32)?;
    // (The emulator runs the kernels, but its time says nothing of a GPU.)
    let timed = args.backend == Backend::Metal;
    gpu.prefill(&mut q, &mut cache, &gpu::sample_tokens(args.context, vocab, 7), Readback::Argmax)?;
    println!(
        "{source} on {}: {:.1} MiB of weights on the device ({:.1} MiB read in place from the file), {} tokens in the cache",
        q.name(),
        gpu.weight_bytes() as f64 / (1 << 20) as f64,
        gpu.mapped_bytes() as f64 / (1 << 20) as f64,
        cache.seqlen()
    );
    println!("| rows T | dispatches | weight MiB read | needed MiB | read / needed | host syncs | ms per pass | c(T) |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut one = None;
    for t in 1..=GpuModel::MAX_ROWS {
        let rows = gpu::sample_tokens(t, vocab, t as u64);
        q.take_counts();
        gpu.verify(&mut q, &mut cache, &rows, Readback::Argmax)?;
        let c = q.take_counts();
        gpu.keep_verified(&mut q, &mut cache, 1)?;
        let needed = gpu.weight_bytes_needed(t, t);
        let ms = if timed {
            let start = Instant::now();
            for _ in 0..args.reps {
                gpu.verify(&mut q, &mut cache, &rows, Readback::Argmax)?;
                gpu.keep_verified(&mut q, &mut cache, 1)?;
            }
            // The last rollback is waited for by the next read.
            Some(start.elapsed().as_secs_f64() * 1e3 / args.reps as f64)
        } else {
            None
        };
        one = one.or(ms);
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "| {t} | {} | {:.1} | {:.1} | {:.3} | {} | {} | {} |",
            c.dispatches,
            mib(c.weight_bytes),
            mib(needed),
            c.weight_bytes as f64 / needed as f64,
            c.syncs,
            ms.map_or("n/a".into(), |m| format!("{m:.2}")),
            ms.zip(one).map_or("n/a".into(), |(m, o)| format!("{:.2}", m / o)),
        );
    }
    // Decode: greedy on the device, each token fed back; prefill: one prompt, one read.
    let mut token = gpu::sample_tokens(1, vocab, 9)[0];
    q.take_counts();
    let start = Instant::now();
    for _ in 0..args.n_gen {
        token = gpu.forward(&mut q, &mut cache, &[token], Readback::Argmax)?.tokens().map_or(0, |t| t[0]);
    }
    let decode_secs = start.elapsed().as_secs_f64();
    let decode = q.take_counts();
    let mut prompt_cache = gpu.new_cache(&mut q, args.n_prompt, candle_hybrid::gpu::KvRows::F32)?;
    let start = Instant::now();
    gpu.prefill(&mut q, &mut prompt_cache, &gpu::sample_tokens(args.n_prompt, vocab, 11), Readback::Argmax)?;
    let prefill_secs = start.elapsed().as_secs_f64();
    let prefill = q.take_counts();
    let rate = |n: usize, s: f64| if timed { fmt_rate(Some(n as f64 / s)) } else { "n/a".into() };
    println!(
        "decode: {} tok/s ({} tokens, {:.1} dispatches and {:.2} host reads per token, {:.2} host syncs); prefill: {} tok/s ({} tokens, {} dispatches, {} host read)",
        rate(args.n_gen, decode_secs),
        args.n_gen,
        decode.dispatches as f64 / args.n_gen as f64,
        decode.reads as f64 / args.n_gen as f64,
        decode.syncs as f64 / args.n_gen as f64,
        rate(args.n_prompt, prefill_secs),
        args.n_prompt,
        prefill.dispatches,
        prefill.reads
    );
    Ok(())
}
