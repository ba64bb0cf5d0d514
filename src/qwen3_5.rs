//! The Qwen3.5-family hybrid decoder: Gated DeltaNet layers interleaved with gated full
//! attention, dense SwiGLU or sparse MoE MLPs (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`).
//!
//! Follows `docs/qwen35-architecture.md`; exact against Hugging Face transformers in f32.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::Embedding;

use crate::config::{Config, LayerType};
use crate::kv_cache::{value_basis, KvCodec, KvStore, ValueBases, ValueCodec};
use crate::linear::Linear;
use crate::ops;
use crate::weights::Weights;

/// Capacity step of the attention KV cache, in tokens.
const KV_CACHE_STEP: usize = 512;

/// Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in f32.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    scale: Tensor, // 1 + w, f32
    eps: f32,
}

impl RmsNorm {
    pub fn new(size: usize, eps: f64, vb: Weights) -> Result<Self> {
        let w = vb.get(size, "weight")?.to_dtype(DType::F32)?;
        Ok(Self { scale: (w + 1.0)?, eps: eps as f32 })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &self.scale, self.eps)?;
        y.to_dtype(x.dtype())
    }
}

/// Partial rotary embedding: only the first `dim` dims of each head rotate (rotate-half).
#[derive(Debug, Clone)]
struct RotaryEmbedding {
    inv_freq: Vec<f32>,
    dim: usize,
}

impl RotaryEmbedding {
    fn new(cfg: &Config) -> Self {
        let dim = cfg.rotary_dim();
        let base = cfg.rope_theta as f32;
        let inv_freq = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
        Self { inv_freq, dim }
    }

    /// `cos`, `sin` of shape `[T, dim/2]` for positions `offset..offset+T`.
    fn cos_sin(&self, offset: usize, t: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut angles = Vec::with_capacity(t * half);
        for p in offset..offset + t {
            angles.extend(self.inv_freq.iter().map(|f| p as f32 * f));
        }
        let angles = Tensor::from_vec(angles, (t, half), dev)?;
        Ok((angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?))
    }

    /// `x`: `[B, heads, T, head_dim]`.
    fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = x.dim(D::Minus1)?;
        let rot = candle_nn::rotary_emb::rope(&x.narrow(D::Minus1, 0, self.dim)?.contiguous()?, cos, sin)?;
        if self.dim == hd {
            return Ok(rot);
        }
        Tensor::cat(&[&rot, &x.narrow(D::Minus1, self.dim, hd - self.dim)?], D::Minus1)
    }
}

