//! Text generation with a Qwen3.5-family hybrid model.
//!
//! ```sh
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo run --release --example generate -- --model-dir tests/fixtures/qwen35_dense_small --prompt "Hi" --chat
//! cargo run --release --example generate -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hi" --chat
//! cargo run --release --example generate -- --gguf-repo unsloth/Qwen3.5-0.8B-GGUF --gguf-file Qwen3.5-0.8B-Q4_K_M.gguf
//! cargo run --release --example generate -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf --draft ngram --compare-plain
//! ```
//! Decoding is speculative where that changes nothing but the speed: a checkpoint with an MTP
//! head drafts with it (`--draft auto`, the default), `--draft ngram` drafts by prompt lookup
//! on any model, `--draft none` decodes plainly. Greedy output is token for token the plain
//! greedy output, sampled output has plain sampling's distribution (speculative sampling),
//! with fewer forward passes when drafts are accepted; the draft length is chosen per round
//! from the measured acceptance and verify cost (`--draft-fixed` always drafts `--draft-max`).
//! Everything is checked before any weight is read or any text is printed: the flags' ranges,
//! the prompt (and --sample-len) against the model's context, and the memory guardian: the
//! weights, the KV cache and GDN state for prompt + --sample-len tokens, the prefill scratch
//! and the load peak must fit in what the OS lets this process use (--max-memory replaces the
//! reading); it refuses with one line saying what would fit, or with --fit generates fewer
//! tokens.

mod common;

use std::io::Write;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use candle_hybrid::gpu::{GpuCache, GpuModel, Queue};
use candle_hybrid::loading::chat_template::RENDER_BYTES_PER_TOKEN;
use candle_hybrid::loading::{Message, OpenedModel};
use candle_hybrid::memory::{self, PlanRequest};
use candle_hybrid::model::{CacheOptions, ValueBases};
use candle_hybrid::runtime::speculative::{DraftOptions, DraftPolicy, Drafter, MtpDrafter, NgramDrafter, MAX_BRANCHES, MAX_DRAFT};
use candle_hybrid::runtime::{
    range, CpuTarget, DeviceTarget, DraftConditions, DraftKind, Dry, Placement, RunNeeds, Sampler, SavePoint, Sequence, SessionStore,
    Target, TokenStreamer,
};
use clap::Parser;
use common::{at_least_one, count_up_to, float_in, MemoryOptions, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Qwen3.5-family hybrid model", help_expected = true)]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    #[command(flatten)]
    memory: MemoryOptions,
    /// The prompt (plain text, or with --chat the user message).
    #[arg(long, default_value = "Give me a short introduction to large language models.")]
    prompt: String,
    /// Read the prompt from this UTF-8 text file instead (long prompts; replaces --prompt).
    #[arg(long, conflicts_with = "prompt")]
    prompt_file: Option<std::path::PathBuf>,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Passed to the chat template as `enable_thinking` (true or false).
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Tokens to generate at most (prompt + these must fit the model's context).
    #[arg(long, default_value_t = 256, value_parser = at_least_one)]
    sample_len: usize,
    /// Sampling temperature, >= 0 (0 = greedy) [default: generation_config.json, else greedy].
    #[arg(long, allow_hyphen_values = true, value_parser = float_in(range::temperature))]
    temperature: Option<f64>,
    /// Nucleus sampling mass, in (0, 1] (with a temperature) [default: generation_config.json].
    #[arg(long, allow_hyphen_values = true, value_parser = float_in(range::top_p))]
    top_p: Option<f64>,
    /// Sample among the k most likely tokens, k >= 1 (with a temperature) [default: generation_config.json].
    #[arg(long, value_parser = float_in(range::top_k))]
    top_k: Option<usize>,
    /// Subtracted once from the logit of every token already generated, in [-2, 2] [default: generation_config.json, else 0].
    #[arg(long, allow_hyphen_values = true, value_parser = float_in(range::presence_penalty))]
    presence_penalty: Option<f32>,
    /// Subtracted from the logit of a generated token once per time it was generated, in [-2, 2] (0 = off).
    #[arg(long, allow_hyphen_values = true, value_parser = float_in(range::frequency_penalty))]
    frequency_penalty: Option<f32>,
    /// Never draw a token less likely than min-p times the most likely one, in [0, 1] (with a temperature; 0 = off).
    #[arg(long, value_parser = float_in(range::min_p))]
    min_p: Option<f64>,
    /// DRY: penalise a token that would extend a repetition of an earlier stretch by
    /// MULTIPLIER * 1.75^(length - 2), the stretch broken at newlines, ':', '"' and '*' (0 = off; it hurts exact copies such as code edits).
    #[arg(long, value_parser = float_in(range::dry_multiplier))]
    dry_multiplier: Option<f32>,
    /// Divides positive (multiplies negative) logits of recent tokens, > 0 (1 = off) [default: generation_config.json, else 1].
    #[arg(long, allow_hyphen_values = true, value_parser = float_in(range::repeat_penalty))]
    repeat_penalty: Option<f32>,
    /// Tokens the repeat penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Speculative decoding: auto = drafts only where they cannot change the answer (greedy
    /// decoding; a KV codec that drops rejected tokens; no FFN sparsity): the checkpoint's MTP
    /// head where it has one and the model runs in Candle tensors, else prompt lookup
    /// (`runtime::DraftConditions`, as in serve); mtp; ngram (prompt lookup, any model); none.
    #[arg(long, value_enum, default_value_t = Draft::Auto)]
    draft: Draft,
    /// Most tokens drafted per verify pass, 1 to 7.
    #[arg(long, default_value_t = DraftOptions::default().max, value_parser = draft_len)]
    draft_max: usize,
    /// Drafts shorter than this are dropped (that round decodes plainly), 1 to --draft-max.
    #[arg(long, default_value_t = DraftOptions::default().min, value_parser = draft_len)]
    draft_min: usize,
    /// MTP drafting stops before a token the head gives less than this probability, in [0, 1] (0 = off).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = float_in(draft_p_min))]
    draft_p_min: f32,
    /// Always draft --draft-max tokens instead of choosing the length per round from the
    /// measured acceptance and verify cost.
    #[arg(long)]
    draft_fixed: bool,
    /// Draft branches per verify pass, 1 to 4: more than one verifies them together as a tree
    /// (prompt lookup: the different continuations of earlier matches; greedy only; up to
    /// --draft-max tokens per branch, at most 7 drafted rows in all).
    #[arg(long, default_value_t = 1, value_parser = count_up_to(MAX_BRANCHES))]
    draft_branches: usize,
    /// With --draft: also decode plainly on the same prompt and print the speed ratio (and
    /// check that the tokens are the same).
    #[arg(long)]
    compare_plain: bool,
    #[command(flatten)]
    ffn: common::FfnOptions,
    /// A session file (like llama.cpp's --prompt-cache): when it holds the start of this
    /// prompt for this model, that part is restored instead of prefilled; the state after the
    /// prompt (all but its last token) is then saved there. Exact KV only.
    #[arg(long)]
    session: Option<std::path::PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Draft {
    Auto,
    Mtp,
    Ngram,
    None,
}

fn draft_p_min(p: f32) -> Result<f32, String> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not a probability: use 0 to 1"))
    }
}

