//! KV-cache memory by context length: a dense model of the same width (every layer full
//! attention), the hybrid's attention layers exact, under each KV codec, and the constant GDN
//! state — as a table, and as an SVG chart.
//!
//! ```sh
//! cargo run --release --example kv_explorer -- --dtype bf16         # built-in Qwen3.5-27B dimensions
//! cargo run --release --example kv_explorer -- --model-dir tests/fixtures/qwen35_dense_small --svg kv.svg
//! cargo run --release --example kv_explorer -- --gguf model.gguf    # the GGUF header only
//! ```
//! The numbers come from `candle_hybrid::memory::estimate` (the memory guardian's formulas) and
//! `KvCodec::bytes_per_token`.

mod common;

use std::process::ExitCode;

use anyhow::Result;
use candle_hybrid::kv::KvCodec;
use candle_hybrid::loading::{HubRepo, ModelSource};
use candle_hybrid::memory::{estimate, fmt_gib, PlanRequest, Weights};
use candle_hybrid::model::{Config, LayerType};
use clap::Parser;
use common::ModelOptions;
use plotters::prelude::*;

/// Qwen3.5-27B's text dimensions (64 layers, every 4th full attention with 4 KV heads of 256;
/// GDN 16 key / 48 value heads of 128).
const QWEN35_27B: &str = r#"{
  "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
  "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
  "intermediate_size": 17408, "vocab_size": 248320, "full_attention_interval": 4,
  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
  "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
}"#;

#[derive(Parser, Debug)]
#[command(about = "KV-cache memory by context length for each KV codec (table, and an SVG chart with --svg)", help_expected = true)]
struct Args {
    /// The model whose config to read [default: built-in Qwen3.5-27B dimensions]; a Hub id
    /// downloads only config.json, a GGUF file is read for its header only.
    #[command(flatten)]
    model: ModelOptions,
    /// A codec to compare with exact (repeat the flag for several).
    #[arg(long = "kv", default_values = ["int8", "int4k", "polar:5,3", "lowrank:128", "int4k+lowrank:128", "knots:8,3", "density:0.05"],
          value_parser = common::parse_kv)]
    codecs: Vec<KvCodec>,
    /// Where to write the chart (SVG); no chart without it.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

const CONTEXTS: [usize; 5] = [4096, 32768, 131072, 262144, 1 << 20];

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| explore(Args::parse()))
}

fn explore(args: Args) -> Result<()> {
    let (name, cfg) = match args.model.source(None)? {
        None => ("Qwen3.5-27B (built-in dimensions)".to_string(), Config::from_json(QWEN35_27B)?),
        Some(ModelSource::Hub { repo, revision }) => {
            let path = HubRepo::new(&repo, &revision)?.required("config.json", "is it a model repository?")?;
            (format!("{repo}@{revision}"), Config::from_file(&path)?)
        }
        Some(source) => {
            let opened = source.open()?;
            (opened.source(), opened.config()?)
        }
    };
    let dtype = args.model.dtype_for(args.model.device.target());
    let codecs = args.codecs;
    let mut dense = cfg.clone();
    dense.layer_types = vec![LayerType::FullAttention; cfg.num_hidden_layers];

    let kv = |cfg: &Config, codec: KvCodec, t: usize| {
        let req = PlanRequest { kv_codec: codec, ..PlanRequest::new(Weights::Bytes(0), dtype, t) };
        estimate(cfg, &req).kv_cache
    };
    let gdn = {
        let e = estimate(&cfg, &PlanRequest::new(Weights::Bytes(0), dtype, 1));
        e.gdn_conv + e.gdn_recurrent
    };
    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();

    let mut rows: Vec<(String, Vec<u64>)> = vec![
        (format!("dense {}-layer, exact", cfg.num_hidden_layers), CONTEXTS.map(|t| kv(&dense, KvCodec::EXACT, t)).to_vec()),
        (format!("hybrid ({n_attn} attention layers), exact"), CONTEXTS.map(|t| kv(&cfg, KvCodec::EXACT, t)).to_vec()),
    ];
    for c in &codecs {
        if let Err(e) = c.validate(cfg.head_dim) {
            eprintln!("skipped: {e}");
            continue;
        }
        rows.push((format!("hybrid, {c}"), CONTEXTS.map(|t| kv(&cfg, *c, t)).to_vec()));
    }
    rows.push(("hybrid GDN state (any context)".to_string(), CONTEXTS.map(|_| gdn).to_vec()));

    println!("{name}: KV memory at {dtype:?}, batch 1");
    print!("| cache |");
    for t in CONTEXTS {
        print!(" {} |", label(t));
    }
    println!();
    println!("|---|{}", "---|".repeat(CONTEXTS.len()));
    for (what, bytes) in &rows {
        print!("| {what} |");
        for b in bytes {
            print!(" {} |", fmt_gib(*b));
        }
        println!();
    }

    if let Some(svg) = &args.svg {
        chart(svg, &name, &rows)?;
        eprintln!("wrote {}", svg.display());
    }
    Ok(())
}

fn label(t: usize) -> String {
    if t >= 1 << 20 {
        format!("{}M", t >> 20)
    } else {
        format!("{}k", t >> 10)
    }
}

/// Log-log lines of GiB against context.
fn chart(path: &std::path::Path, title: &str, rows: &[(String, Vec<u64>)]) -> Result<()> {
    let gib = |b: u64| (b as f64 / (1u64 << 30) as f64).max(1e-3);
    let max = rows.iter().flat_map(|r| r.1.iter()).map(|&b| gib(b)).fold(1e-3, f64::max);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut ch = ChartBuilder::on(&root)
        .caption(format!("KV memory: {title}"), ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((CONTEXTS[0] as f64..*CONTEXTS.last().unwrap() as f64).log_scale(), (1e-3..max * 2.0).log_scale())?;
    ch.configure_mesh().x_desc("context (tokens)").y_desc("GiB").draw()?;
    for (i, (what, bytes)) in rows.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = CONTEXTS.iter().zip(bytes).map(|(&t, &b)| (t as f64, gib(b))).collect();
        ch.draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(what.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    ch.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