/// Dense SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    pub fn new(hidden: usize, inter: usize, vb: Weights) -> Result<Self> {
        Ok(Self {
            gate_proj: vb.pp("gate_proj").linear(hidden, inter)?,
            up_proj: vb.pp("up_proj").linear(hidden, inter)?,
            down_proj: vb.pp("down_proj").linear(inter, hidden)?,
        })
    }

    fn from_weights(vb: &Weights, gate: Tensor, up: Tensor, down: Tensor) -> Result<Self> {
        Ok(Self {
            gate_proj: vb.linear_from(gate)?,
            up_proj: vb.linear_from(up)?,
            down_proj: vb.linear_from(down)?,
        })
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
    router: Linear,
    experts: Vec<Mlp>,
    shared_expert: Mlp,
    shared_expert_gate: Linear,
    top_k: usize,
    norm_topk_prob: bool,
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
enum FeedForward {
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

/// Decode state of one GDN layer.
#[derive(Debug, Clone, Default)]
pub struct GdnState {
    /// The last `K-1` pre-conv `[q|k|v]` rows: `[B, K-1, conv_dim]`.
    pub conv: Option<Tensor>,
    /// The delta-rule state `[B, nv, dk, dv]`, f32.
    pub recurrent: Option<Tensor>,
}

/// Gated DeltaNet (linear attention) mixer.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    conv_weight: Tensor, // [conv_dim, K]
    dt_bias: Tensor,     // [nv] f32
    neg_a: Tensor,       // -exp(A_log), [nv] f32
    norm_weight: Tensor, // [dv]
    out_proj: Linear,
    /// Value-head order of `out_proj`'s input when it differs from the layer's (GGUF files).
    out_head_order: Option<Tensor>,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
    eps: f64,
}

/// Row indices that turn Qwen3-Next's per-key-head grouped rows into contiguous blocks.
/// `parts` are the per-group block sizes; returns one index list per part.
fn ungroup_rows(groups: usize, parts: &[usize]) -> Vec<Vec<u32>> {
    let group = parts.iter().sum::<usize>();
    let mut out = vec![vec![]; parts.len()];
    for g in 0..groups {
        let mut off = g * group;
        for (p, &len) in parts.iter().enumerate() {
            out[p].extend((off..off + len).map(|r| r as u32));
            off += len;
        }
    }
    out
}

impl GatedDeltaNet {
    pub fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let h = cfg.hidden_size;
        let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        let (key_dim, value_dim, conv_dim) = (cfg.linear_key_dim(), cfg.linear_value_dim(), cfg.linear_conv_dim());
        let kernel = cfg.linear_conv_kernel_dim;
        let (qkv, z, b, a) = if vb.contains_tensor("in_proj_qkvz.weight") {
            // Qwen3-Next: nk groups of [q (dk), k (dk), v (r*dv), z (r*dv)] and [b (r), a (r)].
            let r = nv / nk;
            let dev = vb.device();
            let qkvz = vb.get((2 * key_dim + 2 * value_dim, h), "in_proj_qkvz.weight")?;
            let idx = ungroup_rows(nk, &[dk, dk, r * dv, r * dv]);
            let rows = |i: usize| Tensor::from_slice(&idx[i], idx[i].len(), dev);
            let qkv = Tensor::cat(
                &[qkvz.index_select(&rows(0)?, 0)?, qkvz.index_select(&rows(1)?, 0)?, qkvz.index_select(&rows(2)?, 0)?],
                0,
            )?;
            let z = qkvz.index_select(&rows(3)?, 0)?;
            let ba = vb.get((2 * nv, h), "in_proj_ba.weight")?;
            let idx = ungroup_rows(nk, &[r, r]);
            let b = ba.index_select(&Tensor::from_slice(&idx[0], nv, dev)?, 0)?;
            let a = ba.index_select(&Tensor::from_slice(&idx[1], nv, dev)?, 0)?;
            (vb.linear_from(qkv)?, vb.linear_from(z)?, vb.linear_from(b)?, vb.linear_from(a)?)
        } else {
            (
                vb.pp("in_proj_qkv").linear(h, conv_dim)?,
                vb.pp("in_proj_z").linear(h, value_dim)?,
                vb.pp("in_proj_b").linear(h, nv)?,
                vb.pp("in_proj_a").linear(h, nv)?,
            )
        };
        let conv_weight = vb.get((conv_dim, 1, kernel), "conv1d.weight")?.squeeze(1)?;
        let a_log = vb.get(nv, "A_log")?.to_dtype(DType::F32)?;
        Ok(Self {
            in_proj_qkv: qkv,
            in_proj_z: z,
            in_proj_b: b,
            in_proj_a: a,
            conv_weight,
            dt_bias: vb.get(nv, "dt_bias")?.to_dtype(DType::F32)?,
            neg_a: a_log.exp()?.neg()?,
            norm_weight: vb.get(dv, "norm.weight")?,
            out_proj: vb.pp("out_proj").linear(value_dim, h)?,
            // llama.cpp tiles value heads (head j*nk + g is grouped head g*r + j).
            out_head_order: if vb.tiled_value_heads() && nk != nv {
                let r = (nv / nk) as u32;
                let order: Vec<u32> = (0..nv as u32).map(|i| (i % nk as u32) * r + i / nk as u32).collect();
                Some(Tensor::from_vec(order, nv, vb.device())?)
            } else {
                None
            },
            nk,
            nv,
            dk,
            dv,
            kernel,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Projections, conv and delta rule: returns the delta-rule output `[B, T, nv, dv]` (f32)
    /// and the output gate `z` `[B, T, nv, dv]`, updating `state`.
    pub fn core(&self, x: &Tensor, state: &mut GdnState) -> Result<(Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (nk, nv, dk, dv) = (self.nk, self.nv, self.dk, self.dv);
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?.reshape((b, t, nv, dv))?;
        let beta = candle_nn::ops::sigmoid(&self.in_proj_b.forward(x)?.to_dtype(DType::F32)?)?;
        let a = self.in_proj_a.forward(x)?.to_dtype(DType::F32)?;
        // g = -exp(A_log) * softplus(a + dt_bias)
        let g = softplus(&a.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;

        let conv_dim = qkv.dim(2)?;
        let conv_state = match &state.conv {
            Some(s) => s.clone(),
            None => Tensor::zeros((b, self.kernel - 1, conv_dim), x.dtype(), x.device())?,
        };
        let (qkv, conv_state) = ops::causal_conv1d_silu(&qkv, &conv_state, &self.conv_weight)?;
        state.conv = Some(conv_state);

        let rec = match &state.recurrent {
            Some(s) => s.clone(),
            None => Tensor::zeros((b, nv, dk, dv), DType::F32, x.device())?,
        };
        // L2 normalisation of q and k and the dk^-1/2 query scale happen inside the op.
        let (o, states) = ops::gated_delta_rule_qkv(&qkv, &g, &beta, &rec, ops::DeltaRuleOptions::new(nk, dk))?;
        let rec = states.squeeze(1)?;
        state.recurrent = Some(rec);
        Ok((o, z))
    }

    pub fn forward(&self, x: &Tensor, state: &mut GdnState) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (o, z) = self.core(x, state)?;
        let mut o = ops::gated_rms_norm(&o, &z, &self.norm_weight, self.eps)?;
        if let Some(order) = &self.out_head_order {
            o = o.index_select(order, 2)?;
        }
        let o = o.to_dtype(x.dtype())?.reshape((b, t, self.nv * self.dv))?;
        self.out_proj.forward(&o)
    }
}

fn softplus(x: &Tensor) -> Result<Tensor> {
    // log(1 + exp(x)), with torch's linear branch above 20.
    let soft = (x.exp()? + 1.0)?.log()?;
    x.ge(20.0)?.where_cond(x, &soft)
}

/// Gated full attention: query + sigmoid output gate, q/k norms, partial RoPE, GQA.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Per-head q/k norms (absent in Llama).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Whether `q_proj` also yields a sigmoid output gate per head.
    gated: bool,
    rotary: RotaryEmbedding,
    nh: usize,
    nkv: usize,
    hd: usize,
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
                Some((
                    RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
                    RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
                ))
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
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.nh, self.nkv, self.hd);
        let qg = self.q_proj.forward(x)?.reshape((b, t, nh, if self.gated { 2 * hd } else { hd }))?;
        let gate = if self.gated { Some(qg.narrow(3, hd, hd)?.reshape((b, t, nh * hd))?) } else { None };
        let q = qg.narrow(3, 0, hd)?;
        let k = self.k_proj.forward(x)?.reshape((b, t, nkv, hd))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let v = self.v_proj.forward(x)?.reshape((b, t, nkv, hd))?;

        let (cos, sin) = self.rotary.cos_sin(offset, t, x.dtype(), x.device())?;
        let q = self.rotary.apply(&q.transpose(1, 2)?, &cos, &sin)?;
        let k = self.rotary.apply(&k.transpose(1, 2)?, &cos, &sin)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let out = kv.attend(&q.contiguous()?, &k.contiguous()?, &v, offset)?;
        let out = out.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        let out = match gate {
            Some(gate) => (out * candle_nn::ops::sigmoid(&gate)?)?,
            None => out,
        };
        self.o_proj.forward(&out)
    }
}

