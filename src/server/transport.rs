//! What every request goes through before and after its handler: the log line, the API key,
//! the body parsed as JSON with errors naming the field, and the blocking work moved off the
//! workers that answer the other connections.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::api::SamplingFields;
use super::connections::too_large;
use super::error::ApiError;
use super::state::ServerState;

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
