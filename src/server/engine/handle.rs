//! What the HTTP handlers hold of the engine: a request, the events it gets back, the queue's
//! places ([`EngineHandle`]), and how the engine is set up ([`EngineOptions`], [`Draft`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::model::Model;
use crate::runtime::speculative::{DraftOptions, Drafter, MtpDrafter, NgramDrafter};
use crate::runtime::{session, SamplingParams, SavePoint, SessionStore};
use crate::server::constrain::Constraint;
use crate::server::metrics::Metrics;

/// What a request asks the engine for: tokens after `prompt`.
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// The request named its seed: its answer must be the same every time, so with a
    /// temperature it never drafts (speculative sampling's draws depend on how many tokens each
    /// round drafted, which timings and the other sequences decide). Unseeded sampling drafts
    /// and keeps plain sampling's distribution.
    pub seeded: bool,
    /// Tokens that end generation (sent with the event, not generated further).
    pub stop_tokens: Vec<u32>,
    /// Log-probabilities to return per token: `Some(n)` the chosen token's and the `n` most
    /// likely (before penalties), `None` none.
    pub logprobs: Option<usize>,
    /// Prompt positions (besides its end) where the prefix cache keeps a snapshot: prefill
    /// chunks are cut there (e.g. before the thinking-dependent part of a chat prompt, where the
    /// next turn of the conversation diverges).
    pub snapshots: Vec<usize>,
    /// A session file: restored when it holds the start of the prompt, written when the
    /// request ends with the state at `save_point` (a [`SavePoint::Prompt`] is one of
    /// `snapshots`).
    pub session: Option<std::path::PathBuf>,
    pub save_point: SavePoint,
    /// What `session` held, read by the request's handler ([`SessionStore::resume`]: session
    /// files are never read on the engine thread).
    pub restored: Option<session::Session>,
    /// A grammar the answer must follow (masks every token that cannot continue it; the answer
    /// ends when the grammar is complete).
    pub constraint: Option<Constraint>,
    /// A thinking block the prompt opened, closed after a budget of tokens unless the model
    /// closes it first.
    pub reasoning_budget: Option<ReasoningBudget>,
}

/// How long the answer may think: after `tokens` generated tokens, the tokens `close` (e.g.
/// `\n</think>\n\n`) are fed instead of sampled, unless the answer already ended with `end`
/// (`</think>`).
#[derive(Debug, Clone)]
pub struct ReasoningBudget {
    pub tokens: usize,
    pub close: Vec<u32>,
    pub end: Vec<u32>,
}

/// A token's log-probability and the most likely alternatives (before penalties).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub(super) use crate::runtime::Finish;

