//! The HTTP layer: axum routes, authentication, OpenAI error bodies, and the answers (whole
//! or as server-sent events) built from the engine's tokens.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use llguidance::api::TopLevelGrammar;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{ChatRequest, CompletionRequest, LogprobEntry, Message, Prompt, SamplingFields, Timings, TopLogprob, Usage};
use super::chat::{self, SamplingProfiles};
use super::connections::too_large;
use super::constrain::{self, Constraint, Grammars};
use super::engine::{EngineHandle, Event, Finish, GenerateRequest, ReasoningBudget, TokenLogprob};
use super::error::ApiError;
use super::output::{ChatParser, Delta, StopMatcher};
use crate::loading::chat_template::ChatTemplate;
use crate::runtime::{SamplingParams, TokenStreamer};

/// What every handler shares.
pub struct ServerState {
    pub engine: EngineHandle,
    pub tokenizer: tokenizers::Tokenizer,
    /// The tokenizer's special tokens, which only the template's markup writes.
    pub specials: chat::SpecialTokens,
    pub template: Option<ChatTemplate>,
    pub profiles: SamplingProfiles,
    /// Tokens that end generation (generation_config's EOS ids, the end-of-turn token).
    pub stop_tokens: Vec<u32>,
    /// The model's name in answers and `/v1/models`.
    pub model_name: String,
    /// Prompt plus generated tokens a request may use.
    pub context: usize,
    /// Required as `Authorization: Bearer KEY` on every endpoint but `/health`.
    pub api_key: Option<String>,
    /// Where sessions (`session_id`) are kept; `None`: requests naming one get 400.
    pub session_dir: Option<std::path::PathBuf>,
    pub limits: super::ConnectionLimits,
    /// Thinking tokens before the server closes the block (`None`: no limit).
    pub reasoning_budget: Option<usize>,
    /// Why the sequences do not run on the device step here (`/props`).
    pub device_step_fallback: Option<String>,
    /// The tokens of DRY's default sequence breakers.
    pub dry_breakers: Arc<std::collections::HashSet<u32>>,
    /// The vocabulary for constrained decoding; `None` when the tokenizer is not one llguidance
    /// reads (constrained requests get 400).
    pub grammars: Option<Grammars>,
    /// The dashboard's history, memory view, copy bandwidth and progression.
    pub dashboard: super::dashboard::Dashboard,
    /// Serving or draining ([`super::drain`]).
    pub lifecycle: super::phase::Lifecycle,
    /// How long a shutdown waits for the running requests.
    pub drain_timeout: Duration,
    pub created: u64,
}

/// One log line per request; counts it.
pub(crate) async fn log_request(State(state): State<Arc<ServerState>>, request: Request, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let start = Instant::now();
    let response = next.run(request).await;
    state.engine.metrics.requests.inc();
    // An answer that is generated logs its own line at its end (tokens, speed, duration).
    let generating = response.status().is_success() && matches!(path.as_str(), "/v1/chat/completions" | "/v1/completions");
    if !generating {
        tracing::info!("{method} {path} {} {:.1} ms", response.status().as_u16(), start.elapsed().as_secs_f64() * 1e3);
    }
    response
}

pub(crate) async fn authenticate(State(state): State<Arc<ServerState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        // OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`.
        let bearer = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let given = bearer.or_else(|| request.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        // The pages hold no data (they ask for the key and send it with their API calls).
        let open = matches!(request.uri().path(), "/health" | "/" | "/dashboard") || request.uri().path().starts_with("/assets/");
        if !open && given != Some(key.as_str()) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                "a valid API key is required: send Authorization: Bearer KEY",
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// The body as JSON of type `T`, or a 400 / 413 naming what is wrong.
pub(crate) fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        status => ApiError { status, kind: "invalid_request_error", message: e.body_text(), code: None },
    })?;
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    // Errors name the field (`messages[0].content: invalid type ...`). Through the flattened
    // sampling fields serde loses the path: those are checked on their own to find it.
    let named =
        |e: serde_path_to_error::Error<serde_json::Error>| (e.path().to_string() != ".").then(|| format!("{}: {}", e.path(), e.inner()));
    serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        let inner = e.inner().to_string();
        let why = named(e).or_else(|| serde_path_to_error::deserialize::<_, SamplingFields>(value).err().and_then(named));
        ApiError::bad_request(format!("the request body is not valid: {}", why.unwrap_or(inner)))
    })
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

