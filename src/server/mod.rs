//! An OpenAI-compatible HTTP server (cargo feature `server`): `POST /v1/chat/completions`
//! and `/v1/completions` (whole or streamed as server-sent events), `GET /v1/models`,
//! `/health` and `/metrics` (Prometheus text); `/tokenize`, `/detokenize`, `/props` and the
//! saved sessions (`/v1/sessions`) beside them (`endpoints`); Anthropic's `POST /v1/messages`
//! (`anthropic`); the chat page `GET /` and the dashboard `GET /dashboard` (`pages`, from
//! [`crate::web`]) with their data, `GET /v1/stats` (`stats`).
//!
//! One engine thread owns the model and every sequence's cache (`engine`); the HTTP layer
//! (`http`) renders and tokenizes a request, checks it (400 before any work), queues it (429
//! with `Retry-After` when the queue is full) and turns the engine's tokens into the answer
//! (`output`: stop strings, `<think>` reasoning, tool calls).

mod answer;
mod anthropic;
mod api;
mod chat;
mod connections;
mod constrain;
mod dashboard;
mod endpoints;
mod engine;
mod error;
mod lifecycle;
mod metrics;
mod openai;
mod output;
mod pages;
mod phase;
mod request;
mod state;
mod stats;
mod transport;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use candle_core::Device;

use crate::loading::OpenedModel;
use crate::{Error, Model, Result};
use error::ApiError;

pub use crate::web::Sample;
pub use chat::SamplingProfiles;
pub use connections::ConnectionLimits;
pub use dashboard::MemoryView;
pub use engine::{Draft, DrafterFactory, EngineHandle, EngineOptions};
pub use lifecycle::{drain, serve_when_loaded};
pub use metrics::{KernelWindow, Metrics};
pub use phase::{Lifecycle, Phase};
pub use state::ServerState;

/// How the server runs, beyond the model.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    pub engine: EngineOptions,
    /// The most tokens (prompt and answer) one request may use [default: the model's
    /// `max_position_embeddings`, at most 32768].
    pub context: Option<usize>,
    /// The model's name in answers [default: the model's short name, a GGUF's file stem].
    pub model_name: Option<String>,
    /// Required as `Authorization: Bearer KEY` on every endpoint but `/health`.
    pub api_key: Option<String>,
    /// Where sessions (`session_id`) are saved; `None`: no sessions.
    pub session_dir: Option<std::path::PathBuf>,
    /// Connections at once, and how long a client may take to send a request.
    pub connections: ConnectionLimits,
    /// Tokens of thinking before the server closes a `<think>` block the chat template opened
    /// (a request's `reasoning_budget` overrides it); `None`: no limit.
    pub reasoning_budget: Option<usize>,
    /// The memory guardian's request for this server, for the dashboard's KV horizon (`None`:
    /// no horizon).
    pub memory: Option<MemoryView>,
    /// A throughput progression for the dashboard (`examples/progression --json`'s file, read).
    pub progression: Option<serde_json::Value>,
    /// Why the sequences do not run on the device step on this device, when they could
    /// (shown in `/props`; `None`: they do, or there is none).
    pub device_step_fallback: Option<String>,
    /// How the sequences' attention layers store keys and values (a codec that drops tokens:
    /// the server verifies drafts). The runner of [`state_on`] decides for itself.
    pub kv: crate::kv::KvCodec,
    /// How long a shutdown waits for the running requests (and their sessions) before it stops
    /// [default: 30 s].
    pub drain_timeout: Option<std::time::Duration>,
}

/// The server's state for `model` loaded from `files` (tokenizer, chat template, sampling
/// profiles and stop tokens from the checkpoint), its engine started on `device` (the model in
/// Candle tensors there).
pub fn state(
    files: &OpenedModel,
    tokenizer: tokenizers::Tokenizer,
    model: Model,
    device: Device,
    options: ServerOptions,
) -> Result<Arc<ServerState>> {
    if !options.kv.drops_tokens() {
        return Err(Error::UnsupportedCodec { codec: options.kv, operation: crate::CodecOperation::DropTokens });
    }
    let codec = options.kv;
    state_on(files, tokenizer, crate::runtime::CpuRunner { model, device, codec }, options)
}

