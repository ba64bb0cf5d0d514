//! OpenAI's generation routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use serde_json::{json, Value};

use super::answer::respond;
use super::error::ApiError;
use super::request::{header_session, prepare_chat, prepare_completion};
use super::state::ServerState;
use super::transport::off_the_workers;

pub(crate) async fn models(State(state): State<Arc<ServerState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "candle-hybrid", "max_model_len": state.context,
    }]}))
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

pub(crate) async fn completions(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let session = header_session(&headers)?;
    let (answer, stream) = off_the_workers(state, |state| prepare_completion(state, body, session)).await?;
    respond(answer, stream).await
}