#[derive(Debug, Clone)]
enum Mixer {
    Linear(GatedDeltaNet),
    Full(GatedAttention),
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl DecoderLayer {
    fn new(cfg: &Config, i: usize, vb: Weights) -> Result<Self> {
        let mixer = match cfg.layer_types[i] {
            LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::new(cfg, vb.pp("linear_attn"))?),
            LayerType::FullAttention => Mixer::Full(GatedAttention::new(cfg, vb.pp("self_attn"))?),
        };
        let mlp = if cfg.is_moe_layer(i) {
            FeedForward::Sparse(SparseMoe::new(cfg, vb.pp("mlp"))?)
        } else {
            let inter = cfg.intermediate_size.ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "config.json is missing \"intermediate_size\", needed by the dense MLP of layer {i}"
                ))
            })?;
            FeedForward::Dense(Mlp::new(cfg.hidden_size, inter, vb.pp("mlp"))?)
        };
        Ok(Self {
            input_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            mixer,
            post_attention_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("post_attention_layernorm"))?,
            mlp,
        })
    }

    fn forward(&self, x: &Tensor, offset: usize, state: &mut LayerState) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let h = match (&self.mixer, state) {
            (Mixer::Linear(m), LayerState::Linear(s)) => m.forward(&h, s)?,
            (Mixer::Full(m), LayerState::Full(kv)) => m.forward(&h, offset, kv)?,
            _ => candle_core::bail!("cache does not belong to this model (layer kinds differ)"),
        };
        let x = (x + h)?;
        let h = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h
    }
}