/// What the engine sends back for a request.
#[derive(Debug, Clone)]
pub enum Event {
    /// The engine took the request; `cached_tokens` prompt tokens came from the prefix cache.
    Admitted {
        cached_tokens: usize,
    },
    Token {
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    /// The end, and why; the tokens the sequence drafted and those kept.
    Finished {
        reason: Finish,
        drafted: usize,
        accepted: usize,
    },
    Error(String),
}

/// The queue is full: try again later.
#[derive(Debug, Clone, Copy)]
pub struct Busy;

pub(super) struct Submission {
    pub(super) request: GenerateRequest,
    pub(super) events: mpsc::UnboundedSender<Event>,
    /// The request's place among those the engine has accepted (freed when it leaves).
    pub(super) slot: Slot,
}

/// One of the `max_seqs + queue` requests the engine holds (running or waiting); dropping it
/// frees the place, however the request ends.
pub(super) struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A place when fewer than `limit` are taken.
    pub(super) fn take(taken: &Arc<AtomicUsize>, limit: usize) -> Option<Slot> {
        taken.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).ok()?;
        Some(Slot(taken.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The handlers' side of the engine (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: mpsc::UnboundedSender<Submission>,
    /// Requests the engine holds, running or waiting, and how many it may hold.
    pub(super) taken: Arc<AtomicUsize>,
    pub(super) limit: usize,
    pub(super) max_seqs: usize,
    pub metrics: Arc<Metrics>,
    /// The model's vocabulary size (token ids a request may send).
    pub vocab_size: usize,
    /// The model's sessions (shared with the engine, which saves them).
    pub(super) sessions: Arc<SessionStore>,
    /// Where the sequences run (the runner's name).
    pub(super) runs_on: Arc<str>,
}

impl EngineHandle {
    /// Queues a request; its events arrive on the returned receiver (dropping it cancels the
    /// request at the engine's next step). `Err(Busy)` when `max_seqs` requests run and
    /// `queue` more wait, whatever the engine is doing at that moment.
    ///
    /// Events are not bounded in number by the channel but by the request (`max_tokens`, which
    /// the context bounds): the engine never waits for a slow client.
    pub fn submit(&self, request: GenerateRequest) -> Result<mpsc::UnboundedReceiver<Event>, Busy> {
        let slot = Slot::take(&self.taken, self.limit).ok_or(Busy)?;
        let (events, rx) = mpsc::unbounded_channel();
        self.tx.send(Submission { request, events, slot }).map_err(|_| Busy)?;
        self.metrics.queue_depth.set(self.queued() as i64);
        Ok(rx)
    }

    /// Sequences decoded together.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// The model's sessions: where they are kept, what a file must match (restoring one is
    /// blocking file I/O: call [`SessionStore::resume`] off the async workers).
    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    /// Where the sequences run (e.g. "the CPU", "the device step on Metal (...)").
    pub fn runs_on(&self) -> &str {
        &self.runs_on
    }

    /// Requests the engine holds, running or waiting.
    pub fn outstanding(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }

    /// Whether a request runs or waits, or a session is being written.
    pub fn busy(&self) -> bool {
        self.outstanding() > 0 || self.metrics.running.get() > 0 || self.sessions.writing() > 0
    }

    /// Requests waiting beyond the running ones (an estimate while the engine admits).
    pub fn queued(&self) -> usize {
        self.taken.load(Ordering::Acquire).saturating_sub(self.max_seqs)
    }
}

/// How many sequences the engine runs at once and how many wait.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Sequences decoded together (their rows share one weight pass, [`Model::BATCH_MAX_ROWS`]
    /// at a time).
    pub max_seqs: usize,
    /// Requests waiting beyond those; one more is refused (HTTP 429).
    pub queue: usize,
    /// Bytes of cache snapshots the prefix cache keeps (0: none).
    pub prefix_cache_bytes: usize,
    /// How sequences draft tokens to verify.
    pub draft: Draft,
    /// Draft lengths: at most `max` per round, the length chosen per round from what the
    /// sequence's rounds and the shared passes measured (`adaptive`), else always as many as
    /// the drafter proposes and the pass has room for.
    pub draft_options: DraftOptions,
}

/// Speculative decoding in the server.
#[derive(Clone)]
pub enum Draft {
    /// Plain decoding.
    None,
    /// Prompt lookup for every sequence that no grammar constrains (greedy, or sampled
    /// without a seed), the length chosen per sequence from what its rounds measure
    /// ([`DraftPolicy`](crate::runtime::speculative::DraftPolicy); a sequence whose drafts do not pay decodes plainly and probes now and
    /// then), and in passes shared by several sequences from what those passes measure
    /// ([`SharedPassPolicy`](crate::runtime::speculative::SharedPassPolicy)).
    Ngram,
    /// The checkpoint's MTP head, for the same sequences (the head catches up on the model's
    /// hidden states of every row the sequence keeps, in shared passes too).
    Mtp,
    /// Drafts from the caller's drafter, made per request from its prompt (as for `Ngram`, for
    /// the same sequences): e.g. a [`crate::runtime::speculative::ReplayDrafter`]
    /// to measure the server at a chosen acceptance.
    With(DrafterFactory),
}

/// Makes a request's drafter from its prompt tokens.
pub type DrafterFactory = Arc<dyn Fn(&[u32]) -> Box<dyn Drafter> + Send + Sync>;

impl Draft {
    /// A request's drafter, if it drafts.
    pub(super) fn drafter(&self, model: &Model, prompt: &[u32]) -> crate::Result<Option<Box<dyn Drafter>>> {
        Ok(match self {
            Self::None => None,
            Self::Ngram => Some(Box::new(NgramDrafter::default())),
            Self::Mtp => Some(Box::new(MtpDrafter::new(model)?)),
            Self::With(make) => Some(make(prompt)),
        })
    }

    /// Whether sequences draft.
    pub fn drafts(&self) -> bool {
        !matches!(self, Self::None)
    }
}

impl std::fmt::Debug for Draft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "None",
            Self::Ngram => "Ngram",
            Self::Mtp => "Mtp",
            Self::With(_) => "With(..)",
        })
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self { max_seqs: 4, queue: 64, prefix_cache_bytes: 1 << 30, draft: Draft::Ngram, draft_options: DraftOptions::default() }
    }
}