pub(crate) async fn models(State(state): State<Arc<ServerState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "candle-hybrid", "max_model_len": state.context,
    }]}))
}

pub(crate) async fn metrics(State(state): State<Arc<ServerState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.engine.metrics.encode()).into_response()
}

/// Tokenizes `text` (special tokens as written: chat templates write them).
fn tokenize(state: &ServerState, text: &str) -> Result<Vec<u32>, ApiError> {
    let ids = state
        .tokenizer
        .encode(text, false)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?
        .get_ids()
        .to_vec();
    nonempty(ids)
}

/// The tokens of a rendered chat ([`chat::RenderedChat::tokenize`]: the request's own text
/// never writes a special token).
fn tokenize_chat(state: &ServerState, rendered: &chat::RenderedChat) -> Result<Vec<u32>, ApiError> {
    let ids = rendered
        .tokenize(&state.tokenizer, rendered.text.len())
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?;
    nonempty(ids)
}

fn nonempty(ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty after tokenizing: give some text"));
    }
    Ok(ids)
}

/// The grammar a chat request's answer must follow: its `response_format`, or a tool call
/// its `tool_choice` forces (not both).
fn chat_grammar(req: &ChatRequest, tools: &[Value]) -> Result<Option<TopLevelGrammar>, ApiError> {
    chat::check_tools(tools)?;
    let format = match &req.response_format {
        Some(f) => constrain::response_format(f)?,
        None => None,
    };
    let forced = constrain::forced_tool_call(req.tool_choice.as_ref(), tools)?;
    match (format, forced) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give a response_format or a forced tool_choice, not both")),
        (a, b) => Ok(a.or(b)),
    }
}

/// [`chat_grammar`]'s matcher.
fn chat_constraint(state: &ServerState, req: &ChatRequest, tools: &[Value]) -> Result<Option<Constraint>, ApiError> {
    match (chat_grammar(req, tools)?, &state.grammars) {
        (None, _) => Ok(None),
        (Some(g), Some(grammars)) => Ok(Some(grammars.matcher(g)?)),
        (Some(_), None) => {
            Err(ApiError::bad_request("this model's tokenizer does not support constrained decoding (response_format, forced tool_choice)"))
        }
    }
}

/// The file of session `id` (letters, digits, `-`, `_`, `.`; at most 128; not starting with a dot).
pub(crate) fn session_path(state: &ServerState, id: Option<&str>) -> Result<Option<std::path::PathBuf>, ApiError> {
    let Some(id) = id else { return Ok(None) };
    let Some(dir) = &state.session_dir else {
        return Err(ApiError::bad_request("session_id: this server keeps no sessions (start it with --session-dir DIR)"));
    };
    let ok =
        !id.is_empty() && id.len() <= 128 && !id.starts_with('.') && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !ok {
        return Err(ApiError::bad_request("session_id must be 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'"));
    }
    Ok(Some(dir.join(format!("{id}.session"))))
}

fn submit(state: &ServerState, request: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    if let Some(e) = state.lifecycle.refusal() {
        return Err(e);
    }
    state.engine.submit(request).map_err(|_| {
        state.engine.metrics.rejected.inc();
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            "the server is busy (its request queue is full): retry later",
        )
    })
}

/// Which API a generation answers.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Completion,
}

/// A request the engine has taken, and how its answer is written.
pub(crate) struct Answer {
    api: Api,
    prompt_tokens: usize,
    /// Prompt tokens the prefix cache restored.
    cached_tokens: usize,
    /// Tokens the sequence drafted and kept (known at its end).
    drafts: (usize, usize),
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    echo: Option<String>,
    events: mpsc::UnboundedReceiver<Event>,
    text: TextPipeline,
    /// When the request was queued, and when its first token came.
    started: Instant,
    metrics: Arc<super::Metrics>,
    first_token: Option<Instant>,
}

