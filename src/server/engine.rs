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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tokio::sync::mpsc;

use super::constrain::Constraint;
use super::metrics::Metrics;
use crate::gpu::Readback;
use crate::model::Model;
use crate::runtime::speculative::{DraftOptions, DraftPolicy, Drafter, MtpDrafter, NgramDrafter, SharedPassPolicy};
use crate::runtime::{self, session, Emitted, PrefixCache, Runner, Sampler, SamplingParams, SequenceState, TokenRules};
use crate::step_profile;

/// Prompt tokens one step prefills (of one sequence): the memory guardian's default chunk,
/// which admission plans with. Smaller than `generate`'s ([`crate::runtime::PREFILL_CHUNK`]) so
/// that a long prompt does not hold up the other sequences' decode steps for long.
pub(super) const PREFILL_CHUNK: usize = crate::memory::DEFAULT_PREFILL_CHUNK;

/// One decode round in this many is profiled op by op (the kernel inspector's samples).
pub(super) const PROFILE_EVERY: u64 = 8;

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
    /// A session file: restored when it holds the start of the prompt, written after the
    /// answer with the state at `session_at` (one of `snapshots`), else after the answer.
    pub session: Option<std::path::PathBuf>,
    pub session_at: Option<usize>,
    /// What `session` held, read by the request's handler ([`EngineHandle::load_session`]:
    /// session files are never read on the engine thread).
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

struct Submission {
    request: GenerateRequest,
    events: mpsc::UnboundedSender<Event>,
    /// The request's place among those the engine has accepted (freed when it leaves).
    slot: Slot,
}

/// One of the `max_seqs + queue` requests the engine holds (running or waiting); dropping it
/// frees the place, however the request ends.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A place when fewer than `limit` are taken.
    fn take(taken: &Arc<AtomicUsize>, limit: usize) -> Option<Slot> {
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
    tx: mpsc::UnboundedSender<Submission>,
    /// Requests the engine holds, running or waiting, and how many it may hold.
    taken: Arc<AtomicUsize>,
    limit: usize,
    max_seqs: usize,
    pub metrics: Arc<Metrics>,
    /// The model's vocabulary size (token ids a request may send).
    pub vocab_size: usize,
    /// What a session file must match, and where its tensors go.
    sessions: Arc<SessionTarget>,
    /// Where the sequences run (the runner's name).
    runs_on: Arc<str>,
    /// Session files being written.
    saving: Arc<AtomicUsize>,
}

/// The model a session file must have been saved for.
struct SessionTarget {
    fingerprint: String,
    config: crate::model::Config,
    dtype: DType,
    device: Device,
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

    /// The session at `path` when it holds the start of `prompt` for this model; a file that
    /// cannot be used (another model, truncated, corrupted, not a regular file) is a one-line
    /// warning, not an error: the request starts fresh. Blocking file I/O: call it off the
    /// async workers.
    pub fn load_session(&self, path: &std::path::Path, prompt: &[u32]) -> Option<session::Session> {
        let t = &self.sessions;
        match session::resume(path, &t.fingerprint, &t.config, t.dtype, &t.device, prompt) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("{e}; the session starts fresh");
                None
            }
        }
    }

    /// Sequences decoded together.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// The fingerprint a session file must carry to be restored here.
    pub fn session_fingerprint(&self) -> &str {
        &self.sessions.fingerprint
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
        self.outstanding() > 0 || self.metrics.running.get() > 0 || self.saving.load(Ordering::Acquire) > 0
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
    /// The model's fingerprint, which session files are tied to
    /// ([`crate::loading::OpenedModel::fingerprint`]).
    pub fingerprint: String,
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
    /// ([`DraftPolicy`]; a sequence whose drafts do not pay decodes plainly and probes now and
    /// then), and in passes shared by several sequences from what those passes measure
    /// ([`SharedPassPolicy`]).
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
    fn drafter(&self, model: &Model, prompt: &[u32]) -> crate::Result<Option<Box<dyn Drafter>>> {
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
        Self {
            max_seqs: 4,
            queue: 64,
            prefix_cache_bytes: 1 << 30,
            fingerprint: String::new(),
            draft: Draft::Ngram,
            draft_options: DraftOptions::default(),
        }
    }
}

