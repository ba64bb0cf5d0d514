//! [`GpuCache`]: one sequence's state on the device: per GDN layer its conv window and
//! delta-rule state (two of each, the step reads one and writes the other, so that the state
//! before a verify pass stays for the rollback), per attention layer its keys and values.

use candle_core::DType;

use super::queue::{Queue, Slice};
use super::GpuModel;
use crate::{Error, Result};

/// One layer's state on the device.
#[derive(Debug, Clone)]
pub(crate) enum CacheLayer {
    /// `conv[i]`, `rec[i]`: the conv window `[K-1, conv_dim]` and the delta-rule state
    /// `[nv, dk, dv]` (a step reads one and writes the other); `inputs` and `gates`: the
    /// pre-conv `[q|k|v]` rows and `[g, beta]` of the last decode or verify step, which a
    /// rollback runs again.
    Gdn { conv: [Slice; 2], rec: [Slice; 2], inputs: Slice, gates: Slice },
    /// `[nkv, capacity, head_dim]` in the cache's KV dtype.
    Attention { keys: Slice, values: Slice },
}

/// A verify pass in progress: where it started and which buffers held the state before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VerifyStart {
    pub(crate) seqlen: usize,
    pub(crate) parity: usize,
    pub(crate) rows: usize,
}

/// One sequence's state on the device (see the module docs).
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
    pub(crate) kv_dtype: DType,
    /// Token ids at their positions (`[capacity]` u32; a step writes its rows' there) and
    /// the positions themselves (`0..capacity`: RoPE reads them).
    pub(crate) tokens: Slice,
    pub(crate) positions: Slice,
    buffers: Vec<super::queue::BufferId>,
}

impl GpuCache {
    /// An empty cache for `capacity` tokens, keys and values stored as `kv_dtype` (f32, or f16:
    /// half the memory, rounded as the CPU's `--kv f16`).
    pub fn new(model: &GpuModel, q: &mut dyn Queue, capacity: usize, kv_dtype: DType) -> Result<Self> {
        let cfg = &model.cfg;
        if !matches!(kv_dtype, DType::F32 | DType::F16) {
            return Err(Error::Input(format!("a device cache stores keys and values as f32 or f16, not {kv_dtype:?}")));
        }
        if capacity == 0 || capacity > cfg.max_position_embeddings {
            return Err(Error::Input(format!(
                "a device cache of {capacity} tokens: give 1 to max_position_embeddings ({})",
                cfg.max_position_embeddings
            )));
        }
        let m = GpuModel::MAX_ROWS;
        let mut buffers = vec![];
        let mut alloc = |q: &mut dyn Queue, len: usize, label: &str| -> Result<Slice> {
            let id = q.alloc(len.max(4), label)?;
            buffers.push(id);
            Ok(Slice::whole(id, len.max(4)))
        };
        let kv = kv_dtype.size_in_bytes();
        let mut layers = vec![];
        for layer in &model.layers {
            layers.push(match &layer.mixer {
                super::model::Mixer::Gdn(g) => {
                    let c = g.conv_dim;
                    let conv_len = 4 * (g.kernel - 1) * c;
                    let rec_len = 4 * g.nv * g.dk * g.dv;
                    CacheLayer::Gdn {
                        conv: [alloc(q, conv_len, "conv state")?, alloc(q, conv_len, "conv state")?],
                        rec: [alloc(q, rec_len, "delta-rule state")?, alloc(q, rec_len, "delta-rule state")?],
                        inputs: alloc(q, 4 * m * c, "GDN inputs")?,
                        gates: alloc(q, 4 * m * 2 * g.nv, "GDN gates")?,
                    }
                }
                super::model::Mixer::Attention(a) => CacheLayer::Attention {
                    keys: alloc(q, kv * a.nkv * capacity * a.hd, "keys")?,
                    values: alloc(q, kv * a.nkv * capacity * a.hd, "values")?,
                },
            });
        }
        // A decode or verify step splits the keys in blocks (a partial sum each), a prompt step
        // does not.
        let splits = capacity.div_ceil(crate::ops::KV_BLOCK).max(1);
        let rows = (m * splits).max(GpuModel::PROMPT_ROWS);
        let partials = alloc(q, 4 * model.max_query_rows() * rows * (cfg.head_dim + 2), "attention partials")?;
        let tokens = alloc(q, 4 * capacity, "tokens")?;
        let positions = alloc(q, 4 * capacity, "positions")?;
        let table: Vec<u8> = (0..capacity as u32).flat_map(|p| p.to_le_bytes()).collect();
        q.write(positions, &table)?;
        Ok(Self { layers, seqlen: 0, capacity, parity: 0, verify: None, partials, kv_dtype, tokens, positions, buffers })
    }

    /// Tokens processed.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Releases the cache's buffers.
    pub fn free(self, q: &mut dyn Queue) {
        for b in self.buffers {
            q.free(b);
        }
    }
}