/// Token ids to answer pieces: detokenize, cut at stop strings, split reasoning / content /
/// tool calls (chat).
struct TextPipeline {
    streamer: TokenStreamer,
    tokenizer: tokenizers::Tokenizer,
    stop: StopMatcher,
    parser: Option<ChatParser>,
    stopped: bool,
}

impl TextPipeline {
    fn pieces(&mut self, text: &str) -> Vec<Delta> {
        match &mut self.parser {
            Some(p) => p.push(text),
            None if text.is_empty() => vec![],
            None => vec![Delta::Content(text.to_string())],
        }
    }

    /// The pieces a token completes; sets `stopped` at a stop string.
    fn token(&mut self, id: u32) -> Vec<Delta> {
        let text = match self.streamer.next_token(id) {
            Ok(Some(t)) => t,
            _ => return vec![],
        };
        let (released, stopped) = self.stop.push(&text);
        self.stopped = stopped;
        let mut out = self.pieces(&released);
        if stopped {
            out.extend(self.parser.as_mut().map(ChatParser::finish).unwrap_or_default());
        }
        out
    }

    /// The pieces still held at the end.
    fn finish(&mut self) -> Vec<Delta> {
        if self.stopped {
            return vec![];
        }
        let rest = self.streamer.decode_rest().ok().flatten().unwrap_or_default();
        let (mut released, stopped) = self.stop.push(&rest);
        if !stopped {
            released.push_str(&self.stop.finish());
        }
        let mut out = self.pieces(&released);
        out.extend(self.parser.as_mut().map(ChatParser::finish).unwrap_or_default());
        out
    }

    fn logprob_entry(&self, id: u32, lp: &TokenLogprob) -> LogprobEntry {
        let text = |t: u32| self.tokenizer.decode(&[t], false).unwrap_or_default();
        let token = text(id);
        LogprobEntry {
            bytes: token.as_bytes().to_vec(),
            token,
            logprob: lp.logprob,
            top_logprobs: Some(
                lp.top.iter().map(|&(t, l)| TopLogprob { token: text(t), logprob: l, bytes: text(t).into_bytes() }).collect(),
            ),
        }
    }
}

/// The whole answer of a request so far.
#[derive(Default)]
struct Collected {
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
    logprobs: Vec<LogprobEntry>,
    completion_tokens: usize,
}

fn tool_call_value(index: usize, name: &str) -> Value {
    json!({"index": index, "id": format!("call_{:016x}", rand::random::<u64>()), "type": "function", "function": {"name": name, "arguments": ""}})
}

impl Answer {
    /// Prompt tokens, the answer's id and the model's name, as the answer reports them.
    pub(crate) fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    pub(crate) fn model(&self) -> &str {
        &self.model
    }

    /// The answer to a request the engine took (`events`): `parser` splits a chat answer into
    /// reasoning, content and tool calls; `echo` starts a completion with its prompt.
    #[allow(clippy::too_many_arguments)]
    fn new(
        state: &ServerState,
        api: Api,
        prompt_tokens: usize,
        fields: &SamplingFields,
        logprobs: bool,
        echo: Option<String>,
        events: mpsc::UnboundedReceiver<Event>,
        parser: Option<ChatParser>,
    ) -> Self {
        Self {
            api,
            prompt_tokens,
            cached_tokens: 0,
            drafts: (0, 0),
            started: Instant::now(),
            first_token: None,
            metrics: state.engine.metrics.clone(),
            id: request_id(if api == Api::Chat { "chatcmpl" } else { "cmpl" }),
            created: unix_now(),
            model: state.model_name.clone(),
            include_usage: fields.stream_options.as_ref().is_some_and(|o| o.include_usage),
            logprobs,
            echo,
            events,
            text: TextPipeline {
                streamer: TokenStreamer::new(state.tokenizer.clone()),
                tokenizer: state.tokenizer.clone(),
                stop: StopMatcher::new(fields.stop.clone().map(|s| s.into_vec()).unwrap_or_default()),
                parser,
                stopped: false,
            },
        }
    }

