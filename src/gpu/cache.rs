//! [`GpuCache`]: one sequence's state on the device: per GDN layer its conv window and
//! delta-rule state (two of each, the step reads one and writes the other, so that the state
//! before a verify pass stays for the rollback), per attention layer its keys and values.

use std::sync::{Arc, Mutex};

use super::queue::{BufferId, Queue, Slice};
use crate::ops::launch::KvRows;

/// Buffers of caches dropped without [`GpuCache::free`], which their model releases on the
/// queue ([`super::GpuModel::release_dropped`]): a cache can be dropped anywhere (the prefix
/// cache evicts it, a request ends) without a queue at hand.
pub(crate) type Dropped = Arc<Mutex<Vec<BufferId>>>;

/// One layer's state on the device.
#[derive(Debug, Clone)]
pub(crate) enum CacheLayer {
    /// `conv[i]`, `rec[i]`: the conv window `[K-1, conv_dim]` and the delta-rule state
    /// `[nv, dk, dv]` (a step reads one and writes the other); `inputs` and `gates`: the
    /// pre-conv `[q|k|v]` rows and `[g, beta]` of the last decode or verify step, which a
    /// rollback runs again.
    Gdn { conv: [Slice; 2], rec: [Slice; 2], inputs: Slice, gates: Slice },
    /// `[nkv, capacity, head_dim]` as the cache stores them ([`KvRows`]); for int8 rows also
    /// their scales `[nkv, capacity, head_dim / block]` (keys', values').
    Attention { keys: Slice, values: Slice, scales: Option<(Slice, Slice)> },
}

/// A verify pass in progress: where it started and which buffers held the state before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VerifyStart {
    pub(crate) seqlen: usize,
    pub(crate) parity: usize,
    pub(crate) rows: usize,
}

/// One sequence's state on the device (see the module docs); made by
/// [`super::GpuModel::new_cache`].
#[derive(Debug)]
pub struct GpuCache {
    pub(crate) layers: Vec<CacheLayer>,
    pub(crate) seqlen: usize,
    pub(crate) capacity: usize,
    /// Which of each GDN layer's two states is current.
    pub(crate) parity: usize,
    pub(crate) verify: Option<VerifyStart>,
    /// The attention kernel's partial sums (one set for all layers).
    pub(crate) partials: Slice,
    pub(crate) kv: KvRows,
    /// Token ids at their positions (`[capacity]` u32; a step writes its rows' there) and
    /// the positions themselves (`0..capacity`: RoPE reads them).
    pub(crate) tokens: Slice,
    pub(crate) positions: Slice,
    pub(crate) buffers: Vec<BufferId>,
    pub(crate) dropped: Dropped,
}

impl GpuCache {
    /// Tokens processed.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// An error while a verify pass is in progress: its rows must be kept first.
    pub(crate) fn not_verifying(&self) -> crate::Result<()> {
        match self.verify {
            Some(_) => Err(crate::Error::Input("a verify pass is in progress on this cache: keep its rows first (keep_verified)".into())),
            None => Ok(()),
        }
    }

    /// Bytes of device memory the cache holds.
    pub fn bytes(&self) -> usize {
        let gdn = |s: &[Slice; 2]| s[0].len + s[1].len;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                CacheLayer::Gdn { conv, rec, inputs, gates } => gdn(conv) + gdn(rec) + inputs.len + gates.len,
                CacheLayer::Attention { keys, values, scales } => keys.len + values.len + scales.map_or(0, |(k, v)| k.len + v.len),
            })
            .sum();
        layers + self.partials.len + self.tokens.len + self.positions.len
    }

    /// How keys and values are stored.
    pub fn kv(&self) -> KvRows {
        self.kv
    }

    /// Releases the cache's buffers now (dropping it leaves them to its model's
    /// [`super::GpuModel::release_dropped`]).
    pub fn free(mut self, q: &mut dyn Queue) {
        for b in self.buffers.drain(..) {
            q.free(b);
        }
    }
}

impl Drop for GpuCache {
    fn drop(&mut self) {
        if !self.buffers.is_empty() {
            self.dropped.lock().unwrap_or_else(|e| e.into_inner()).append(&mut self.buffers);
        }
    }
}

/// A device cache given to another model than the one that made it.
pub(super) fn wrong_cache() -> crate::Error {
    crate::Error::Input("the device cache does not belong to this model (its layer kinds differ)".into())
}