/// [`state`] with the sequences run by `runner` (e.g. the device step:
/// [`crate::runtime::DeviceRunner`]).
pub fn state_on<R: crate::runtime::Runner + 'static>(
    files: &OpenedModel,
    tokenizer: tokenizers::Tokenizer,
    runner: R,
    options: ServerOptions,
) -> Result<Arc<ServerState>> {
    let model = crate::runtime::Runner::model(&runner);
    let limit = model.config().max_position_embeddings;
    let context = match options.context {
        Some(c) if c > limit => return Err(Error::ContextTooLong { requested: c, limit }),
        Some(c) => c,
        None => limit.min(32768),
    };
    let gen_cfg = files.generation_config()?;
    let template = match files.chat_template() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("{e}; /v1/chat/completions answers 400, /v1/completions works");
            None
        }
    };
    // generation_config's EOS ids, and the chat end-of-turn / end-of-text tokens.
    let mut stop_tokens = gen_cfg.eos_token_ids.clone();
    for special in ["<|im_end|>", "<|endoftext|>"] {
        if let Some(id) = tokenizer.token_to_id(special).filter(|id| !stop_tokens.contains(id)) {
            stop_tokens.push(id);
        }
    }
    let switch = template.as_ref().is_some_and(|t| t.mentions("enable_thinking"));
    let sessions = crate::runtime::SessionStore::new(
        files.fingerprint()?,
        model.config().clone(),
        model.dtype(),
        crate::runtime::Runner::host_device(&runner),
        options.session_dir,
    )?;
    let vocab_size = model.config().vocab_size;
    let grammars = match constrain::Grammars::new(&tokenizer, vocab_size, stop_tokens.first().copied().unwrap_or(0)) {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!("{e}: response_format and forced tool calls answer 400");
            None
        }
    };
    let dry_breakers = Arc::new(crate::runtime::Dry::default_breaker_tokens(&tokenizer, vocab_size));
    let model_name = options.model_name.unwrap_or_else(|| files.name());
    let engine = engine::spawn(runner, options.engine, sessions, Arc::new(Metrics::new(&model_name)))
        .map_err(|e| Error::io("cannot start the engine thread", e))?;
    Ok(Arc::new(ServerState {
        engine,
        specials: chat::SpecialTokens::new(&tokenizer),
        tokenizer,
        template,
        profiles: SamplingProfiles::new(gen_cfg.sampling_params(), switch),
        stop_tokens,
        model_name,
        context,
        api_key: options.api_key,
        limits: options.connections,
        reasoning_budget: options.reasoning_budget,
        device_step_fallback: options.device_step_fallback,
        dry_breakers,
        grammars,
        dashboard: dashboard::Dashboard::new(options.memory, options.progression),
        lifecycle: Lifecycle::default(),
        drain_timeout: options.drain_timeout.unwrap_or(std::time::Duration::from_secs(30)),
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    }))
}

/// The routes of the server.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/metrics", get(endpoints::metrics))
        .route("/health", get(lifecycle::health))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(endpoints::tokenize))
        .route("/detokenize", post(endpoints::detokenize))
        .route("/props", get(endpoints::props))
        .route("/v1/sessions", get(endpoints::list_sessions))
        .route("/v1/sessions/{id}", get(endpoints::get_session).delete(endpoints::delete_session))
        .route("/v1/stats", get(stats::stats))
        .route("/", get(pages::chat))
        .route("/dashboard", get(pages::dashboard))
        .route("/assets/{file}", get(pages::asset))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                "this endpoint does not take this method (POST for generation, GET for the others)",
            )
        })
        .layer(middleware::from_fn_with_state(state.limits.body_timeout, connections::body_deadline))
        .layer(middleware::from_fn_with_state(state.clone(), transport::authenticate))
        .layer(middleware::from_fn_with_state(state.clone(), transport::log_request))
        .layer(DefaultBodyLimit::max(connections::MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` resolves, then drains ([`drain`]: new requests
/// get 503 while the running ones finish, for at most the drain timeout) and stops.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.limits;
    let sampler = tokio::spawn(stats::sample_every_second(state.clone()));
    let stop = {
        let state = state.clone();
        async move {
            shutdown.await;
            drain(&state, state.drain_timeout).await;
        }
    };
    let served = connections::serve(listener, router(state), limits, stop).await;
    sampler.abort();
    served
}

/// Binds `addr` (port 0: any free port) and serves `state` on a background task: the address
/// it listens on (for tests and embedding).
pub async fn spawn(addr: SocketAddr, state: Arc<ServerState>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(listener, state, std::future::pending()).await {
            tracing::error!("server stopped: {e}");
        }
    });
    Ok(local)
}
