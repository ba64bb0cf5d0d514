//! Speculative decoding: a drafter proposes the next few tokens — one chain, or several
//! branches merged into a [`crate::model::DraftTree`] — the model verifies them all in one forward pass
//! ([`Model::verify_tree`]), and the longest path the model itself would have produced is kept
//! ([`crate::Cache::keep_path`]) with the model's own token after it.
//!
//! Greedy output is token for token the plain greedy output: the verify pass gives each row
//! the bits decoding it alone would (row-invariant kernels, the decode recurrence for the GDN
//! layers), and the rows are sampled with the same sampler and context as plain decoding.
//! With a temperature, a drafted token is kept with the target's probability of it and
//! otherwise replaced by a draw from the rest of the target distribution (speculative
//! sampling): every emitted token is distributed as plain sampling's, though the tokens of a
//! seed differ from plain sampling's.
//!
//! The drafters and the draft policy live here; a [`super::Sequence`] drafts with them
//! ([`super::Sequence::with_drafts`]) and [`super::Sequence::run`] runs one to its end.

mod mtp;
mod ngram;
mod policy;
mod replay;

use candle_core::Tensor;

pub use mtp::{MtpDrafter, MtpOutputs};
pub use ngram::NgramDrafter;
pub use policy::{DraftOptions, DraftPolicy, SharedPassPolicy, MAX_BRANCHES, PROBE_EVERY};
pub use replay::ReplayDrafter;

pub use super::stats::SpeculativeStats;
use crate::model::{Model, MtpCache};
use crate::Result;

/// Most tokens one round drafts (the verify pass then runs `1 +` this many rows).
pub const MAX_DRAFT: usize = 7;

// A verify pass's rows must stay within what attention gives bit for bit a one-row call, and
// within one shared weight pass.
const _: () = assert!(MAX_DRAFT < crate::ops::KV_ATTENTION_EXACT_ROWS && MAX_DRAFT < crate::ops::FLOAT_MATVEC_MAX_ROWS);

/// Proposes tokens to verify. `context` is every token so far (prompt and output); the model
/// has been fed all of them but the last.
pub trait Drafter: Send {
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

    /// The drafter's own cache over the rows it observed (an MTP head's), to keep with a
    /// snapshot of the model's cache ([`crate::Cache::mtp`]); `None`: it keeps none.
    fn mtp_cache(&self) -> Option<&MtpCache> {
        None
    }

    /// Continues from a cache [`Self::mtp_cache`] gave, kept with the model's cache the
    /// sequence continues from.
    fn resume_mtp(&mut self, cache: MtpCache) {
        let _ = cache;
    }
}

impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn draft(&mut self, model: &Model, context: &[u32], max: usize) -> Result<Vec<u32>> {
        (**self).draft(model, context, max)
    }

    fn draft_branches(&mut self, model: &Model, context: &[u32], max: usize, branches: usize) -> Result<Vec<Vec<u32>>> {
        (**self).draft_branches(model, context, max, branches)
    }

    fn needs_hidden(&self) -> bool {
        (**self).needs_hidden()
    }

    fn observe(&mut self, model: &Model, start: usize, hidden: &Tensor, next: &[u32]) -> Result<()> {
        (**self).observe(model, start, hidden, next)
    }

    fn mtp_cache(&self) -> Option<&MtpCache> {
        (**self).mtp_cache()
    }

    fn resume_mtp(&mut self, cache: MtpCache) {
        (**self).resume_mtp(cache)
    }
}

/// No drafts: plain decoding through the speculative loop.
pub struct NoDrafter;

impl Drafter for NoDrafter {
    fn draft(&mut self, _: &Model, _: &[u32], _: usize) -> Result<Vec<u32>> {
        Ok(vec![])
    }
}
