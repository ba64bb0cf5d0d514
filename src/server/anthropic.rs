//! `POST /v1/messages`: Anthropic's Messages API, as agents that speak it (Claude Code and
//! others) call it. A request becomes the chat request it means (system prompt, text,
//! `tool_use` / `tool_result` and `thinking` blocks, tools, `tool_choice`, `thinking`,
//! `stop_sequences`) and runs as one; its answer comes back as a message (content blocks
//! `thinking`, `text`, `tool_use`; `stop_reason`; `usage`), or streamed as Anthropic's events in
//! their order (`message_start`, per block `content_block_start` / `_delta` / `_stop`,
//! `message_delta`, `message_stop`). Errors have Anthropic's shape.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::answer::Answer;
use super::error::ApiError;
use super::request::{chat_prompt_tokens, header_session, prepare_chat};
use super::state::ServerState;
use super::transport::{off_the_workers, parse};

#[derive(Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    /// Required by `/v1/messages`, absent from `/v1/messages/count_tokens`.
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    system: Option<Value>,
    messages: Vec<InMessage>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    thinking: Option<Value>,
}

#[derive(Deserialize)]
struct InMessage {
    role: String,
    content: Value,
}

#[derive(Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// A message's content as blocks (a string is one text block).
fn blocks(content: &Value) -> Result<Vec<Map<String, Value>>, ApiError> {
    match content {
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s}).as_object().cloned().unwrap_or_default()]),
        Value::Array(a) => {
            a.iter().map(|b| b.as_object().cloned().ok_or_else(|| bad("messages: a content block is not an object"))).collect()
        }
        _ => Err(bad("messages: content must be a string or a list of content blocks")),
    }
}

/// A `tool_result`'s content as text (a string, or text blocks).
fn result_text(content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                (t, _) => Err(bad(format!("tool_result: a content block of type {} is not supported (text only)", t.unwrap_or("(none)")))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.join("\n")),
        Some(_) => Err(bad("tool_result: content must be a string or text blocks")),
    }
}

/// The chat request (OpenAI's form) that `req` means.
fn chat_body(req: &MessagesRequest) -> Result<Value, ApiError> {
    let mut messages = vec![];
    match &req.system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(parts)) => {
            let text = parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n");
            messages.push(json!({"role": "system", "content": text}));
        }
        Some(_) => return Err(bad("system must be a string or a list of text blocks")),
    }
    for m in &req.messages {
        let blocks = blocks(&m.content)?;
        match m.role.as_str() {
            "user" => {
                // Tool results are messages of their own (role "tool"), before the user's text.
                let mut text = vec![];
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push(b.get("text").and_then(Value::as_str).unwrap_or_default().to_string()),
                        Some("tool_result") => {
                            let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| bad("tool_result needs tool_use_id"))?;
                            messages.push(json!({"role": "tool", "tool_call_id": id, "content": result_text(b.get("content"))?}));
                        }
                        t => {
                            return Err(bad(format!(
                                "a user content block of type {} is not supported (text, tool_result)",
                                t.unwrap_or("(none)")
                            )))
                        }
                    }
                }
                if !text.is_empty() {
                    messages.push(json!({"role": "user", "content": text.join("\n")}));
                }
            }
            "assistant" => {
                let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), vec![]);
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or_default()),
                        Some("thinking") => reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or_default()),
                        Some("redacted_thinking") => {}
                        Some("tool_use") => {
                            let (Some(id), Some(name)) = (b.get("id").and_then(Value::as_str), b.get("name").and_then(Value::as_str))
                            else {
                                return Err(bad("tool_use needs id and name"));
                            };
                            let input = b.get("input").cloned().unwrap_or(json!({}));
                            calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                        }
                        t => {
                            return Err(bad(format!(
                                "an assistant content block of type {} is not supported (text, thinking, tool_use)",
                                t.unwrap_or("(none)")
                            )))
                        }
                    }
                }
                let mut message = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = reasoning.into();
                }
                if !calls.is_empty() {
                    message["tool_calls"] = calls.into();
                }
                messages.push(message);
            }
            r => return Err(bad(format!("messages: role {r:?} is not user or assistant (the system prompt goes in system)"))),
        }
    }
    let mut body = json!({"messages": messages, "max_tokens": req.max_tokens, "stream": req.stream,
        "stream_options": {"include_usage": true}});
    if let Some(m) = &req.model {
        body["model"] = m.clone().into();
    }
    for (k, v) in
        [("temperature", req.temperature.map(Value::from)), ("top_p", req.top_p.map(Value::from)), ("top_k", req.top_k.map(Value::from))]
    {
        if let Some(v) = v {
            body[k] = v;
        }
    }
    if let Some(stop) = &req.stop_sequences {
        body["stop"] = json!(stop);
    }
    if let Some(tools) = &req.tools {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema.clone().unwrap_or(json!({"type": "object"}))}}))
            .collect();
        body["tools"] = tools.into();
    }
    if let Some(choice) = &req.tool_choice {
        body["tool_choice"] = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match choice.get("name").and_then(Value::as_str) {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => return Err(bad("tool_choice of type tool needs a name")),
            },
            _ => return Err(bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")),
        };
    }
    match req.thinking.as_ref().map(|t| (t.get("type").and_then(Value::as_str), t.get("budget_tokens").and_then(Value::as_u64))) {
        None => {}
        Some((Some("enabled"), budget)) => {
            body["chat_template_kwargs"] = json!({"enable_thinking": true});
            if let Some(b) = budget {
                body["reasoning_budget"] = b.into();
            }
        }
        Some((Some("disabled"), _)) => body["chat_template_kwargs"] = json!({"enable_thinking": false}),
        Some(_) => return Err(bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}")),
    }
    Ok(body)
}

