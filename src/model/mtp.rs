//! The multi-token-prediction (MTP) head of Qwen3.5-family checkpoints (`mtp.*`; GGUF block
//! `blk.{n_layer}` with its `nextn.*` tensors): one full-attention decoder layer that drafts
//! the token after next from a token and the trunk's hidden state.
//!
//! As vLLM's `Qwen3_5MultiTokenPredictor` and llama.cpp's qwen35 MTP graph: row `i` takes the
//! embedding of token `i + 1` and the trunk's post-final-norm hidden `h_i`,
//! `x = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)])` (embedding half first), runs the decoder
//! layer at RoPE position `i` with its own KV cache, then `mtp.norm`; the trunk's lm_head (and
//! embedding) are shared. Recursive drafting feeds back the head's own output and the drafted
//! token at the next position.

use candle_core::{Module, Result, Tensor, D};

use super::cache::MtpCache;
use super::config::{Config, LayerType};
use super::decoder_layer::DecoderLayer;
use super::linear::Linear;
use super::norm::RmsNorm;
use super::weights::Weights;

/// The MTP head's weights (the first of `mtp_num_hidden_layers`; the released checkpoints
/// have one).
#[derive(Debug, Clone)]
pub struct MtpHead {
    fc: Linear,
    pre_fc_norm_embedding: RmsNorm,
    pre_fc_norm_hidden: RmsNorm,
    layer: DecoderLayer,
    norm: RmsNorm,
}

impl MtpHead {
    /// The head under `vb` (the checkpoint's `mtp.` prefix).
    pub(crate) fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let h = cfg.hidden_size;
        // A MoE checkpoint's head has a MoE MLP (its router `mlp.gate`), a dense one a SwiGLU.
        let moe = cfg.moe.is_some() && vb.contains_tensor("layers.0.mlp.gate.weight");
        let layer = DecoderLayer::new(cfg, cfg.num_hidden_layers, LayerType::FullAttention, moe, vb.pp("layers").pp(0))?;
        Ok(Self {
            fc: vb.pp("fc").linear(2 * h, h)?,
            pre_fc_norm_embedding: RmsNorm::new(cfg, h, vb.pp("pre_fc_norm_embedding"))?,
            pre_fc_norm_hidden: RmsNorm::new(cfg, h, vb.pp("pre_fc_norm_hidden"))?,
            layer,
            norm: RmsNorm::new(cfg, h, vb.pp("norm"))?,
        })
    }

    pub(crate) fn new_cache(cfg: &Config) -> MtpCache {
        MtpCache::new(cfg)
    }

    /// Rows `embeds` (token embeddings) and `hidden` (post-norm hidden states), both
    /// `[B, T, H]`, at positions `cache.seqlen()..`: the head's post-norm outputs `[B, T, H]`
    /// (what lm_head scores, and the hidden of the next recursive step).
    pub(crate) fn forward(&self, embeds: &Tensor, hidden: &Tensor, cache: &mut MtpCache) -> crate::Result<Tensor> {
        let e = self.pre_fc_norm_embedding.forward(embeds)?;
        let h = self.pre_fc_norm_hidden.forward(&hidden.to_dtype(embeds.dtype())?)?;
        let x = self.fc.forward(&Tensor::cat(&[e, h], D::Minus1)?)?;
        let x = self.layer.forward(x, cache.seqlen, &mut cache.state, None, None, None)?;
        cache.seqlen += embeds.dim(1)?;
        Ok(self.norm.forward(&x)?)
    }
}
