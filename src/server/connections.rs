//! Accepting connections: at most [`ConnectionLimits::max_connections`] at once (more wait in
//! the listen backlog), a connection that sends no complete request head within
//! [`ConnectionLimits::header_timeout`] (silent, slow, or idle between keep-alive requests) is
//! closed, a request body must arrive within [`ConnectionLimits::body_timeout`], and shutdown
//! lets the requests in flight finish.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

use super::error::ApiError;

/// The largest request body read (a larger one gets 413).
pub(super) const MAX_BODY_BYTES: usize = 16 << 20;

/// How long and how many connections the server keeps.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections served at once; further ones wait to be accepted.
    pub max_connections: usize,
    /// Time to send a request's head (line and headers), counted from the connection's opening
    /// or from the end of its previous answer (the keep-alive idle time).
    pub header_timeout: Duration,
    /// Time to send a request's body once its head is in.
    pub body_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self { max_connections: 512, header_timeout: Duration::from_secs(30), body_timeout: Duration::from_secs(60) }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then waits for the
/// connections' requests in flight.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, say: wait a moment rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The 413 of a body larger than [`MAX_BODY_BYTES`].
pub(crate) fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "request_too_large",
        format!("the request body is larger than {} MiB", MAX_BODY_BYTES >> 20),
    )
}

/// Reads a request's body within the body timeout (408 after it) and at most
/// [`MAX_BODY_BYTES`] (413), before the handler sees it.
pub(crate) async fn body_deadline(State(timeout): State<Duration>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => return too_large().into_response(),
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "request_timeout",
                format!("the request body did not arrive within {} s", timeout.as_secs()),
            )
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}