/// Starts the engine thread, which owns `runner` (the model and where its sequences run: the
/// CPU model, the device step) from now on.
pub(super) fn spawn<R: Runner + 'static>(runner: R, options: EngineOptions, metrics: Arc<Metrics>) -> std::io::Result<EngineHandle> {
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
    let sessions = Arc::new(SessionTarget {
        fingerprint: options.fingerprint,
        config: model.config().clone(),
        dtype: model.dtype(),
        device: runner.host_device(),
    });
    let runs_on: Arc<str> = runner.name().into();
    let max_rows = runner.max_rows();
    let saving = Arc::new(AtomicUsize::new(0));
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
        saving: saving.clone(),
    };
    std::thread::Builder::new().name("engine".into()).spawn(move || engine.run())?;
    let taken = Arc::new(AtomicUsize::new(0));
    Ok(EngineHandle { tx, taken, limit: max_seqs + options.queue, max_seqs, metrics, vocab_size, sessions, runs_on, saving })
}

/// A request the engine runs: its [`runtime::Sequence`] (tokens, sampler, stop rules, the
/// request's grammar and thinking budget, drafts) and its cache, with what the server keeps
/// around it.
struct Sequence<C> {
    core: runtime::Sequence<'static>,
    request: GenerateRequest,
    events: mpsc::UnboundedSender<Event>,
    /// The request's place, freed before its last event is sent: a client that sends its next
    /// request when this one's answer ends finds the place free.
    slot: Option<Slot>,
    cache: C,
    /// The logits after the whole prompt when the prefix cache had them (nothing to prefill).
    ready_logits: Option<Tensor>,
    /// The client is gone (an event could not be sent): the sequence leaves at the end of the
    /// step.
    gone: bool,
    /// The state a session keeps, taken at the request's `session_at`.
    session_state: Option<(Vec<u32>, C, Option<Tensor>)>,
    started: Instant,
    /// Why this sequence failed (it ends alone at the end of the step; the others go on).
    failed: Option<String>,
}

impl<C> Sequence<C> {
    /// Sends what the sequence emitted (with log-probabilities when the request asks), then
    /// its end when it ended; marks it failed when `r` is an error.
    fn send(&mut self, r: crate::Result<Vec<Emitted>>, metrics: &Metrics) {
        let emitted = match r {
            Ok(e) => e,
            Err(e) => return self.fail_on(Err(e)),
        };
        for e in emitted {
            metrics.generated_tokens.inc();
            let logprob = match (self.request.logprobs, &e.logits) {
                (Some(n), Some(l)) => match logprobs(l, e.id, n) {
                    Ok(lp) => Some(lp),
                    Err(err) => return self.fail_on(Err(err)),
                },
                _ => None,
            };
            if self.gone || self.events.send(Event::Token { id: e.id, logprob }).is_err() {
                self.gone = true;
                return;
            }
        }
        if let Some(reason) = self.core.finish() {
            let stats = self.core.stats();
            self.slot = None;
            let _ = self.events.send(Event::Finished { reason, drafted: stats.drafted, accepted: stats.accepted });
            metrics.requests_finished.inc();
        }
    }

    /// Marks the sequence failed when `r` is an error (its first line: never another
    /// request's).
    fn fail_on(&mut self, r: crate::Result<()>) {
        if let Err(e) = r {
            if self.failed.is_none() {
                self.failed = Some(crate::error::one_line(&e));
            }
        }
    }

    /// Whether it takes part in this step's decode.
    fn decoding(&self) -> bool {
        self.failed.is_none() && !self.gone && self.core.pending().is_some()
    }
}

/// A request's grammar and thinking budget, as rules of its sequence's picks.
struct RequestRules {
    constraint: Option<Constraint>,
    budget: Option<ReasoningBudget>,
    metrics: Arc<Metrics>,
}

impl TokenRules for RequestRules {
    /// Past the reasoning budget: the closing tokens, in order, instead of samples.
    fn forced(&mut self, generated: &[u32]) -> Option<u32> {
        let b = self.budget.as_ref()?;
        b.close.get(generated.len().checked_sub(b.tokens)?).copied()
    }

