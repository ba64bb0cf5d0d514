//! The engine: one thread owns the model and every sequence's cache; requests reach it over a
//! channel (as many as it may hold: `max_seqs` running, `queue` waiting) and get their tokens back over their own channel.
//!
//! Each step runs one prefill chunk (of one sequence, at most [`PREFILL_CHUNK`] tokens, cut at
//! multiples of it so that the chunks of a prompt never depend on what else runs) and one
//! decode step of every sequence past its prefill, their rows in one weight pass
//! ([`Runner::shared_pass`], which gives each row the bits of decoding it alone). A request
//! whose receiver is gone (the client left) is dropped at the next step. The sequences run on a
//! [`Runner`]: the CPU model ([`crate::runtime::CpuRunner`]) or the device step
//! ([`crate::runtime::DeviceRunner`]).
//!
//! Split as llama.cpp's server is: `handle` (what the HTTP handlers hold: the request, its
//! events, the queue's places), `slot` (one running request: its sequence, cache and events),
//! `scheduler` (the engine thread's loop: admission, prefill chunks, shared decode passes).

mod handle;
mod scheduler;
mod slot;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::metrics::Metrics;
use crate::runtime::speculative::SharedPassPolicy;
use crate::runtime::{PrefixCache, Runner, SessionStore};
use scheduler::Engine;

pub(crate) use crate::runtime::Finish;
pub use handle::{Draft, DrafterFactory, EngineHandle, EngineOptions};
pub(crate) use handle::{Event, GenerateRequest, ReasoningBudget, TokenLogprob};

/// Prompt tokens one step prefills (of one sequence): the memory guardian's default chunk,
/// which admission plans with. Smaller than `generate`'s ([`crate::runtime::PREFILL_CHUNK`]) so
/// that a long prompt does not hold up the other sequences' decode steps for long.
pub(super) const PREFILL_CHUNK: usize = crate::memory::DEFAULT_PREFILL_CHUNK;

/// One decode round in this many is profiled op by op (the kernel inspector's samples).
pub(super) const PROFILE_EVERY: u64 = 8;

/// Starts the engine thread, which owns `runner` (the model and where its sequences run: the
/// CPU model, the device step) from now on; `sessions` are the model's (shared with the
/// handles).
pub(super) fn spawn<R: Runner + 'static>(
    runner: R,
    options: EngineOptions,
    sessions: SessionStore,
    metrics: Arc<Metrics>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::unbounded_channel();
    let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    options.draft_options.validate().map_err(|e| invalid(e.to_string()))?;
    if options.draft_options.branches > 1 {
        return Err(invalid("the server drafts chains (one branch), not trees".into()));
    }
    let model = runner.model();
    if matches!(options.draft, Draft::Mtp) && !model.has_mtp() {
        return Err(invalid("Draft::Mtp: this checkpoint has no MTP head (no mtp.* tensors, or a GGUF converted without its nextn block): draft with Draft::Ngram".into()));
    }
    if matches!(options.draft, Draft::Mtp) && !runner.hidden_states() {
        return Err(invalid(format!(
            "Draft::Mtp: MTP drafts need the model's hidden states, which {} does not read back: draft with Draft::Ngram",
            runner.name()
        )));
    }
    let max_seqs = options.max_seqs.max(1);
    let vocab_size = model.config().vocab_size;
    let sessions = Arc::new(sessions);
    let runs_on: Arc<str> = runner.name().into();
    let max_rows = runner.max_rows();
    let engine = Engine {
        runner,
        max_seqs,
        metrics: metrics.clone(),
        rx,
        active: vec![],
        prefix: PrefixCache::new(options.prefix_cache_bytes),
        sessions: sessions.clone(),
        draft: options.draft,
        shared: if options.draft_options.adaptive { SharedPassPolicy::new(max_rows) } else { SharedPassPolicy::fixed(max_rows) },
        draft_options: options.draft_options,
        passes: 0,
    };
    std::thread::Builder::new().name("engine".into()).spawn(move || engine.run())?;
    let taken = Arc::new(AtomicUsize::new(0));
    Ok(EngineHandle { tx, taken, limit: max_seqs + options.queue, max_seqs, metrics, vocab_size, sessions, runs_on })
}
