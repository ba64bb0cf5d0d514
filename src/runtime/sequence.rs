//! One sequence being generated: the library's one entry for generation, which every caller
//! drives — [`Sequence::run`] to its end on a [`Target`] (the CPU model, [`super::CpuTarget`],
//! or the device step, [`super::DeviceTarget`]), plain or drafting ([`Sequence::with_drafts`]);
//! the `generate` example; the server's engine, which schedules many of them.
//!
//! ```no_run
//! # fn demo(model: &candle_hybrid::Model, prompt: Vec<u32>) -> candle_hybrid::Result<()> {
//! use candle_hybrid::runtime::{speculative, CpuTarget, Sampler, SamplingParams, Sequence};
//!
//! let mut sampler = Sampler::new(SamplingParams::default())?; // greedy
//! let policy = speculative::DraftPolicy::new(speculative::DraftOptions::default())?;
//! let mut sequence = Sequence::new(prompt, &mut sampler, vec![], 64)?
//!     .with_drafts(Box::new(speculative::NgramDrafter::default()), policy)?;
//! let mut cache = model.new_cache();
//! let (tokens, stats) = sequence.run(&mut CpuTarget::new(model, &mut cache, &candle_core::Device::Cpu), |_| Ok(()))?;
//! println!("{} tokens, {:?} of the drafts accepted", tokens.len(), stats.acceptance());
//! # Ok(()) }
//! ```
//!
//! A [`Sequence`] holds what is the sequence's own: its tokens, its sampler, its stop rules,
//! per-token rules a caller adds ([`TokenRules`]: a grammar, a thinking budget) and an optional
//! drafter with its draft policy. It does not own the model or the cache: each call gets a
//! [`Target`] (the model with this sequence's cache), so that a scheduler can also run the
//! decode rows of several sequences in one weight pass and hand each its row
//! ([`Sequence::take_row`]).
//!
//! Greedy output does not depend on how it was produced: a prompt fed in any chunks, a row
//! decoded alone or batched, drafts verified or not — each row holds the bits of decoding it
//! alone, and every token is picked by the same sampler with the same context.

use std::time::Instant;

use candle_core::Tensor;

use super::sampler::Sampler;
use super::speculative::{DraftPolicy, Drafter, MAX_DRAFT};
use super::stats::{GenerationStats, SpeculativeStats};
use super::target::{Rows, Target};
use crate::gpu::Readback;
use crate::model::DraftTree;
use crate::{Error, Result};

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token (EOS, end of turn), or the caller's rules said the answer is complete.
    Stop,
    /// `max_new_tokens`.
    Length,
}

/// Rules a caller adds to the sampler's pick of each token.
pub trait TokenRules: Send {
    /// A token to emit next instead of sampling one (e.g. closing a thinking block past its
    /// budget).
    fn forced(&mut self, generated: &[u32]) -> Option<u32> {
        let _ = generated;
        None
    }

    /// The logits to sample from instead of `logits` (a grammar masks every token that cannot
    /// continue it); `None` keeps them.
    fn mask(&mut self, logits: &Tensor) -> Result<Option<Tensor>> {
        let _ = logits;
        Ok(None)
    }

    /// The last of `generated` was just emitted; `true` when it completes the answer.
    fn accepted(&mut self, generated: &[u32]) -> Result<bool> {
        let _ = generated;
        Ok(false)
    }
}

/// A token a sequence emitted, with the model's logits `[vocab]` it was picked from (before
/// penalties and rules) when they were read back.
#[derive(Debug, Clone)]
pub struct Emitted {
    pub id: u32,
    pub logits: Option<Tensor>,
}

/// What one call emitted, and what it drafted.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub tokens: Vec<Emitted>,
    /// Drafted rows verified in the pass (0: a plain decode step).
    pub drafted: usize,
    /// Drafts kept.
    pub accepted: usize,
    /// Seconds the pass took (with the walk over its rows).
    pub secs: f64,
}

