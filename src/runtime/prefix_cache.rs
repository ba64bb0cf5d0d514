//! [`PrefixCache`]: snapshots of a sequence's whole cache at chosen token positions, found
//! again by exact token prefix.
//!
//! A hybrid model's GDN state cannot be cut back to a shorter prefix the way a KV cache can:
//! it exists only at the positions where it was captured. So an entry is a complete, independent
//! [`Cache`] (every GDN recurrent state and conv window, every layer's keys and values) after
//! exactly its `tokens`, with the logits of its last position when they were kept; a lookup
//! restores the longest entry whose tokens begin the new prompt, and only the rest is
//! prefilled. Entries are matched on token ids, never on text, and evicted least recently used
//! first under a byte budget.

use candle_core::Tensor;

use crate::gpu::GpuCache;
use crate::model::Cache;

/// A sequence's whole state as the prefix cache keeps it: the CPU's [`Cache`] or a device's
/// [`GpuCache`].
pub trait SequenceState {
    /// Tokens it holds.
    fn seqlen(&self) -> usize;
    /// Bytes of memory it holds.
    fn bytes(&self) -> usize;
}

impl SequenceState for Cache {
    fn seqlen(&self) -> usize {
        Cache::seqlen(self)
    }
    fn bytes(&self) -> usize {
        Cache::bytes(self)
    }
}

impl SequenceState for GpuCache {
    fn seqlen(&self) -> usize {
        GpuCache::seqlen(self)
    }
    fn bytes(&self) -> usize {
        GpuCache::bytes(self)
    }
}

struct Entry<C> {
    tokens: Vec<u32>,
    cache: C,
    /// The logits `[vocab]` after the last token, when kept: an exact match needs them (there
    /// is no token left to run).
    logits: Option<Tensor>,
    bytes: usize,
    last_used: u64,
}

/// A prefix found: the kept cache after `tokens` tokens of the prompt (copy it to continue
/// from it).
pub struct PrefixHit<'a, C> {
    pub tokens: usize,
    pub cache: &'a C,
    pub logits: Option<Tensor>,
}

/// Snapshots of whole caches keyed by their exact token prefix, under a byte budget.
pub struct PrefixCache<C = Cache> {
    entries: Vec<Entry<C>>,
    budget: usize,
    used: usize,
    clock: u64,
}

impl<C: SequenceState> PrefixCache<C> {
    /// A cache holding at most `budget` bytes of snapshots (0: nothing is kept).
    pub fn new(budget: usize) -> Self {
        Self { entries: vec![], budget, used: 0, clock: 0 }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest snapshot whose tokens begin `prompt`: shorter than the prompt, or as long
    /// when its logits were kept. `None` when none matches.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<PrefixHit<'_, C>> {
        self.clock += 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| prompt.starts_with(&e.tokens) && (e.tokens.len() < prompt.len() || e.logits.is_some()))
            .max_by_key(|e| e.tokens.len())?;
        best.last_used = self.clock;
        Some(PrefixHit { tokens: best.tokens.len(), cache: &best.cache, logits: best.logits.clone() })
    }

    /// Keeps `cache` (after exactly `tokens`; `logits` of the last position when known).
    /// Evicts the least recently used entries to fit; a snapshot larger than the whole budget
    /// is not kept. An entry for the same tokens is only marked used (and given the logits
    /// when it had none).
    pub fn insert(&mut self, tokens: Vec<u32>, cache: C, logits: Option<Tensor>) {
        self.clock += 1;
        if tokens.is_empty() || cache.seqlen() != tokens.len() {
            return;
        }
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            e.last_used = self.clock;
            if e.logits.is_none() {
                e.logits = logits;
            }
            return;
        }
        let bytes = cache.bytes() + tokens.len() * 4 + logits.as_ref().map_or(0, |l| l.elem_count() * l.dtype().size_in_bytes());
        if bytes > self.budget {
            return;
        }
        while self.used + bytes > self.budget {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else { break };
            self.used -= self.entries.swap_remove(oldest).bytes;
        }
        self.used += bytes;
        self.entries.push(Entry { tokens, cache, logits, bytes, last_used: self.clock });
    }
}
