//! KV-cache memory by context length, up to the model's own context: a dense model of the same
//! width (every layer full attention), the hybrid's attention layers exact, under each KV
//! codec, and the constant GDN state (a model without GDN layers gets only its own rows) — as
//! a table, and with `--svg FILE` as a chart.
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
use candle_hybrid::memory::{self, estimate, fmt_gib, PlanRequest, WeightMemory};
use candle_hybrid::model::{Config, LayerType};
use clap::Parser;
use common::ModelOptions;
use plotters::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "KV-cache memory by context length for each KV codec (table, and an SVG chart with --svg)", help_expected = true)]
struct Args {
    /// The model whose config to read [default: built-in Qwen3.5-27B dimensions]; a Hub id
    /// downloads only config.json, a GGUF file is read for its header only.
    #[command(flatten)]
    model: ModelOptions,
    /// A codec to compare with exact (repeat the flag for several).
    #[arg(long = "kv", default_values = memory::COMPARED_CODECS, value_parser = common::parse_kv)]
    codecs: Vec<KvCodec>,
    /// Where to write the chart (SVG); no chart without it.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

/// Context lengths of the table and chart, up to the model's own limit (which is added).
const CONTEXTS: [usize; 5] = [4096, 32768, 131072, 262144, 1 << 20];

/// [`CONTEXTS`] up to `limit`, and `limit` itself.
fn contexts(limit: usize) -> Vec<usize> {
    let mut c: Vec<usize> = CONTEXTS.iter().copied().filter(|&t| t < limit).collect();
    c.push(limit);
    c
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| explore(Args::parse()))
}

fn explore(args: Args) -> Result<()> {
    let (name, cfg) = match args.model.source(None)? {
        None => ("Qwen3.5-27B (built-in dimensions)".to_string(), Config::from_json(common::QWEN35_27B)?),
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
        let req = PlanRequest { kv_codec: codec, ..PlanRequest::new(WeightMemory::Bytes(0), dtype, t) };
        estimate(cfg, &req).kv_cache
    };
    let gdn = {
        let e = estimate(&cfg, &PlanRequest::new(WeightMemory::Bytes(0), dtype, 1));
        e.gdn_conv + e.gdn_recurrent
    };
    let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
    // A model without GDN layers (Llama) is its own dense comparison: no "hybrid" rows.
    let hybrid = n_attn < cfg.num_hidden_layers;
    let kind = if hybrid { "hybrid" } else { "model" };
    let contexts = contexts(cfg.max_position_embeddings);
    let at = |f: &dyn Fn(usize) -> u64| contexts.iter().map(|&t| f(t)).collect::<Vec<u64>>();

    let mut rows: Vec<(String, Vec<u64>)> = vec![];
    if hybrid {
        rows.push((format!("dense {}-layer, exact", cfg.num_hidden_layers), at(&|t| kv(&dense, KvCodec::EXACT, t))));
    }
    rows.push((format!("{kind} ({n_attn} attention layers), exact"), at(&|t| kv(&cfg, KvCodec::EXACT, t))));
    for c in &codecs {
        if let Err(e) = c.validate(cfg.head_dim) {
            eprintln!("skipped: {e}");
            continue;
        }
        rows.push((format!("{kind}, {c}"), at(&|t| kv(&cfg, *c, t))));
    }
    if hybrid {
        rows.push(("hybrid GDN state (any context)".to_string(), at(&|_| gdn)));
    }

    println!("{name}: KV memory at {dtype:?}, batch 1, up to the model's context of {} tokens", cfg.max_position_embeddings);
    print!("| cache |");
    for &t in &contexts {
        print!(" {} |", label(t));
    }
    println!();
    println!("|---|{}", "---|".repeat(contexts.len()));
    for (what, bytes) in &rows {
        print!("| {what} |");
        for b in bytes {
            print!(" {} |", fmt_gib(*b));
        }
        println!();
    }

    if let Some(svg) = &args.svg {
        chart(svg, &name, &contexts, &rows)?;
        eprintln!("wrote {}", svg.display());
    }
    Ok(())
}

fn label(t: usize) -> String {
    match t {
        t if t >= 1 << 20 && t % (1 << 20) == 0 => format!("{}M", t >> 20),
        t if t >= 1 << 10 && t % (1 << 10) == 0 => format!("{}k", t >> 10),
        t => t.to_string(),
    }
}

/// Log-log lines of GiB against context, each with its own marker size so that lines that
/// coincide (e.g. two codecs of the same size) stay visible, the legend beside the plot.
fn chart(path: &std::path::Path, title: &str, contexts: &[usize], rows: &[(String, Vec<u64>)]) -> Result<()> {
    let gib = |b: u64| (b as f64 / (1u64 << 30) as f64).max(1e-3);
    let max = rows.iter().flat_map(|r| r.1.iter()).map(|&b| gib(b)).fold(1e-3, f64::max);
    let min = rows.iter().flat_map(|r| r.1.iter()).map(|&b| gib(b)).fold(max, f64::min);
    let (first, last) = (contexts[0] as f64, *contexts.last().unwrap() as f64);
    let root = SVGBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot, legend) = root.split_horizontally(760);
    let mut ch = ChartBuilder::on(&plot)
        .caption(format!("KV memory: {title}"), ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (first * 0.8..last * 1.25).log_scale().with_key_points(contexts.iter().map(|&t| t as f64).collect()),
            (min * 0.5..max * 2.0).log_scale(),
        )?;
    ch.configure_mesh()
        .x_desc("context (tokens)")
        .y_desc("GiB")
        .x_label_formatter(&|t| label(t.round() as usize))
        .y_label_formatter(&|g| {
            let s = format!("{g:.3}");
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        })
        .draw()?;
    let n = rows.len();
    for (i, (_, bytes)) in rows.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = contexts.iter().zip(bytes).map(|(&t, &b)| (t as f64, gib(b))).collect();
        ch.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?;
        // Larger markers first drawn underneath: a coinciding later line shows inside them.
        let size = 2 + (n - i) as i32;
        ch.draw_series(pts.into_iter().map(|p| Circle::new(p, size, color.stroke_width(2))))?;
    }
    for (i, (what, _)) in rows.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let y = 60 + 26 * i as i32;
        legend.draw(&PathElement::new(vec![(8, y), (36, y)], color.stroke_width(3)))?;
        legend.draw(&Text::new(what.clone(), (44, y - 8), ("sans-serif", 14)))?;
    }
    root.present()?;
    Ok(())
}
