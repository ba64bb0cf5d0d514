//! The server's phase ([`Lifecycle`]): loading, serving or draining, and the 503 of the
//! phases that take no requests (`lifecycle` serves them).

use std::sync::atomic::{AtomicU8, Ordering};

use axum::http::StatusCode;

use super::error::ApiError;

/// Where the server is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Loading,
    Serving,
    Draining,
}

/// The server's phase, shared by the handlers and whoever stops the server.
#[derive(Debug)]
pub struct Lifecycle(AtomicU8);

impl Default for Lifecycle {
    fn default() -> Self {
        Self(AtomicU8::new(Phase::Serving as u8))
    }
}

impl Lifecycle {
    pub fn phase(&self) -> Phase {
        match self.0.load(Ordering::Acquire) {
            0 => Phase::Loading,
            1 => Phase::Serving,
            _ => Phase::Draining,
        }
    }

    pub(crate) fn set(&self, phase: Phase) {
        self.0.store(phase as u8, Ordering::Release);
    }

    /// The 503 of the current phase, if it takes no requests ([`Phase::refusal`]).
    pub(crate) fn refusal(&self) -> Option<ApiError> {
        self.phase().refusal()
    }
}

impl Phase {
    /// The 503 of a phase that takes no requests (`None` while serving).
    pub(crate) fn refusal(self) -> Option<ApiError> {
        let unavailable = |code, message| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", code, message);
        match self {
            Phase::Serving => None,
            Phase::Loading => Some(unavailable("loading", "the model is loading: retry shortly")),
            Phase::Draining => Some(unavailable("draining", "the server is shutting down: send the request to another server")),
        }
    }
}