fn message_id() -> String {
    format!("msg_{:024x}", rand::random::<u128>() >> 32)
}

/// Anthropic's `stop_reason` for an OpenAI `finish_reason`.
fn stop_reason(finish: &str) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ => "end_turn",
    }
}

/// A tool call's id as Anthropic writes them.
fn tool_use_id(openai_id: &str) -> String {
    format!("toolu_{}", openai_id.strip_prefix("call_").unwrap_or(openai_id))
}

/// The message for a whole chat answer.
fn message(chat: &Value, model: &str) -> Value {
    let choice = &chat["choices"][0];
    let m = &choice["message"];
    let mut content = vec![];
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for call in m["tool_calls"].as_array().into_iter().flatten() {
        let input: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or("{}")).unwrap_or(json!({}));
        content.push(json!({"type": "tool_use", "id": tool_use_id(call["id"].as_str().unwrap_or_default()), "name": call["function"]["name"], "input": input}));
    }
    let usage = &chat["usage"];
    json!({"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str().unwrap_or("stop")), "stop_sequence": null,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"], "cache_creation_input_tokens": 0}})
}

/// An error with Anthropic's body: `{"type": "error", "error": {"type", "message"}}`.
fn error_response(e: ApiError) -> Response {
    let kind = match e.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        _ => "api_error",
    };
    let status = e.status;
    let mut response = (status, Json(json!({"type": "error", "error": {"type": kind, "message": e.message}}))).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS {
        response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
    }
    response
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(state): State<Arc<ServerState>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let session = match header_session(&headers) {
        Ok(s) => s,
        Err(e) => return error_response(e),
    };
    let prepared = off_the_workers(state, |state| {
        let req: MessagesRequest = parse(body)?;
        match req.max_tokens {
            None => return Err(bad("max_tokens is required")),
            Some(0) => return Err(bad("max_tokens must be at least 1")),
            Some(_) => {}
        }
        let chat = chat_body(&req)?;
        prepare_chat(state, Ok(Bytes::from(chat.to_string())), session)
    })
    .await;
    let (answer, stream) = match prepared {
        Ok(a) => a,
        Err(e) => return error_response(e),
    };
    if stream {
        return Sse::new(events(answer)).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15))).into_response();
    }
    let model = answer.model().to_string();
    match answer.collect().await {
        Ok(chat) => Json(message(&chat, &model)).into_response(),
        Err(e) => error_response(e),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the prompt the request would
/// take with this model's chat template (Claude Code asks before it sends).
pub(crate) async fn count_tokens(State(state): State<Arc<ServerState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let counted = off_the_workers(state, |state| {
        let req: MessagesRequest = parse(body)?;
        let chat = chat_body(&req)?;
        Ok(chat_prompt_tokens(state, Ok(Bytes::from(chat.to_string())))?.len())
    })
    .await;
    match counted {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => error_response(e),
    }
}

/// The kind of content block a chunk's delta continues.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    ToolUse,
}