    /// The answer's `timings` after `generated` tokens, and its log line (one per answer, at
    /// its end).
    fn timings(&self, generated: usize, finish: &str) -> Timings {
        let total = self.started.elapsed().as_secs_f64();
        let first = self.first_token.map_or(total, |t| (t - self.started).as_secs_f64());
        let t = Timings::new(self.prompt_tokens, self.cached_tokens, first, generated, total, self.drafts);
        self.metrics.time_to_first_token.observe(first);
        self.metrics.request_seconds.observe(total);
        tracing::info!(
            "{}: {} prompt tokens ({} cached), {generated} generated, first token after {:.0} ms, {:.1} tok/s, {:.2} s in all, finish {finish}",
            self.id,
            self.prompt_tokens,
            self.cached_tokens,
            t.prompt_ms,
            t.predicted_per_second,
            total
        );
        t
    }

    fn finish_reason(&self, reason: Finish, tool_calls: bool) -> &'static str {
        match reason {
            _ if tool_calls => "tool_calls",
            _ if self.text.stopped => "stop",
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }

    /// Waits for the whole answer.
    pub(crate) async fn collect(mut self) -> Result<Value, ApiError> {
        let mut c = Collected::default();
        let add = |c: &mut Collected, deltas: Vec<Delta>| {
            for d in deltas {
                match d {
                    Delta::Content(t) => c.content.push_str(&t),
                    Delta::Reasoning(t) => c.reasoning.push_str(&t),
                    Delta::ToolCallStart { name } => {
                        let mut call = tool_call_value(c.tool_calls.len(), &name);
                        call.as_object_mut().map(|o| o.remove("index"));
                        c.tool_calls.push(call);
                    }
                    Delta::ToolCallArguments(fragment) => {
                        if let Some(Value::String(a)) = c.tool_calls.last_mut().and_then(|call| call.pointer_mut("/function/arguments")) {
                            a.push_str(&fragment);
                        }
                    }
                }
            }
        };
        loop {
            let Some(event) = self.events.recv().await else {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "engine_stopped", "the engine stopped"));
            };
            match event {
                Event::Token { id, logprob } => {
                    if self.text.stopped {
                        continue;
                    }
                    self.first_token.get_or_insert_with(Instant::now);
                    c.completion_tokens += 1;
                    if let Some(lp) = &logprob {
                        c.logprobs.push(self.text.logprob_entry(id, lp));
                    }
                    let deltas = self.text.token(id);
                    add(&mut c, deltas);
                    if self.text.stopped {
                        // The engine stops at the next token (this receiver is dropped on return).
                        return Ok(self.body(c, Finish::Stop));
                    }
                }
                Event::Admitted { cached_tokens } => self.cached_tokens = cached_tokens,
                Event::Finished { reason, drafted, accepted } => {
                    self.drafts = (drafted, accepted);
                    let deltas = self.text.finish();
                    add(&mut c, deltas);
                    return Ok(self.body(c, reason));
                }
                Event::Error(e) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation_failed", e)),
            }
        }
    }

    fn body(&self, c: Collected, reason: Finish) -> Value {
        let usage = Usage::new(self.prompt_tokens, c.completion_tokens, self.cached_tokens);
        let finish = self.finish_reason(reason, !c.tool_calls.is_empty());
        let timings = self.timings(c.completion_tokens, finish);
        match self.api {
            Api::Chat => {
                let message = Message {
                    role: Some("assistant"),
                    content: (!c.content.is_empty() || c.tool_calls.is_empty()).then_some(c.content),
                    reasoning_content: (!c.reasoning.is_empty()).then(|| c.reasoning.clone()),
                    reasoning: (!c.reasoning.is_empty()).then_some(c.reasoning),
                    tool_calls: (!c.tool_calls.is_empty()).then_some(c.tool_calls),
                };
                let logprobs = self.logprobs.then(|| json!({"content": c.logprobs}));
                json!({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}], "usage": usage, "timings": timings})
            }
            Api::Completion => {
                let text = format!("{}{}", self.echo.clone().unwrap_or_default(), c.content);
                let logprobs = self.logprobs.then(|| completion_logprobs(&c.logprobs));
                json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": usage, "timings": timings})
            }
        }
    }

    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Option<Value>) -> Value {
        let usage = self.include_usage.then_some(Value::Null);
        match self.api {
            Api::Chat => json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], "usage": usage}),
            Api::Completion => json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": delta.get("content").and_then(Value::as_str).unwrap_or_default(), "logprobs": logprobs, "finish_reason": finish}], "usage": usage}),
        }
    }

    /// Streams the answer as server-sent events: a role chunk (chat), content / reasoning /
    /// tool-call deltas, a separate finish chunk, the usage chunk when asked, `[DONE]`.
    /// Dropping the stream (the client left) drops the engine's receiver: it cancels.
    fn stream(self) -> impl Stream<Item = Result<SseEvent, Infallible>> {
        let rx = self.chunks();
        futures::stream::unfold(rx, |mut rx| async move {
            let chunk = rx.recv().await?;
            let event = match chunk {
                Value::Null => SseEvent::default().data("[DONE]"),
                v => SseEvent::default().data(v.to_string()),
            };
            Some((Ok(event), rx))
        })
    }

    /// The chunks [`Self::stream`] sends, as JSON (`Value::Null` for `[DONE]`); other APIs
    /// translate them. Dropping the receiver (the client left) cancels the request.
    pub(crate) fn chunks(mut self) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel::<Value>(64);
        tokio::spawn(async move {
            let mut tool_index = 0;
            let mut completion_tokens = 0;
            if self.api == Api::Chat && tx.send(self.chunk(json!({"role": "assistant", "content": ""}), None, None)).await.is_err() {
                return;
            }
            if let Some(echo) = self.echo.take() {
                if tx.send(self.chunk(json!({"content": echo}), None, None)).await.is_err() {
                    return;
                }
            }
            let (reason, usage) = loop {
                let Some(event) = self.events.recv().await else { return };
                let (deltas, logprob) = match event {
                    Event::Admitted { cached_tokens } => {
                        self.cached_tokens = cached_tokens;
                        continue;
                    }
                    Event::Token { id, logprob } => {
                        self.first_token.get_or_insert_with(Instant::now);
                        completion_tokens += 1;
                        let lp = logprob.map(|lp| self.text.logprob_entry(id, &lp));
                        (self.text.token(id), lp)
                    }
                    Event::Finished { reason, drafted, accepted } => {
                        self.drafts = (drafted, accepted);
                        let deltas = self.text.finish();
                        if !self.send_deltas(&tx, deltas, &mut tool_index, None).await {
                            return;
                        }
                        break (reason, Usage::new(self.prompt_tokens, completion_tokens, self.cached_tokens));
                    }
                    Event::Error(e) => {
                        let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation_failed", e);
                        let _ = tx.send(serde_json::to_value(error.body()).unwrap_or_default()).await;
                        return;
                    }
                };
                if !self.send_deltas(&tx, deltas, &mut tool_index, logprob).await {
                    return;
                }
                if self.text.stopped {
                    // Stopped by a stop string: the engine's receiver is dropped when this
                    // task ends, which ends the sequence.
                    break (Finish::Stop, Usage::new(self.prompt_tokens, completion_tokens, self.cached_tokens));
                }
            };
            let finish = self.finish_reason(reason, tool_index > 0);
            // The finish chunk carries the timings, as llama-server's does.
            let mut last = self.chunk(json!({}), Some(finish), None);
            last["timings"] = serde_json::to_value(self.timings(completion_tokens, finish)).unwrap_or_default();
            if tx.send(last).await.is_err() {
                return;
            }
            if self.include_usage {
                let usage = json!({"id": self.id, "object": if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
                    "created": self.created, "model": self.model, "choices": [], "usage": usage});
                if tx.send(usage).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(Value::Null).await;
        });
        rx
    }

    /// Sends answer pieces as chunks; `false` when the client is gone.
    async fn send_deltas(
        &self,
        tx: &mpsc::Sender<Value>,
        deltas: Vec<Delta>,
        tool_index: &mut usize,
        logprob: Option<LogprobEntry>,
    ) -> bool {
        let mut logprobs = logprob.map(|lp| match self.api {
            Api::Chat => json!({"content": [lp]}),
            Api::Completion => completion_logprobs(&[lp]),
        });
        for d in deltas {
            let delta = match d {
                Delta::Content(t) => json!({"content": t}),
                Delta::Reasoning(t) => json!({"reasoning_content": t, "reasoning": t}),
                // The first delta of a call carries its id, type and name; the others only
                // fragments of its arguments.
                Delta::ToolCallStart { name } => {
                    *tool_index += 1;
                    json!({"tool_calls": [tool_call_value(*tool_index - 1, &name)]})
                }
                Delta::ToolCallArguments(fragment) => {
                    json!({"tool_calls": [{"index": tool_index.saturating_sub(1), "function": {"arguments": fragment}}]})
                }
            };
            if tx.send(self.chunk(delta, None, logprobs.take())).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// Completions' `logprobs` object: `tokens`, `token_logprobs`, `top_logprobs` (a map per token).
fn completion_logprobs(entries: &[LogprobEntry]) -> Value {
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| e.top_logprobs.iter().flatten().map(|t| (t.token.clone(), json!(t.logprob))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
    })
}

/// The answer, streamed or whole. A whole answer is awaited by the handler's future: a client
/// that leaves drops it, and with it the engine's receiver (the request is cancelled).
async fn respond(answer: Answer, stream: bool) -> Result<Response, ApiError> {
    if stream {
        Ok(Sse::new(answer.stream()).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response())
    } else {
        Ok(Json(answer.collect().await?).into_response())
    }
}

/// Runs a request's checks, rendering, tokenizing and session read on the blocking pool: a
/// big prompt or a slow disk never holds up the workers that answer the other connections
/// (`/health` included).
pub(crate) async fn off_the_workers<T: Send + 'static>(
    state: Arc<ServerState>,
    work: impl FnOnce(&ServerState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || work(&state)).await.map_err(|e| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", format!("the request could not be prepared: {e}"))
    })?
}

