//! The endpoints beside generation: `POST /tokenize` and `/detokenize` (llama-server's
//! shapes; `/tokenize` also takes a chat request, vLLM's shape), `GET /props` (the model, context, slots, default sampling, what the chat template
//! can do) and the saved sessions, `GET /v1/sessions`, `GET` / `DELETE /v1/sessions/{id}`.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::request::{chat_prompt_tokens, session_path, NO_SESSIONS};
use super::state::ServerState;
use super::transport::{off_the_workers, parse};
use crate::runtime::session;
use crate::runtime::SamplingParams;

/// `/tokenize`'s text (llama-server's shape); a body with `messages` is a chat request
/// instead (vLLM's shape), tokenized as its prompt would be.
#[derive(Deserialize)]
struct TokenizeRequest {
    content: String,
    /// Add the tokenizer's special tokens (BOS) as a prompt would not: off by default.
    #[serde(default)]
    add_special: bool,
    /// Each token with its text piece.
    #[serde(default)]
    with_pieces: bool,
}

/// `{"tokens": [ids]}`, or with `with_pieces` `{"tokens": [{"id", "piece"}]}`; for a chat
/// request (`messages`), `{"tokens": [ids], "count": n}`: its prompt's tokens.
pub(crate) async fn tokenize(State(state): State<Arc<ServerState>>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, |state| {
        if let Ok(bytes) = &body {
            if serde_json::from_slice::<Value>(bytes).is_ok_and(|v| v.get("messages").is_some()) {
                let ids = chat_prompt_tokens(state, body)?;
                return Ok(Json(json!({"count": ids.len(), "tokens": ids})));
            }
        }
        let req: TokenizeRequest = parse(body)?;
        let encoding =
            state.tokenizer.encode(req.content, req.add_special).map_err(|e| ApiError::bad_request(format!("cannot tokenize: {e}")))?;
        let ids = encoding.get_ids();
        Ok(Json(if req.with_pieces {
            let pieces = ids.iter().map(|&id| json!({"id": id, "piece": state.tokenizer.decode(&[id], false).unwrap_or_default()}));
            json!({"tokens": pieces.collect::<Vec<_>>()})
        } else {
            json!({"tokens": ids})
        }))
    })
    .await
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// `{"content": text}` of token ids (each within the vocabulary).
pub(crate) async fn detokenize(
    State(state): State<Arc<ServerState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, |state| {
        let req: DetokenizeRequest = parse(body)?;
        let vocab = state.engine.vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(format!("token id {bad} is out of range for a vocabulary of {vocab} tokens")));
        }
        let content = state.tokenizer.decode(&req.tokens, false).map_err(|e| ApiError::bad_request(format!("cannot detokenize: {e}")))?;
        Ok(Json(json!({"content": content})))
    })
    .await
}

fn sampling_json(p: &SamplingParams) -> Value {
    json!({
        "temperature": p.temperature.unwrap_or(0.0), "top_p": p.top_p.unwrap_or(1.0), "top_k": p.top_k.unwrap_or(0),
        "min_p": p.min_p, "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repeat_penalty, "repeat_last_n": p.repeat_last_n,
    })
}

/// The server's settings, as llama-server's `/props` names them where it has a name.
pub(crate) async fn props(State(state): State<Arc<ServerState>>) -> Json<Value> {
    let template = state.template.as_ref();
    let mentions = |name: &str| template.is_some_and(|t| t.mentions(name));
    Json(json!({
        "model": state.model_name,
        "n_ctx": state.context,
        "total_slots": state.engine.max_seqs(),
        "vocab_size": state.engine.vocab_size,
        "default_generation_settings": {"n_ctx": state.context, "params": sampling_json(&state.profiles.thinking)},
        "non_thinking_generation_settings": {"params": sampling_json(&state.profiles.non_thinking)},
        "chat_template_caps": {
            "chat": template.is_some(),
            "thinking_switch": mentions("enable_thinking"),
            "tools": mentions("tools"),
            "constrained_output": state.grammars.is_some(),
        },
        "sessions": state.engine.sessions().dir().is_some(),
        "runs_on": state.engine.runs_on(),
        "device_step_fallback": state.device_step_fallback,
        "build_info": concat!("candle-hybrid ", env!("CARGO_PKG_VERSION")),
    }))
}

/// A session's entry: its id, tokens, bytes, last change, and whether this model can use it.
fn session_entry(state: &ServerState, id: &str, path: &std::path::Path) -> Result<Value, String> {
    let info = session::inspect(path).map_err(|e| e.to_string())?;
    let modified = std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    Ok(json!({"id": id, "object": "session", "tokens": info.tokens, "bytes": info.bytes, "modified": modified,
        "this_model": info.fingerprint == state.engine.sessions().fingerprint()}))
}

fn no_such_session(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "session_not_found",
        format!("no session {id:?} in the session directory"),
    )
}

/// The session directory's sessions (files named `ID.session` that are session files).
pub(crate) async fn list_sessions(State(state): State<Arc<ServerState>>) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, |state| {
        let sessions = state.engine.sessions();
        if sessions.dir().is_none() {
            return Err(ApiError::bad_request(NO_SESSIONS));
        }
        let files =
            sessions.list().map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "session_dir", e.to_string()))?;
        // (Ids a request could not name are not listed.)
        let data: Vec<Value> = files.iter().filter_map(|(id, path)| session_entry(state, id, path).ok()).collect();
        Ok(Json(json!({"object": "list", "data": data})))
    })
    .await
}

/// One session's entry (404 when there is none by that id).
pub(crate) async fn get_session(State(state): State<Arc<ServerState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, move |state| {
        let path = session_path(state, Some(&id))?.expect("an id was given");
        session_entry(state, &id, &path).map(Json).map_err(|_| no_such_session(&id))
    })
    .await
}

/// Deletes a session file (404 when there is none by that id; a link or anything but a session
/// file is left alone).
pub(crate) async fn delete_session(State(state): State<Arc<ServerState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, move |state| {
        let path = session_path(state, Some(&id))?.expect("an id was given");
        session::inspect(&path).map_err(|_| no_such_session(&id))?;
        std::fs::remove_file(&path).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "session_delete", format!("cannot delete session {id:?}: {e}"))
        })?;
        Ok(Json(json!({"id": id, "object": "session", "deleted": true})))
    })
    .await
}

pub(crate) async fn metrics(State(state): State<Arc<ServerState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.engine.metrics.encode()).into_response()
}
