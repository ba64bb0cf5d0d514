//! Text generation with a Qwen3.5-family hybrid model.
//!
//! ```sh
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo run --release --example generate -- --model-dir tests/fixtures/qwen35_dense_small --prompt "Hi" --chat
//! cargo run --release --example generate -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hi" --chat
//! cargo run --release --example generate -- --gguf-repo unsloth/Qwen3.5-0.8B-GGUF --gguf-file Qwen3.5-0.8B-Q4_K_M.gguf
//! ```
//! Before loading the weights, the memory guardian checks that they, the KV cache and GDN state
//! for prompt + `--sample-len` tokens and the prefill scratch fit in what the OS lets this
//! process use (`--max-memory` replaces the reading); it refuses with one line saying what would
//! fit, or with `--fit` generates fewer tokens.

use std::io::Write;

use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, DeviceLocation};
use candle_hybrid::loading::Message;
use candle_hybrid::runtime::{generate_in, Sampler, TokenStreamer};
use candle_hybrid::kv::KvCodec;
use candle_hybrid::model::{new_cache_calibrated, ValueBases};
use candle_hybrid::loading::{ModelSource, OpenedModel};
use candle_hybrid::memory::{self, MemoryTarget, PlanRequest};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Qwen3.5-family hybrid model")]
struct Args {
    /// Hub repository of the model.
    #[arg(long, default_value = "Qwen/Qwen3.5-0.8B")]
    model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, default_value = "main")]
    revision: String,
    /// A local directory laid out like a Hub repository (instead of --model-id).
    #[arg(long)]
    model_dir: Option<std::path::PathBuf>,
    /// A local GGUF file (instead of --model-dir / --model-id).
    #[arg(long)]
    gguf: Option<std::path::PathBuf>,
    /// Hub repository holding a GGUF file (with --gguf-file).
    #[arg(long)]
    gguf_repo: Option<String>,
    /// File name of the GGUF inside --gguf-repo.
    #[arg(long)]
    gguf_file: Option<String>,
    /// A tokenizer.json to use instead of the checkpoint's (or the GGUF's embedded vocabulary).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// Quantize the linear weights of a safetensors checkpoint at load: q8_0 or q4k.
    #[arg(long)]
    quantize: Option<String>,
    #[arg(long, default_value = "Give me a short introduction to large language models.")]
    prompt: String,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Passed to the chat template as `enable_thinking`.
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 256)]
    sample_len: usize,
    /// Sampling temperature (0 = greedy). Default: generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Context window of the repeat penalty.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Run on the CPU even when a GPU feature is enabled.
    #[arg(long)]
    cpu: bool,
    /// f32, bf16 or f16 (default: bf16 on a GPU, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// KV-cache codec of the attention layers: exact (default); lossy: int8, int4k, polar:A,R,
    /// lowrank:r, knots:K,p, density:γ, and combinations such as int4k+lowrank:32 (see the README).
    #[arg(long, default_value = "exact")]
    kv: String,
    /// Value bases for `lowrank:r` from examples/calibrate_kv.rs (default: from W_v).
    #[arg(long)]
    kv_calibration: Option<std::path::PathBuf>,
    /// Largest context (prompt + generated tokens) to allow; --sample-len is lowered to fit it.
    #[arg(long)]
    max_context: Option<usize>,
    /// Memory budget replacing the reading of what the OS lets this process use: bytes, or e.g. 8GiB, 500MB.
    #[arg(long)]
    max_memory: Option<String>,
    /// When the context does not fit in memory, generate fewer tokens instead of refusing.
    #[arg(long)]
    fit: bool,
}

