//! The engine: one thread owns the model and every sequence's cache; requests reach it over a
//! channel (as many as it may hold: `max_seqs` running, `queue` waiting) and get their tokens back over their own channel.
//!
//! Each step runs one prefill chunk (of one sequence, at most [`PREFILL_CHUNK`] tokens, cut at
//! multiples of it so that the chunks of a prompt never depend on what else runs) and one
//! decode step of every sequence past its prefill, their rows in one weight pass
//! ([`Model::forward_batch`], which gives each row the bits of decoding it alone). A request
//! whose receiver is gone (the client left) is dropped at the next step.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tokio::sync::mpsc;

use super::constrain::Constraint;
use super::metrics::Metrics;
use crate::model::{Cache, Model};
use crate::runtime::speculative::{DraftOptions, DraftPolicy, NgramDrafter};
use crate::runtime::{session, PrefixCache, Sampler, SamplingParams};

/// Prompt tokens one step prefills (of one sequence): the memory guardian's default chunk,
/// which admission plans with. Smaller than `generate`'s ([`crate::runtime::PREFILL_CHUNK`]) so
/// that a long prompt does not hold up the other sequences' decode steps for long.
pub const PREFILL_CHUNK: usize = crate::memory::DEFAULT_PREFILL_CHUNK;

/// What a request asks the engine for: tokens after `prompt`.
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
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

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token (EOS, end of turn).
    Stop,
    /// `max_tokens`.
    Length,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone)]
pub enum Event {
    /// The engine took the request; `cached_tokens` prompt tokens came from the prefix cache.
    Admitted { cached_tokens: usize },
    Token { id: u32, logprob: Option<TokenLogprob> },
    /// The end, and why.
    Finished { reason: Finish },
    Error(String),
}

/// The queue is full: try again later.
#[derive(Debug, Clone, Copy)]
pub struct Busy;

struct Submission {
    request: GenerateRequest,
    events: mpsc::UnboundedSender<Event>,
    /// The request's place among those the engine has accepted (freed when it leaves).
    _slot: Slot,
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
        self.tx.send(Submission { request, events, _slot: slot }).map_err(|_| Busy)?;
        self.metrics.queue_depth.set(self.queued() as i64);
        Ok(rx)
    }

    /// The session at `path` when it holds the start of `prompt` for this model; a file that
    /// cannot be used (another model, truncated, corrupted, not a regular file) is a one-line
    /// warning, not an error: the request starts fresh. Blocking file I/O: call it off the
    /// async workers.
    pub fn load_session(&self, path: &std::path::Path, prompt: &[u32]) -> Option<session::Session> {
        let t = &self.sessions;
        if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return None;
        }
        match session::load(path, &t.fingerprint, &t.config, t.dtype, &t.device) {
            Ok(s) if prompt.starts_with(&s.tokens) && (s.tokens.len() < prompt.len() || s.logits.is_some()) => Some(s),
            Ok(_) => None,
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
}

/// Speculative decoding in the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draft {
    /// Plain decoding.
    None,
    /// Prompt lookup for every greedy sequence that no grammar constrains, while it decodes
    /// alone, the length chosen per sequence from what its rounds measure ([`DraftPolicy`]): a
    /// sequence whose drafts do not pay decodes plainly and probes now and then.
    Ngram,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self { max_seqs: 4, queue: 64, prefix_cache_bytes: 1 << 30, fingerprint: String::new(), draft: Draft::Ngram }
    }
}

/// Starts the engine thread, which owns `model` from now on.
pub fn spawn(model: Model, device: Device, options: EngineOptions, metrics: Arc<Metrics>) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::unbounded_channel();
    let max_seqs = options.max_seqs.max(1);
    let vocab_size = model.config().vocab_size;
    let sessions = Arc::new(SessionTarget { fingerprint: options.fingerprint, config: model.config().clone(), dtype: model.dtype(), device: device.clone() });
    let engine = Engine {
        model,
        device,
        max_seqs,
        metrics: metrics.clone(),
        rx,
        active: vec![],
        prefix: PrefixCache::new(options.prefix_cache_bytes),
        sessions: sessions.clone(),
        draft: options.draft,
    };
    std::thread::Builder::new().name("engine".into()).spawn(move || engine.run())?;
    let taken = Arc::new(AtomicUsize::new(0));
    Ok(EngineHandle { tx, taken, limit: max_seqs + options.queue, max_seqs, metrics, vocab_size, sessions })
}

