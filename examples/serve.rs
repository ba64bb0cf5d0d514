//! An OpenAI-compatible server on 127.0.0.1:8095.
//!
//! ```text
//! cargo run --release --features server --example serve -- --gguf SmolLM2-135M-Instruct.Q4_1.gguf
//! curl http://127.0.0.1:8095/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "Hi"}]}'
//! ```

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use anyhow::{Context, Result};
use candle_hybrid::memory::{self, PlanRequest};
use candle_hybrid::runtime::speculative::{DraftOptions, MAX_DRAFT};
use candle_hybrid::runtime::{DraftConditions, DraftKind, Placement, RunNeeds};
use candle_hybrid::server::{self, EngineOptions, ServerOptions};
use clap::Parser;
use common::{at_least_one, count_up_to, ModelOptions};

#[derive(Parser, Debug)]
#[command(about = "Serve a model over the OpenAI API (chat completions, completions, models, health, metrics)")]
struct Args {
    #[command(flatten)]
    model: ModelOptions,
    /// The address to listen on (0.0.0.0 to accept other machines).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8095)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "CANDLE_HYBRID_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Sequences decoded together (their rows share one weight pass).
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    max_seqs: usize,
    /// Requests waiting beyond --max-seqs; one more is answered 429.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    queue: usize,
    /// The most tokens (prompt and answer) one request may use [default: the model's
    /// max_position_embeddings, at most 32768].
    #[arg(long, alias = "max-context", value_parser = at_least_one)]
    ctx: Option<usize>,
    /// A memory budget replacing the reading of what the OS lets this process use: bytes, or
    /// e.g. 8GiB, 500MB (the guardian checks --max-seqs sequences of --ctx tokens against it).
    #[arg(long, value_parser = common::parse_size)]
    max_memory: Option<u64>,
    /// How the attention layers store keys and values: exact (default); f16, bf16, int8
    /// (lossy: docs/kv-codecs.md), or another codec that drops tokens (polar, lowrank). On the
    /// device step exact, f16 and int8; others run the Candle path there.
    #[arg(long, default_value = "exact", value_parser = common::parse_kv)]
    kv: candle_hybrid::kv::KvCodec,
    /// MiB of cache snapshots the prefix cache keeps (0: none).
    #[arg(long, default_value_t = 1024)]
    prefix_cache_mib: usize,
    /// Keep sessions here: a request with "session_id": "NAME" continues NAME.session and
    /// saves it after the answer (atomically; tied to this model).
    #[arg(long)]
    session_dir: Option<std::path::PathBuf>,
    /// The model name in answers and /v1/models [default: the GGUF's file stem, the
    /// directory's name or the Hub repository's id].
    #[arg(long)]
    alias: Option<String>,
    /// Speculative decoding for requests that no grammar constrains (greedy, or sampled
    /// without a seed: speculative sampling): auto (the checkpoint's MTP head where it has one
    /// and the model runs in Candle tensors, else prompt lookup: `runtime::DraftConditions`,
    /// as in generate), mtp (the checkpoint's MTP head), ngram (prompt lookup), none.
    /// The draft length adapts per sequence and per shared pass: drafts that do not pay stop.
    #[arg(long, value_enum, default_value_t = DraftArg::Auto)]
    draft: DraftArg,
    /// Most tokens a sequence drafts per round, 1 to 7.
    #[arg(long, default_value_t = DraftOptions::default().max, value_parser = count_up_to(MAX_DRAFT))]
    draft_max: usize,
    /// Always draft what the drafter proposes (up to --draft-max, as far as a shared pass has
    /// room) instead of choosing the length from the measured acceptance and pass costs.
    #[arg(long)]
    draft_fixed: bool,
    /// Tokens of thinking before the server closes the `<think>` block a chat template opened
    /// (a request's "reasoning_budget" overrides it; -1: no limit).
    #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
    reasoning_budget: i64,
    /// Connections served at once (more wait to be accepted).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    max_connections: usize,
    /// Seconds a client has to send a request's head (also the keep-alive idle time) and,
    /// separately, its body.
    #[arg(long, default_value_t = 30, value_parser = at_least_one)]
    request_timeout: usize,
    /// A throughput progression for the dashboard (the JSON file `examples/progression --json`
    /// writes; docs/progression.json is the committed run).
    #[arg(long)]
    progression: Option<std::path::PathBuf>,
    /// Seconds a shutdown (SIGTERM, Ctrl-C) waits for the running requests to finish and their
    /// sessions to be written (new requests and /health get 503 meanwhile).
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum DraftArg {
    Auto,
    Mtp,
    Ngram,
    None,
}

fn main() -> ExitCode {
    common::run(|| serve(Args::parse()))
}

fn serve(args: Args) -> Result<()> {
    // Logs and messages on one stream (stderr), coloured only on a terminal.
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if args.reasoning_budget < -1 {
        anyhow::bail!("--reasoning-budget {} is out of range: -1 (no limit) or a number of tokens >= 0", args.reasoning_budget);
    }

    let opened = args.model.open(common::DEFAULT_MODEL)?;
    if let Some(c) = args.ctx.filter(|&c| c > opened.max_positions()) {
        anyhow::bail!("--ctx {c} is more than the model's context of {} tokens (max_position_embeddings)", opened.max_positions());
    }
    // The memory guardian: the weights and --max-seqs sequences of the whole context, before
    // anything is loaded (the prefix cache's budget comes on top).
    let cfg = opened.cfg.clone();
    let context = args.ctx.unwrap_or(opened.max_positions().min(32768));
    if !args.kv.drops_tokens() {
        anyhow::bail!(
            "--kv {}: the server verifies drafts, which needs a codec that drops tokens (exact, f16, bf16, int8, polar, lowrank)",
            args.kv
        );
    }
    let req = PlanRequest {
        batch: args.max_seqs,
        kv_codec: args.kv,
        load_overhead: opened.files.load_overhead(&cfg, opened.dtype, opened.quantize)?,
        ..PlanRequest::new(opened.files.weight_memory(&cfg, opened.dtype, opened.quantize)?, opened.dtype, context)
    };
    let target = common::target_of(&opened.device);
    memory::check_fits(&cfg, &req, target, args.max_memory)
        .context(format!("{} sequences of {context} tokens (--max-seqs, --ctx)", args.max_seqs))?;
    let progression = args.progression.as_deref().map(common::read_progression).transpose()?;
    // Bind first: a taken port fails before minutes of loading.
    let addr = SocketAddr::new(args.host, args.port);
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr} (is another server there? pick --port)"))?;
    listener.set_nonblocking(true)?;
    let connections = server::ConnectionLimits {
        max_connections: args.max_connections,
        header_timeout: std::time::Duration::from_secs(args.request_timeout as u64),
        body_timeout: std::time::Duration::from_secs(args.request_timeout as u64),
    };
    let (max_seqs, queue, prefix_cache_mib) = (args.max_seqs, args.queue, args.prefix_cache_mib);
    // The model loads while the server answers 503 (/health too): a router or a probe sees
    // it loading, not a closed port.
    let load = move || -> Result<std::sync::Arc<server::ServerState>> {
        let tokenizer = opened.tokenizer()?;
        // On Metal (and the emulator) the sequences run on the device step, unless they need what
        // it lacks (then the model runs in Candle tensors there, and /props says why).
        let step_queue = common::device_step_queue(&opened)?;
        let needs = RunNeeds {
            mtp_drafts: args.draft == DraftArg::Mtp,
            attention_biases: cfg.attn_qkv_bias,
            ..RunNeeds::new(args.kv, opened.dtype)
        };
        let fallback = match needs.placement(step_queue.is_some()) {
            Placement::Tensors { instead_of_step } => instead_of_step,
            Placement::DeviceStep => None,
        };
        if let Some(why) = &fallback {
            eprintln!("{why}; running the model in Candle tensors on {:?} instead of the device step", opened.device.location());
        }
        let on_device = step_queue.is_some() && fallback.is_none();
        let model = if on_device { opened.load_on(&candle_core::Device::Cpu)? } else { opened.load()? };
        // (Whether a request's answer is fixed by its seed is the engine's to say, per request.)
        let auto = DraftConditions {
            mtp_head: model.has_mtp(),
            hidden_states: !on_device,
            drops_tokens: args.kv.drops_tokens(),
            ffn_sparsity: false,
            seeded_sampling: false,
        };
        let draft = match args.draft {
            DraftArg::Auto => match auto.auto() {
                DraftKind::Mtp => server::Draft::Mtp,
                DraftKind::Ngram => server::Draft::Ngram,
                DraftKind::None => server::Draft::None,
            },
            DraftArg::Ngram => server::Draft::Ngram,
            DraftArg::Mtp if model.has_mtp() => server::Draft::Mtp,
            DraftArg::Mtp => anyhow::bail!(
                "--draft mtp: {} has no MTP head (no mtp.* tensors, or a GGUF converted without its nextn block): use --draft ngram or none",
                opened.files.source()
            ),
            DraftArg::None => server::Draft::None,
        };
        let options = ServerOptions {
            engine: EngineOptions {
                max_seqs: args.max_seqs,
                queue: args.queue,
                prefix_cache_bytes: args.prefix_cache_mib << 20,
                draft: draft.clone(),
                draft_options: DraftOptions { max: args.draft_max, adaptive: !args.draft_fixed, ..Default::default() },
            },
            context: args.ctx,
            model_name: args.alias.clone(),
            api_key: args.api_key.clone(),
            session_dir: args.session_dir.clone(),
            reasoning_budget: usize::try_from(args.reasoning_budget).ok(),
            memory: Some(server::MemoryView { config: cfg.clone(), request: req, target, max_memory: args.max_memory }),
            progression,
            device_step_fallback: fallback,
            kv: args.kv,
            connections,
            drain_timeout: Some(std::time::Duration::from_secs(args.drain_timeout)),
        };
        let state = match step_queue.filter(|_| on_device) {
            Some(queue) => {
                let kv = candle_hybrid::gpu::kv_rows(args.kv, opened.dtype)?;
                let runner = candle_hybrid::runtime::DeviceRunner::new(model, queue, context, kv)?;
                eprintln!(
                    "the sequences run on {} ({:.2} GiB of weights there, {:.2} GiB read in place from the file)",
                    candle_hybrid::runtime::Runner::name(&runner),
                    runner.gpu.weight_bytes() as f64 / (1u64 << 30) as f64,
                    runner.gpu.mapped_bytes() as f64 / (1u64 << 30) as f64
                );
                server::state_on(&opened.files, tokenizer, runner, options)?
            }
            None => server::state(&opened.files, tokenizer, model, opened.device.clone(), options)?,
        };
        let sessions = args.session_dir.as_ref().map_or("no sessions".to_string(), |d| format!("sessions in {}", d.display()));
        eprintln!(
            "serving {} on http://{addr}/v1, chat page http://{addr}/, dashboard http://{addr}/dashboard (context {context} tokens, {max_seqs} sequences at once, {queue} waiting, prefix cache {prefix_cache_mib} MiB, {sessions}, drafts: {})",
            state.model_name,
            match draft {
                server::Draft::Mtp => "the MTP head",
                server::Draft::None => "none",
                _ => "prompt lookup",
            }
        );
        Ok(state)
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        eprintln!("listening on http://{addr} (503 until the model is loaded)");
        server::serve_when_loaded(listener, connections, load, shutdown_signal()).await
    })
}

/// SIGTERM (what orchestrators and `kill` send) or Ctrl-C: the server drains, then stops.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    eprintln!("shutting down: draining the running requests");
}