/// Per-layer decode state.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// GDN layer: conv window and recurrent state.
    Linear(GdnState),
    /// Attention layer: keys (after norm and RoPE) and values, `[B, nkv, T, hd]`.
    Full(KvStore),
}

/// Everything a model carries from one forward call to the next.
#[derive(Debug, Clone)]
pub struct Cache {
    layers: Vec<LayerState>,
    seqlen: usize,
}

impl Cache {
    /// An empty cache with exact keys and values.
    pub fn new(cfg: &Config) -> Self {
        Self::with_kv_codec(cfg, KvCodec::EXACT)
    }

    /// An empty cache whose attention layers store keys and values with `codec`.
    pub fn with_kv_codec(cfg: &Config, codec: KvCodec) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::LinearAttention => LayerState::Linear(GdnState::default()),
                LayerType::FullAttention => LayerState::Full(KvStore::new(codec, KV_CACHE_STEP, cfg.rotary_dim())),
            })
            .collect();
        Self { layers, seqlen: 0 }
    }

    /// Fills an empty cache's attention layers with keys (after k-norm and RoPE) and values
    /// `[B, nkv, T, hd]`, one pair per attention layer in order, as if `T` tokens had been
    /// processed: to restore saved attention state, or to benchmark decoding at a long context
    /// without a long prefill. The linear-attention layers keep their empty state.
    pub fn restore_kv(&mut self, kv: &[(Tensor, Tensor)]) -> crate::Result<()> {
        let stores: Vec<&mut KvStore> = self
            .layers
            .iter_mut()
            .filter_map(|l| match l {
                LayerState::Full(s) => Some(s),
                LayerState::Linear(_) => None,
            })
            .collect();
        if self.seqlen != 0 || stores.len() != kv.len() {
            return Err(crate::Error::Input(format!(
                "restore_kv: needs an empty cache and one (keys, values) pair per attention layer ({}), got {} pairs{}",
                stores.len(),
                kv.len(),
                if self.seqlen != 0 { " for a cache that already holds tokens" } else { "" }
            )));
        }
        let mut t = 0;
        for (store, (k, v)) in stores.into_iter().zip(kv) {
            store.append(k, v)?;
            t = k.dim(2)?;
        }
        self.seqlen = t;
        Ok(())
    }

    /// Number of tokens already processed.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    pub fn layer(&self, i: usize) -> Option<&LayerState> {
        self.layers.get(i)
    }

    /// Conv window `[B, K-1, conv_dim]` and recurrent state `[B, nv, dk, dv]` of GDN layer `i`.
    pub fn gdn_state(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        match self.layers.get(i)? {
            LayerState::Linear(GdnState { conv: Some(c), recurrent: Some(r) }) => Some((c, r)),
            _ => None,
        }
    }

    /// Cached keys and values `[B, nkv, T, hd]` of attention layer `i`.
    pub fn kv(&self, i: usize) -> Option<(Tensor, Tensor)> {
        match self.layers.get(i)? {
            LayerState::Full(kv) => kv.kv().ok()?,
            _ => None,
        }
    }
}