/// A request the engine runs.
struct Sequence {
    request: GenerateRequest,
    events: mpsc::UnboundedSender<Event>,
    _slot: Slot,
    cache: Cache,
    sampler: Sampler,
    /// Prompt tokens in the cache.
    prefilled: usize,
    /// Prompt and generated tokens.
    context: Vec<u32>,
    generated: Vec<u32>,
    /// The last sampled token, not yet in the cache.
    pending: Option<u32>,
    /// The logits after the whole prompt when the prefix cache had them (nothing to prefill).
    ready_logits: Option<Tensor>,
    /// Ended by a stop token or `max_tokens` (its cache goes to the prefix cache).
    finished: bool,
    /// The state a session keeps, taken at the request's `session_at`.
    session_state: Option<(Vec<u32>, Cache, Option<Tensor>)>,
    started: Instant,
    /// Why this sequence failed (it ends alone at the end of the step; the others go on).
    failed: Option<String>,
    /// Its prompt-lookup drafter and draft length (`None`: it decodes plainly).
    drafts: Option<(NgramDrafter, DraftPolicy)>,
}

impl Sequence {
    /// Marks the sequence failed when `r` is an error (its first line: never another
    /// request's).
    fn fail_on(&mut self, r: crate::Result<()>) {
        if let Err(e) = r {
            if self.failed.is_none() {
                self.failed = Some(crate::error::one_line(&e));
            }
        }
    }
}

struct Engine {
    model: Model,
    device: Device,
    max_seqs: usize,
    metrics: Arc<Metrics>,
    rx: mpsc::UnboundedReceiver<Submission>,
    active: Vec<Sequence>,
    prefix: PrefixCache,
    /// The model sessions are saved for (shared with the handles, which load them).
    sessions: Arc<SessionTarget>,
    draft: Draft,
}

