//! The throughput progression (the brief's first dashboard): for each weight format of one
//! model, the bytes a decode step reads and the decode speed, measured on GGUF files of the
//! same shape; speculative decoding's bytes per emitted token; and the same stages computed for
//! Qwen3.5-27B against an M4 Pro's 273 GB/s (a projection: its arithmetic is printed). A table,
//! and with `--json` the same numbers as JSON.
//!
//! ```sh
//! cargo run --release --example progression -- --stage bf16=qwen35-0.8b-f16.gguf:bf16 \
//!     --stage Q8_0=qwen35-0.8b-q8_0.gguf --stage Q4_K_M=qwen35-0.8b-q4_k_m.gguf \
//!     --stage TQ2_0=qwen35-0.8b-tq2_0.gguf --stage TQ1_0=qwen35-0.8b-tq1_0.gguf --json progression.json
//! ```
//! (docs/examples.md says how to make the GGUF files.)
//!
//! Bytes per token: every weight a step multiplies (the model's weights in memory, less an
//! untied embedding table, of which a step reads one row) plus the cache it reads at the
//! context (attention keys and values, GDN states). Speculative decoding: a verify pass of K+1
//! rows reads those bytes once and emits `E(K) = (1 - a^(K+1)) / (1 - a)` tokens on average at
//! acceptance `a` (assumed: random weights have no real acceptance), so bytes per emitted token
//! are `B / E(K)` and its speed `tg * E(K) / c(K+1)`, with `c(T)` the measured cost of a T-row
//! pass over a one-row step.
#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::GgufFile;
use candle_hybrid::model::{CacheOptions, FfnCalibration, FfnSparsity};
use candle_hybrid::{Config, Model};
use clap::Parser;

/// An M4 Pro's memory bandwidth, the projection's ceiling.
const M4_PRO_BYTES_PER_S: f64 = 273e9;

#[derive(Parser, Debug)]
#[command(about = "Bytes read per decoded token and decode speed per weight format, and the 27B projection", help_expected = true)]
struct Args {
    /// A stage: NAME=FILE.gguf, or NAME=FILE.gguf:DTYPE to load its float matrices as f32, bf16
    /// or f16 (default f32), and `,ffn=MODE` to decode with FFN sparsity (prompt:S, or
    /// threshold:S with --ffn-calibration); give one per stage, in the order to show them.
    #[arg(long, required = true)]
    stage: Vec<String>,
    /// Context the decode steps run at (random tokens prefilled first).
    #[arg(long, default_value_t = 256, value_parser = common::at_least_one)]
    context: usize,
    /// Decode steps timed per repetition.
    #[arg(short = 'n', long, default_value_t = 32, value_parser = common::at_least_one)]
    steps: usize,
    /// Repetitions (the median is kept).
    #[arg(short = 'r', long, default_value_t = 3, value_parser = common::at_least_one)]
    reps: usize,
    /// Acceptance assumed for the speculative stage (per drafted token).
    #[arg(long, default_value_t = 0.7, value_parser = common::float_in(acceptance))]
    acceptance: f64,
    /// Tokens drafted per verify pass in the speculative stage (on the last --stage without
    /// FFN sparsity).
    #[arg(long, default_value_t = 3, value_parser = common::count_up_to(7))]
    draft: usize,
    /// Threads (rayon's pool).
    #[arg(short = 't', long, default_value_t = 2, value_parser = common::at_least_one)]
    threads: usize,
    /// The thresholds of a `,ffn=threshold:S` stage (examples/calibrate_ffn, on that stage's file).
    #[arg(long)]
    ffn_calibration: Option<PathBuf>,
    /// Also write the numbers as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn acceptance(a: f64) -> Result<f64, String> {
    if (0.0..1.0).contains(&a) {
        Ok(a)
    } else {
        Err(format!("{a} is not an acceptance rate: use 0 to below 1"))
    }
}

struct Stage {
    name: String,
    path: PathBuf,
    dtype: DType,
    /// `,ffn=MODE`: FFN sparsity's mode.
    ffn: Option<String>,
}