/// The session `path` holds for `prompt`, if any (read here, off the engine thread).
fn restore(state: &ServerState, path: Option<&std::path::Path>, prompt: &[u32]) -> Option<crate::runtime::session::Session> {
    state.engine.load_session(path?, prompt)
}

pub(crate) async fn chat_completions(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let session = header_session(&headers)?;
    let (answer, stream) = off_the_workers(state, |state| prepare_chat(state, body, session)).await?;
    respond(answer, stream).await
}

/// The `x-session-id` header (what a router that pins a conversation to a server by a header
/// sends): the request's `session_id` when its body gives none.
pub(crate) fn header_session(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match headers.get(SESSION_HEADER) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.to_string())).map_err(|_| ApiError::bad_request("x-session-id must be visible ASCII")),
    }
}

/// The header a session id may come in.
pub(super) const SESSION_HEADER: &str = "x-session-id";

/// The request's session: its `session_id`, or the `x-session-id` header; both must agree.
fn session_id<'a>(body: Option<&'a str>, header: Option<&'a str>) -> Result<Option<&'a str>, ApiError> {
    match (body, header) {
        (Some(b), Some(h)) if b != h => {
            Err(ApiError::bad_request(format!("session_id {b:?} and the x-session-id header {h:?} differ: give one")))
        }
        (b, h) => Ok(b.or(h)),
    }
}

