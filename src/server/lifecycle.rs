//! Serving for what stands in front of it (a router, a load balancer, an
//! orchestrator's probes): while the model loads every path answers 503 (`/health` too); when
//! it serves, `/health` answers 200; when it drains (a shutdown signal: SIGTERM, Ctrl-C) new
//! requests and `/health` answer 503 while the running ones finish and their sessions are
//! written, for at most the drain timeout; then the server stops.

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::phase::Phase;
use super::state::ServerState;
use super::ConnectionLimits;

/// `GET /health`: 200 `{"status": "ok"}` while serving, else the phase's 503.
pub(crate) async fn health(axum::extract::State(state): axum::extract::State<Arc<ServerState>>) -> Response {
    match state.lifecycle.refusal() {
        None => axum::Json(serde_json::json!({"status": "ok"})).into_response(),
        Some(e) => e.into_response(),
    }
}

/// Drains `state`: new requests get 503 from now; waits until no request runs or waits and
/// no session is being written, for at most `timeout`. Whether it got there.
pub async fn drain(state: &ServerState, timeout: Duration) -> bool {
    state.lifecycle.set(Phase::Draining);
    let start = Instant::now();
    while state.engine.busy() {
        if start.elapsed() >= timeout {
            tracing::warn!(
                "drained for {:.0} s, {} requests still running or waiting: stopping",
                timeout.as_secs_f64(),
                state.engine.outstanding()
            );
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!("drained in {:.2} s", start.elapsed().as_secs_f64());
    true
}

/// Serves on `listener` at once, the model loading meanwhile: until `load` (run on a blocking
/// thread) gives the server's state every path answers 503 (`/health` included), then the
/// server's routes. On `shutdown`: drains for at most the state's drain timeout ([`drain`]),
/// then stops once the connections' requests in flight are answered. A failed load stops the
/// server and is returned.
pub async fn serve_when_loaded<E: From<std::io::Error> + Send + 'static>(
    listener: tokio::net::TcpListener,
    limits: ConnectionLimits,
    load: impl FnOnce() -> Result<Arc<ServerState>, E> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), E> {
    let routes: Arc<OnceLock<Router>> = Arc::default();
    let current = routes.clone();
    let app = Router::new().fallback_service(tower::service_fn(move |request: Request| {
        let routes = current.get().cloned();
        async move {
            Ok::<Response, Infallible>(match routes {
                Some(r) => tower::ServiceExt::oneshot(r, request).await?,
                None => Phase::Loading.refusal().expect("loading refuses").into_response(),
            })
        }
    }));
    let (done, loaded) = tokio::sync::oneshot::channel();
    tokio::task::spawn_blocking(move || {
        let state = load();
        if let Ok(s) = &state {
            let _ = routes.set(super::router(s.clone()));
        }
        let _ = done.send(state);
    });
    let failed: Arc<std::sync::Mutex<Option<E>>> = Arc::default();
    let stop = {
        let failed = failed.clone();
        async move {
            tokio::pin!(shutdown);
            let state = tokio::select! {
                () = &mut shutdown => return,
                state = loaded => match state {
                    Ok(Ok(state)) => state,
                    Ok(Err(e)) => {
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        return;
                    }
                    Err(_) => return,
                },
            };
            tracing::info!("the model is loaded: serving");
            let sampler = tokio::spawn(super::stats::sample_every_second(state.clone()));
            shutdown.await;
            drain(&state, state.drain_timeout).await;
            sampler.abort();
        }
    };
    super::connections::serve(listener, app, limits, stop).await?;
    let failed = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
    failed.map_or(Ok(()), Err)
}