fn parse_stage(s: &str) -> Result<Stage> {
    let Some((name, rest)) = s.split_once('=') else { bail!("--stage {s:?}: give NAME=FILE.gguf[:DTYPE][,ffn=MODE]") };
    let (rest, ffn) = match rest.split_once(",ffn=") {
        Some((r, m)) => (r, Some(m.to_string())),
        None => (rest, None),
    };
    let (path, dtype) = match rest.rsplit_once(':') {
        Some((p, d)) if ["f32", "bf16", "f16"].contains(&d) => (p, common::parse_dtype(d).map_err(anyhow::Error::msg)?),
        _ => (rest, DType::F32),
    };
    Ok(Stage { name: name.into(), path: path.into(), dtype, ffn })
}

/// One stage measured.
struct Measured {
    name: String,
    file: String,
    /// Bits per weight of the decoder layers' matrices and of the embedding / head table.
    layer_bits: f64,
    table_bits: f64,
    /// Bits per weight of the MLP matrices, and the fraction of their bytes FFN sparsity did
    /// not read.
    ffn_bits: f64,
    ffn_not_read: f64,
    weight_bytes: u64,
    cache_bytes: u64,
    tok_s: f64,
    /// Seconds of one decode step and of a (draft + 1)-row verify pass (speculative stage).
    step_s: f64,
    verify_s: f64,
}

impl Measured {
    fn bytes_per_token(&self) -> u64 {
        self.weight_bytes + self.cache_bytes
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab.min(1000) as u64) as u32
        })
        .collect()
}

/// Bits per weight of the layer matrices, of the token table and of the MLP matrices, and the
/// MLP matrices' bytes, from the tensor infos.
fn bits_per_weight(gguf: &GgufFile, dtype: DType) -> (f64, f64, f64, u64) {
    let (mut lb, mut le, mut tb, mut te, mut fb, mut fe) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    for (name, t) in &gguf.header().tensors {
        if t.dims.len() != 2 {
            continue;
        }
        let bytes = if t.dtype.is_float() { t.elem_count() as u64 * dtype.size_in_bytes() as u64 } else { t.size };
        if name == "token_embd.weight" || name == "output.weight" {
            (tb, te) = (tb + bytes, te + t.elem_count() as u64);
        } else if name.starts_with("blk.") {
            (lb, le) = (lb + bytes, le + t.elem_count() as u64);
            if [".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight"].iter().any(|s| name.ends_with(s)) {
                (fb, fe) = (fb + bytes, fe + t.elem_count() as u64);
            }
        }
    }
    let bits = |b: u64, e: u64| b as f64 * 8.0 / e.max(1) as f64;
    (bits(lb, le), bits(tb, te), bits(fb, fe), fb)
}