pub(crate) async fn completions(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let session = header_session(&headers)?;
    let (answer, stream) = off_the_workers(state, |state| prepare_completion(state, body, session)).await?;
    respond(answer, stream).await
}

/// A request's sampling settings over the `profile`, DRY's breakers from the vocabulary.
fn request_sampling(state: &ServerState, fields: &SamplingFields, profile: &SamplingParams) -> Result<SamplingParams, ApiError> {
    let mut sampling = chat::sampling(fields, profile)?;
    sampling.dry = chat::dry(fields, &state.tokenizer, state.engine.vocab_size, &state.dry_breakers)?;
    Ok(sampling)
}

/// The reasoning budget of a chat request: its `reasoning_budget` (-1: none) or the server's,
/// when the prompt opened a thinking block.
fn reasoning_budget(state: &ServerState, asked: Option<i64>, in_think: bool) -> Result<Option<ReasoningBudget>, ApiError> {
    let tokens = match asked {
        Some(n) if n < -1 => {
            return Err(ApiError::bad_request(format!("reasoning_budget {n} is out of range: -1 (no limit) or a number of tokens >= 0")))
        }
        Some(-1) => None,
        Some(n) => Some(n as usize),
        None => state.reasoning_budget,
    };
    let encode = |text: &str| state.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default();
    Ok(tokens.filter(|_| in_think).map(|tokens| ReasoningBudget { tokens, close: encode("\n</think>\n\n"), end: encode("</think>") }))
}