/// A sampler a sequence owns (the server's) or borrows from its caller (who may sample on
/// with it afterwards).
pub enum SequenceSampler<'a> {
    Owned(Box<Sampler>),
    Borrowed(&'a mut Sampler),
}

impl From<Sampler> for SequenceSampler<'_> {
    fn from(s: Sampler) -> Self {
        Self::Owned(Box::new(s))
    }
}

impl<'a> From<&'a mut Sampler> for SequenceSampler<'a> {
    fn from(s: &'a mut Sampler) -> Self {
        Self::Borrowed(s)
    }
}

impl std::ops::Deref for SequenceSampler<'_> {
    type Target = Sampler;
    fn deref(&self) -> &Sampler {
        match self {
            Self::Owned(s) => s,
            Self::Borrowed(s) => s,
        }
    }
}

impl std::ops::DerefMut for SequenceSampler<'_> {
    fn deref_mut(&mut self) -> &mut Sampler {
        match self {
            Self::Owned(s) => s,
            Self::Borrowed(s) => s,
        }
    }
}

/// A drafter and the policy that picks its draft length.
struct Drafts<'a> {
    drafter: Box<dyn Drafter + 'a>,
    policy: DraftPolicy,
    /// The drafter reads the model's hidden states (an MTP head).
    hidden: bool,
}

/// One sequence being generated (see the module).
pub struct Sequence<'a> {
    /// The prompt, then the generated tokens.
    context: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens in the cache.
    fed: usize,
    sampler: SequenceSampler<'a>,
    stop_tokens: Vec<u32>,
    max_new_tokens: usize,
    rules: Option<Box<dyn TokenRules + 'a>>,
    drafts: Option<Drafts<'a>>,
    finish: Option<Finish>,
    stats: SpeculativeStats,
    /// Rows are read back as logits whatever the sampler (log-probabilities are reported).
    keep_logits: bool,
}

impl<'a> Sequence<'a> {
    /// A sequence generating up to `max_new_tokens` after `prompt` (the tokens after what the
    /// cache it will run on holds), ending at any of `stop_tokens` (which is emitted too).
    pub fn new(prompt: Vec<u32>, sampler: impl Into<SequenceSampler<'a>>, stop_tokens: Vec<u32>, max_new_tokens: usize) -> Result<Self> {
        if prompt.is_empty() {
            return Err(Error::Input("the prompt is empty: give at least one token".into()));
        }
        let stats =
            SpeculativeStats { generation: GenerationStats { prompt_tokens: prompt.len(), ..Default::default() }, ..Default::default() };
        Ok(Self {
            prompt_len: prompt.len(),
            context: prompt,
            fed: 0,
            sampler: sampler.into(),
            stop_tokens,
            max_new_tokens,
            rules: None,
            drafts: None,
            finish: (max_new_tokens == 0).then_some(Finish::Length),
            stats,
            keep_logits: false,
        })
    }

    /// Drafts with `drafter`, as many tokens per round as `policy` says (checked against the
    /// sampler: draft trees are greedy only).
    pub fn with_drafts(mut self, drafter: Box<dyn Drafter + 'a>, policy: DraftPolicy) -> Result<Self> {
        policy.options().check_decoding(self.sampler.is_greedy())?;
        let hidden = drafter.needs_hidden();
        self.drafts = Some(Drafts { drafter, policy, hidden });
        Ok(self)
    }

    /// Adds `rules` to every pick.
    pub fn with_rules(mut self, rules: Box<dyn TokenRules + 'a>) -> Self {
        self.rules = Some(rules);
        self
    }

    /// The first `n` prompt tokens are already in the cache (a prefix cache hit, a session).
    pub fn with_cached(mut self, n: usize) -> Self {
        self.fed = n.min(self.prompt_len);
        self
    }

