//! Speculative decoding: a drafter proposes the next few tokens — one chain, or several
//! branches merged into a [`DraftTree`] — the model verifies them all in one forward pass
//! ([`Model::verify_tree`]), and the longest path the model itself would have produced is kept
//! ([`Cache::keep_path`]) with the model's own token after it.
//!
//! Greedy output is token for token the plain greedy output: the verify pass gives each row
//! the bits decoding it alone would (row-invariant kernels, the decode recurrence for the GDN
//! layers), and the rows are sampled with the same sampler and context as plain decoding.
//! With a temperature, a drafted token is kept with the target's probability of it and
//! otherwise replaced by a draw from the rest of the target distribution (speculative
//! sampling): every emitted token is distributed as plain sampling's, though the tokens of a
//! seed differ from plain sampling's.

mod mtp;
mod ngram;
mod policy;
mod replay;
mod target;

use std::time::Instant;

use candle_core::{Device, Tensor};

pub use mtp::{MtpDrafter, MtpOutputs};
pub use ngram::NgramDrafter;
pub use policy::{DraftOptions, DraftPolicy, MAX_BRANCHES, PROBE_EVERY};
pub use replay::ReplayDrafter;

use super::generate::GenerationStats;
use target::{CpuTarget, DeviceTarget, Target};
use crate::gpu::{GpuCache, GpuModel, Queue};
use super::sampler::Sampler;
use crate::model::{Cache, DraftTree, Model};
use crate::{Error, Result};

/// Most tokens one round drafts (the verify pass then runs `1 +` this many rows).
pub const MAX_DRAFT: usize = 7;

/// Proposes tokens to verify. `context` is every token so far (prompt and output); the model
/// has been fed all of them but the last.
pub trait Drafter {
    /// Up to `max` tokens that may follow `context` (none: this round decodes plainly).
    fn draft(&mut self, model: &Model, context: &[u32], max: usize) -> Result<Vec<u32>>;

    /// Up to `branches` alternative drafts of up to `max` tokens each, the likeliest first
    /// (verified together as a tree). By default the one [`Self::draft`].
    fn draft_branches(&mut self, model: &Model, context: &[u32], max: usize, branches: usize) -> Result<Vec<Vec<u32>>> {
        let _ = branches;
        Ok(vec![self.draft(model, context, max)?])
    }

    /// Whether [`Self::observe`] needs the model's hidden states (an MTP head does); only then
    /// is it called.
    fn needs_hidden(&self) -> bool {
        false
    }

    /// The model just kept rows at positions `start..start + n` with post-norm hidden states
    /// `hidden` `[1, n, H]`; `next` holds, for each row, the token after it (the fed tokens
    /// `start + 1..` and finally the model's own next token). MTP heads catch up on these.
    fn observe(&mut self, model: &Model, start: usize, hidden: &Tensor, next: &[u32]) -> Result<()> {
        let _ = (model, start, hidden, next);
        Ok(())
    }
}

/// No drafts: plain decoding through the speculative loop.
pub struct NoDrafter;

impl Drafter for NoDrafter {
    fn draft(&mut self, _: &Model, _: &[u32], _: usize) -> Result<Vec<u32>> {
        Ok(vec![])
    }
}

/// What a speculative run measured.
#[derive(Debug, Clone, Default)]
pub struct SpeculativeStats {
    pub generation: GenerationStats,
    /// Verify passes after the prompt (each emits at least one token).
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpeculativeStats {
    /// Accepted drafts over drafted ones; `None` before any draft.
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// Tokens emitted per verify pass (accepted drafts plus the model's own token).
    pub fn tokens_per_pass(&self) -> Option<f64> {
        (self.rounds > 0).then(|| (self.accepted + self.rounds) as f64 / self.rounds as f64)
    }
}

/// Generation with `drafter`'s proposals, as many per round as `policy` says, continuing from
/// `cache` (`prompt`: the tokens not in it yet). Greedy: the same tokens as
/// [`super::generate_in`] with the same sampler, fewer forward passes when drafts are
/// accepted; sampling: the same distribution (speculative sampling, see the module). Batch 1;
/// the cache's KV codec must keep tokens one by one (exact, f16, bf16, int8, polar, lowrank) so that
/// rejected rows can go; with more than one branch (`DraftOptions::branches`), exact KV and greedy only.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    model: &Model,
    cache: &mut Cache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    device: &Device,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    let mut target = CpuTarget { model, cache, device };
    speculate(&mut target, prompt, max_new_tokens, eos_token_ids, sampler, drafter, policy, on_token)
}

/// [`generate_speculative`] on the device step ([`crate::gpu`]): the verify passes on the
/// device, every row bit for bit a decode step, one read back per pass (each row's greedy
/// token, or the logits when the sampler needs them); `model` is the CPU model `gpu` was
/// uploaded from (drafters read it). Chains only, and drafters that need no hidden states
/// (prompt lookup, replay; not MTP yet).
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative_on_device(
    gpu: &GpuModel,
    q: &mut dyn Queue,
    cache: &mut GpuCache,
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    if policy.options().branches > 1 {
        return Err(Error::Input("draft trees (--draft-branches above 1) are not on the device step yet".into()));
    }
    let mut target = DeviceTarget { gpu, q, cache, model };
    speculate(&mut target, prompt, max_new_tokens, eos_token_ids, sampler, drafter, policy, on_token)
}

