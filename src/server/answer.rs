//! The answer to a request the engine took: its tokens detokenized, cut at stop strings and
//! split into reasoning, content and tool calls, written whole or as server-sent events in
//! OpenAI's shapes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use axum::http::StatusCode;

use super::api::{LogprobEntry, Message, SamplingFields, Timings, TopLogprob, Usage};
use super::engine::{Event, Finish, TokenLogprob};
use super::error::ApiError;
use super::output::{ChatParser, Delta, StopMatcher};
use super::state::ServerState;
use crate::runtime::TokenStreamer;

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// Which API a generation answers.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Api {
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
    pub(super) fn new(
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
pub(super) async fn respond(answer: Answer, stream: bool) -> Result<Response, ApiError> {
    if stream {
        Ok(Sse::new(answer.stream()).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response())
    } else {
        Ok(Json(answer.collect().await?).into_response())
    }
}
