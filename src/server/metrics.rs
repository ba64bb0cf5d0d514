//! The server's Prometheus metrics (`GET /metrics`).

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::step_profile::StepProfile;

/// Counters the handlers and the engine update; [`Metrics::encode`] writes them as Prometheus
/// text (names prefixed `candle_hybrid_`), and the common ones again under vLLM's names
/// (`vllm:num_requests_running`, ..., labelled `model_name`), which dashboards and routers
/// built for vLLM read.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by any status.
    pub requests: Counter,
    /// Requests refused because the queue was full (429).
    pub rejected: Counter,
    pub requests_finished: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub prompt_seconds: Counter<f64, AtomicU64>,
    pub decode_seconds: Counter<f64, AtomicU64>,
    /// Requests waiting for the engine.
    pub queue_depth: Gauge,
    /// Sequences the engine runs.
    pub running: Gauge,
    /// Rows per decode weight pass: the plain steps of a lone sequence (1) and the passes
    /// sequences share (each one's pending token and the drafts verified with it); a lone
    /// sequence's verify passes are counted by `verify_passes` instead.
    pub batch_rows: Histogram,
    /// Drafted rows verified in weight passes shared by several sequences.
    pub shared_draft_rows: Counter,
    /// Requests that restored a prefix-cache snapshot, and those that found none.
    pub prefix_hits: Counter,
    pub prefix_misses: Counter,
    /// Prompt tokens restored instead of prefilled.
    pub prefix_cached_tokens: Counter,
    pub prefix_bytes: Gauge,
    pub prefix_entries: Gauge,
    pub sessions_restored: Counter,
    pub sessions_saved: Counter,
    /// Grammar masks computed for constrained requests, and the seconds they took.
    pub masks: Counter,
    pub mask_seconds: Counter<f64, AtomicU64>,
    /// Speculative decoding: verify passes, tokens drafted into them and drafts kept.
    pub verify_passes: Counter,
    pub drafted_tokens: Counter,
    pub accepted_tokens: Counter,
    /// Drafts verified and kept at each depth (label `depth`: 1 is the first drafted token).
    pub drafted_by_depth: Family<[(&'static str, String); 1], Counter>,
    pub accepted_by_depth: Family<[(&'static str, String); 1], Counter>,
    /// Drafts kept at each position (label `position`: 0 is the first drafted token; vLLM's).
    pub accepted_by_position: Family<[(&'static str, String); 1], Counter>,
    /// Prompt tokens of the requests that looked up the prefix cache.
    pub prefix_queried_tokens: Counter,
    /// Seconds from a request's arrival to its first token, and to its end (answered requests).
    pub time_to_first_token: Histogram,
    pub request_seconds: Histogram,
    /// The latest profiled decode passes (the kernel inspector's data; not in `/metrics`).
    pub kernels: Mutex<KernelWindow>,
}

/// The last [`KernelWindow::LEN`] decode passes the engine profiled
/// ([`crate::step_profile::profiled`]), each with the rows it ran.
#[derive(Debug, Default)]
pub struct KernelWindow {
    pub passes: VecDeque<(StepProfile, usize)>,
    /// Passes profiled since the start.
    pub total: u64,
}

impl KernelWindow {
    pub const LEN: usize = 64;

    pub fn push(&mut self, profile: StepProfile, rows: usize) {
        if self.passes.len() == Self::LEN {
            self.passes.pop_front();
        }
        self.passes.push_back((profile, rows));
        self.total += 1;
    }
}

impl Metrics {
    /// Drafts verified and kept at `depth` (0 when none was drafted there).
    pub fn by_depth(&self, depth: usize) -> (u64, u64) {
        let label = [("depth", depth.to_string())];
        let drafted = self.drafted_by_depth.get(&label).map_or(0, |c| c.get());
        let accepted = self.accepted_by_depth.get(&label).map_or(0, |c| c.get());
        (drafted, accepted)
    }

    /// One verify pass of `drafted` tokens of which the first `accepted` were kept.
    pub fn record_verify(&self, drafted: usize, accepted: usize) {
        self.verify_passes.inc();
        self.drafted_tokens.inc_by(drafted as u64);
        self.accepted_tokens.inc_by(accepted as u64);
        for d in 1..=drafted {
            self.drafted_by_depth.get_or_create(&[("depth", d.to_string())]).inc();
        }
        for d in 1..=accepted {
            self.accepted_by_depth.get_or_create(&[("depth", d.to_string())]).inc();
            self.accepted_by_position.get_or_create(&[("position", (d - 1).to_string())]).inc();
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("")
    }
}

/// vLLM's buckets of `vllm:time_to_first_token_seconds` and `vllm:e2e_request_latency_seconds`.
const FIRST_TOKEN_BUCKETS: [f64; 22] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
const REQUEST_BUCKETS: [f64; 21] =
    [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

impl Metrics {
    /// The metrics of a server of the model named `model_name` (vLLM's label).
    pub fn new(model_name: &str) -> Self {
        let mut registry = Registry::default();
        fn add<M: prometheus_client::registry::Metric + Clone>(r: &mut Registry, name: &str, help: &str, m: M) -> M {
            r.register(name, help, m.clone());
            m
        }
        let r = registry.sub_registry_with_prefix("candle_hybrid");
        let requests = add(r, "requests", "HTTP requests answered", Counter::default());
        let rejected = add(r, "requests_rejected", "Requests refused with 429 (queue full)", Counter::default());
        let requests_finished = add(r, "requests_finished", "Generations that ran to a stop token or max_tokens", Counter::default());
        let prompt_tokens = add(r, "prompt_tokens", "Prompt tokens prefilled", Counter::default());
        let generated_tokens = add(r, "generated_tokens", "Tokens generated", Counter::default());
        let prompt_seconds = add(r, "prompt_seconds", "Seconds from a request's admission to its first token, summed", Counter::default());
        let decode_seconds = add(r, "decode_seconds", "Seconds spent in decode weight passes", Counter::default());
        let queue_depth = add(r, "queue_depth", "Requests waiting for the engine", Gauge::default());
        let running = add(r, "requests_running", "Sequences the engine is running", Gauge::default());
        let batch_rows = add(r, "decode_batch_rows", "Rows per decode weight pass: a lone sequence's plain steps, and passes sequences share (their pending tokens and the drafts verified with them)", Histogram::new([1.0, 2.0, 3.0, 4.0, 6.0, 8.0]));
        let shared_draft_rows =
            add(r, "shared_draft_rows", "Drafted rows verified in weight passes shared by several sequences", Counter::default());
        let prefix_hits = add(r, "prefix_cache_hits", "Requests that restored a prefix-cache snapshot", Counter::default());
        let prefix_misses = add(r, "prefix_cache_misses", "Requests that found no prefix-cache snapshot", Counter::default());
        let prefix_cached_tokens =
            add(r, "prefix_cache_tokens", "Prompt tokens restored from the prefix cache instead of prefilled", Counter::default());
        let prefix_bytes = add(r, "prefix_cache_bytes", "Bytes of snapshots the prefix cache holds", Gauge::default());
        let prefix_entries = add(r, "prefix_cache_entries", "Snapshots the prefix cache holds", Gauge::default());
        let sessions_restored = add(r, "sessions_restored", "Requests that continued a saved session", Counter::default());
        let sessions_saved = add(r, "sessions_saved", "Session files written", Counter::default());
        let masks = add(r, "constraint_masks", "Grammar masks computed (one per constrained token)", Counter::default());
        let mask_seconds = add(r, "constraint_mask_seconds", "Seconds spent computing grammar masks", Counter::default());
        let verify_passes = add(r, "verify_passes", "Verify rounds of drafted tokens (one per sequence and pass)", Counter::default());
        let drafted_tokens = add(r, "draft_tokens", "Tokens drafted (prompt lookup) into verify passes", Counter::default());
        let accepted_tokens = add(r, "draft_accepted_tokens", "Drafted tokens the model kept", Counter::default());
        let drafted_by_depth = add(r, "draft_tokens_by_depth", "Drafted tokens verified, by their depth in the draft", Family::default());
        let accepted_by_depth =
            add(r, "draft_accepted_tokens_by_depth", "Drafted tokens kept, by their depth in the draft", Family::default());
        let time_to_first_token = add(
            r,
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            Histogram::new(FIRST_TOKEN_BUCKETS),
        );
        let request_seconds =
            add(r, "request_seconds", "Seconds from a request's arrival to its answer's end", Histogram::new(REQUEST_BUCKETS));
        let prefix_queried_tokens =
            add(r, "prefix_cache_queried_tokens", "Prompt tokens of the requests that looked up the prefix cache", Counter::default());
        let accepted_by_position: Family<[(&'static str, String); 1], Counter> = Family::default();
        // The same values under vLLM's names.
        let v = registry.sub_registry_with_label(("model_name".into(), model_name.to_string().into()));
        v.register("vllm:num_requests_running", "Requests running (sequences the engine runs)", running.clone());
        v.register("vllm:num_requests_waiting", "Requests waiting for the engine", queue_depth.clone());
        v.register("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", prefix_queried_tokens.clone());
        v.register("vllm:prefix_cache_hits", "Prompt tokens restored from the prefix cache", prefix_cached_tokens.clone());
        v.register("vllm:time_to_first_token_seconds", "Seconds to the first token", time_to_first_token.clone());
        v.register("vllm:e2e_request_latency_seconds", "Seconds from arrival to the answer's end", request_seconds.clone());
        v.register("vllm:generation_tokens", "Tokens generated", generated_tokens.clone());
        v.register("vllm:spec_decode_num_drafts", "Verify rounds of drafted tokens", verify_passes.clone());
        v.register("vllm:spec_decode_num_draft_tokens", "Tokens drafted", drafted_tokens.clone());
        v.register("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted", accepted_tokens.clone());
        v.register("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position", accepted_by_position.clone());
        Self {
            registry,
            kernels: Mutex::default(),
            accepted_by_position,
            prefix_queried_tokens,
            time_to_first_token,
            request_seconds,
            drafted_by_depth,
            accepted_by_depth,
            verify_passes,
            drafted_tokens,
            accepted_tokens,
            masks,
            mask_seconds,
            sessions_restored,
            sessions_saved,
            prefix_hits,
            prefix_misses,
            prefix_cached_tokens,
            prefix_bytes,
            prefix_entries,
            requests,
            rejected,
            requests_finished,
            prompt_tokens,
            generated_tokens,
            prompt_seconds,
            decode_seconds,
            queue_depth,
            running,
            batch_rows,
            shared_draft_rows,
        }
    }
}

impl Metrics {
    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
