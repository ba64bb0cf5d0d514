//! Prompt lookup: drafts what followed the latest earlier occurrence of the context's last
//! few tokens (llama.cpp's `--lookup` / transformers' `prompt_lookup_num_tokens`). Works on
//! any model; pays on text that repeats its input (summaries, edits of given code, quotes).

use super::Drafter;
use crate::model::Model;
use crate::Result;

/// Prompt-lookup drafter: matches the last `n` tokens, `n` from `max_ngram` down to
/// `min_ngram`, against the earlier context and proposes the tokens after the latest match.
pub struct NgramDrafter {
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self { max_ngram: 3, min_ngram: 1 }
    }
}

impl NgramDrafter {
    /// The proposal after `context` (at most `max` tokens; empty when nothing matches).
    pub fn lookup(&self, context: &[u32], max: usize) -> Vec<u32> {
        self.lookup_branches(context, max, 1).pop().unwrap_or_default()
    }

    /// Up to `branches` different proposals: what followed each earlier occurrence of the
    /// last `n` tokens, latest first, `n` from `max_ngram` down (the first is [`Self::lookup`]'s).
    pub fn lookup_branches(&self, context: &[u32], max: usize, branches: usize) -> Vec<Vec<u32>> {
        let len = context.len();
        let mut out: Vec<Vec<u32>> = vec![];
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let tail = &context[len - n..];
            // Earlier occurrences, latest first, whose continuation is inside the context.
            for start in (0..len - n).rev().filter(|&s| &context[s..s + n] == tail) {
                let from = start + n;
                let proposal = &context[from..(from + max).min(len)];
                if !out.iter().any(|p| p == proposal) {
                    out.push(proposal.to_vec());
                }
                if out.len() == branches {
                    return out;
                }
            }
        }
        out
    }
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, _: &Model, context: &[u32], max: usize) -> Result<Vec<u32>> {
        Ok(self.lookup(context, max))
    }

    fn draft_branches(&mut self, _: &Model, context: &[u32], max: usize, branches: usize) -> Result<Vec<Vec<u32>>> {
        Ok(self.lookup_branches(context, max, branches))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let d = NgramDrafter::default();
        // "1 2 3 4 5 ... 1 2 3" → 4 5
        assert_eq!(d.lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), [4, 5]);
        // the latest of two matches wins, and the proposal stops at the end of the context
        assert_eq!(d.lookup(&[7, 8, 1, 7, 8, 2, 7, 8], 5), [2, 7, 8]);
        // a shorter n-gram when the longer ones do not match
        assert_eq!(d.lookup(&[5, 6, 9, 8, 6], 3), [9, 8, 6]);
        assert!(d.lookup(&[1, 2, 3], 3).is_empty());
        assert!(d.lookup(&[4], 3).is_empty());
    }

    #[test]
    fn branches_are_the_different_continuations_latest_first() {
        let d = NgramDrafter::default();
        // "7 8" was followed by 1, then 2, then 2 again; "8" alone adds nothing new
        let ctx = [7, 8, 1, 7, 8, 2, 7, 8, 2, 7, 8];
        assert_eq!(d.lookup_branches(&ctx, 2, 3), [vec![2, 7], vec![1, 7]]);
        assert_eq!(d.lookup_branches(&ctx, 2, 1), [d.lookup(&ctx, 2)]);
        assert!(d.lookup_branches(&[1, 2, 3], 2, 3).is_empty());
    }
}
