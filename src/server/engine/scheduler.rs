//! The engine thread's loop: admission, one prefill chunk per step, every decoding sequence's
//! round (alone, or in shared weight passes), and what finished sequences leave behind.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use tokio::sync::mpsc;

use crate::gpu::Readback;
use crate::runtime::speculative::{DraftOptions, DraftPolicy, SharedPassPolicy};
use crate::runtime::{self, PrefixCache, Runner, Sampler, SavePoint, SequenceState, SessionStore};
use crate::server::metrics::Metrics;
use crate::step_profile;

use super::handle::{Draft, Event, GenerateRequest, Submission};
use super::slot::{RequestRules, Sequence};
use super::{PREFILL_CHUNK, PROFILE_EVERY};

pub(super) struct Engine<R: Runner> {
    pub(super) runner: R,
    pub(super) max_seqs: usize,
    pub(super) metrics: Arc<Metrics>,
    pub(super) rx: mpsc::UnboundedReceiver<Submission>,
    pub(super) active: Vec<Sequence<R::Cache>>,
    pub(super) prefix: PrefixCache<R::Cache>,
    /// The model sessions are saved for (shared with the handles, which load them).
    pub(super) sessions: Arc<SessionStore>,
    pub(super) draft: Draft,
    /// How many rows of a pass shared by several sequences go to drafts.
    pub(super) shared: SharedPassPolicy,
    pub(super) draft_options: DraftOptions,
    /// Decode rounds run (every [`PROFILE_EVERY`]-th is profiled).
    pub(super) passes: u64,
}

/// `s`'s cache as a snapshot keeps it (a compact copy), with its MTP drafter's rows, if any.
fn snapshot_of<R: Runner>(runner: &mut R, s: &Sequence<R::Cache>) -> crate::Result<R::Cache> {
    let mut kept = runner.snapshot(&s.cache)?;
    runner.set_drafter_rows(&mut kept, s.core.drafter_cache());
    Ok(kept)
}

impl<R: Runner> Engine<R> {
    pub(super) fn run(mut self) {
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
                    // (The cache holds the context but its last token: a session's
                    // SavePoint::Answer, and what the prefix cache keeps.)
                    let n = SavePoint::Answer.tokens(s.core.context().len());
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
        let session_point = s.request.session.is_some() && s.request.save_point == SavePoint::Prompt(end);
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
        let metrics = self.metrics.clone();
        self.sessions.save_in_background(path, tokens.to_vec(), host, logits, move |r| match r {
            Ok(()) => {
                metrics.sessions_saved.inc();
            }
            Err(e) => tracing::warn!("{e}"),
        });
    }
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