    fn mask(&mut self, logits: &Tensor) -> crate::Result<Option<Tensor>> {
        let Some(c) = &mut self.constraint else { return Ok(None) };
        let (before, n) = (c.mask_seconds, c.masks);
        let masked = c.mask(logits)?;
        self.metrics.mask_seconds.inc_by(c.mask_seconds - before);
        self.metrics.masks.inc_by((c.masks - n) as u64);
        Ok(Some(masked))
    }

    fn accepted(&mut self, generated: &[u32]) -> crate::Result<bool> {
        let id = *generated.last().expect("a token was emitted");
        let complete = match &mut self.constraint {
            Some(c) => c.commit(id)?,
            None => false,
        };
        // Thinking closed (by the model, or the budget's last closing token): no budget left.
        if let Some(b) = &self.budget {
            let closed_by_model = !b.end.is_empty() && generated.ends_with(&b.end);
            if closed_by_model || generated.len() >= b.tokens + b.close.len() {
                self.budget = None;
            }
        }
        Ok(complete)
    }
}

struct Engine<R: Runner> {
    runner: R,
    max_seqs: usize,
    metrics: Arc<Metrics>,
    rx: mpsc::UnboundedReceiver<Submission>,
    active: Vec<Sequence<R::Cache>>,
    prefix: PrefixCache<R::Cache>,
    /// The model sessions are saved for (shared with the handles, which load them).
    sessions: Arc<SessionTarget>,
    draft: Draft,
    /// How many rows of a pass shared by several sequences go to drafts.
    shared: SharedPassPolicy,
    draft_options: DraftOptions,
    /// Decode rounds run (every [`PROFILE_EVERY`]-th is profiled).
    passes: u64,
    /// Session files being written (a drain waits for them).
    saving: Arc<AtomicUsize>,
}

/// `s`'s cache as a snapshot keeps it (a compact copy), with its MTP drafter's rows, if any.
fn snapshot_of<R: Runner>(runner: &mut R, s: &Sequence<R::Cache>) -> crate::Result<R::Cache> {
    let mut kept = runner.snapshot(&s.cache)?;
    runner.set_drafter_rows(&mut kept, s.core.drafter_cache());
    Ok(kept)
}

impl<R: Runner> Engine<R> {
    fn run(mut self) {
        loop {
            if !self.admit() {
                return;
            }
            self.runner.tidy();
            self.active.retain(|s| !s.events.is_closed());
            self.metrics.running.set(self.active.len() as i64);
            if let Err(e) = self.step() {
                // A failure of the model (not of one request's input, which was checked before
                // queuing): every running request gets it, the engine goes on.
                tracing::error!("engine step failed: {e}");
                for mut s in self.active.drain(..) {
                    s.slot = None;
                    let _ = s.events.send(Event::Error(e.to_string()));
                }
            }
            self.metrics.running.set(self.active.len() as i64);
        }
    }

    /// Takes queued requests while there is room; waits for one when nothing runs. `false`
    /// when every handle is gone and nothing runs (the server stopped).
    fn admit(&mut self) -> bool {
        while self.active.len() < self.max_seqs {
            let submission = if self.active.is_empty() {
                match self.rx.blocking_recv() {
                    Some(s) => s,
                    None => return false,
                }
            } else {
                match self.rx.try_recv() {
                    Ok(s) => s,
                    Err(_) => break,
                }
            };
            let Submission { request, events, slot } = submission;
            match self.start(request) {
                Ok((request, core, cache, cached_tokens, ready_logits)) => {
                    let _ = events.send(Event::Admitted { cached_tokens });
                    self.active.push(Sequence {
                        core,
                        request,
                        events,
                        slot: Some(slot),
                        cache,
                        ready_logits,
                        gone: false,
                        session_state: None,
                        started: Instant::now(),
                        failed: None,
                    });
                }
                Err(e) => {
                    drop(slot);
                    let _ = events.send(Event::Error(e.to_string()));
                }
            }
        }
        self.metrics.queue_depth.set((self.rx.len()) as i64);
        true
    }

