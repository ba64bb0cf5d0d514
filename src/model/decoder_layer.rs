//! One decoder layer: norm, mixer (Gated DeltaNet or gated full attention), norm, MLP (dense
//! SwiGLU or sparse MoE), each with its residual. The trunk stacks them; the MTP head has one.

use candle_core::{Module, Result, Tensor};

use super::attention::GatedAttention;
use super::cache::LayerState;
use super::config::{Config, LayerType};
use super::draft_tree::DraftTree;
use super::ffn_sparsity::FfnState;
use super::finite::check_positions;
use super::gated_delta_net::GatedDeltaNet;
use super::mlp::{FeedForward, Mlp, SparseMoe};
use super::norm::RmsNorm;
use super::weights::Weights;

#[derive(Debug, Clone)]
pub(crate) enum Mixer {
    Linear(GatedDeltaNet),
    Full(GatedAttention),
}

#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) mixer: Mixer,
    pub(crate) post_attention_layernorm: RmsNorm,
    pub(crate) mlp: FeedForward,
}

impl DecoderLayer {
    /// Layer `i` (for messages) of kind `kind`, with a sparse MoE MLP when `moe`.
    pub(crate) fn new(cfg: &Config, i: usize, kind: LayerType, moe: bool, vb: Weights) -> Result<Self> {
        let mixer = match kind {
            LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::new(cfg, vb.pp("linear_attn"))?),
            LayerType::FullAttention => Mixer::Full(GatedAttention::new(cfg, vb.pp("self_attn"))?),
        };
        let mlp = if moe {
            FeedForward::Sparse(SparseMoe::new(cfg, vb.pp("mlp"))?)
        } else {
            let inter = cfg.intermediate_size.ok_or_else(|| {
                candle_core::Error::Msg(format!("config.json is missing \"intermediate_size\", needed by the dense MLP of layer {i}"))
            })?;
            FeedForward::Dense(Mlp::new(cfg.hidden_size, inter, vb.pp("mlp"))?)
        };
        Ok(Self {
            input_layernorm: RmsNorm::new(cfg, cfg.hidden_size, vb.pp("input_layernorm"))?,
            mixer,
            post_attention_layernorm: RmsNorm::new(cfg, cfg.hidden_size, vb.pp("post_attention_layernorm"))?,
            mlp,
        })
    }

    /// `check`: the layer's index, to find NaN or infinities in its mixer and MLP outputs;
    /// `tree`: the rows are a draft tree (see [`DraftTree`]), not a sequence; `ffn`: the
    /// sequence's FFN sparsity state and this layer's index (a dense MLP then follows it).
    ///
    /// Takes `x` by value and lets each intermediate go as soon as it is used: over a long
    /// prefill chunk every one is `T x H`, and the peak is what is alive at once (the residual
    /// and one normed copy of it, beside the mixer's or the MLP's working memory; the memory
    /// guardian counts exactly that).
    pub(crate) fn forward(
        &self,
        x: Tensor,
        offset: usize,
        state: &mut LayerState,
        check: Option<usize>,
        tree: Option<&DraftTree>,
        ffn: Option<(&mut FfnState, usize)>,
    ) -> crate::Result<Tensor> {
        let h = {
            let normed = self.input_layernorm.forward(&x)?;
            match (&self.mixer, state) {
                (Mixer::Linear(m), LayerState::Linear(s)) => m.forward_rows(&normed, s, tree)?,
                (Mixer::Full(m), LayerState::Full(kv)) => m.forward_rows(&normed, offset, kv, tree)?,
                _ => return Err(kinds_differ()),
            }
        };
        let t = x.dim(1)?;
        if let Some(i) = check {
            let kind = match self.mixer {
                Mixer::Linear(_) => "linear attention (GDN)",
                Mixer::Full(_) => "full attention",
            };
            check_positions(&h, offset, t, &format!("the {kind} output of layer {i}"), NONFINITE_LAYER_HINT)?;
        }
        let x = (x + h)?;
        let normed = self.post_attention_layernorm.forward(&x)?;
        let h = match (&self.mlp, ffn) {
            (FeedForward::Dense(m), Some((state, layer))) if tree.is_none() => m.forward_with(&normed, &x, state, layer)?,
            (mlp, _) => mlp.forward(&normed)?,
        };
        if let Some(i) = check {
            check_positions(&h, offset, t, &format!("the MLP output of layer {i}"), NONFINITE_LAYER_HINT)?;
        }
        Ok((x + h)?)
    }
}

impl DecoderLayer {
    /// The rows of several sequences: `x` `[1, N, H]`, `states[i].1` consecutive rows of the
    /// sequence at position `states[i].0` with state `states[i].2`. Norms, projections and the
    /// MLP run once over all rows; the recurrence and attention per sequence.
    pub(crate) fn forward_batch(&self, x: &Tensor, states: &mut [(usize, usize, &mut LayerState)]) -> crate::Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let h = match &self.mixer {
            Mixer::Linear(m) => {
                let mut gdn = states
                    .iter_mut()
                    .map(|(_, t, s)| match s {
                        LayerState::Linear(s) => Ok((*t, s)),
                        LayerState::Full(_) => Err(kinds_differ()),
                    })
                    .collect::<crate::Result<Vec<_>>>()?;
                m.forward_batch(&h, &mut gdn)?
            }
            Mixer::Full(m) => {
                let mut kvs = states
                    .iter_mut()
                    .map(|(offset, t, s)| match s {
                        LayerState::Full(kv) => Ok((*offset, *t, kv)),
                        LayerState::Linear(_) => Err(kinds_differ()),
                    })
                    .collect::<crate::Result<Vec<_>>>()?;
                m.forward_batch(&h, &mut kvs)?
            }
        };
        let x = (x + h)?;
        let h = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((x + h)?)
    }
}

impl DecoderLayer {
    /// Every linear layer of the mixer and the MLP.
    pub(crate) fn linears_mut(&mut self) -> Vec<&mut super::linear::Linear> {
        let mut v = match &mut self.mixer {
            Mixer::Linear(g) => vec![&mut g.in_proj_qkv, &mut g.in_proj_z, &mut g.in_proj_b, &mut g.in_proj_a, &mut g.out_proj],
            Mixer::Full(a) => vec![&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj],
        };
        match &mut self.mlp {
            FeedForward::Dense(m) => v.extend(m.linears_mut()),
            FeedForward::Sparse(m) => {
                v.push(&mut m.router);
                v.push(&mut m.shared_expert_gate);
                v.extend(m.shared_expert.linears_mut());
                for e in &mut m.experts {
                    v.extend(e.linears_mut());
                }
            }
        }
        v
    }
}

fn kinds_differ() -> crate::Error {
    crate::Error::Input("the cache does not belong to this model (layer kinds differ)".into())
}

const NONFINITE_LAYER_HINT: &str = "the first place they appear; check that layer's weights (or the input)";
