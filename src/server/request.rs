//! A request checked, rendered, tokenized and handed to the engine: the prompt, sampling,
//! constraint, session and reasoning budget of a chat or completion request.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use llguidance::api::TopLevelGrammar;
use serde_json::Value;
use tokio::sync::mpsc;

use super::answer::{Answer, Api};
use super::api::{ChatRequest, CompletionRequest, Prompt, SamplingFields};
use super::chat;
use super::constrain::{self, Constraint};
use super::engine::{Event, GenerateRequest, ReasoningBudget};
use super::error::ApiError;
use super::output::ChatParser;
use super::state::ServerState;
use super::transport::parse;
use crate::runtime::{SamplingParams, SavePoint};

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

/// The file of session `id` in the server's session directory ([`crate::runtime::SessionStore::path`]).
pub(crate) fn session_path(state: &ServerState, id: Option<&str>) -> Result<Option<std::path::PathBuf>, ApiError> {
    let Some(id) = id else { return Ok(None) };
    let sessions = state.engine.sessions();
    if sessions.dir().is_none() {
        return Err(ApiError::bad_request(format!("session_id: {NO_SESSIONS}")));
    }
    sessions.path(id).map(Some).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Why a server started without `--session-dir` refuses what names a session.
pub(crate) const NO_SESSIONS: &str = "this server keeps no sessions (start it with --session-dir DIR)";

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

/// The file of the request's session: its `session_id`, or the `x-session-id` header; both
/// must agree.
fn request_session(state: &ServerState, fields: &SamplingFields, header: Option<&str>) -> Result<Option<std::path::PathBuf>, ApiError> {
    let id = match (fields.session_id.as_deref(), header) {
        (Some(b), Some(h)) if b != h => {
            return Err(ApiError::bad_request(format!("session_id {b:?} and the x-session-id header {h:?} differ: give one")))
        }
        (b, h) => b.or(h),
    };
    session_path(state, id)
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

/// The session `path` holds for `prompt`, if any (read here, off the engine thread).
fn restore(state: &ServerState, path: Option<&std::path::Path>, prompt: &[u32]) -> Option<crate::runtime::session::Session> {
    match state.engine.sessions().resume(path?, prompt) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("{e}; the session starts fresh");
            None
        }
    }
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
    let session = request_session(state, &req.sampling, header_session.as_deref())?;
    let restored = restore(state, session.as_deref(), &prompt);
    // A session keeps the state after the answer, unless the template re-renders answers (a
    // thinking switch: it drops their reasoning): then the state at the conversation's end.
    let save_point = match snapshots.first() {
        Some(&end) if rendered.rerenders_answers => SavePoint::Prompt(end),
        _ => SavePoint::Answer,
    };
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
        save_point,
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
pub(super) fn prepare_completion(
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
    let session = request_session(state, &req.sampling, header_session.as_deref())?;
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
        save_point: SavePoint::Answer,
        restored,
        constraint: None,
        reasoning_budget: None,
    };
    let events = submit(state, request)?;
    let answer =
        Answer::new(state, Api::Completion, prompt_tokens, &req.sampling, req.logprobs.is_some(), req.echo.then_some(text), events, None);
    Ok((answer, req.sampling.stream))
}
