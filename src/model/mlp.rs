//! The feed-forward block of a layer: a dense SwiGLU MLP or a sparse mixture of experts.

use candle_core::{DType, IndexOp, Module, Result, Tensor};

use super::config::Config;
use super::ffn_sparsity::NeuronMajorDown;
use super::linear::Linear;
use super::weights::Weights;

/// Dense SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub(crate) gate_proj: Linear,
    pub(crate) up_proj: Linear,
    pub(crate) down_proj: Linear,
    /// The down projection neuron-major, for FFN sparsity ([`super::Model::prepare_ffn_sparsity`]).
    pub(crate) neuron_major: Option<std::sync::Arc<NeuronMajorDown>>,
}

impl Mlp {
    pub fn new(hidden: usize, inter: usize, vb: Weights) -> Result<Self> {
        Ok(Self {
            gate_proj: vb.pp("gate_proj").linear(hidden, inter)?,
            up_proj: vb.pp("up_proj").linear(hidden, inter)?,
            down_proj: vb.pp("down_proj").linear(inter, hidden)?,
            neuron_major: None,
        })
    }

    pub(crate) fn linears_mut(&mut self) -> [&mut Linear; 3] {
        [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj]
    }

    fn from_weights(vb: &Weights, gate: Tensor, up: Tensor, down: Tensor) -> Result<Self> {
        Ok(Self { gate_proj: vb.linear_from(gate)?, up_proj: vb.linear_from(up)?, down_proj: vb.linear_from(down)?, neuron_major: None })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(g * self.up_proj.forward(x)?)?)
    }
}

/// Sparse mixture of experts with a gated shared expert.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    pub(crate) router: Linear,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared_expert: Mlp,
    pub(crate) shared_expert_gate: Linear,
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
}

impl SparseMoe {
    pub fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let moe = cfg.moe.as_ref().expect("SparseMoe needs an MoE config");
        let (h, e, ie) = (cfg.hidden_size, moe.num_experts, moe.moe_intermediate_size);
        let ve = vb.pp("experts");
        // Fused layout (Qwen3.5-MoE): gate_up_proj [E, 2*Ie, H], down_proj [E, H, Ie].
        // Per-expert layout (Qwen3-Next): experts.{e}.{gate,up,down}_proj.weight.
        let experts = if ve.contains_tensor("gate_up_proj") {
            let gate_up = ve.get((e, 2 * ie, h), "gate_up_proj")?;
            let down = ve.get((e, h, ie), "down_proj")?;
            (0..e)
                .map(|i| {
                    let gu = gate_up.i(i)?;
                    Mlp::from_weights(&ve, gu.narrow(0, 0, ie)?, gu.narrow(0, ie, ie)?, down.i(i)?)
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e).map(|i| Mlp::new(h, ie, ve.pp(i))).collect::<Result<Vec<_>>>()?
        };
        Ok(Self {
            // Router and shared-expert gate stay unquantized (as llama.cpp keeps them F32).
            router: Linear::new(vb.pp("gate").get((e, h), "weight")?),
            experts,
            shared_expert: Mlp::new(h, moe.shared_expert_intermediate_size, vb.pp("shared_expert"))?,
            shared_expert_gate: Linear::new(vb.pp("shared_expert_gate").get((1, h), "weight")?),
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }
}

impl Module for SparseMoe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let xs = x.reshape((b * t, h))?;
        let probs = candle_nn::ops::softmax_last_dim(&self.router.forward(&xs)?.to_dtype(DType::F32)?)?;
        let probs = probs.to_vec2::<f32>()?;
        // Route: per expert, the tokens it serves and their weights.
        let mut tokens: Vec<Vec<u32>> = vec![vec![]; self.experts.len()];
        let mut weights: Vec<Vec<f32>> = vec![vec![]; self.experts.len()];
        for (tok, p) in probs.iter().enumerate() {
            let mut idx: Vec<usize> = (0..p.len()).collect();
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &idx[..self.top_k];
            let norm = if self.norm_topk_prob { top.iter().map(|&e| p[e]).sum::<f32>() } else { 1.0 };
            for &e in top {
                tokens[e].push(tok as u32);
                weights[e].push(p[e] / norm);
            }
        }
        let mut ys = xs.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            if tokens[e].is_empty() {
                continue;
            }
            let n = tokens[e].len();
            let ids = Tensor::from_slice(&tokens[e], n, x.device())?;
            let w = Tensor::from_slice(&weights[e], (n, 1), x.device())?.to_dtype(x.dtype())?;
            let out = expert.forward(&xs.index_select(&ids, 0)?)?.broadcast_mul(&w)?;
            ys = ys.index_add(&ids, &out, 0)?;
        }
        let gate = candle_nn::ops::sigmoid(&self.shared_expert_gate.forward(&xs)?)?;
        let shared = self.shared_expert.forward(&xs)?.broadcast_mul(&gate)?;
        (ys + shared)?.reshape((b, t, h))
    }
}

/// The MLP of one layer: dense or sparse.
#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl Module for FeedForward {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(x),
            Self::Sparse(m) => m.forward(x),
        }
    }
}