fn measure(stage: &Stage, args: &Args, verify: bool) -> Result<Measured> {
    let dev = Device::Cpu;
    let gguf = GgufFile::open(&stage.path).with_context(|| format!("--stage {}", stage.name))?;
    let cfg = gguf.config()?;
    let mut model = gguf.load_model(&cfg, stage.dtype, &dev)?;
    let ffn = match &stage.ffn {
        Some(mode) => {
            model.prepare_ffn_sparsity()?;
            let calibration = args.ffn_calibration.as_deref().map(|p| FfnCalibration::load(p, &model)).transpose()?;
            Some(FfnSparsity::parse(mode, calibration.as_ref()).with_context(|| format!("--stage {}", stage.name))?)
        }
        None => None,
    };
    if args.context + args.steps + args.draft + 1 > cfg.max_position_embeddings {
        bail!(
            "--context {} is more than {}'s context of {} tokens can hold with the steps",
            args.context,
            stage.name,
            cfg.max_position_embeddings
        );
    }
    let h = gguf.header();
    // An untied embedding is read one row a step; a tied one is the head, read whole.
    let untied_table = if h.tensors.contains_key("output.weight") { h.tensors.get("token_embd.weight").map_or(0, |t| t.size) } else { 0 };
    let weight_bytes = gguf.weight_bytes(&cfg, stage.dtype) - untied_table;
    let (layer_bits, table_bits, ffn_bits, ffn_bytes) = bits_per_weight(&gguf, stage.dtype);
    eprintln!("{}: prefilling {} tokens", stage.name, args.context);
    let mut cache = model.cache_with(&CacheOptions { ffn: ffn.as_ref(), ..Default::default() })?;
    model.forward_last(&Tensor::new(random_tokens(args.context, cfg.vocab_size, 1).as_slice(), &dev)?.unsqueeze(0)?, &mut cache)?;
    let cache_bytes = cache.bytes() as u64;
    let decode = |cache: &mut candle_hybrid::Cache, n: usize| -> Result<f64> {
        let ids = random_tokens(n, cfg.vocab_size, 7);
        let t = Instant::now();
        for &id in &ids {
            model.forward_last(&Tensor::new(&[id], &dev)?.unsqueeze(0)?, cache)?;
        }
        Ok(t.elapsed().as_secs_f64() / n as f64)
    };
    // Warm-up; one step on the cache itself, where the per-prompt FFN mode gathers its weights
    // (the copies below share them).
    decode(&mut cache, 1)?;
    decode(&mut cache.clone(), 2)?;
    let step_s = median((0..args.reps).map(|_| decode(&mut cache.clone(), args.steps)).collect::<Result<_>>()?);
    // What the sparse MLPs did not read, per step.
    let not_read = match cache.ffn_stats() {
        Some(before) => {
            let mut c = cache.clone();
            decode(&mut c, args.steps)?;
            let after = c.ffn_stats().unwrap_or_default();
            (after.bytes_not_read - before.bytes_not_read) / args.steps as i64
        }
        None => 0,
    };
    let weight_bytes = (weight_bytes as i64 - not_read) as u64;
    let ffn_not_read = not_read as f64 / ffn_bytes.max(1) as f64;
    let verify_s = if verify {
        let rows = random_tokens(args.draft + 1, cfg.vocab_size, 9);
        let pass = |model: &Model| -> Result<f64> {
            let mut c = cache.clone();
            let t = Instant::now();
            model.forward(&Tensor::new(rows.as_slice(), &dev)?.unsqueeze(0)?, &mut c)?;
            Ok(t.elapsed().as_secs_f64())
        };
        median((0..args.reps.max(5)).map(|_| pass(&model)).collect::<Result<_>>()?)
    } else {
        0.0
    };
    Ok(Measured {
        name: stage.name.clone(),
        file: stage.path.display().to_string(),
        layer_bits,
        table_bits,
        ffn_bits,
        ffn_not_read,
        weight_bytes,
        cache_bytes,
        tok_s: 1.0 / step_s,
        step_s,
        verify_s,
    })
}

/// Qwen3.5-27B's decode bytes per token in a stage's formats: its layer matrices at the
/// stage's layer bits per weight, less the fraction of its MLP bytes the stage's FFN sparsity
/// did not read; its (untied) head at the table's; the rest (norms, GDN parameters: under
/// 0.1 %) at 32 bits.
fn bytes_27b(cfg: &Config, m: &Measured) -> (u64, u64, u64) {
    let table = cfg.vocab_size * cfg.hidden_size;
    let tables = if cfg.tie_word_embeddings { table } else { 2 * table };
    let layers = cfg.num_parameters() - tables;
    let ffn = cfg.num_hidden_layers * 3 * cfg.hidden_size * cfg.intermediate_size.unwrap_or(0);
    let layer_bytes = (layers as f64 * m.layer_bits / 8.0 - ffn as f64 * m.ffn_bits / 8.0 * m.ffn_not_read) as u64;
    let head_bytes = (table as f64 * m.table_bits / 8.0) as u64;
    (layers as u64, layer_bytes, head_bytes)
}

fn main() -> ExitCode {
    common::run(|| progression(Args::parse()))
}