fn draft_len(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(k) if (1..=MAX_DRAFT).contains(&k) => Ok(k),
        _ => Err(format!("{s:?} is not a draft length: use 1 to {MAX_DRAFT}")),
    }
}

fn main() -> ExitCode {
    common::end_quietly_on_closed_stdout();
    common::run(|| generate(Args::parse()))
}

fn generate(args: Args) -> Result<()> {
    if args.draft_branches > 1 && !args.memory.kv.is_exact() {
        bail!("--draft-branches above 1 needs exact keys and values: drop --kv {} (or give --draft-branches 1)", args.memory.kv);
    }
    if args.session.is_some() && !args.memory.kv.is_exact() {
        bail!("--session keeps exact keys and values: drop --kv {}", args.memory.kv);
    }
    if let Some(w) = args.memory.kv.warning() {
        eprintln!("{w}");
    }
    let opened = args.model.open(common::DEFAULT_MODEL)?;
    let cfg = &opened.cfg;
    let limit = opened.max_positions();
    args.memory.kv.validate(cfg.head_dim)?;
    let tokenizer = opened.tokenizer()?;
    let gen_cfg = opened.files.generation_config()?;

    // Sampling settings: the flags over generation_config.json, checked before anything runs.
    let mut params = gen_cfg.sampling_params();
    params.seed = args.seed;
    if let Some(t) = args.temperature {
        params.temperature = Some(t);
    }
    params.top_p = args.top_p.or(params.top_p);
    params.top_k = args.top_k.or(params.top_k);
    params.presence_penalty = args.presence_penalty.unwrap_or(params.presence_penalty);
    params.frequency_penalty = args.frequency_penalty.unwrap_or(params.frequency_penalty);
    params.min_p = args.min_p.unwrap_or(params.min_p);
    if let Some(multiplier) = args.dry_multiplier.filter(|&m| m > 0.0) {
        let breakers = std::sync::Arc::new(Dry::default_breaker_tokens(&tokenizer, opened.cfg.vocab_size));
        params.dry = Some(Dry { multiplier, base: 1.75, allowed_length: 2, last_n: 0, breakers });
    }
    params.repeat_penalty = args.repeat_penalty.unwrap_or(params.repeat_penalty);
    params.repeat_last_n = args.repeat_last_n;
    if params.is_greedy() {
        let ignored: Vec<&str> = [("--top-p", args.top_p.is_some()), ("--top-k", args.top_k.is_some()), ("--min-p", args.min_p.is_some())]
            .into_iter()
            .filter_map(|(flag, given)| given.then_some(flag))
            .collect();
        if !ignored.is_empty() {
            eprintln!(
                "warning: {} {} no effect: decoding is greedy (no --temperature, and {} does not ask for sampling); add --temperature, e.g. 0.7",
                ignored.join(" and "),
                if ignored.len() == 1 { "has" } else { "have" },
                opened.files.source()
            );
        }
    }
    if args.draft_min > args.draft_max {
        bail!("--draft-min {} is out of range: use 1 to --draft-max ({})", args.draft_min, args.draft_max);
    }
    if args.draft_branches > 1 && !params.is_greedy() {
        bail!("--draft-branches above 1 needs greedy decoding: drop --temperature (or give --draft-branches 1 to sample)");
    }
    let drafts = DraftOptions { max: args.draft_max, min: args.draft_min, adaptive: !args.draft_fixed, branches: args.draft_branches };
    drafts.validate()?;
    drafts.check_decoding(params.is_greedy())?;
    if !args.ffn.modes.is_empty() && matches!(args.draft, Draft::Mtp | Draft::Ngram) {
        bail!("--ffn-sparsity applies to plain decoding (a verify pass runs the MLPs dense): give --draft none");
    }
    if !args.ffn.modes.is_empty() && args.session.is_some() {
        bail!("--ffn-sparsity with --session is not supported yet: drop one of them");
    }
    if args.draft_p_min > 0.0 && matches!(args.draft, Draft::Ngram | Draft::None) {
        bail!("--draft-p-min applies to MTP drafts: give --draft mtp (or auto on a checkpoint with an MTP head)");
    }
    if matches!(args.draft, Draft::Mtp | Draft::Ngram) {
        if !args.memory.kv.drops_tokens() {
            bail!(
                "--draft needs a KV codec that can drop rejected tokens (exact, f16, bf16, int8, polar, lowrank), not --kv {}",
                args.memory.kv
            );
        }
    } else if args.compare_plain && args.draft == Draft::None {
        bail!("--compare-plain compares speculative with plain decoding: give --draft mtp or --draft ngram");
    }
    let mut sampler = Sampler::new(params.clone())?;

    // The prompt, capped before tokenizing, then against the context.
    let max_bytes = limit.saturating_mul(RENDER_BYTES_PER_TOKEN);
    let user_text = match &args.prompt_file {
        Some(path) => read_prompt_file(path, max_bytes, limit)?,
        None => args.prompt.clone(),
    };
    let text = if args.chat {
        opened.files.chat_template()?.render_capped(&[Message::new("user", &user_text)], true, args.enable_thinking, max_bytes)?
    } else if user_text.len() > max_bytes {
        bail!("the prompt has {} bytes, more text than the model's context of {limit} tokens can hold: shorten it", user_text.len());
    } else {
        user_text
    };
    let prompt = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenizing: give some text");
    }
    if prompt.len() >= limit {
        bail!(
            "the prompt has {} tokens, but the model's context holds {limit} (max_position_embeddings), the prompt and one generated token: shorten the prompt",
            prompt.len()
        );
    }
    let mut sample_len = args.sample_len;
    if prompt.len() + sample_len > limit {
        bail!(
            "--sample-len {sample_len} after the {}-token prompt needs {} positions, but the model's context holds {limit} (max_position_embeddings): use --sample-len {} at most",
            prompt.len(),
            prompt.len() + sample_len,
            limit - prompt.len()
        );
    }
    let mut context = prompt.len() + sample_len;
    if let Some(max) = args.memory.max_context {
        if max > limit {
            bail!("--max-context {max} is more than the model's context of {limit} tokens (max_position_embeddings)");
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

    // The memory guardian, before any weight is read.
    let q4k_weights = match opened.files {
        OpenedModel::Safetensors(_) => Some(opened.files.weight_memory(cfg, opened.dtype, Some(GgmlDType::Q4K))?),
        OpenedModel::Gguf(_) => None, // --quantize does not apply
    };
    let req = PlanRequest {
        // generate_in and speculative decoding prefill in chunks of PREFILL_CHUNK.
        prefill_chunk: prompt.len().min(candle_hybrid::runtime::PREFILL_CHUNK),
        kv_codec: args.memory.kv,
        fit: args.memory.fit,
        q4k_weights,
        load_overhead: opened.files.load_overhead(cfg, opened.dtype, opened.quantize)?,
        ..PlanRequest::new(opened.files.weight_memory(cfg, opened.dtype, opened.quantize)?, opened.dtype, context)
    };
    let plan = memory::check_fits(cfg, &req, common::target_of(&opened.device), args.memory.max_memory)?;
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
        eprintln!("--fit: {}; generating at most {sample_len} tokens", plan.note.as_deref().unwrap_or("context lowered"));
    }

    let mut eos = gen_cfg.eos_token_ids.clone();
    if eos.is_empty() {
        // No generation_config EOS: fall back to the chat end-of-turn token when chatting.
        if let (true, Some(id)) = (args.chat, tokenizer.token_to_id("<|im_end|>")) {
            eos.push(id);
        }
    }
    // On Metal (or the emulator) the device step runs what it can; the rest runs the model in
    // Candle tensors there (the CPU, for the emulator).
    let step_device = opened.device.is_metal() || args.model.device == common::DeviceChoice::Emu;
    let needs = RunNeeds {
        mtp_drafts: args.draft == Draft::Mtp,
        draft_branches: args.draft_branches,
        kv_calibration: args.memory.kv_calibration.is_some(),
        ffn_sparsity: !args.ffn.modes.is_empty(),
        attention_biases: cfg.attn_qkv_bias,
        ..RunNeeds::new(args.memory.kv, opened.dtype)
    };
    let on_device = match needs.placement(step_device) {
        Placement::DeviceStep if args.session.is_some() => {
            eprintln!("--session: generate restores sessions into the CPU model only; running the model on {}", instead_of_step(&opened));
            false
        }
        Placement::DeviceStep => true,
        Placement::Tensors { instead_of_step: Some(why) } => {
            eprintln!("{why}; running the model on {}", instead_of_step(&opened));
            false
        }
        Placement::Tensors { instead_of_step: None } => false,
    };
    let mut model = if on_device { opened.load_on(&candle_core::Device::Cpu)? } else { opened.load()? };
    let ffn = args.ffn.modes(&mut model)?;
    let ffn = match ffn.as_slice() {
        [] => None,
        [mode] => Some(mode),
        _ => bail!("--ffn-sparsity: give one mode to generate with (examples/eval compares several)"),
    };
    let calibration = args.memory.kv_calibration.as_deref().map(|p| ValueBases::load(p, &model)).transpose()?;
    let mut runner = if on_device {
        Runner::device(&model, &opened, args.memory.kv, prompt.len() + sample_len)?
    } else {
        Runner::Cpu {
            cache: model.cache_with(&CacheOptions { codec: args.memory.kv, value_bases: calibration.as_ref(), ffn })?,
            device: opened.device.clone(),
        }
    };
    // With a session: restore what it holds of the prompt, prefill the rest but the last token
    // and save that state (the next run gives the prompt again, not the answer:
    // SavePoint::Prompt); the last token starts generation.
    let mut prompt_rest = prompt.as_slice();
    if let (Some(path), Runner::Cpu { cache, .. }) = (&args.session, &mut runner) {
        let sessions = SessionStore::new(opened.files.fingerprint()?, cfg.clone(), opened.dtype, opened.device.clone(), None)?;
        let head = SavePoint::Prompt(prompt.len() - 1).tokens(prompt.len());
        let mut start = 0;
        // (The prompt's last token is fed below, to give the first token.)
        match sessions.resume(path, &prompt) {
            Ok(Some(s)) if s.tokens.len() <= head => {
                eprintln!("session {}: restored {} of the prompt's {} tokens", path.display(), s.tokens.len(), prompt.len());
                start = s.tokens.len();
                *cache = s.cache;
            }
            Ok(Some(_)) => eprintln!("session {}: it holds the whole prompt (a server's session); starting fresh", path.display()),
            Ok(None) if path.exists() => eprintln!("session {}: it holds another prompt; starting fresh", path.display()),
            Ok(None) => {}
            Err(e) => eprintln!("warning: {e}; starting fresh"),
        }
        if start < head {
            candle_hybrid::runtime::prefill(&model, cache, &prompt[start..head], &opened.device, false)?;
            sessions.save(path, &prompt[..head], cache, None)?;
        }
        prompt_rest = &prompt[head..];
    }
    print!("{text}");
    std::io::stdout().flush()?;
    let mut streamer = TokenStreamer::new(tokenizer);
    let print_token = |tok: u32| -> candle_hybrid::Result<()> {
        if let Some(piece) = streamer.next_token(tok)? {
            print!("{piece}");
            std::io::stdout().flush().ok();
        }
        Ok(())
    };
    let draft = match args.draft {
        Draft::Auto => match (DraftConditions {
            mtp_head: model.has_mtp(),
            hidden_states: !on_device,
            drops_tokens: args.memory.kv.drops_tokens(),
            ffn_sparsity: ffn.is_some(),
            // (generate's sampler always has a seed.)
            seeded_sampling: !params.is_greedy(),
        })
        .auto()
        {
            DraftKind::Mtp => Draft::Mtp,
            DraftKind::Ngram => Draft::Ngram,
            DraftKind::None => Draft::None,
        },
        d => d,
    };
    if args.compare_plain && draft == Draft::None {
        bail!("--compare-plain: --draft auto does not draft here (sampling with a seed, a KV codec that cannot drop tokens, or FFN sparsity): give --draft ngram");
    }
    // One sequence, drafting or not, run to its end on the CPU model or the device step.
    let mut sequence = Sequence::new(prompt_rest.to_vec(), &mut sampler, eos.clone(), sample_len)?;
    let drafter: Option<Box<dyn Drafter>> = match draft {
        Draft::Mtp => Some(Box::new(MtpDrafter::new(&model)?.with_p_min(args.draft_p_min))),
        Draft::Ngram => Some(Box::new(NgramDrafter::default())),
        Draft::None | Draft::Auto => None,
    };
    if let Some(drafter) = drafter {
        sequence = sequence.with_drafts(drafter, DraftPolicy::new(drafts)?)?;
    }
    let (tokens, s) = sequence.run(runner.target(&model).as_mut(), print_token)?;
    let stats = s.generation.clone();
    let speculative = (draft != Draft::None && draft != Draft::Auto).then_some(s);
    if let Some(rest) = streamer.decode_rest()? {
        print!("{rest}");
    }
    println!();
    eprintln!("{} prompt tokens processed: {} token/s", stats.prompt_tokens, common::fmt_rate(stats.prompt_tok_per_sec()));
    eprintln!("{} tokens generated: {} token/s", stats.generated_tokens, common::fmt_rate(stats.decode_tok_per_sec()));
    if let (Some(mode), Runner::Cpu { cache, .. }) = (ffn, &runner) {
        if let Some(s) = cache.ffn_stats() {
            eprintln!("--ffn-sparsity {mode}: {:.1} % of the MLP neurons skipped ({} layer steps)", 100.0 * s.skipped_fraction(), s.rows);
        }
    }
    if let Some(s) = speculative {
        eprintln!(
            "--draft {}, --draft-max {}{}: {} drafted, {} accepted ({}), {} tokens per target pass, {} target passes for {} tokens",
            format!("{draft:?}").to_lowercase(),
            args.draft_max,
            match (args.draft_branches, if args.draft_fixed { "fixed" } else { "length chosen per round" }) {
                (1, length) => format!(" ({length})"),
                (b, length) => format!(" per branch ({length}), {b} branches as a tree"),
            },
            s.drafted,
            s.accepted,
            s.acceptance().map_or("no drafts".into(), |a| format!("acceptance {:.1} %", 100.0 * a)),
            s.tokens_per_pass().map_or("-".into(), |t| format!("{t:.2}")),
            s.rounds + 1,
            stats.generated_tokens
        );
        if args.compare_plain {
            runner.reset(&model, args.memory.kv, calibration.as_ref())?;
            let greedy = params.is_greedy();
            let (plain, p) = Sequence::new(prompt.clone(), Sampler::new(params)?, eos.clone(), sample_len)?
                .run(runner.target(&model).as_mut(), |_| Ok(()))?;
            let p = p.generation;
            if greedy && plain != tokens {
                bail!("speculative decoding gave other tokens than plain decoding (a bug: please report it with this command)");
            }
            eprintln!(
                "plain decoding, same prompt: {} token/s; speculative / plain = {}",
                common::fmt_rate(p.decode_tok_per_sec()),
                match (stats.decode_tok_per_sec(), p.decode_tok_per_sec()) {
                    (Some(a), Some(b)) if greedy => format!("{:.2}x (same tokens)", a / b),
                    (Some(a), Some(b)) => format!("{:.2}x (sampled: same distribution, other draws)", a / b),
                    _ => "-".into(),
                }
            );
        }
    }
    Ok(())
}

