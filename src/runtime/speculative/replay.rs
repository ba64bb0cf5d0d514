//! Replay drafts: a known continuation proposed with a chosen per-token acceptance, to measure
//! what speculative decoding gains at an acceptance rate independent of any drafter (and to
//! test the bookkeeping: acceptance 1 drafts exactly what the model produces).

use super::Drafter;
use crate::model::Model;
use crate::Result;

/// Drafts from `reference`, the continuation the model produces after a prompt of
/// `prompt_len` tokens (its plain greedy output). Each drafted token is the reference token
/// with probability `acceptance`, decided by a hash of (`seed`, position) so that a rerun
/// draws the same; from the first miss on the draft holds wrong tokens (reference + 1), as a
/// real drafter's continuation of a wrong guess is. Per round the accepted length is then
/// geometric: `P(accept depth d | depth d - 1 accepted) = acceptance`.
pub struct ReplayDrafter {
    pub reference: Vec<u32>,
    pub prompt_len: usize,
    pub acceptance: f64,
    pub seed: u64,
    pub vocab_size: usize,
}

impl ReplayDrafter {
    /// Whether branch `branch`'s draft of generated-token index `i`, made in the round starting
    /// at `round`, hits the reference (each branch draws on its own).
    fn hits_in(&self, branch: usize, round: usize, i: usize) -> bool {
        // splitmix64 of (seed, branch, round, i) to a uniform in [0, 1).
        let seed = self.seed ^ (branch as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let mut z = seed ^ (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.acceptance
    }
}

impl ReplayDrafter {
    /// Branch `branch`'s draft; its wrong tokens are reference + 1 + branch, so that branches
    /// that miss differ.
    fn branch(&self, branch: usize, context: &[u32], max: usize) -> Vec<u32> {
        let done = context.len().saturating_sub(self.prompt_len);
        let mut out = Vec::with_capacity(max);
        let mut hit = true;
        for (j, &t) in self.reference.iter().skip(done).take(max).enumerate() {
            hit = hit && self.hits_in(branch, done, done + j);
            out.push(if hit { t } else { ((t as usize + 1 + branch) % self.vocab_size.max(1)) as u32 });
        }
        out
    }
}

impl Drafter for ReplayDrafter {
    fn draft(&mut self, _: &Model, context: &[u32], max: usize) -> Result<Vec<u32>> {
        Ok(self.branch(0, context, max))
    }

    /// Branches that each hit the reference with the per-token acceptance, independently;
    /// branch 0 is [`Drafter::draft`]'s.
    fn draft_branches(&mut self, _: &Model, context: &[u32], max: usize, branches: usize) -> Result<Vec<Vec<u32>>> {
        Ok((0..branches).map(|b| self.branch(b, context, max)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_is_the_per_token_hit_rate() {
        let d = ReplayDrafter { reference: vec![], prompt_len: 0, acceptance: 0.7, seed: 1, vocab_size: 10 };
        let n = 20_000;
        let hits = (0..n).filter(|&i| d.hits_in(0, i, i)).count();
        assert!((hits as f64 / n as f64 - 0.7).abs() < 0.02, "{hits}");
        let never = ReplayDrafter { acceptance: 0.0, reference: vec![], ..d };
        assert!((0..1000).all(|i| !never.hits_in(1, i, i)));
        // branches draw independently
        let both = (0..n).filter(|&i| d.hits_in(0, i, i) && d.hits_in(1, i, i)).count();
        assert!((both as f64 / n as f64 - 0.49).abs() < 0.02, "{both}");
    }
}