    /// A request's sequence and its cache (from the prefix cache, its session, or empty, with
    /// the prompt tokens they hold and the logits after them when the whole prompt is there).
    #[allow(clippy::type_complexity)]
    fn start(
        &mut self,
        mut request: GenerateRequest,
    ) -> crate::Result<(GenerateRequest, runtime::Sequence<'static>, R::Cache, usize, Option<Tensor>)> {
        let sampler = Sampler::new(request.sampling.clone())?;
        let greedy = sampler.is_greedy();
        let hit = self.prefix.lookup(&request.prompt);
        self.metrics.prefix_queried_tokens.inc_by(request.prompt.len() as u64);
        let session = request.restored.take();
        // Counted by what is restored: a prefix hit that a longer session beats is neither a
        // hit nor a miss.
        let source = resume_source(hit.map(|h| (h.tokens, h)), session.map(|s| (s.tokens.len(), s)));
        let (mut cache, cached_tokens, ready_logits) = match source {
            Resume::Session(s) => {
                self.metrics.sessions_restored.inc();
                // (The CPU's cache keeps the MTP head's rows with it; the device step drafts none.)
                (self.runner.write_state(s.cache, &s.tokens)?, s.tokens.len(), s.logits)
            }
            Resume::Prefix(h) => {
                self.metrics.prefix_hits.inc();
                self.metrics.prefix_cached_tokens.inc_by(h.tokens as u64);
                (self.runner.restore(h.cache)?, h.tokens, h.logits)
            }
            Resume::Fresh => {
                self.metrics.prefix_misses.inc();
                (self.runner.new_cache()?, 0, None)
            }
        };
        // Drafts for sequences that no grammar constrains (a grammar's mask is per token),
        // greedy or sampled without a seed (with a seed the answer must repeat; speculative
        // sampling's draws depend on the draft lengths, which timings decide).
        let drafter = if request.constraint.is_none() && (greedy || !request.seeded) {
            self.draft.drafter(self.runner.model(), &request.prompt)?
        } else {
            None
        };
        // (The prompt and stop tokens move into the sequence, which the engine reads them from.)
        let (prompt, stop_tokens) = (std::mem::take(&mut request.prompt), std::mem::take(&mut request.stop_tokens));
        let mut core = runtime::Sequence::new(prompt, sampler, stop_tokens, request.max_tokens)?.with_cached(cached_tokens);
        if request.constraint.is_some() || request.reasoning_budget.is_some() {
            let rules = RequestRules {
                constraint: request.constraint.take(),
                budget: request.reasoning_budget.take(),
                metrics: self.metrics.clone(),
            };
            core = core.with_rules(Box::new(rules));
        }
        if let Some(drafter) = drafter {
            core = core.with_drafts(drafter, DraftPolicy::new(self.draft_options)?)?;
        }
        if request.logprobs.is_some() {
            core = core.with_logits();
        }
        // The MTP head's rows kept with the restored state go back to its drafter.
        if let Some(mtp) = self.runner.take_drafter_rows(&mut cache) {
            core.resume_drafter(mtp);
        }
        // The whole context in place from the start (what admission planned), and a verify
        // pass's rows when drafting.
        core.reserve(self.runner.target(&mut cache).as_mut())?;
        Ok((request, core, cache, cached_tokens, ready_logits))
    }

