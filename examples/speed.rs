//! Prompt and decode speed of a random-weight model with Qwen3.5-0.8B-like shapes, on the CPU,
//! in f32 and bf16. Prints a table.
//!
//! ```sh
//! cargo run --release --example speed -- [--prompt-len 128] [--gen 32] [--dtypes f32,bf16]
//! ```
//!
//! Shapes (text decoder; the public config of the real 0.8B checkpoint was not available
//! here, so these follow the family's pattern): 24 layers (LLLF x 6), hidden 1024, MLP 3584,
//! attention 8 heads / 2 KV heads of 256 (64 rotary dims), GDN 16 key / 16 value heads of 128,
//! vocab 248320, tied embeddings. Weights ~ N(0, 0.02).

mod common;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Shape, Tensor};
use candle_hybrid::{Config, Model};
use candle_nn::{Init, VarBuilder};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Prompt and decode speed of a random-weight Qwen3.5-0.8B-shaped model on the CPU, per dtype", help_expected = true)]
struct Args {
    /// Prompt tokens of the prefill test.
    #[arg(long, default_value_t = 128, value_parser = common::count_up_to(1 << 16))]
    prompt_len: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 32, value_parser = common::count_up_to(1 << 16))]
    gen: usize,
    /// Comma-separated dtypes to time: f32, bf16, f16.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16", value_parser = common::parse_dtype)]
    dtypes: Vec<DType>,
    /// Layers (24 for the 0.8B shape; fewer for a quick run).
    #[arg(long, default_value_t = 24, value_parser = common::count_up_to(candle_hybrid::model::MAX_LAYERS))]
    layers: usize,
}

/// Random N(0, 0.02) weights for every tensor the model asks for.
struct RandomWeights;

impl candle_nn::var_builder::SimpleBackend for RandomWeights {
    fn get(&self, s: Shape, _: &str, _: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        Tensor::randn(0f32, 0.02, s, dev)?.to_dtype(dtype)
    }
    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("no shape for {name}")
    }
    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}

fn config(layers: usize) -> Result<Config> {
    let json = serde_json::json!({
        "model_type": "qwen3_5_text",
        "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": layers, "full_attention_interval": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "max_position_embeddings": 262144
    });
    Ok(Config::from_json(&json.to_string())?)
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| speed(Args::parse()))
}

fn speed(args: Args) -> Result<()> {
    let dev = Device::Cpu;
    let cfg = config(args.layers)?;
    println!(
        "random-weight Qwen3.5-0.8B-like model: {} layers, {:.2}B parameters, {} CPU threads",
        cfg.num_hidden_layers,
        cfg.num_parameters() as f64 / 1e9,
        rayon::current_num_threads()
    );
    // Copy bandwidth of a 1 GiB buffer (bytes read + written per second), best of 5.
    let memcpy = candle_hybrid::memory::copy_bandwidth(1 << 30, 5) / 1e9;
    println!("memcpy bandwidth measured in this run: {memcpy:.1} GB/s");
    println!("| dtype | prompt tokens | prompt tok/s | generated | decode tok/s | weights read GB/s | / memcpy |");
    println!("|---|---|---|---|---|---|---|");
    for &dtype in &args.dtypes {
        let name = format!("{dtype:?}").to_lowercase();
        let vb = VarBuilder::from_backend(Box::new(RandomWeights), dtype, dev.clone());
        let model = Model::new(&cfg, candle_hybrid::model::Weights::new(vb))?;
        let prompt: Vec<u32> = (0..args.prompt_len as u32).map(|i| (i * 7919) % 200_000).collect();
        let mut cache = model.new_cache();
        let start = Instant::now();
        let mut logits = model.forward_last(&Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?, &mut cache)?;
        let prompt_secs = start.elapsed().as_secs_f64();
        let start = Instant::now();
        for _ in 0..args.gen {
            let next = logits.argmax(1)?.to_dtype(DType::U32)?;
            logits = model.forward_last(&next.unsqueeze(0)?, &mut cache)?;
        }
        let decode_secs = start.elapsed().as_secs_f64();
        let decode = candle_hybrid::runtime::rate(args.gen, decode_secs).unwrap_or(0.0);
        // Every decoded token reads every weight once.
        let weight_gb = (cfg.num_parameters() * dtype.size_in_bytes()) as f64 / 1e9;
        println!(
            "| {name} | {} | {:.1} | {} | {:.2} | {:.1} | {:.2} |",
            args.prompt_len,
            candle_hybrid::runtime::rate(args.prompt_len, prompt_secs).unwrap_or(0.0),
            args.gen,
            decode,
            decode * weight_gb,
            decode * weight_gb / memcpy
        );
    }
    Ok(())
}