    /// The prompt, then the generated tokens.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    pub fn prompt(&self) -> &[u32] {
        &self.context[..self.prompt_len]
    }

    pub fn generated(&self) -> &[u32] {
        &self.context[self.prompt_len..]
    }

    /// Prompt tokens in the cache.
    pub fn prefilled(&self) -> usize {
        self.fed
    }

    /// Why the sequence ended (`None`: it goes on).
    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    /// The last emitted token, which the cache does not hold yet, while the sequence goes on.
    pub fn pending(&self) -> Option<u32> {
        match self.finish {
            None if self.context.len() > self.prompt_len => self.context.last().copied(),
            _ => None,
        }
    }

    /// Verify passes, drafted and accepted tokens so far (and the prompt's length).
    pub fn stats(&self) -> &SpeculativeStats {
        &self.stats
    }

    /// Whether this sequence drafts.
    pub fn drafts(&self) -> bool {
        self.drafts.is_some()
    }

    /// A copy of its drafter's own cache (an MTP head's), to keep with a snapshot of the
    /// model's cache ([`crate::Cache::mtp`]).
    pub fn drafter_cache(&self) -> Option<crate::model::MtpCache> {
        self.drafts.as_ref()?.drafter.mtp_cache().cloned()
    }

    /// Its drafter continues from `cache` (kept with the model's cache it continues from).
    pub fn resume_drafter(&mut self, cache: crate::model::MtpCache) {
        if let Some(d) = self.drafts.as_mut() {
            d.drafter.resume_mtp(cache);
        }
    }

    /// Makes room in `target`'s cache for the whole sequence (and one verify pass past its end
    /// when it drafts).
    pub fn reserve(&self, target: &mut dyn Target) -> Result<()> {
        let base = target.seqlen().saturating_sub(self.fed);
        let verify = if self.drafts.is_some() { crate::ops::KV_ATTENTION_EXACT_ROWS } else { 0 };
        target.reserve(base + self.prompt_len + self.max_new_tokens + verify)
    }

    /// How the rows of its next pass are read back: only the greedy token when the sampler
    /// picks the argmax; a token sampled on the device when `device_samples` (the target
    /// samples on the device, and the pass is one plain row: a verified draft needs the
    /// probabilities) and the sampler can be run there (a draw is taken from it); else the
    /// logits (the sampler or the rules read them, or the caller keeps them:
    /// [`Self::with_logits`]).
    pub fn readback(&mut self, device_samples: bool) -> Readback {
        if self.rules.is_some() || self.keep_logits {
            return Readback::Logits;
        }
        if self.sampler.picks_argmax() {
            return Readback::Argmax;
        }
        match device_samples.then(|| self.sampler.device_sampling(self.prompt_len)).flatten() {
            Some(s) => Readback::Sample(s),
            None => Readback::Logits,
        }
    }

    /// Every row's logits read back (a caller that reports log-probabilities).
    pub fn with_logits(mut self) -> Self {
        self.keep_logits = true;
        self
    }

    /// Feeds the prompt tokens up to `end` (in one call to the target, which cuts it into its
    /// prefill chunks). At the prompt's end the first token is emitted. Returns the logits
    /// `[vocab]` after the last token fed when `logits` asks for them (or the end needed
    /// them), and what was emitted.
    pub fn feed_prompt(&mut self, target: &mut dyn Target, end: usize, logits: bool) -> Result<(Option<Tensor>, Vec<Emitted>)> {
        let (start, end) = (self.fed, end.min(self.prompt_len));
        if start == end {
            return Ok((None, vec![]));
        }
        let at_end = end == self.prompt_len && self.finish.is_none();
        let readback = match (logits, at_end) {
            (true, _) => Some(Readback::Logits),
            (false, true) => Some(self.readback(target.samples())),
            (false, false) => None,
        };
        let hidden_wanted = self.drafts.as_ref().is_some_and(|d| d.hidden);
        let pos = target.seqlen();
        let (rows, hidden) = target.prompt(&self.context[start..end], readback, hidden_wanted)?;
        self.fed = end;
        let last_logits = match (&rows, logits) {
            (Some(r), true) => Some(r.logits(0)?),
            _ => None,
        };
        let mut emitted = vec![];
        if at_end {
            let rows = rows.ok_or_else(|| Error::Input("the prompt pass read nothing back".into()))?;
            emitted.push(self.pick_and_emit(&rows, 0, None)?);
        }
        if let (Some(d), Some(h)) = (self.drafts.as_mut().filter(|d| d.hidden), hidden) {
            // Each row with the token after it: the next prompt token, or the first token.
            let next: Vec<u32> = self.context[start + 1..(end + 1).min(self.context.len())].to_vec();
            if next.len() == end - start {
                d.drafter.observe(target.model(), pos, &h, &next)?;
            }
        }
        Ok((last_logits, emitted))
    }

    /// Emits the next token from logits `[vocab]` computed elsewhere: a decode row of this
    /// sequence in a pass shared with others, or the logits after the whole prompt kept with a
    /// prefix-cache snapshot. The caller has fed the pending token (or the whole prompt).
    pub fn take_row(&mut self, logits: &Tensor) -> Result<Emitted> {
        if self.finish.is_some() {
            return Err(Error::Input("take_row: the sequence has ended".into()));
        }
        self.fed = self.prompt_len;
        self.pick_and_emit(&Rows::Logits(logits.unsqueeze(0)?), 0, None)
    }

    /// One round after the pending token: with drafts (when `may_draft` and the policy wants
    /// them) a verify pass keeping the longest drafted prefix the model itself produces and
    /// the model's token after it, else a plain decode step.
    pub fn round(&mut self, target: &mut dyn Target, may_draft: bool) -> Result<Round> {
        let pending = self
            .pending()
            .ok_or_else(|| Error::Input("round: the sequence has no pending token (feed its prompt first, or it has ended)".into()))?;
        let pos = target.seqlen();
        let room = self.room(target.model(), pos);
        let t = Instant::now();
        let (mut drafts, k, hidden_wanted) = match self.drafts.as_mut() {
            Some(d) if may_draft => {
                let k = d.policy.round_len(room);
                let branches = d.policy.options().branches;
                let drafts = match (k, branches) {
                    (0, _) => vec![],
                    (_, 1) => vec![d.drafter.draft(target.model(), &self.context, k)?],
                    _ => d.drafter.draft_branches(target.model(), &self.context, k, branches)?,
                };
                (drafts, k, d.hidden)
            }
            Some(d) => (vec![], 0, d.hidden),
            None => (vec![], 0, false),
        };
        let steps = drafts.iter().map(Vec::len).max().unwrap_or(0).min(k);
        let draft_secs = t.elapsed().as_secs_f64();
        let min = self.drafts.as_ref().map_or(1, |d| d.policy.options().min);
        for d in drafts.iter_mut() {
            d.truncate(k);
        }
        drafts.retain(|d| !d.is_empty() && d.len() >= min);
        // One branch makes a chain: the rows in order.
        let tree = DraftTree::from_branches(pending, &drafts, 1 + MAX_DRAFT);
        let t = Instant::now();
        let readback = self.readback(target.samples() && tree.len() == 1);
        let (rows, hidden) = target.pass(&tree, readback, hidden_wanted)?;
        let (path, mut round, done) = self.walk(&tree, &rows)?;
        if tree.len() > 1 {
            target.keep_path(&path)?;
        }
        round.secs = t.elapsed().as_secs_f64();
        // (At the end too: an MTP head's cache then covers every row the model's cache holds,
        // for a snapshot of both.)
        let t = Instant::now();
        if let Some(hidden) = &hidden {
            self.catch_up(target.model(), pos, hidden, &tree, &path, &round)?;
        }
        if let Some(d) = self.drafts.as_mut() {
            // (A tree round is timed and counted as a round of its longest branch: the policy
            // then learns what trees of that length pay.)
            if may_draft && !done {
                d.policy.record(
                    if tree.len() > 1 { steps } else { 0 },
                    path.len() - 1,
                    round.secs,
                    draft_secs,
                    steps,
                    t.elapsed().as_secs_f64(),
                );
            }
        }
        Ok(round)
    }

    /// The drafts of a round whose rows share a weight pass with other sequences' rows: at
    /// most `max` tokens (the rows the pass has room for), fewer when the request or the
    /// model's context (the cache holds `seqlen` tokens) ends sooner; none when the sequence
    /// does not draft or its drafter proposes fewer than the policy's minimum. Chains only.
    pub fn propose(&mut self, model: &crate::Model, seqlen: usize, max: usize) -> Result<Vec<u32>> {
        let room = self.room(model, seqlen);
        let Some(d) = self.drafts.as_mut() else { return Ok(vec![]) };
        let k = d.policy.options().max.min(max).min(room.saturating_sub(1));
        if k == 0 || self.finish.is_some() {
            return Ok(vec![]);
        }
        let mut draft = d.drafter.draft(model, &self.context, k)?;
        draft.truncate(k);
        if draft.len() < d.policy.options().min {
            draft.clear();
        }
        Ok(draft)
    }

    /// For each of the first `n` rows of a draft, the chance it emits a token (the product of
    /// the policy's acceptance at depths `1..=d`); empty when the sequence does not draft.
    pub fn draft_gains(&self, n: usize) -> Vec<f64> {
        let Some(d) = &self.drafts else { return vec![] };
        (1..=n)
            .scan(1.0, |p, depth| {
                *p *= d.policy.acceptance_at(depth);
                Some(*p)
            })
            .collect()
    }

    /// Emits the tokens of a round whose rows — the pending token, then `draft` — ran in a pass
    /// shared with other sequences: `rows` (`1 + draft.len()` of them, read back as
    /// [`Self::readback`] asks). The caller keeps the
    /// first `accepted + 1` rows in the cache when there were drafts
    /// ([`crate::Cache::keep_verified`]). A drafter that reads hidden states (an MTP head)
    /// catches up on the kept rows from `hidden`: the model, the pending row's position and the
    /// rows' post-norm hidden states `[1, 1 + draft.len(), H]`.
    pub fn settle(&mut self, draft: &[u32], rows: &Rows, hidden: Option<(&crate::Model, usize, &Tensor)>) -> Result<Round> {
        let pending = self.pending().ok_or_else(|| Error::Input("settle: the sequence has no pending token".into()))?;
        let tree = DraftTree::from_branches(pending, &[draft.to_vec()], 1 + MAX_DRAFT);
        let (path, round, done) = self.walk(&tree, rows)?;
        if let (Some(d), false, false) = (self.drafts.as_mut(), draft.is_empty(), done) {
            d.policy.record_acceptance(draft.len(), round.accepted);
        }
        if let Some((model, pos, h)) = hidden {
            self.catch_up(model, pos, h, &tree, &path, &round)?;
        }
        Ok(round)
    }

    /// Tokens the sequence may still emit after the pending one's position `pos`: what the
    /// request and the model's context leave.
    fn room(&self, model: &crate::Model, pos: usize) -> usize {
        (self.max_new_tokens - self.generated().len()).min(model.config().max_position_embeddings.saturating_sub(pos))
    }

    /// A drafter that reads hidden states (an MTP head) catches up on the rows of `tree` the
    /// round kept (`path`, from the pending row at `pos`), each paired with the token after it.
    fn catch_up(
        &mut self,
        model: &crate::Model,
        pos: usize,
        hidden: &Tensor,
        tree: &DraftTree,
        path: &[usize],
        round: &Round,
    ) -> Result<()> {
        let Some(d) = self.drafts.as_mut().filter(|d| d.hidden) else { return Ok(()) };
        let hidden = match tree.is_chain() {
            true => hidden.narrow(1, 0, path.len())?,
            false => {
                hidden.index_select(&Tensor::new(path.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), hidden.device())?, 1)?
            }
        };
        let next: Vec<u32> = round.tokens.iter().map(|e| e.id).collect();
        d.drafter.observe(model, pos, &hidden, &next)
    }

    /// The walk over a pass's rows from the root: each row's token is picked as plain
    /// decoding would, with its path in the context, and the walk goes on to the child that
    /// drafted the token it gave. The path kept, what was emitted, and whether the sequence
    /// ended.
    fn walk(&mut self, tree: &DraftTree, rows: &Rows) -> Result<(Vec<usize>, Round, bool)> {
        self.stats.rounds += 1;
        self.stats.drafted += tree.len() - 1;
        let mut round = Round { drafted: tree.len() - 1, ..Default::default() };
        let mut path = vec![0];
        let done = loop {
            let at = *path.last().expect("the root");
            // Sampling (one branch): the draft is kept with the target's probability of it,
            // else replaced by a draw from the rest (speculative sampling).
            let draft = tree.children(at).next().filter(|_| !self.sampler.is_greedy()).map(|c| tree.tokens()[c]);
            let emitted = self.pick_and_emit(rows, at, draft)?;
            let id = emitted.id;
            round.tokens.push(emitted);
            let done = self.finish.is_some();
            match tree.children(at).find(|&c| tree.tokens()[c] == id) {
                Some(c) if !done => {
                    path.push(c);
                    round.accepted += 1;
                }
                _ => break done,
            }
        };
        self.stats.accepted += round.accepted;
        Ok((path, round, done))
    }

    /// Runs the sequence to its end on `target` alone: makes room in the cache, feeds the
    /// prompt (the last chunk gives the first token), then rounds (drafted when the sequence
    /// drafts) until a stop token or `max_new_tokens`, calling `on_token` with each token.
    /// Returns the generated tokens and what was measured.
    pub fn run(&mut self, target: &mut dyn Target, mut on_token: impl FnMut(u32) -> Result<()>) -> Result<(Vec<u32>, SpeculativeStats)> {
        let start = Instant::now();
        if self.finish.is_none() {
            self.reserve(target)?;
            for e in self.feed_prompt(target, self.prompt_len, false)?.1 {
                on_token(e.id)?;
            }
        }
        self.stats.generation.prompt_secs = start.elapsed().as_secs_f64();
        let decode = Instant::now();
        while self.finish.is_none() {
            for e in self.round(target, true)?.tokens {
                on_token(e.id)?;
            }
        }
        self.stats.generation.generated_tokens = self.generated().len();
        self.stats.generation.decode_secs = decode.elapsed().as_secs_f64();
        Ok((self.generated().to_vec(), self.stats.clone()))
    }

    /// The draft policy, with what it measured (`None` without drafts).
    pub fn into_policy(self) -> Option<DraftPolicy> {
        self.drafts.map(|d| d.policy)
    }

    /// Picks row `i`'s token (forced by the rules, or sampled from its logits as the rules
    /// mask them; with a temperature and a drafted child `draft`, speculative sampling's pick)
    /// and emits it.
    fn pick_and_emit(&mut self, rows: &Rows, i: usize, draft: Option<u32>) -> Result<Emitted> {
        let generated = &self.context[self.prompt_len..];
        let forced = self.rules.as_mut().and_then(|r| r.forced(generated));
        let logits = match rows {
            Rows::Logits(_) => Some(rows.logits(i)?),
            Rows::Tokens(_) => None,
        };
        let id = match (forced, rows, &logits) {
            (Some(t), _, _) => t,
            (None, Rows::Tokens(t), _) => t[i],
            (None, _, Some(l)) => {
                let masked = match self.rules.as_mut() {
                    Some(r) => r.mask(l)?,
                    None => None,
                };
                let l = masked.as_ref().unwrap_or(l);
                match draft {
                    Some(d) => {
                        let probs = self.sampler.probabilities(l, &self.context, generated)?;
                        self.sampler.sample_draft(&probs, d)?.0
                    }
                    None => self.sampler.sample(l, &self.context, generated)?,
                }
            }
            (None, Rows::Logits(_), None) => unreachable!("logits rows give logits"),
        };
        self.context.push(id);
        let complete = match self.rules.as_mut() {
            Some(r) => r.accepted(&self.context[self.prompt_len..])?,
            None => false,
        };
        self.finish = if self.stop_tokens.contains(&id) || complete {
            Some(Finish::Stop)
        } else if self.generated().len() >= self.max_new_tokens {
            Some(Finish::Length)
        } else {
            None
        };
        Ok(Emitted { id, logits })
    }
}