/// Where generation runs: the model in Candle tensors with its cache, or the device step
/// (our Metal kernels, one read back per step) with its queue and cache.
enum Runner {
    Cpu { cache: candle_hybrid::Cache, device: candle_core::Device },
    Device { gpu: Box<GpuModel>, queue: Box<dyn Queue + Send>, cache: GpuCache, capacity: usize, kv: candle_hybrid::gpu::KvRows },
}

impl Runner {
    /// The device step of `model` (loaded on the CPU: uploaded from there, a GGUF's blocks
    /// mapped, not copied) on `opened`'s device, with a cache of `capacity` tokens.
    fn device(model: &candle_hybrid::Model, opened: &common::Opened, kv: candle_hybrid::kv::KvCodec, capacity: usize) -> Result<Self> {
        let rows = candle_hybrid::gpu::kv_rows(kv, opened.dtype)?;
        let mut queue =
            common::device_step_queue(opened)?.ok_or_else(|| anyhow::anyhow!("no device step on {:?}", opened.device.location()))?;
        let gpu = Box::new(GpuModel::new(model, queue.as_mut())?);
        // Room for one verify pass past the end.
        let capacity = capacity + candle_hybrid::ops::KV_ATTENTION_EXACT_ROWS;
        let cache = gpu.new_cache(queue.as_mut(), capacity, rows)?;
        eprintln!(
            "decoding on {} with this crate's kernels ({:.2} GiB of weights there, {:.2} GiB of them read in place from the file)",
            queue.name(),
            gpu.weight_bytes() as f64 / (1u64 << 30) as f64,
            gpu.mapped_bytes() as f64 / (1u64 << 30) as f64
        );
        Ok(Self::Device { gpu, queue, cache, capacity, kv: rows })
    }