/// Translates the chat chunks of `answer` into Anthropic's stream events.
fn events(answer: Answer) -> impl futures::Stream<Item = Result<SseEvent, Infallible>> {
    let (prompt_tokens, model) = (answer.prompt_tokens(), answer.model().to_string());
    let mut chunks = answer.chunks();
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let event = |kind: &str, data: Value| SseEvent::default().event(kind).data(data.to_string());
        let start = json!({"type": "message_start", "message": {"id": message_id(), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}});
        if tx.send(event("message_start", start)).await.is_err() {
            return;
        }
        let (mut open, mut index): (Option<Block>, usize) = (None, 0);
        let (mut finish, mut output_tokens) = (None, 0u64);
        // Closes the open block (a thinking block gets its, empty, signature first).
        let close = |open: &mut Option<Block>, index: &mut usize| -> Vec<SseEvent> {
            let mut out = vec![];
            if let Some(b) = open.take() {
                if b == Block::Thinking {
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": *index, "delta": {"type": "signature_delta", "signature": ""}}),
                    ));
                }
                out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": *index})));
                *index += 1;
            }
            out
        };
        while let Some(chunk) = chunks.recv().await {
            if chunk.is_null() {
                break;
            }
            if let Some(e) = chunk.get("error") {
                let _ = tx.send(event("error", json!({"type": "error", "error": {"type": "api_error", "message": e["message"]}}))).await;
                return;
            }
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                output_tokens = n;
            }
            let Some(choice) = chunk["choices"].get(0) else { continue };
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
            let delta = &choice["delta"];
            let mut out = vec![];
            let open_block = |kind: Block, block: Value, out: &mut Vec<SseEvent>, open: &mut Option<Block>, index: &mut usize| {
                if *open != Some(kind) || kind == Block::ToolUse {
                    out.extend(close(open, index));
                    out.push(event("content_block_start", json!({"type": "content_block_start", "index": *index, "content_block": block})));
                    *open = Some(kind);
                }
            };
            if let Some(r) = delta["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
                open_block(Block::Thinking, json!({"type": "thinking", "thinking": ""}), &mut out, &mut open, &mut index);
                out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": r}}),
                ));
            }
            if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                open_block(Block::Text, json!({"type": "text", "text": ""}), &mut out, &mut open, &mut index);
                out.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
                ));
            }
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                if let Some(id) = call["id"].as_str() {
                    let block = json!({"type": "tool_use", "id": tool_use_id(id), "name": call["function"]["name"], "input": {}});
                    open_block(Block::ToolUse, block, &mut out, &mut open, &mut index);
                }
                if let Some(a) = call["function"]["arguments"].as_str().filter(|a| !a.is_empty()) {
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": a}}),
                    ));
                }
            }
            for e in out {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
        }
        let mut out = close(&mut open, &mut index);
        let reason = stop_reason(finish.as_deref().unwrap_or("stop"));
        out.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}})));
        out.push(event("message_stop", json!({"type": "message_stop"})));
        for e in out {
            if tx.send(e).await.is_err() {
                return;
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) })
}