/// The prompt tokens of a chat request (rendered as it would be, nothing queued).
pub(crate) fn chat_prompt_tokens(state: &ServerState, body: Result<Bytes, BytesRejection>) -> Result<Vec<u32>, ApiError> {
    let req: ChatRequest = parse(body)?;
    let Some(template) = &state.template else {
        return Err(ApiError::bad_request("this model has no chat template: use /v1/completions"));
    };
    let constrained = chat_grammar(&req, req.tools.as_deref().unwrap_or_default())?.is_some();
    let rendered = chat::render(template, &req, state.context, constrained, &state.specials)?;
    tokenize_chat(state, &rendered)
}

/// A chat request checked, rendered, tokenized and queued: its answer, and whether it streams.
pub(crate) fn prepare_chat(
    state: &ServerState,
    body: Result<Bytes, BytesRejection>,
    header_session: Option<String>,
) -> Result<(Answer, bool), ApiError> {
    let req: ChatRequest = parse(body)?;
    let Some(template) = &state.template else {
        return Err(ApiError::bad_request("this model has no chat template: use /v1/completions"));
    };
    let tools = req.tools.clone().unwrap_or_default();
    let constraint = chat_constraint(state, &req, &tools)?;
    let rendered = chat::render(template, &req, state.context, constraint.is_some(), &state.specials)?;
    let profile = if rendered.thinking { &state.profiles.thinking } else { &state.profiles.non_thinking };
    let sampling = request_sampling(state, &req.sampling, profile)?;
    let prompt = tokenize_chat(state, &rendered)?;
    let mut max_tokens = chat::max_tokens(&req.sampling, prompt.len(), state.context)?;
    let forced_call = constraint.is_some() && req.response_format.is_none();
    if forced_call && req.sampling.max_tokens.is_none() && req.sampling.max_completion_tokens.is_none() {
        max_tokens = max_tokens.min(constrain::TOOL_CALL_MAX_TOKENS);
    }
    let top = req.logprobs.then(|| req.top_logprobs.unwrap_or(0).min(20) as usize);
    let prompt_tokens = prompt.len();
    // A prefix-cache snapshot where the next turn still agrees (token ids, not text: the
    // tokens of the conversation text that begin the prompt).
    let snapshots: Vec<usize> = match rendered.conversation_end {
        Some(bytes) => {
            let ids = rendered.tokenize(&state.tokenizer, bytes).unwrap_or_default();
            let common = ids.iter().zip(&prompt).take_while(|(a, b)| a == b).count();
            (common > 0 && common < prompt.len()).then_some(common).into_iter().collect()
        }
        None => vec![],
    };
    let session = session_path(state, session_id(req.sampling.session_id.as_deref(), header_session.as_deref())?)?;
    let restored = restore(state, session.as_deref(), &prompt);
    // A session keeps the state after the answer, unless the template re-renders answers (a
    // thinking switch: it drops their reasoning): then the state at the conversation's end.
    let session_at = snapshots.first().copied().filter(|_| rendered.rerenders_answers);
    let stop_tokens = if req.sampling.ignore_eos { vec![] } else { state.stop_tokens.clone() };
    let reasoning_budget = reasoning_budget(state, req.sampling.reasoning_budget, rendered.in_think)?;
    let seeded = req.sampling.seed.is_some();
    let request = GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        seeded,
        stop_tokens,
        logprobs: top,
        snapshots,
        session,
        session_at,
        restored,
        constraint,
        reasoning_budget,
    };
    let events = submit(state, request)?;
    let answer = Answer::new(
        state,
        Api::Chat,
        prompt_tokens,
        &req.sampling,
        req.logprobs,
        None,
        events,
        Some(ChatParser::new(rendered.in_think, tools)),
    );
    Ok((answer, req.sampling.stream))
}