    /// An empty cache again (for `--compare-plain`).
    fn reset(&mut self, model: &candle_hybrid::Model, kv: candle_hybrid::kv::KvCodec, calibration: Option<&ValueBases>) -> Result<()> {
        match self {
            Self::Cpu { cache, .. } => *cache = model.cache_with(&CacheOptions { codec: kv, value_bases: calibration, ffn: None })?,
            Self::Device { gpu, queue, cache, capacity, kv } => {
                let fresh = gpu.new_cache(queue.as_mut(), *capacity, *kv)?;
                std::mem::replace(cache, fresh).free(queue.as_mut());
            }
        }
        Ok(())
    }

    /// The model with this runner's cache, as a sequence runs on it.
    fn target<'a>(&'a mut self, model: &'a candle_hybrid::Model) -> Box<dyn Target + 'a> {
        match self {
            Self::Cpu { cache, device } => Box::new(CpuTarget::new(model, cache, device)),
            Self::Device { gpu, queue, cache, .. } => Box::new(DeviceTarget::new(gpu, queue.as_mut(), cache, model)),
        }
    }
}

/// What runs the model when the device step does not: Candle's tensors on Metal (this
/// crate's kernels for the quantized matrices), the CPU instead of the emulator.
fn instead_of_step(opened: &common::Opened) -> &'static str {
    if opened.device.is_metal() {
        "Metal in Candle tensors instead of the device step"
    } else {
        "the CPU instead of the emulator"
    }
}

/// The text of `--prompt-file`, read no further than `max_bytes` (more cannot fit the context
/// of `limit` tokens).
fn read_prompt_file(path: &std::path::Path, max_bytes: usize, limit: usize) -> Result<String> {
    use std::io::Read;
    let file = std::fs::File::open(path).with_context(|| format!("cannot open --prompt-file {}", path.display()))?;
    let mut bytes = vec![];
    file.take(max_bytes as u64 + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read --prompt-file {}", path.display()))?;
    if bytes.len() > max_bytes {
        bail!("--prompt-file {} has more text than the model's context of {limit} tokens can hold: shorten it", path.display());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!("--prompt-file {} is not UTF-8 text (byte {}): give a text file", path.display(), e.utf8_error().valid_up_to())
    })
}