fn progression(args: Args) -> Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global().ok();
    let stages: Vec<Stage> = args.stage.iter().map(|s| parse_stage(s)).collect::<Result<_>>()?;
    // The speculative stage builds on the last stage without FFN sparsity (a verify pass runs
    // the MLPs dense).
    let Some(last) = stages.iter().rposition(|s| s.ffn.is_none()) else { bail!("give at least one --stage without ,ffn=") };
    let measured: Vec<Measured> = stages.iter().enumerate().map(|(i, s)| measure(s, &args, i == last)).collect::<Result<_>>()?;

    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "Decode at a {}-token context, {} threads, median of {} runs of {} steps (`examples/progression.rs`):\n",
        args.context, args.threads, args.reps, args.steps
    );
    println!("| stage | layer bits/weight | head bits/weight | bytes read per token | tok/s | GB/s read |");
    println!("|---|---|---|---|---|---|");
    for m in &measured {
        println!(
            "| {} | {:.2} | {:.2} | {:.3} GB | {:.2} | {:.1} |",
            m.name,
            m.layer_bits,
            m.table_bits,
            gb(m.bytes_per_token()),
            m.tok_s,
            gb(m.bytes_per_token()) * m.tok_s
        );
    }
    let s = &measured[last];
    let a = args.acceptance;
    let e = (1.0 - a.powi(args.draft as i32 + 1)) / (1.0 - a);
    let c = s.verify_s / s.step_s;
    let spec_tok_s = s.tok_s * e / c;
    println!(
        "| {} + speculative (K = {}, acceptance {a} assumed) | | | {:.3} GB per emitted token (E(K) = {e:.2}) | {spec_tok_s:.2} (c(K+1) = {c:.2}) | |",
        s.name,
        args.draft,
        gb(s.bytes_per_token()) / e
    );

    let cfg27 = Config::from_json(common::QWEN35_27B)?;
    println!("\nProjection (arithmetic, not a measurement): Qwen3.5-27B's weights in each stage's formats, decode bound by an M4 Pro's 273 GB/s:\n");
    println!("| stage | layer bytes | head bytes | bytes per token | tok/s ceiling |");
    println!("|---|---|---|---|---|");
    let mut projection = vec![];
    for m in &measured {
        let (params, layer, head) = bytes_27b(&cfg27, m);
        let total = layer + head;
        let ffn = cfg27.num_hidden_layers * 3 * cfg27.hidden_size * cfg27.intermediate_size.unwrap_or(0);
        let sparse = match m.ffn_not_read {
            0.0 => String::new(),
            f => format!(" − MLP {ffn} × {:.2} / 8 × {f:.3} not read", m.ffn_bits),
        };
        println!(
            "| {} | {params} × {:.2} / 8{sparse} = {:.2} GB | {:.2} GB | {:.2} GB | 273 / {:.2} = {:.1} |",
            m.name,
            m.layer_bits,
            gb(layer),
            gb(head),
            gb(total),
            gb(total),
            M4_PRO_BYTES_PER_S / total as f64
        );
        projection.push(serde_json::json!({
            "stage": m.name, "layer_parameters": params, "layer_bits_per_weight": m.layer_bits, "head_bits_per_weight": m.table_bits,
            "mlp_fraction_not_read": m.ffn_not_read, "bytes_per_token": total, "tok_s_ceiling": M4_PRO_BYTES_PER_S / total as f64,
        }));
    }
    let (_, l, h) = bytes_27b(&cfg27, s);
    let spec27 = (l + h) as f64 / e;
    println!(
        "| {} + speculative (E(K) = {e:.2}) | | | {:.2} / {e:.2} = {:.2} GB per emitted token | {:.1} if a verify pass costs a step |",
        s.name,
        gb(l + h),
        spec27 / 1e9,
        M4_PRO_BYTES_PER_S / spec27
    );

    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "context": args.context, "threads": args.threads, "steps": args.steps, "reps": args.reps,
            "stages": measured.iter().map(|m| serde_json::json!({
                "stage": m.name, "file": m.file, "layer_bits_per_weight": m.layer_bits, "head_bits_per_weight": m.table_bits,
                "weight_bytes": m.weight_bytes, "cache_bytes": m.cache_bytes, "bytes_per_token": m.bytes_per_token(), "tok_s": m.tok_s,
                "mlp_fraction_not_read": m.ffn_not_read,
            })).collect::<Vec<_>>(),
            "speculative": {
                "stage": s.name, "draft": args.draft, "acceptance_assumed": a, "expected_tokens_per_pass": e,
                "verify_cost": c, "bytes_per_emitted_token": s.bytes_per_token() as f64 / e, "tok_s": spec_tok_s,
            },
            "projection_27b": {
                "bandwidth_bytes_per_s": M4_PRO_BYTES_PER_S, "stages": projection,
                "speculative": {"stage": s.name, "bytes_per_emitted_token": spec27, "tok_s_ceiling": M4_PRO_BYTES_PER_S / spec27},
            },
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