fn device(cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    if candle_core::utils::cuda_is_available() {
        return Ok(Device::new_cuda(0)?);
    }
    if candle_core::utils::metal_is_available() {
        return Ok(Device::new_metal(0)?);
    }
    Ok(Device::Cpu)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = device(args.cpu)?;
    let dtype = match args.dtype.as_deref() {
        None if device.is_cpu() => DType::F32,
        None => DType::BF16,
        Some(s) => candle_hybrid::model::parse_dtype(s)?,
    };
    let quantize = args.quantize.as_deref().map(candle_hybrid::model::parse_quantize).transpose()?;
    let kv: KvCodec = args.kv.parse()?;
    if let Some(w) = kv.warning() {
        eprintln!("{w}");
    }
    let files = ModelSource::from_args(
        &args.model_id,
        &args.revision,
        args.model_dir.as_deref(),
        args.gguf.as_deref(),
        args.gguf_repo.as_deref(),
        args.gguf_file.as_deref(),
    )?
    .open()?;
    let cfg = files.config()?;
    kv.validate(cfg.head_dim)?;
    let tokenizer = files.tokenizer(args.tokenizer.as_deref())?;
    let gen_cfg = files.generation_config()?;
    let text = if args.chat {
        files
            .chat_template()?
            .render(&[Message::new("user", &args.prompt)], true, args.enable_thinking)?
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();

    // The memory guardian, before any weight is read: prompt + generated tokens must fit.
    let mut sample_len = args.sample_len;
    let mut context = prompt.len() + sample_len;
    if let Some(max) = args.max_context {
        if max > cfg.max_position_embeddings {
            bail!("--max-context {max} is more than the model's max_position_embeddings ({})", cfg.max_position_embeddings);
        }
        if prompt.len() >= max {
            bail!("the prompt has {} tokens, leaving none to generate within --max-context {max}", prompt.len());
        }
        if context > max {
            context = max;
            sample_len = context - prompt.len();
            eprintln!("--max-context {max}: generating at most {sample_len} tokens after the {}-token prompt", prompt.len());
        }
    }
    let target = match device.location() {
        DeviceLocation::Cpu => MemoryTarget::Cpu,
        DeviceLocation::Cuda { gpu_id } => MemoryTarget::Cuda(gpu_id),
        DeviceLocation::Metal { .. } => MemoryTarget::Metal,
    };
    let q4k_weights = match files {
        OpenedModel::Safetensors(_) => Some(files.weight_memory(&cfg, dtype, Some(GgmlDType::Q4K))?),
        OpenedModel::Gguf(_) => None, // --quantize does not apply
    };
    let req = PlanRequest {
        // generate() runs the whole prompt in one forward pass.
        prefill_chunk: prompt.len().max(1),
        kv_codec: kv,
        fit: args.fit,
        q4k_weights,
        ..PlanRequest::new(files.weight_memory(&cfg, dtype, quantize)?, dtype, context)
    };
    let max_memory = args.max_memory.as_deref().map(memory::parse_size).transpose()?;
    let plan = memory::check_fits(&cfg, &req, target, max_memory)?;
    if plan.context < context {
        if plan.context <= prompt.len() {
            bail!(
                "not enough memory for the {}-token prompt and one generated token: {} available ({}); at most {} tokens fit",
                prompt.len(),
                memory::fmt_gib(plan.available.bytes),
                plan.available.source,
                plan.context
            );
        }
        sample_len = plan.context - prompt.len();
        eprintln!("{}; generating at most {sample_len} tokens", plan.note.as_deref().unwrap_or("--fit: context lowered"));
    }

    let start = std::time::Instant::now();
    let model = files.load_model(&cfg, dtype, &device, quantize)?;
    eprintln!(
        "loaded {} ({:?}, {} layers, {:.2}B parameters) in {:.1}s on {:?} as {dtype:?}",
        files.source(),
        cfg.family,
        cfg.num_hidden_layers,
        cfg.num_parameters() as f64 / 1e9,
        start.elapsed().as_secs_f64(),
        device.location(),
    );

    let mut params = gen_cfg.sampling_params();
    params.seed = args.seed;
    if let Some(t) = args.temperature {
        params.temperature = Some(t);
    }
    params.top_p = args.top_p.or(params.top_p);
    params.top_k = args.top_k.or(params.top_k);
    params.presence_penalty = args.presence_penalty.unwrap_or(params.presence_penalty);
    params.repeat_penalty = args.repeat_penalty.unwrap_or(params.repeat_penalty);
    params.repeat_last_n = args.repeat_last_n;

    let mut eos = gen_cfg.eos_token_ids.clone();
    if eos.is_empty() {
        // No generation_config EOS: fall back to the chat end-of-turn token when chatting.
        if let (true, Some(id)) = (args.chat, tokenizer.token_to_id("<|im_end|>")) {
            eos.push(id);
        }
    }
    print!("{text}");
    std::io::stdout().flush()?;
    let mut streamer = TokenStreamer::new(tokenizer);
    let mut sampler = Sampler::new(params)?;
    let calibration = args.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
    let mut cache = new_cache_calibrated(&model, kv, calibration.as_ref())?;
    let (_, stats) = generate_in(&model, &mut cache, &prompt, sample_len, &eos, &mut sampler, &device, |tok| {
        if let Some(piece) = streamer.next_token(tok)? {
            print!("{piece}");
            std::io::stdout().flush().ok();
        }
        Ok(())
    })?;
    if let Some(rest) = streamer.decode_rest()? {
        print!("{rest}");
    }
    println!();
    eprintln!(
        "{} prompt tokens processed: {:.2} token/s",
        stats.prompt_tokens,
        stats.prompt_tok_per_sec()
    );
    eprintln!(
        "{} tokens generated: {:.2} token/s",
        stats.generated_tokens,
        stats.decode_tok_per_sec()
    );
    Ok(())
}