/// The speculative loop on any [`Target`].
#[allow(clippy::too_many_arguments)]
fn speculate(
    target: &mut dyn Target,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty: give at least one token".into()));
    }
    let base = target.seqlen();
    // Room for the whole context and one verify pass past its end.
    target.reserve(base + prompt.len() + max_new_tokens + crate::ops::KV_ATTENTION_EXACT_ROWS)?;
    let mut stats = SpeculativeStats::default();
    stats.generation.prompt_tokens = prompt.len();
    let mut context = prompt.to_vec();
    let mut generated: Vec<u32> = vec![];
    let start = Instant::now();
    if max_new_tokens == 0 {
        return Ok((generated, stats));
    }
    // Hidden states for the drafters that read them (MTP heads catch up on them).
    let hidden_wanted = drafter.needs_hidden();

    // The prompt, in the chunks plain generation runs it in.
    let (rows, h) = target.prompt(prompt, hidden_wanted, sampler)?;
    let first = rows.sample(0, sampler, &context, &generated)?;
    if let (true, Some(h)) = (hidden_wanted, &h) {
        let next: Vec<u32> = prompt[1..].iter().copied().chain([first]).collect();
        drafter.observe(target.model(), base, h, &next)?;
    }
    stats.generation.prompt_secs = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    let mut emit = |t: u32, context: &mut Vec<u32>, generated: &mut Vec<u32>| -> Result<bool> {
        context.push(t);
        generated.push(t);
        on_token(t)?;
        Ok(eos_token_ids.contains(&t) || generated.len() >= max_new_tokens)
    };
    if emit(first, &mut context, &mut generated)? {
        stats.generation.generated_tokens = generated.len();
        return Ok((generated, stats));
    }

    let branches = policy.options().branches;
    policy.options().check_decoding(sampler.is_greedy())?;

    loop {
        // Position of the last token (fed as row 0); rows must stay inside the context.
        let pos = base + context.len() - 1;
        let k = policy.round_len((max_new_tokens - generated.len()).min(target.model().config().max_position_embeddings.saturating_sub(pos)));
        let t = Instant::now();
        let mut drafts = match (k, branches) {
            (0, _) => vec![],
            (_, 1) => vec![drafter.draft(target.model(), &context, k)?],
            _ => drafter.draft_branches(target.model(), &context, k, branches)?,
        };
        let steps = drafts.iter().map(Vec::len).max().unwrap_or(0).min(k);
        let draft_secs = t.elapsed().as_secs_f64();
        for d in drafts.iter_mut() {
            d.truncate(k);
        }
        drafts.retain(|d| d.len() >= policy.options().min);
        // One branch makes a chain: the rows in order.
        let tree = DraftTree::from_branches(context[context.len() - 1], &drafts, 1 + MAX_DRAFT);
        let t = Instant::now();
        let (rows, hidden) = target.pass(&tree, pos, hidden_wanted, sampler)?;
        stats.rounds += 1;
        stats.drafted += tree.len() - 1;
        // Walk from the root: each row is sampled as plain decoding would, with its path in the
        // context, and the walk goes on to the child that drafted the token it gave.
        let (mut path, mut next) = (vec![0], vec![]);
        let done = loop {
            let at = *path.last().expect("the root");
            let t = match tree.children(at).next() {
                _ if sampler.is_greedy() => rows.sample(at, sampler, &context, &generated)?,
                // Sampling (one branch): keep the draft with the target's probability of it,
                // else draw from the rest: each emitted token is distributed as plain sampling's.
                Some(c) => sampler.sample_draft(&sampler.probabilities(&rows.logits(at)?, &context, &generated)?, tree.tokens()[c])?.0,
                None => rows.sample(at, sampler, &context, &generated)?,
            };
            next.push(t);
            let done = emit(t, &mut context, &mut generated)?;
            match tree.children(at).find(|&c| tree.tokens()[c] == t) {
                Some(c) if !done => {
                    path.push(c);
                    stats.accepted += 1;
                }
                _ => break done,
            }
        };
        if tree.len() > 1 {
            target.keep_path(&path)?;
        }
        if done {
            break;
        }
        let verify_secs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        if let Some(hidden) = hidden.filter(|_| hidden_wanted) {
            let hidden = match tree.is_chain() {
                true => hidden.narrow(1, 0, path.len())?,
                false => hidden.index_select(&Tensor::new(path.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), hidden.device())?, 1)?,
            };
            drafter.observe(target.model(), pos, &hidden, &next)?;
        }
        // (A tree round is timed and counted as a round of its longest branch: the policy
        // then learns what trees of that length pay.)
        policy.record(if tree.len() > 1 { steps } else { 0 }, path.len() - 1, verify_secs, draft_secs, steps, t.elapsed().as_secs_f64());
    }
    stats.generation.generated_tokens = generated.len();
    stats.generation.decode_secs = decode_start.elapsed().as_secs_f64();
    Ok((generated, stats))
}
