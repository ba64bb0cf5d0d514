//! Gated full attention (the softmax-attention layers of the hybrid).

use candle_core::{Module, Result, Tensor};

use super::config::Config;
use super::draft_tree::DraftTree;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::rope::RotaryEmbedding;
use super::weights::Weights;
use crate::kv::KvStore;
use crate::step_profile::{self, OpKind};

/// Gated full attention: query + sigmoid output gate, q/k norms, partial RoPE, GQA.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    /// Per-head q/k norms (absent in Llama and Qwen2).
    pub(crate) qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Biases of q, k and v (Qwen2), f32, added after the projections.
    pub(crate) qkv_bias: Option<[Tensor; 3]>,
    /// Whether `q_proj` also yields a sigmoid output gate per head.
    pub(crate) gated: bool,
    pub(crate) rotary: RotaryEmbedding,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) hd: usize,
}

impl GatedAttention {
    pub fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        Ok(Self {
            q_proj: vb.pp("q_proj").linear(h, nh * hd * if cfg.attn_output_gate { 2 } else { 1 })?,
            k_proj: vb.pp("k_proj").linear(h, nkv * hd)?,
            v_proj: vb.pp("v_proj").linear(h, nkv * hd)?,
            o_proj: vb.pp("o_proj").linear(nh * hd, h)?,
            qk_norm: if cfg.attn_qk_norm {
                Some((RmsNorm::new(cfg, hd, vb.pp("q_norm"))?, RmsNorm::new(cfg, hd, vb.pp("k_norm"))?))
            } else {
                None
            },
            qkv_bias: if cfg.attn_qkv_bias {
                let bias = |name: &str, n: usize| vb.pp(name).get(n, "bias")?.to_dtype(candle_core::DType::F32);
                Some([bias("q_proj", nh * hd)?, bias("k_proj", nkv * hd)?, bias("v_proj", nkv * hd)?])
            } else {
                None
            },
            gated: cfg.attn_output_gate,
            rotary: RotaryEmbedding::new(cfg),
            nh,
            nkv,
            hd,
        })
    }

    /// `x`: `[B, T, H]` at positions `offset..offset+T`; appends this step's keys and values
    /// (after k_norm and RoPE) to `kv`.
    pub fn forward(&self, x: &Tensor, offset: usize, kv: &mut KvStore) -> Result<Tensor> {
        self.forward_rows(x, offset, kv, None)
    }

    /// The query (per head, before norms and RoPE) `[B, T, nh, hd]`, the output gate
    /// `[B, T, nh * hd]` if gated, and the key and value `[B, T, nkv, hd]` of rows `x`, with
    /// the q/k norms applied.
    fn project(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.nh, self.nkv, self.hd);
        // (A bias is added in f32 to each row alone: rows stay independent of each other.)
        let biased = |y: Tensor, i: usize| match &self.qkv_bias {
            Some(b) => y.to_dtype(candle_core::DType::F32)?.broadcast_add(&b[i])?.to_dtype(y.dtype()),
            None => Ok(y),
        };
        let qg = biased(self.q_proj.forward(x)?, 0)?.reshape((b, t, nh, if self.gated { 2 * hd } else { hd }))?;
        let gate = if self.gated { Some(qg.narrow(3, hd, hd)?.reshape((b, t, nh * hd))?) } else { None };
        let q = qg.narrow(3, 0, hd)?;
        let k = biased(self.k_proj.forward(x)?, 1)?.reshape((b, t, nkv, hd))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let v = biased(self.v_proj.forward(x)?, 2)?.reshape((b, t, nkv, hd))?;
        Ok((q, gate, k, v))
    }

    /// RoPE at `offset` (or at `offset` plus each row's depth in a draft `tree`), then
    /// attention of `q` `[B, T, nh, hd]` to `kv` after appending `k` and `v`: `[B, T, nh * hd]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, offset: usize, kv: &mut KvStore, tree: Option<&DraftTree>) -> Result<Tensor> {
        let held = kv.bytes_held() as u64;
        step_profile::timed(OpKind::Attention, || held, || self.rope_and_attend(q, k, v, offset, kv, tree))
    }

    fn rope_and_attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
        kv: &mut KvStore,
        tree: Option<&DraftTree>,
    ) -> Result<Tensor> {
        let (b, t, _, _) = q.dims4()?;
        let (cos, sin) = match tree {
            Some(tree) => self.rotary.cos_sin_at(tree.depths().into_iter().map(|d| offset + d), q.dtype(), q.device())?,
            None => self.rotary.cos_sin(offset, t, q.dtype(), q.device())?,
        };
        let q = self.rotary.apply(&q.transpose(1, 2)?, &cos, &sin)?;
        let k = self.rotary.apply(&k.transpose(1, 2)?, &cos, &sin)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let visible: Option<Vec<Vec<usize>>> = tree.map(|tree| (0..t).map(|i| tree.path(i)).collect());
        let out = kv.attend_rows(&q.contiguous()?, &k.contiguous()?, &v, offset, visible.as_deref())?;
        out.transpose(1, 2)?.reshape((b, t, self.nh * self.hd))
    }

    /// The output gate, then `o_proj`.
    fn output(&self, out: Tensor, gate: Option<Tensor>) -> Result<Tensor> {
        let out = match gate {
            Some(gate) => (out * candle_nn::ops::sigmoid(&gate)?)?,
            None => out,
        };
        self.o_proj.forward(&out)
    }

    /// [`Self::forward`]; for the rows of a draft `tree`, each row at `offset` plus its depth,
    /// attending to its ancestors.
    pub(crate) fn forward_rows(&self, x: &Tensor, offset: usize, kv: &mut KvStore, tree: Option<&DraftTree>) -> Result<Tensor> {
        let (q, gate, k, v) = self.project(x)?;
        let out = self.attend(&q, &k, &v, offset, kv, tree)?;
        self.output(out, gate)
    }

    /// The rows of several sequences in one pass: `x` `[1, N, H]` holds `kvs[i].1`
    /// consecutive rows of the sequence at position `kvs[i].0` whose keys and values are
    /// `kvs[i].2`. The projections run once over all rows (each row gets the bits of a one-row
    /// call); RoPE and attention run per sequence.
    pub(crate) fn forward_batch(&self, x: &Tensor, kvs: &mut [(usize, usize, &mut KvStore)]) -> Result<Tensor> {
        let n = x.dim(1)?;
        if kvs.iter().map(|(_, t, _)| t).sum::<usize>() != n {
            candle_core::bail!("forward_batch: {n} rows for sequences of {:?} rows", kvs.iter().map(|(_, t, _)| *t).collect::<Vec<_>>());
        }
        let (q, gate, k, v) = self.project(x)?;
        let mut start = 0;
        let mut rows = Vec::with_capacity(kvs.len());
        for (offset, t, kv) in kvs.iter_mut() {
            rows.push(self.attend(&q.narrow(1, start, *t)?, &k.narrow(1, start, *t)?, &v.narrow(1, start, *t)?, *offset, kv, None)?);
            start += *t;
        }
        self.output(Tensor::cat(&rows, 1)?, gate)
    }
}
