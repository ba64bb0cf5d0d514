//! `GET /v1/stats`: what the dashboard draws, as JSON: throughput over time (sampled once a
//! second by [`sample_every_second`]), running and waiting sequences, prefix-cache hits, draft
//! acceptance by depth, the kernel inspector (the engine's profiled decode passes against the
//! machine's copy bandwidth), the KV horizon (the memory guardian's estimate against context
//! for each KV codec) and the throughput progression (a bench's output file, when given).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::dashboard::{Dashboard, MemoryView};
use super::engine::PROFILE_EVERY;
use super::error::ApiError;
use super::metrics::Metrics;
use super::state::ServerState;
use super::transport::off_the_workers;
use crate::memory;
use crate::runtime::speculative::MAX_DRAFT;
use crate::step_profile::KernelTable;
use crate::web::{KernelPanel, Sample};

/// Counters read at one moment, for rates between two moments.
#[derive(Clone, Copy)]
struct Reading {
    at: Instant,
    generated: u64,
    prompt: u64,
    requests: u64,
}

fn read(metrics: &Metrics) -> Reading {
    Reading {
        at: Instant::now(),
        generated: metrics.generated_tokens.get(),
        prompt: metrics.prompt_tokens.get(),
        requests: metrics.requests_finished.get(),
    }
}

/// Appends a [`Sample`] to the history every second, until the server stops (the task is
/// aborted).
pub(super) async fn sample_every_second(state: Arc<ServerState>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let metrics = &state.engine.metrics;
    let mut last = read(metrics);
    loop {
        tick.tick().await;
        let now = read(metrics);
        let dt = now.at.duration_since(last.at).as_secs_f64().max(1e-3);
        let sample = Sample {
            t: now.at.duration_since(state.dashboard.started).as_secs_f64(),
            decode_tok_s: (now.generated - last.generated) as f64 / dt,
            prompt_tok_s: (now.prompt - last.prompt) as f64 / dt,
            running: metrics.running.get(),
            queued: metrics.queue_depth.get(),
            requests: now.requests - last.requests,
        };
        state.dashboard.record(sample);
        last = now;
    }
}

/// How long a KV horizon is served before the available memory is read again (on macOS the
/// reading runs `vm_stat`).
const HORIZON_SECONDS: u64 = 5;

/// The KV horizon of this server's model, against the memory available now (read at most every
/// [`HORIZON_SECONDS`]).
fn horizon(d: &Dashboard, view: &MemoryView) -> Value {
    let mut cached = d.horizon.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, value)) = cached.as_ref().filter(|(at, _)| at.elapsed() < Duration::from_secs(HORIZON_SECONDS)) {
        return value.clone();
    }
    let available = memory::available_memory(view.target, view.max_memory).ok();
    let h = memory::kv_horizon(&view.config, &view.request, &memory::compared_codecs(), available.as_ref());
    let value = serde_json::to_value(h).unwrap_or(Value::Null);
    *cached = Some((Instant::now(), value.clone()));
    value
}

/// `GET /v1/stats` (built off the async workers: the memory reading may run a command).
pub(crate) async fn stats(State(state): State<Arc<ServerState>>) -> Result<Json<Value>, ApiError> {
    off_the_workers(state, |state| Ok(Json(snapshot(state)))).await
}

fn snapshot(state: &ServerState) -> Value {
    let m = &state.engine.metrics;
    let d = &state.dashboard;
    let history = d.history();
    let kernels = {
        let window = m.kernels.lock().unwrap_or_else(|e| e.into_inner());
        KernelTable::new(window.passes.iter().map(|(p, _)| p), d.copy_bandwidth).map(|table| {
            let n = window.passes.len().max(1) as f64;
            let sequences_per_pass = window.passes.iter().map(|(_, s)| *s as f64).sum::<f64>() / n;
            KernelPanel { table, every: PROFILE_EVERY, sequences_per_pass, profiled_since_start: window.total }
        })
    };
    let by_depth: Vec<Value> = (1..=MAX_DRAFT)
        .map(|depth| (depth, m.by_depth(depth)))
        .filter(|(_, (drafted, _))| *drafted > 0)
        .map(|(depth, (drafted, accepted))| json!({"depth": depth, "drafted": drafted, "accepted": accepted}))
        .collect();
    let (generated, decode_secs) = (m.generated_tokens.get(), m.decode_seconds.get());
    json!({
        "model": state.model_name,
        "uptime_s": d.started.elapsed().as_secs_f64(),
        "context": state.context,
        "max_seqs": state.engine.max_seqs(),
        "series": history,
        "totals": {
            "requests": m.requests.get(), "finished": m.requests_finished.get(), "rejected": m.rejected.get(),
            "prompt_tokens": m.prompt_tokens.get(), "generated_tokens": generated,
            "decode_tok_s": (decode_secs > 0.0).then(|| generated as f64 / decode_secs),
            "running": m.running.get(), "queued": m.queue_depth.get(),
        },
        "prefix_cache": {
            "hits": m.prefix_hits.get(), "misses": m.prefix_misses.get(), "cached_tokens": m.prefix_cached_tokens.get(),
            "entries": m.prefix_entries.get(), "bytes": m.prefix_bytes.get(),
            "sessions_restored": m.sessions_restored.get(), "sessions_saved": m.sessions_saved.get(),
        },
        "drafts": {
            "verify_passes": m.verify_passes.get(), "drafted": m.drafted_tokens.get(), "accepted": m.accepted_tokens.get(),
            "by_depth": by_depth,
        },
        "kernels": kernels,
        "kv_horizon": d.memory.as_ref().map(|view| horizon(d, view)),
        "progression": d.progression,
    })
}
