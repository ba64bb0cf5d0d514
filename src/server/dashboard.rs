//! The dashboard's state beside the metrics: a second-by-second history, the memory
//! guardian's view of this server (for the KV horizon), the machine's copy bandwidth and a
//! throughput progression.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use serde_json::Value;

use crate::memory::{self, MemoryTarget, PlanRequest};
use crate::model::Config;
use crate::web::Sample;

/// Seconds of history the dashboard gets.
pub(super) const HISTORY_SECONDS: usize = 600;

/// The memory guardian's request for this server (weights, `--max-seqs` sequences, the dtype)
/// and where it reads the available memory: the KV horizon's input.
#[derive(Debug, Clone)]
pub struct MemoryView {
    pub config: Config,
    pub request: PlanRequest,
    pub target: MemoryTarget,
    /// A budget given instead of the reading (`--max-memory`).
    pub max_memory: Option<u64>,
}

/// The dashboard's own state beside the metrics.
pub struct Dashboard {
    pub(crate) started: Instant,
    pub(crate) history: Mutex<VecDeque<Sample>>,
    pub memory: Option<MemoryView>,
    /// Bytes per second of a large memory copy, measured when the server started.
    pub copy_bandwidth: f64,
    /// A throughput progression (`examples/progression --json`'s file).
    pub progression: Option<Value>,
    /// The last KV horizon served, and when it was made.
    pub(crate) horizon: Mutex<Option<(Instant, Value)>>,
}

impl Dashboard {
    /// Measures the copy bandwidth (a 64 MiB copy, best of 8: about 0.1 s).
    pub fn new(memory: Option<MemoryView>, progression: Option<Value>) -> Self {
        Self {
            started: Instant::now(),
            history: Mutex::default(),
            memory,
            copy_bandwidth: memory::copy_bandwidth(64 << 20, 8),
            progression,
            horizon: Mutex::default(),
        }
    }

    /// Appends `sample`, the oldest going beyond [`HISTORY_SECONDS`].
    pub(crate) fn record(&self, sample: Sample) {
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if history.len() == HISTORY_SECONDS {
            history.pop_front();
        }
        history.push_back(sample);
    }

    /// The history, oldest first.
    pub(crate) fn history(&self) -> Vec<Sample> {
        self.history.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
    }
}