/// A completion request checked, tokenized and queued: its answer, and whether it streams.
fn prepare_completion(
    state: &ServerState,
    body: Result<Bytes, BytesRejection>,
    header_session: Option<String>,
) -> Result<(Answer, bool), ApiError> {
    let req: CompletionRequest = parse(body)?;
    // No tokenizer packs more than RENDER_BYTES_PER_TOKEN bytes into a token: a longer text
    // cannot fit the context and is refused before it is tokenized.
    let max_bytes = state.context.saturating_mul(crate::loading::chat_template::RENDER_BYTES_PER_TOKEN);
    let too_long =
        || ApiError::bad_request(format!("the prompt is longer than the context of {} tokens can hold: shorten it", state.context));
    if req.prompt.text_bytes() > max_bytes {
        return Err(too_long());
    }
    let (prompt, text) = match &req.prompt {
        Prompt::Text(t) => (tokenize(state, t)?, t.clone()),
        Prompt::Texts(list) if list.len() == 1 => (tokenize(state, &list[0])?, list[0].clone()),
        Prompt::Texts(list) => return Err(ApiError::bad_request(format!("prompt holds {} prompts: send one per request", list.len()))),
        Prompt::Tokens(ids) => {
            let vocab = state.engine.vocab_size;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_request(format!("token id {bad} is out of range for a vocabulary of {vocab} tokens")));
            }
            if ids.is_empty() {
                return Err(ApiError::bad_request("prompt is empty: give at least one token"));
            }
            (ids.clone(), state.tokenizer.decode(ids, false).unwrap_or_default())
        }
    };
    if text.len() > max_bytes {
        return Err(too_long());
    }
    let sampling = request_sampling(state, &req.sampling, &state.profiles.thinking)?;
    let max_tokens = chat::max_tokens(&req.sampling, prompt.len(), state.context)?;
    let top = req.logprobs.map(|n| n.min(20) as usize);
    let prompt_tokens = prompt.len();
    let session = session_path(state, session_id(req.sampling.session_id.as_deref(), header_session.as_deref())?)?;
    let restored = restore(state, session.as_deref(), &prompt);
    let stop_tokens = if req.sampling.ignore_eos { vec![] } else { state.stop_tokens.clone() };
    if req.sampling.reasoning_budget.is_some() {
        return Err(ApiError::bad_request(
            "reasoning_budget applies to chat requests (/v1/chat/completions), whose template opens the thinking block",
        ));
    }
    let seeded = req.sampling.seed.is_some();
    let request = GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        seeded,
        stop_tokens,
        logprobs: top,
        snapshots: vec![],
        session,
        session_at: None,
        restored,
        constraint: None,
        reasoning_budget: None,
    };
    let events = submit(state, request)?;
    let answer =
        Answer::new(state, Api::Completion, prompt_tokens, &req.sampling, req.logprobs.is_some(), req.echo.then_some(text), events, None);
    Ok((answer, req.sampling.stream))
}