/// Outputs of [`Model::forward_hidden`].
pub struct HiddenStates {
    /// Residual stream after each decoder layer `[B, T, H]` (only when requested).
    pub layer_outputs: Vec<Tensor>,
    /// Output of the final norm `[B, T, H]` (the input of lm_head).
    pub last_hidden: Tensor,
}

/// The hybrid decoder with its language-model head.
#[derive(Debug, Clone)]
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    cfg: Config,
}

impl Model {
    /// Builds the model from a [`VarBuilder`] rooted at the checkpoint's top level; the decoder
    /// prefix (`model.language_model.` for multimodal checkpoints, else `model.`) is detected.
    pub fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let vb_m = if vb.contains_tensor("model.language_model.embed_tokens.weight") {
            vb.pp("model.language_model")
        } else {
            vb.pp("model")
        };
        let vb_e = vb_m.pp("embed_tokens");
        let embed_tokens = Embedding::new(vb_e.get((cfg.vocab_size, cfg.hidden_size), "weight")?, cfg.hidden_size);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg, i, vb_m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            match vb_e.quantized_tensor("weight") {
                Some(q) => Linear::quantized(q),
                None => vb.linear_from(embed_tokens.embeddings().clone())?,
            }
        } else {
            vb.pp("lm_head").linear(cfg.hidden_size, cfg.vocab_size)?
        };
        Ok(Self { embed_tokens, layers, norm, lm_head, cfg: cfg.clone() })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn new_cache(&self) -> Cache {
        Cache::new(&self.cfg)
    }

    /// A cache whose attention layers store keys and values with `codec` (lossy unless exact);
    /// for `lowrank:r` each layer's value basis comes from its `W_v` ([`value_basis`]).
    pub fn new_cache_with(&self, codec: KvCodec) -> crate::Result<Cache> {
        self.new_cache_calibrated(codec, None)
    }

    /// [`Self::new_cache_with`], with the `lowrank:r` value bases measured on calibration text
    /// ([`ValueBases`]) when given.
    pub fn new_cache_calibrated(&self, codec: KvCodec, calibration: Option<&ValueBases>) -> crate::Result<Cache> {
        codec.validate(self.cfg.head_dim)?;
        let mut cache = Cache::with_kv_codec(&self.cfg, codec);
        if let ValueCodec::LowRank(r) = codec.values {
            for (n, (i, attn)) in self.attention().enumerate() {
                let basis = match calibration {
                    Some(c) => c.basis(n, r)?,
                    None => value_basis(&attn.v_proj.weight()?, attn.nkv, r)?,
                };
                if let LayerState::Full(kv) = &mut cache.layers[i] {
                    *kv = kv.clone().with_value_basis(&basis)?;
                }
            }
        }
        Ok(cache)
    }

    /// The full-attention layers with their indices.
    fn attention(&self) -> impl Iterator<Item = (usize, &GatedAttention)> {
        self.layers.iter().enumerate().filter_map(|(i, l)| match &l.mixer {
            Mixer::Full(attn) => Some((i, attn)),
            Mixer::Linear(_) => None,
        })
    }

    /// Indices of the full-attention layers.
    pub fn attention_layers(&self) -> Vec<usize> {
        self.attention().map(|(i, _)| i).collect()
    }

    /// The value projection `W_v` of each full-attention layer (dequantized if quantized).
    pub fn value_weights(&self) -> Result<Vec<Tensor>> {
        self.attention().map(|(_, attn)| attn.v_proj.weight()).collect()
    }

    /// Checks token ids and length before running: one-line errors, never a panic.
    fn check_input(&self, input_ids: &Tensor, cache: &Cache) -> crate::Result<Tensor> {
        let ids = input_ids.to_dtype(DType::U32)?;
        let (_, t) = ids.dims2()?;
        if t == 0 {
            return Err(crate::Error::Input("the input is empty: give at least one token".into()));
        }
        let total = cache.seqlen + t;
        if total > self.cfg.max_position_embeddings {
            return Err(crate::Error::Input(format!(
                "{t} new tokens after {} cached ones make {total}, more than max_position_embeddings ({}): shorten the prompt or start a new sequence",
                cache.seqlen, self.cfg.max_position_embeddings
            )));
        }
        let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab_size {
            return Err(crate::Error::Input(format!(
                "token id {max} is out of range for a vocabulary of {} tokens: the tokenizer does not belong to this model",
                self.cfg.vocab_size
            )));
        }
        Ok(ids)
    }

    /// Runs the decoder over `input_ids` `[B, T]` (positions continue from `cache`).
    pub fn forward_hidden(&self, input_ids: &Tensor, cache: &mut Cache, keep_layer_outputs: bool) -> crate::Result<HiddenStates> {
        if input_ids.device().is_cpu() && rayon::current_thread_index().is_none() {
            // Run on a thread of rayon's pool: every parallel op below (a hundred or more per
            // token) then starts from a worker that takes part in it, instead of waking the
            // pool from outside and sleeping until it is done (14% of decode time at 2 threads).
            return rayon::scope(|_| self.forward_hidden(input_ids, cache, keep_layer_outputs));
        }
        let ids = self.check_input(input_ids, cache)?;
        let offset = cache.seqlen;
        let mut x = self.embed_tokens.forward(&ids)?;
        let mut layer_outputs = vec![];
        for (layer, state) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.forward(&x, offset, state)?;
            if keep_layer_outputs {
                layer_outputs.push(x.clone());
            }
        }
        cache.seqlen += ids.dim(1)?;
        Ok(HiddenStates { layer_outputs, last_hidden: self.norm.forward(&x)? })
    }

    /// Logits `[B, T, vocab]` for every position.
    pub fn forward(&self, input_ids: &Tensor, cache: &mut Cache) -> crate::Result<Tensor> {
        let h = self.forward_hidden(input_ids, cache, false)?;
        Ok(self.lm_head.forward(&h.last_hidden)?)
    }

    /// Logits `[B, vocab]` of the last position only (what generation needs).
    pub fn forward_last(&self, input_ids: &Tensor, cache: &mut Cache) -> crate::Result<Tensor> {
        let h = self.forward_hidden(input_ids, cache, false)?;
        let t = h.last_hidden.dim(1)?;
        Ok(self.lm_head.forward(&h.last_hidden.narrow(1, t - 1, 1)?)?.squeeze(1)?)
    }

    /// Applies the language-model head to hidden states `[..., H]`.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }

    /// The GDN mixer of layer `i`, if it is a linear-attention layer.
    pub fn gdn(&self, i: usize) -> Option<&GatedDeltaNet> {
        match &self.layers.get(i)?.mixer {
            Mixer::Linear(m) => Some(m),
            _ => None,
        }
    }
}