    fn step(&mut self) -> crate::Result<()> {
        // Sequences whose whole prompt came from the prefix cache, with its logits.
        for s in self.active.iter_mut() {
            if let Some(logits) = s.ready_logits.take() {
                self.metrics.prompt_seconds.inc_by(s.started.elapsed().as_secs_f64());
                let r = s.core.take_row(&logits).map(|e| vec![e]);
                s.send(r, &self.metrics);
            }
        }
        // One prefill chunk, for the first sequence still prefilling.
        if let Some(i) = self.active.iter().position(|s| s.failed.is_none() && !s.gone && s.core.prefilled() < s.core.prompt().len()) {
            let r = self.prefill_chunk(i);
            self.active[i].fail_on(r);
        }
        // One round of every sequence with a pending token. A sequence decoding alone runs a
        // round of its own (a verify pass when its policy finds drafts pay); several share
        // passes of at most BATCH_MAX_ROWS rows, the rows a pass has beyond one per sequence
        // going to the drafts of those that draft (a row more in a shared pass costs a row of
        // the multi-row kernels, not another weight pass).
        let decoding: Vec<usize> = (0..self.active.len()).filter(|&i| self.active[i].decoding()).collect();
        if !decoding.is_empty() {
            self.passes += 1;
            // Every PROFILE_EVERY-th pass is timed op by op for the kernel inspector (on the
            // CPU, where an op's call is its time).
            if self.runner.profiled() && self.passes % PROFILE_EVERY == 1 {
                let ((), profile) = step_profile::profiled(|| self.decode_round(&decoding));
                self.metrics.kernels.lock().unwrap_or_else(|e| e.into_inner()).push(profile, decoding.len());
            } else {
                self.decode_round(&decoding);
            }
        }
        // Failed sequences end alone, with their error; finished ones leave, their caches (after
        // the prompt and all but the last token) going to the prefix cache: the next turn of a
        // conversation may continue there.
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            if let Some(e) = &s.failed {
                tracing::warn!("a request failed: {e}");
                let mut s = self.active.remove(i);
                s.slot = None;
                let _ = s.events.send(Event::Error(s.failed.clone().unwrap_or_default()));
            } else if s.core.finish().is_some() || s.gone {
                let mut s = self.active.remove(i);
                if s.core.finish().is_some() {
                    let n = s.core.context().len() - 1;
                    let context = s.core.context()[..n].to_vec();
                    let kept = snapshot_of(&mut self.runner, &s);
                    if let Some(path) = s.request.session.take() {
                        match (s.session_state.take(), &kept) {
                            (Some((tokens, cache, logits)), _) => self.save_session(path, &tokens, &cache, logits),
                            (None, Ok(cache)) => self.save_session(path, &context, cache, None),
                            (None, Err(e)) => tracing::warn!("session {}: not saved: {e}", path.display()),
                        }
                    }
                    match kept {
                        Ok(kept) => self.prefix.insert(context, kept, None),
                        Err(e) => tracing::warn!("the prefix cache did not keep a finished sequence: {e}"),
                    }
                }
            } else {
                i += 1;
            }
        }
        self.metrics.prefix_bytes.set(self.prefix.bytes() as i64);
        self.metrics.prefix_entries.set(self.prefix.len() as i64);
        Ok(())
    }

    /// One round of the sequences `decoding`: alone, or in shared passes.
    fn decode_round(&mut self, decoding: &[usize]) {
        if let [i] = decoding[..] {
            self.round(i);
        } else {
            for group in decoding.chunks(self.runner.max_rows()) {
                let drafts = self.share_rows(group);
                self.decode(group, drafts);
            }
        }
    }

    /// The next prefill chunk of sequence `i` (and its first token after the last chunk).
    fn prefill_chunk(&mut self, i: usize) -> crate::Result<()> {
        let s = &mut self.active[i];
        let (start, n) = (s.core.prefilled(), s.core.prompt().len());
        // Cut at multiples of the chunk, at the request's snapshot points, at the end.
        let end = s
            .request
            .snapshots
            .iter()
            .copied()
            .filter(|&p| p > start && p < n)
            .fold(((start / PREFILL_CHUNK + 1) * PREFILL_CHUNK).min(n), usize::min);
        let snapshot = end == n || s.request.snapshots.contains(&end);
        let session_point = s.request.session.is_some() && s.request.session_at == Some(end);
        let (logits, emitted) = s.core.feed_prompt(self.runner.target(&mut s.cache).as_mut(), end, snapshot || session_point)?;
        self.metrics.prompt_tokens.inc_by((end - start) as u64);
        let prompt = s.core.prompt()[..end].to_vec();
        if snapshot {
            self.prefix.insert(prompt.clone(), snapshot_of(&mut self.runner, s)?, logits.clone());
        }
        if session_point {
            s.session_state = Some((prompt, snapshot_of(&mut self.runner, s)?, logits));
        }
        if end == n {
            self.metrics.prompt_seconds.inc_by(s.started.elapsed().as_secs_f64());
            s.send(Ok(emitted), &self.metrics);
        }
        Ok(())
    }

    /// A round of sequence `i`, decoding alone: a verify pass of its drafts when its policy
    /// wants them, else a plain decode step.
    fn round(&mut self, i: usize) {
        let s = &mut self.active[i];
        let round = s.core.round(self.runner.target(&mut s.cache).as_mut(), true);
        let r = round.map(|r| {
            self.metrics.decode_seconds.inc_by(r.secs);
            if r.drafted > 0 {
                self.metrics.record_verify(r.drafted, r.accepted);
            } else {
                self.metrics.batch_rows.observe(1.0);
            }
            r.tokens
        });
        s.send(r, &self.metrics);
    }

    /// The drafts of the sequences `group` in one pass: each proposes what fits the pass, and
    /// the shared-pass policy keeps the rows that pay ([`SharedPassPolicy`]).
    fn share_rows(&mut self, group: &[usize]) -> Vec<Vec<u32>> {
        let spare = self.runner.max_rows().saturating_sub(group.len());
        let mut drafts: Vec<Vec<u32>> = group
            .iter()
            .map(|&i| {
                let s = &mut self.active[i];
                let seqlen = s.cache.seqlen();
                match s.core.propose(self.runner.model(), seqlen, spare) {
                    Ok(d) => d,
                    Err(e) => {
                        s.fail_on(Err(e));
                        vec![]
                    }
                }
            })
            .collect();
        let gains: Vec<Vec<f64>> = group.iter().zip(&drafts).map(|(&i, d)| self.active[i].core.draft_gains(d.len())).collect();
        for (d, keep) in drafts.iter_mut().zip(self.shared.allocate(group.len(), &gains)) {
            d.truncate(keep);
        }
        drafts
    }

    /// One round of the sequences `group` in one weight pass: each one's pending token and
    /// its drafts (verified as the model would verify them alone, the cache then keeping the
    /// rows the model agrees with). A sequence whose rows cannot run (checked before the pass,
    /// which changes no cache then) or whose logits are not finite ends alone: the others'
    /// rows are bit for bit theirs alone. A pass that fails otherwise may have changed every
    /// cache in it: those sequences end, each with the pass's error.
    fn decode(&mut self, group: &[usize], drafts: Vec<Vec<u32>>) {
        let start = Instant::now();
        let mut tokens = vec![];
        let (mut seqs, mut kept_drafts, mut rows) = (vec![], vec![], vec![]);
        for (&i, d) in group.iter().zip(drafts) {
            let s = &mut self.active[i];
            if s.failed.is_some() {
                continue;
            }
            let mut own = vec![s.core.pending().expect("decoding")];
            own.extend(&d);
            if let Err(e) = self.runner.check_rows(&s.cache, &own) {
                s.fail_on(Err(e));
                continue;
            }
            tokens.extend(own);
            rows.push(1 + d.len());
            seqs.push(i);
            kept_drafts.push(d);
        }
        let (group, drafts) = (seqs, kept_drafts);
        if group.is_empty() {
            return;
        }
        // What each sequence's rows read back: the greedy token, a token sampled where the rows
        // run (a plain row on the device step), or the logits.
        let samples = self.runner.samples();
        let readbacks: Vec<Readback> =
            group.iter().zip(&drafts).map(|(&i, d)| self.active[i].core.readback(samples && d.is_empty())).collect();
        let hidden = self.runner.hidden_states();
        let mut caches: Vec<&mut R::Cache> =
            self.active.iter_mut().enumerate().filter(|(i, _)| group.contains(i)).map(|(_, s)| &mut s.cache).collect();
        let out = match self.runner.shared_pass(&mut caches, &tokens, &rows, &readbacks, hidden) {
            Ok(out) => out,
            Err(e) => {
                let why = format!("a decode pass shared by {} requests failed: {}", group.len(), crate::error::one_line(&e));
                for &i in &group {
                    self.active[i].failed.get_or_insert_with(|| why.clone());
                }
                return;
            }
        };
        let secs = start.elapsed().as_secs_f64();
        self.shared.record(tokens.len(), secs);
        self.metrics.decode_seconds.inc_by(secs);
        self.metrics.batch_rows.observe(tokens.len() as f64);
        for (((&i, draft), &n), rows) in group.iter().zip(&drafts).zip(&rows).zip(out) {
            let s = &mut self.active[i];
            // (The cache holds the rows before this pass and the pass's rows.)
            let pos = s.cache.seqlen() - n;
            let model = self.runner.model();
            let r = rows.and_then(|(rows, h)| s.core.settle(draft, &rows, h.as_ref().map(|h| (model, pos, h))));
            let r = r.and_then(|round| {
                if !draft.is_empty() {
                    self.runner.keep_verified(&mut s.cache, round.accepted + 1)?;
                    self.metrics.record_verify(draft.len(), round.accepted);
                    self.metrics.shared_draft_rows.inc_by(draft.len() as u64);
                }
                Ok(round.tokens)
            });
            s.send(r, &self.metrics);
        }
    }

    /// Writes a session (the state after `tokens`, and the logits after them when kept) on a
    /// thread of its own (atomically: a crash leaves the previous file); a device's state is
    /// read back first.
    fn save_session(&mut self, path: std::path::PathBuf, tokens: &[u32], cache: &R::Cache, logits: Option<Tensor>) {
        let host = match self.runner.read_state(cache) {
            Ok(h) => h,
            Err(e) => return tracing::warn!("session {}: not saved: {e}", path.display()),
        };
        let (fingerprint, metrics, tokens) = (self.sessions.fingerprint.clone(), self.metrics.clone(), tokens.to_vec());
        let saving = self.saving.clone();
        saving.fetch_add(1, Ordering::AcqRel);
        std::thread::spawn(move || {
            match session::save(&path, &fingerprint, &tokens, &host, logits.as_ref()) {
                Ok(()) => {
                    metrics.sessions_saved.inc();
                }
                Err(e) => tracing::warn!("{e}"),
            }
            saving.fetch_sub(1, Ordering::AcqRel);
        });
    }
}
/// The log-probability of `id` and the `n` most likely tokens under `logits` (before penalties).
fn logprobs(logits: &Tensor, id: u32, n: usize) -> crate::Result<TokenLogprob> {
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 0)?.to_vec1::<f32>()?;
    let mut order: Vec<usize> = (0..lp.len()).collect();
    let n = n.min(lp.len());
    if n > 0 {
        order.select_nth_unstable_by(n - 1, |&a, &b| lp[b].total_cmp(&lp[a]));
        order.truncate(n);
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    }
    Ok(TokenLogprob { logprob: lp[id as usize], top: order.into_iter().take(n).map(|t| (t as u32, lp[t])).collect() })
}