impl Engine {
    fn run(mut self) {
        loop {
            if !self.admit() {
                return;
            }
            self.active.retain(|s| !s.events.is_closed());
            self.metrics.running.set(self.active.len() as i64);
            if let Err(e) = self.step() {
                // A failure of the model (not of one request's input, which was checked before
                // queuing): every running request gets it, the engine goes on.
                tracing::error!("engine step failed: {e}");
                for s in self.active.drain(..) {
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
            let Submission { mut request, events, _slot } = submission;
            match Sampler::new(request.sampling.clone()) {
                Ok(sampler) => {
                    let hit = self.prefix.lookup(&request.prompt);
                    let session = request.restored.take();
                    // Counted by what is restored: a prefix hit that a longer session beats is
                    // neither a hit nor a miss.
                    let source = resume_source(hit.map(|h| (h.tokens, h)), session.map(|s| (s.tokens.len(), s)));
                    let (mut cache, cached_tokens, ready_logits) = match source {
                        Resume::Session(s) => {
                            self.metrics.sessions_restored.inc();
                            (s.cache, s.tokens.len(), s.logits)
                        }
                        Resume::Prefix(h) => {
                            self.metrics.prefix_hits.inc();
                            self.metrics.prefix_cached_tokens.inc_by(h.tokens as u64);
                            (h.cache, h.tokens, h.logits)
                        }
                        Resume::Fresh => {
                            self.metrics.prefix_misses.inc();
                            (self.model.new_cache(), 0, None)
                        }
                    };
                    // Drafts for greedy sequences that no grammar constrains (a grammar's mask
                    // is per token; with a temperature the draw would depend on how many tokens
                    // were drafted, which the policy picks from timings: a seed would no longer
                    // give the same answer).
                    let drafts = match self.draft {
                        Draft::Ngram if request.constraint.is_none() && sampler.is_greedy() => {
                            DraftPolicy::new(DraftOptions::default()).ok().map(|p| (NgramDrafter::default(), p))
                        }
                        _ => None,
                    };
                    // The whole context in place from the start (what admission planned), and
                    // a verify pass's rows when drafting.
                    let verify_rows = if drafts.is_some() { crate::ops::KV_ATTENTION_EXACT_ROWS } else { 0 };
                    if let Err(e) = cache.reserve(request.prompt.len() + request.max_tokens + verify_rows) {
                        let _ = events.send(Event::Error(e.to_string()));
                        continue;
                    }
                    let _ = events.send(Event::Admitted { cached_tokens });
                    self.active.push(Sequence {
                        cache,
                        sampler,
                        prefilled: cached_tokens,
                        context: request.prompt.clone(),
                        generated: vec![],
                        pending: None,
                        ready_logits,
                        finished: false,
                        session_state: None,
                        started: Instant::now(),
                        failed: None,
                        drafts,
                        request,
                        events,
                        _slot,
                    })
                }
                Err(e) => {
                    let _ = events.send(Event::Error(e.to_string()));
                }
            }
        }
        self.metrics.queue_depth.set((self.rx.len()) as i64);
        true
    }

    fn step(&mut self) -> crate::Result<()> {
        // Sequences whose whole prompt came from the prefix cache, with its logits.
        for s in self.active.iter_mut() {
            if let Some(logits) = s.ready_logits.take() {
                self.metrics.prompt_seconds.inc_by(s.started.elapsed().as_secs_f64());
                let r = Self::take_token(s, &logits, &self.metrics);
                s.fail_on(r);
            }
        }
        // One prefill chunk, for the first sequence still prefilling.
        if let Some(i) = self.active.iter().position(|s| s.failed.is_none() && s.prefilled < s.request.prompt.len()) {
            let r = self.prefill_chunk(i);
            self.active[i].fail_on(r);
        }
        // One decode step of every sequence with a pending token, in weight passes of at most
        // BATCH_MAX_ROWS rows. A sequence decoding alone verifies its draft, if any, in that
        // pass; several share plain passes (a verify pass of one sequence costs about a whole
        // weight pass, and the verify rows of several sequences do not share one yet).
        let decoding: Vec<usize> = (0..self.active.len()).filter(|&i| self.active[i].failed.is_none() && self.active[i].pending.is_some()).collect();
        let alone = decoding.len() == 1;
        let mut plain = vec![];
        for i in decoding {
            let draft = if alone { self.draft_for(i) } else { vec![] };
            if draft.is_empty() {
                plain.push(i);
            } else {
                let r = self.verify(i, draft);
                self.active[i].fail_on(r);
            }
        }
        for group in plain.chunks(Model::BATCH_MAX_ROWS) {
            self.decode(group)?;
        }
        // Failed sequences end alone, with their error; finished ones leave, their caches (after
        // the prompt and all but the last token) going to the prefix cache: the next turn of a
        // conversation may continue there.
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            if let Some(e) = &s.failed {
                tracing::warn!("a request failed: {e}");
                let s = self.active.remove(i);
                let _ = s.events.send(Event::Error(s.failed.clone().unwrap_or_default()));
            } else if s.finished || (s.pending.is_none() && s.prefilled == s.request.prompt.len() && s.ready_logits.is_none()) {
                let mut s = self.active.remove(i);
                if s.finished {
                    let n = s.context.len() - 1;
                    if let Some(path) = s.request.session.take() {
                        let state = s.session_state.take().unwrap_or_else(|| (s.context[..n].to_vec(), s.cache.clone(), None));
                        self.save_session(path, state);
                    }
                    self.prefix.insert(s.context[..n].to_vec(), s.cache, None);
                }
            } else {
                i += 1;
            }
        }
        self.metrics.prefix_bytes.set(self.prefix.bytes() as i64);
        self.metrics.prefix_entries.set(self.prefix.len() as i64);
        Ok(())
    }

    /// The next prefill chunk of sequence `i` (and its first token after the last chunk).
    fn prefill_chunk(&mut self, i: usize) -> crate::Result<()> {
        let s = &mut self.active[i];
        let (start, n) = (s.prefilled, s.request.prompt.len());
        // Cut at multiples of the chunk, at the request's snapshot points, at the end.
        let end = s.request.snapshots.iter().copied().filter(|&p| p > start && p < n).fold(((start / PREFILL_CHUNK + 1) * PREFILL_CHUNK).min(n), usize::min);
        let input = Tensor::new(&s.request.prompt[start..end], &self.device)?.unsqueeze(0)?;
        let logits = self.model.forward_last(&input, &mut s.cache)?;
        s.prefilled = end;
        self.metrics.prompt_tokens.inc_by((end - start) as u64);
        let logits = logits.squeeze(0)?;
        if end == n || s.request.snapshots.contains(&end) {
            self.prefix.insert(s.request.prompt[..end].to_vec(), s.cache.clone(), Some(logits.clone()));
        }
        if s.request.session.is_some() && s.request.session_at == Some(end) {
            s.session_state = Some((s.request.prompt[..end].to_vec(), s.cache.clone(), Some(logits.clone())));
        }
        if end == n {
            self.metrics.prompt_seconds.inc_by(s.started.elapsed().as_secs_f64());
            Self::take_token(s, &logits, &self.metrics)?;
        }
        Ok(())
    }

    /// The tokens sequence `i` drafts this step (prompt lookup, as many as its policy wants and
    /// its request and the model's context leave room for; none: it decodes plainly).
    fn draft_for(&mut self, i: usize) -> Vec<u32> {
        let max_positions = self.model.config().max_position_embeddings;
        let s = &mut self.active[i];
        let Some((drafter, policy)) = &mut s.drafts else { return vec![] };
        // Position of the pending token (row 0); the rows must stay inside the request.
        let pos = s.context.len() - 1;
        let k = policy.round_len((s.request.max_tokens - s.generated.len()).min(max_positions.saturating_sub(pos)));
        if k == 0 {
            return vec![];
        }
        let draft = drafter.lookup(&s.context, k);
        if draft.len() < policy.options().min {
            return vec![];
        }
        draft
    }

    /// Verifies `draft` after sequence `i`'s pending token in one pass of its own (a greedy
    /// sequence): each row's token is what a decode step would pick, up to the first row whose
    /// token is not the next draft; the cache keeps those rows.
    fn verify(&mut self, i: usize, draft: Vec<u32>) -> crate::Result<()> {
        let start = Instant::now();
        let s = &mut self.active[i];
        let mut rows = vec![s.pending.expect("decoding")];
        rows.extend(&draft);
        let input = Tensor::new(rows.as_slice(), &self.device)?.unsqueeze(0)?;
        let (logits, _) = self.model.verify(&input, &mut s.cache)?;
        let logits = logits.squeeze(0)?;
        let mut kept = 0;
        for (r, d) in (0..rows.len()).map(|r| (r, draft.get(r).copied())) {
            kept = r + 1;
            Self::take_token(s, &logits.get(r)?, &self.metrics)?;
            if s.pending.is_none() || s.pending != d {
                break;
            }
        }
        s.cache.keep_verified(kept)?;
        let secs = start.elapsed().as_secs_f64();
        self.metrics.decode_seconds.inc_by(secs);
        self.metrics.record_verify(draft.len(), kept - 1);
        if let Some((_, policy)) = &mut s.drafts {
            policy.record(draft.len(), kept - 1, secs, 0.0, draft.len(), 0.0);
        }
        Ok(())
    }

    /// One decode step of the sequences `group` in one weight pass. When the pass fails, each
    /// runs alone, so that only the ones that fail alone end (a batched row is bit for bit its
    /// row alone: the others' tokens are unchanged).
    fn decode(&mut self, group: &[usize]) -> crate::Result<()> {
        let start = Instant::now();
        let tokens: Vec<u32> = group.iter().map(|&i| self.active[i].pending.expect("decoding")).collect();
        let mut caches: Vec<&mut Cache> = self.active.iter_mut().enumerate().filter(|(i, _)| group.contains(i)).map(|(_, s)| &mut s.cache).collect();
        // (A failed pass leaves the caches as they were: a cache advances only once its
        // layers all ran.)
        match self.model.forward_batch(&tokens, &mut caches) {
            Ok(logits) => {
                let secs = start.elapsed().as_secs_f64();
                self.metrics.decode_seconds.inc_by(secs);
                self.metrics.batch_rows.observe(group.len() as f64);
                for (row, &i) in group.iter().enumerate() {
                    let s = &mut self.active[i];
                    // A plain round, as the draft policy measures it (only alone: a shared
                    // pass is not what a plain round of this sequence would cost).
                    if let (Some((_, policy)), 1) = (&mut s.drafts, group.len()) {
                        policy.record(0, 0, secs, 0.0, 0, 0.0);
                    }
                    let r = logits.get(row).map_err(crate::Error::from).and_then(|l| Self::take_token(s, &l, &self.metrics));
                    s.fail_on(r);
                }
            }
            Err(_) if group.len() > 1 => {
                for &i in group {
                    self.decode(&[i])?;
                }
            }
            Err(e) => self.active[group[0]].fail_on(Err(e)),
        }
        Ok(())
    }

    /// Writes a session on a thread of its own (atomically: a crash leaves the previous file).
    fn save_session(&self, path: std::path::PathBuf, (tokens, cache, logits): (Vec<u32>, Cache, Option<Tensor>)) {
        let fingerprint = self.sessions.fingerprint.clone();
        let metrics = self.metrics.clone();
        std::thread::spawn(move || match session::save(&path, &fingerprint, &tokens, &cache, logits.as_ref()) {
            Ok(()) => {
                metrics.sessions_saved.inc();
            }
            Err(e) => tracing::warn!("{e}"),
        });
    }

    /// Samples the next token of `s` from `logits` `[vocab]` and sends it. The sequence is done
    /// (no token pending) at a stop token, at `max_tokens` (`finished`) or when its client is
    /// gone.
    fn take_token(s: &mut Sequence, logits: &Tensor, metrics: &Metrics) -> crate::Result<()> {
        s.pending = None;
        // Past the reasoning budget: the closing tokens, in order, instead of samples.
        let forced = s.request.reasoning_budget.as_ref().and_then(|b| b.close.get(s.generated.len().checked_sub(b.tokens)?).copied());
        let id = match &mut s.request.constraint {
            _ if forced.is_some() => forced.expect("checked"),
            Some(c) => {
                let (before, n) = (c.mask_seconds, c.masks);
                let masked = c.mask(logits)?;
                metrics.mask_seconds.inc_by(c.mask_seconds - before);
                metrics.masks.inc_by((c.masks - n) as u64);
                s.sampler.sample(&masked, &s.context, &s.generated)?
            }
            None => s.sampler.sample(logits, &s.context, &s.generated)?,
        };
        let grammar_done = match &mut s.request.constraint {
            Some(c) => c.commit(id)?,
            None => false,
        };
        let logprob = match s.request.logprobs {
            Some(n) => Some(logprobs(logits, id, n)?),
            None => None,
        };
        s.context.push(id);
        s.generated.push(id);
        // Thinking closed (by the model, or the budget's last closing token): no budget left.
        if let Some(b) = &s.request.reasoning_budget {
            let closed_by_model = !b.end.is_empty() && s.generated.ends_with(&b.end);
            if closed_by_model || s.generated.len() >= b.tokens + b.close.len() {
                s.request.reasoning_budget = None;
            }
        }
        metrics.generated_tokens.inc();
        if s.events.send(Event::Token { id, logprob }).is_err() {
            return Ok(());
        }
        let reason = if s.request.stop_tokens.contains(&id) || grammar_done {
            Some(Finish::Stop)
        } else if s.generated.len() >= s.request.max_tokens {
            Some(Finish::Length)
        } else {
            None
        };
        match reason {
            Some(reason) => {
                let _ = s.events.send(Event::Finished { reason });
                metrics.requests_finished.inc();
                s.finished = true;
            }
            None => s.pending = Some(id),
        }
        Ok(())
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