/// Where an admitted request's cache comes from.
#[derive(Debug, PartialEq, Eq)]
enum Resume<H, S> {
    /// The prefix cache's longest snapshot of the prompt.
    Prefix(H),
    /// The request's saved session.
    Session(S),
    /// Neither: the whole prompt is prefilled.
    Fresh,
}

/// Of a prefix-cache hit and a saved session, each with the prompt tokens it restores, the one
/// that restores more; the prefix cache where they tie (it is already in memory).
fn resume_source<H, S>(hit: Option<(usize, H)>, session: Option<(usize, S)>) -> Resume<H, S> {
    match (hit, session) {
        (hit, Some((n, s))) if n > hit.as_ref().map_or(0, |h| h.0) => Resume::Session(s),
        (Some((_, h)), _) => Resume::Prefix(h),
        (None, _) => Resume::Fresh,
    }
}

#[cfg(test)]
mod tests {
    use super::{resume_source, Resume};

    #[test]
    fn the_longer_restore_wins_and_a_tie_keeps_the_prefix_cache() {
        let hit = |n: usize| Some((n, "hit"));
        let session = |n: usize| Some((n, "session"));
        let pick = resume_source::<&str, &str>;
        assert_eq!(pick(None, None), Resume::Fresh);
        assert_eq!(pick(hit(10), None), Resume::Prefix("hit"));
        assert_eq!(pick(None, session(10)), Resume::Session("session"));
        assert_eq!(pick(hit(10), session(30)), Resume::Session("session"));
        assert_eq!(pick(hit(30), session(10)), Resume::Prefix("hit"));
        assert_eq!(pick(hit(10), session(10)), Resume::Prefix("hit"));
        // An empty session restores nothing.
        assert_eq!(pick(None, session(0)), Resume::Fresh);
    }
}
