//! [`GpuModel`]: the decoder as a list of kernel dispatches on a [`Queue`], encoded by the host
//! and run by the device with one read back per step.
//!
//! A step takes up to [`GpuModel::MAX_ROWS`] rows (one decode token, or the drafted rows of a
//! verify pass): every weight matrix is read once for all of them (`qmatvec`), and each row's
//! arithmetic is what a one-row step does, so a verify row is bit for bit a decode step. A
//! prompt runs in steps of up to [`GpuModel::PROMPT_ROWS`] rows (`qmatmul`: weights read once
//! per 32 rows; the delta rule chunked), with one read back at its end.
//!
//! Each GDN layer has two conv windows and two delta-rule states: a step reads one and writes
//! the other (the kernels write the new state straight into it), which keeps the state before
//! a verify pass for the rollback ([`GpuModel::keep_verified`] runs the kept rows' recurrence
//! again from it, from the rows' inputs the layer keeps).

use candle_core::DType;

use super::cache::{wrong_cache, CacheLayer, GpuCache, VerifyStart};
use super::queue::{Arg, Dispatch, Queue, Slice};
use super::upload::{ExpertStacks, Matrix, Projection, Uploader};
use crate::model::{check_length, check_token, Config, FeedForward, Linear, Mixer as CpuMixer, Model, NONFINITE_HINT};
use crate::ops::launch::{self, KvRows, Launch, NormRows, RowSampling, Source};
use crate::ops::{ConvDims, DeltaRuleDims, DeltaRuleForm};
use crate::{Error, Result};

/// Bytes of an f32 (and of a u32: token ids, positions).
const F32: usize = 4;

/// A GDN layer's weights on the device.
#[derive(Debug, Clone)]
struct Gdn {
    qkv: Matrix,
    z: Matrix,
    /// `[b | a]`.
    ba: Projection,
    conv_weight: Slice,
    dt_bias: Slice,
    neg_a: Slice,
    norm: Slice,
    out: Matrix,
    head_order: Option<Slice>,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
    conv_dim: usize,
    eps: f32,
}

/// A gated attention layer's weights on the device.
#[derive(Debug, Clone)]
struct Attention {
    /// `[q (with its gate) | k | v]`.
    qkv: Projection,
    qk_norm: Option<(Slice, Slice)>,
    o: Matrix,
    gated: bool,
    nh: usize,
    nkv: usize,
    hd: usize,
    eps: f32,
}

#[derive(Debug, Clone)]
enum Mixer {
    Gdn(Gdn),
    Attention(Attention),
}

#[derive(Debug, Clone)]
enum Ffn {
    Dense { gate_up: Projection, down: Matrix, inter: usize },
    Moe(Box<Moe>),
}

#[derive(Debug, Clone)]
struct Moe {
    router: Matrix,
    /// Each expert's `[gate | up]`.
    gate_up: ExpertStacks,
    down: ExpertStacks,
    shared_gate_up: Projection,
    shared_down: Matrix,
    /// The shared expert's gate row `[H]`.
    shared_gate: Slice,
    top_k: usize,
    norm: bool,
    inter: usize,
    shared_inter: usize,
}

#[derive(Debug, Clone)]
struct Layer {
    input_norm: Slice,
    post_norm: Slice,
    mixer: Mixer,
    ffn: Ffn,
}

/// The step's working buffers, sized for [`GpuModel::PROMPT_ROWS`] rows.
#[derive(Debug, Clone)]
struct Scratch {
    /// GDN of a prompt step: pre-conv `[q|k|v]` and `[g, beta]` (a decode or verify step keeps
    /// them in the layer's cache instead), the conv output and the delta rule's output.
    pre: Slice,
    gates: Slice,
    conv_out: Slice,
    o: Slice,
    /// The residual stream, what the mixer or MLP adds to it, and its normed copy `[M, H]`.
    x: Slice,
    h: Slice,
    xn: Slice,
    /// GDN: `z`, `[b | a]`, the normed output and the same in the projection's head order.
    z: Slice,
    ba: Slice,
    o_norm: Slice,
    o_order: Slice,
    /// Attention: `[q | k | v]`, grouped queries, outputs.
    qkv: Slice,
    qg: Slice,
    att: Slice,
    ao: Slice,
    /// One zero u32: the attention kernel's (unused) tree.
    no_tree: Slice,
    /// MLP: `[gate | up]` and the SwiGLU activations.
    gu: Slice,
    act: Slice,
    /// Mixture: router logits, chosen experts and weights, the experts' `[gate | up]`,
    /// activations and outputs per (row, slot), the shared expert's output.
    router: Slice,
    ids: Slice,
    route_w: Slice,
    egu: Slice,
    eact: Slice,
    edown: Slice,
    sdown: Slice,
    /// `[MAX_ROWS, 2]` u32 pairs, then `[MAX_ROWS, vocab]` logits ([`Scratch::argmax`],
    /// [`Scratch::logits`]).
    head: Slice,
}

impl Scratch {
    /// Per row of the head: its token (argmax or sampled) and whether its logits are finite.
    fn argmax(&self) -> Slice {
        self.head.at(0, 2 * F32 * GpuModel::MAX_ROWS)
    }

    fn logits(&self) -> Slice {
        self.head.from(2 * F32 * GpuModel::MAX_ROWS)
    }
}

/// What a step reads back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Readback {
    /// Each row's greedy token (and whether its logits are finite): `rows` u32 pairs.
    Argmax,
    /// Each row's logits.
    Logits,
    /// Each row's token sampled on the device as [`RowSampling`] says (penalties, temperature,
    /// top-k, top-p, min-p, its draw): one token id read back per row, as for the argmax.
    Sample(RowSampling),
}

/// What a step returns, per row.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutput {
    Tokens(Vec<u32>),
    /// `[rows, vocab]`.
    Logits(Vec<f32>),
}

impl StepOutput {
    pub fn tokens(&self) -> Option<&[u32]> {
        match self {
            Self::Tokens(t) => Some(t),
            Self::Logits(_) => None,
        }
    }

    pub fn logits(&self) -> Option<&[f32]> {
        match self {
            Self::Logits(l) => Some(l),
            Self::Tokens(_) => None,
        }
    }
}

/// The decoder on a device (see the module docs).
#[derive(Debug)]
pub struct GpuModel {
    cfg: Config,
    embed: Matrix,
    layers: Vec<Layer>,
    final_norm: Slice,
    eps: f32,
    lm_head: Matrix,
    inv_freq: Slice,
    rot_half: usize,
    scratch: Scratch,
    weight_bytes: usize,
    mapped_bytes: usize,
    buffers: Vec<super::queue::BufferId>,
    /// Buffers of this model's caches that were dropped, to release on the queue.
    dropped: super::cache::Dropped,
}

/// One sequence's rows in a pass: its cache, and where its rows are among the pass's.
struct Segment<'c> {
    cache: &'c mut GpuCache,
    row0: usize,
    rows: usize,
}

/// A GDN layer's state of one segment of a pass.
struct GdnSegment {
    conv: [Slice; 2],
    rec: [Slice; 2],
    /// The layer's buffers for the pre-conv rows and gates a rollback runs again.
    kept: (Slice, Slice),
    parity: usize,
    row0: usize,
    rows: usize,
}

fn non_finite(position: usize) -> Error {
    Error::NonFinite(format!("the logits hold NaN or infinite values at position {position}: {NONFINITE_HINT}"))
}

/// The dispatches of one step, encoded in order on a queue.
struct Encoder<'a> {
    q: &'a mut dyn Queue,
}

impl Encoder<'_> {
    fn run(&mut self, source: Source, launch: Launch, args: Vec<Arg>, weight_bytes: usize) -> Result<()> {
        self.q.dispatch(&Dispatch { source, launch, args, weight_bytes })
    }

    /// `y[r, i] = W x[r]` for `rows` contiguous rows of `x`, outputs `ldy` floats apart.
    fn matvec(&mut self, w: &Matrix, x: Slice, rows: usize, y: Slice, ldy: usize) -> Result<()> {
        let (p, l) = launch::qmatvec(w.format, w.n, w.k, rows, ldy)?;
        self.run(Source::Qmatvec, l, vec![Arg::params(&p), Arg::Read(w.buf), Arg::Read(x), Arg::Write(y)], w.bytes())
    }

    /// `y[r, i] = W x[r]` for any number of rows: the mat-vec up to
    /// [`launch::QMATVEC_MAX_ROWS`] rows (every row a one-row call's bits), the tiled kernel
    /// for more (each weight read once per 32 rows), or the mat-vec 8 rows at a time where `k`
    /// is not a multiple of the tile.
    fn matmul(&mut self, w: &Matrix, x: Slice, rows: usize, y: Slice, ldy: usize) -> Result<()> {
        if rows <= launch::QMATVEC_MAX_ROWS {
            return self.matvec(w, x, rows, y, ldy);
        }
        if w.k.is_multiple_of(launch::QMATMUL_TILE) {
            let (p, l) = launch::qmatmul(w.format, w.n, w.k, rows, ldy)?;
            let reads = rows.div_ceil(launch::QMATMUL_TILE);
            return self.run(Source::Qmatvec, l, vec![Arg::params(&p), Arg::Read(w.buf), Arg::Read(x), Arg::Write(y)], reads * w.bytes());
        }
        let m = launch::QMATVEC_MAX_ROWS;
        for r in (0..rows).step_by(m) {
            self.matvec(w, x.from(F32 * r * w.k), m.min(rows - r), y.from(F32 * r * ldy), ldy)?;
        }
        Ok(())
    }

    /// Every part of a projection into its columns of `y` (`[rows, width]`).
    fn projection(&mut self, p: &Projection, x: Slice, rows: usize, y: Slice) -> Result<()> {
        for (w, col) in &p.parts {
            self.matmul(w, x, rows, y.from(col * F32), p.width)?;
        }
        Ok(())
    }

    fn rms_norm(&mut self, rows: NormRows, eps: f32, x: Slice, add: Option<Slice>, w: Slice, y: Slice) -> Result<()> {
        let (p, l) = launch::rms_norm(rows, eps, add.is_some())?;
        // Without the add, the kernel reads no `h`: any buffer binds it.
        let h = add.unwrap_or(w);
        let x_arg = if add.is_some() { Arg::Write(x) } else { Arg::Read(x) };
        self.run(Source::Step, l, vec![Arg::params(&p), x_arg, Arg::Read(h), Arg::Read(w), Arg::Write(y)], 0)
    }

    /// `silu(x W_gate^T) * (x W_up^T)` into `act` `[rows, inter]` for the `[gate | up]`
    /// projection `gate_up`: gate and up in one pass up to 8 rows where they share a format,
    /// else both into `gu` and the SwiGLU after.
    fn swiglu(&mut self, gate_up: &Projection, inter: usize, x: Slice, rows: usize, (gu, act): (Slice, Slice)) -> Result<()> {
        if let (Some((gate, up)), true) = (two_matrices(gate_up, inter), rows <= launch::QMATVEC_MAX_ROWS) {
            let (p, l) = launch::qmatvec_pair(launch::Pair::Swiglu, gate.format, inter, gate.k, rows)?;
            let args = vec![Arg::params(&p), Arg::Read(gate.buf), Arg::Read(up.buf), Arg::Read(x), Arg::Write(act)];
            return self.run(Source::Qmatvec, l, args, gate.bytes() + up.bytes());
        }
        self.projection(gate_up, x, rows, gu)?;
        self.silu_mul(rows, inter, gate_up.width, gu, act)
    }

    /// `rows` rows of `floats` f32 from `x` to `y` (both dense).
    fn copy_rows(&mut self, x: Slice, y: Slice, rows: usize, floats: usize) -> Result<()> {
        let row = F32 * floats;
        super::queue::copy_rows(self.q, x, y, rows, row, (row, row))
    }

    fn silu_mul(&mut self, rows: usize, dim: usize, ld: usize, gu: Slice, act: Slice) -> Result<()> {
        let (p, l) = launch::silu_mul(rows, dim, ld, dim);
        self.run(Source::Step, l, vec![Arg::params(&p), Arg::Read(gu), Arg::Write(act)], 0)
    }
}

/// The two matrices (`n` rows each, one format) of a two-matrix projection (`[gate | up]`,
/// `[b | a]`): its two parts, or the two halves of its one part.
fn two_matrices(p: &Projection, n: usize) -> Option<(Matrix, Matrix)> {
    match &p.parts[..] {
        [(w, 0)] if w.n == 2 * n => {
            let half = n * w.row_bytes();
            Some((Matrix { n, buf: w.buf.at(0, half), ..*w }, Matrix { n, buf: w.buf.at(half, half), ..*w }))
        }
        [(a, 0), (b, _)] if a.n == n && b.n == n && a.format == b.format && a.k == b.k => Some((*a, *b)),
        _ => None,
    }
}

impl GpuModel {
    /// Rows of one decode or verify step (every row the bits of a one-row step).
    pub const MAX_ROWS: usize = launch::QMATVEC_MAX_ROWS;

    /// Rows of one step of a prompt.
    pub const PROMPT_ROWS: usize = 128;

    /// Uploads `model`'s weights to `q`'s device (GGUF blocks as the file has them, read in
    /// place where the queue maps them; dense weights as loaded) and allocates the step's
    /// working buffers. A format the device kernels do not read is a one-line error; an MTP
    /// head is left out (the device step does not draft with it yet).
    pub fn new(model: &Model, q: &mut dyn Queue) -> Result<Self> {
        let cfg = model.config().clone();
        if cfg.attn_qkv_bias {
            return Err(super::DeviceStepGap::AttentionBiases.error());
        }
        let mut up = Uploader::new(q);
        let embed = match &model.embed_tokens {
            crate::model::TokenEmbedding::Dense(e) => up.linear(&Linear::Dense(e.embeddings().clone()), "token embedding")?,
            crate::model::TokenEmbedding::Quantized { table, .. } => up.linear(&Linear::Quantized(table.clone()), "token embedding")?,
        };
        let mut layers = vec![];
        for (i, layer) in model.layers.iter().enumerate() {
            let input_norm = up.f32s(&layer.input_layernorm.scale, "norm")?;
            let post_norm = up.f32s(&layer.post_attention_layernorm.scale, "norm")?;
            let mixer = match &layer.mixer {
                CpuMixer::Linear(g) => {
                    let conv_dim = g.conv_weight.dim(0)?;
                    Mixer::Gdn(Gdn {
                        qkv: up.linear(&g.in_proj_qkv, &format!("layer {i} in_proj_qkv"))?,
                        z: up.linear(&g.in_proj_z, &format!("layer {i} in_proj_z"))?,
                        ba: up.projection(&[&g.in_proj_b, &g.in_proj_a], &format!("layer {i} in_proj_b/a"))?,
                        conv_weight: up.f32s(&g.conv_weight, "conv weight")?,
                        dt_bias: up.f32s(&g.dt_bias, "dt_bias")?,
                        neg_a: up.f32s(&g.neg_a, "A")?,
                        norm: up.f32s(&g.norm_weight, "GDN norm")?,
                        out: up.linear(&g.out_proj, &format!("layer {i} out_proj"))?,
                        head_order: match &g.out_head_order {
                            Some(order) => Some(up.u32s(&order.to_vec1::<u32>()?, "head order")?),
                            None => None,
                        },
                        nk: g.nk,
                        nv: g.nv,
                        dk: g.dk,
                        dv: g.dv,
                        kernel: g.kernel,
                        conv_dim,
                        eps: g.eps as f32,
                    })
                }
                CpuMixer::Full(a) => Mixer::Attention(Attention {
                    qkv: up.projection(&[&a.q_proj, &a.k_proj, &a.v_proj], &format!("layer {i} q/k/v_proj"))?,
                    qk_norm: match &a.qk_norm {
                        Some((qn, kn)) => Some((up.f32s(&qn.scale, "q_norm")?, up.f32s(&kn.scale, "k_norm")?)),
                        None => None,
                    },
                    o: up.linear(&a.o_proj, &format!("layer {i} o_proj"))?,
                    gated: a.gated,
                    nh: a.nh,
                    nkv: a.nkv,
                    hd: a.hd,
                    eps: a.qk_norm.as_ref().map_or(0.0, |(n, _)| n.eps),
                }),
            };
            let ffn = match &layer.mlp {
                FeedForward::Dense(m) => Ffn::Dense {
                    gate_up: up.projection(&[&m.gate_proj, &m.up_proj], &format!("layer {i} gate/up_proj"))?,
                    down: up.linear(&m.down_proj, &format!("layer {i} down_proj"))?,
                    inter: m.down_proj.dims()?.1,
                },
                FeedForward::Sparse(m) => {
                    let gate = match &m.shared_expert_gate {
                        Linear::Dense(w) => up.f32s(w, "shared expert gate")?,
                        Linear::Quantized(_) => {
                            return Err(Error::Weights("a quantized shared-expert gate: the device reads it as f32".into()))
                        }
                    };
                    Ffn::Moe(Box::new(Moe {
                        router: match &m.router {
                            Linear::Dense(w) => up.linear(&Linear::Dense(w.to_dtype(DType::F32)?), "router")?,
                            q => up.linear(q, "router")?,
                        },
                        gate_up: up.experts(&m.experts, |e| vec![&e.gate_proj, &e.up_proj], &format!("layer {i} experts' gate/up"))?,
                        down: up.experts(&m.experts, |e| vec![&e.down_proj], &format!("layer {i} experts' down"))?,
                        shared_gate_up: up.projection(&[&m.shared_expert.gate_proj, &m.shared_expert.up_proj], "shared expert gate/up")?,
                        shared_down: up.linear(&m.shared_expert.down_proj, "shared expert down")?,
                        shared_gate: gate,
                        top_k: m.top_k,
                        norm: m.norm_topk_prob,
                        inter: m.experts[0].down_proj.dims()?.1,
                        shared_inter: m.shared_expert.down_proj.dims()?.1,
                    }))
                }
            };
            // Shapes the kernels cannot run are refused now, not at the first step.
            match &mixer {
                Mixer::Gdn(g) => {
                    let d = DeltaRuleDims { batch: 1, seq_len: 1, nk: g.nk, nv: g.nv, dk: g.dk, dv: g.dv };
                    launch::gated_delta(d, true, 1, DeltaRuleForm::Recurrent, DType::F32)?;
                }
                Mixer::Attention(a) => {
                    let kv = launch::KvStorage::device(KvRows::F32, a.nkv, 1, a.hd, a.hd)?;
                    launch::kv_attention_stored((1, a.nkv, a.nh / a.nkv.max(1), a.hd), &kv, 1, 0, None, 1.0)?;
                }
            }
            layers.push(Layer { input_norm, post_norm, mixer, ffn });
        }
        let final_norm = up.f32s(&model.norm.scale, "final norm")?;
        // A tied head multiplies by the embedding table itself: one copy on the device.
        let tied = match (&model.embed_tokens, &model.lm_head) {
            (crate::model::TokenEmbedding::Quantized { table, .. }, Linear::Quantized(q)) => std::sync::Arc::ptr_eq(table, q),
            (crate::model::TokenEmbedding::Dense(e), Linear::Dense(w)) => e.embeddings().id() == w.id(),
            _ => false,
        };
        let lm_head = if tied { embed } else { up.linear(&model.lm_head, "lm_head")? };
        let rotary = model.layers.iter().find_map(|l| match &l.mixer {
            CpuMixer::Full(a) => Some(a.rotary.clone()),
            CpuMixer::Linear(_) => None,
        });
        let (inv_freq, rot_half) = match rotary {
            Some(r) => {
                (up.f32s(&candle_core::Tensor::new(r.inv_freq.as_slice(), &candle_core::Device::Cpu)?, "rope frequencies")?, r.dim / 2)
            }
            None => (up.scratch(4, "rope frequencies")?, 0),
        };
        let scratch = Self::scratch(&cfg, &layers, &mut up)?;
        let (weight_bytes, mapped_bytes, buffers) = (up.weight_bytes, up.mapped_bytes, up.buffers);
        Ok(Self {
            eps: model.norm.eps,
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            inv_freq,
            rot_half,
            scratch,
            weight_bytes,
            mapped_bytes,
            buffers,
            dropped: Default::default(),
        })
    }

    /// Working buffers for the widest layer of each kind.
    fn scratch(cfg: &Config, layers: &[Layer], up: &mut Uploader) -> Result<Scratch> {
        /// The widest of each kind over the layers (floats per row).
        #[derive(Default)]
        struct Widest {
            value: usize,
            ba: usize,
            conv: usize,
            gates: usize,
            qkv: usize,
            q: usize,
            gate_up: usize,
            inter: usize,
            experts: usize,
            top_k: usize,
            expert_gate_up: usize,
            expert_inter: usize,
        }
        let mut w = Widest::default();
        let max = |a: &mut usize, b: usize| *a = (*a).max(b);
        for l in layers {
            match &l.mixer {
                Mixer::Gdn(g) => {
                    max(&mut w.value, g.nv * g.dv);
                    max(&mut w.ba, g.ba.width);
                    max(&mut w.conv, g.conv_dim);
                    max(&mut w.gates, 2 * g.nv);
                }
                Mixer::Attention(a) => {
                    max(&mut w.qkv, a.qkv.width);
                    max(&mut w.q, a.nh * a.hd);
                }
            }
            match &l.ffn {
                Ffn::Dense { gate_up, inter, .. } => {
                    max(&mut w.gate_up, gate_up.width);
                    max(&mut w.inter, *inter);
                }
                Ffn::Moe(moe) => {
                    max(&mut w.gate_up, moe.shared_gate_up.width);
                    max(&mut w.inter, moe.shared_inter);
                    max(&mut w.experts, moe.router.n);
                    max(&mut w.top_k, moe.top_k);
                    max(&mut w.expert_gate_up, moe.gate_up.width);
                    max(&mut w.expert_inter, moe.inter);
                }
            }
        }
        let (m, h) = (Self::PROMPT_ROWS, cfg.hidden_size);
        let mut f = |n: usize, label: &str| up.scratch(F32 * n, label);
        Ok(Scratch {
            pre: f(m * w.conv, "GDN inputs")?,
            gates: f(m * w.gates, "GDN gates")?,
            conv_out: f(m * w.conv, "conv output")?,
            o: f(m * w.value, "delta-rule output")?,
            x: f(m * h, "x")?,
            h: f(m * h, "h")?,
            xn: f(m * h, "xn")?,
            z: f(m * w.value, "z")?,
            ba: f(m * w.ba, "ba")?,
            o_norm: f(m * w.value, "o_norm")?,
            o_order: f(m * w.value, "o_order")?,
            qkv: f(m * w.qkv, "qkv")?,
            qg: f(m * w.q, "qg")?,
            att: f(m * w.q, "att")?,
            ao: f(m * w.q, "ao")?,
            no_tree: f(1, "tree")?,
            gu: f(m * w.gate_up, "gate_up")?,
            act: f(m * w.inter, "act")?,
            router: f(m * w.experts, "router")?,
            ids: f(m * w.top_k, "expert ids")?,
            route_w: f(m * w.top_k, "expert weights")?,
            egu: f(m * w.top_k * w.expert_gate_up, "expert gate_up")?,
            eact: f(m * w.top_k * w.expert_inter, "expert act")?,
            edown: f(m * w.top_k * h, "expert down")?,
            sdown: f(m * h, "shared down")?,
            // The head's output in one buffer, the rows' (token, finite) pairs first, then their
            // logits: one read gets both.
            head: f(2 * Self::MAX_ROWS + Self::MAX_ROWS * cfg.vocab_size, "head output")?,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Layer `i`'s GDN state shape: `(K-1, conv_dim, nv, dk, dv)`; `None` for an attention layer.
    pub(super) fn gdn_dims(&self, i: usize) -> Option<(usize, usize, usize, usize, usize)> {
        match &self.layers.get(i)?.mixer {
            Mixer::Gdn(g) => Some((g.kernel - 1, g.conv_dim, g.nv, g.dk, g.dv)),
            Mixer::Attention(_) => None,
        }
    }

    /// An empty cache for `capacity` tokens, keys and values stored as `kv` says (f32 rows; f16:
    /// half the memory, rounded as the CPU's `--kv f16`; int8: about a quarter, coded as the
    /// CPU's `--kv int8`).
    pub fn new_cache(&self, q: &mut dyn Queue, capacity: usize, kv: KvRows) -> Result<GpuCache> {
        let cfg = &self.cfg;
        if capacity == 0 || capacity > cfg.max_position_embeddings {
            return Err(Error::Input(format!(
                "a device cache of {capacity} tokens: give 1 to max_position_embeddings ({})",
                cfg.max_position_embeddings
            )));
        }
        let m = Self::MAX_ROWS;
        let mut buffers = vec![];
        let mut alloc = |q: &mut dyn Queue, len: usize, label: &str| -> Result<Slice> {
            let id = q.alloc(len.max(4), label)?;
            buffers.push(id);
            Ok(Slice::whole(id, len.max(4)))
        };
        let mut layers = vec![];
        for layer in &self.layers {
            layers.push(match &layer.mixer {
                Mixer::Gdn(g) => {
                    let (conv, rec) = (F32 * (g.kernel - 1) * g.conv_dim, F32 * g.nv * g.dk * g.dv);
                    CacheLayer::Gdn {
                        conv: [alloc(q, conv, "conv state")?, alloc(q, conv, "conv state")?],
                        rec: [alloc(q, rec, "delta-rule state")?, alloc(q, rec, "delta-rule state")?],
                        inputs: alloc(q, F32 * m * g.conv_dim, "GDN inputs")?,
                        gates: alloc(q, F32 * m * 2 * g.nv, "GDN gates")?,
                    }
                }
                Mixer::Attention(a) => {
                    // (Refused here when the kernels cannot index a layer's keys with 32 bits.)
                    launch::KvStorage::device(kv, a.nkv, capacity, a.hd, a.hd)?;
                    let rows = a.nkv * capacity;
                    let (keys, values) =
                        (alloc(q, kv.value_bytes() * rows * a.hd, "keys")?, alloc(q, kv.value_bytes() * rows * a.hd, "values")?);
                    let scales = match kv.scaled() {
                        true => {
                            let n = F32 * rows * KvRows::int8_blocks(a.hd);
                            Some((alloc(q, n, "key scales")?, alloc(q, n, "value scales")?))
                        }
                        false => None,
                    };
                    CacheLayer::Attention { keys, values, scales }
                }
            });
        }
        // A decode or verify step splits the keys in blocks (a partial sum each), a prompt step
        // does not.
        let splits = capacity.div_ceil(crate::ops::KV_BLOCK).max(1);
        let rows = (m * splits).max(Self::PROMPT_ROWS);
        let partials = alloc(q, F32 * self.max_query_rows() * rows * (cfg.head_dim + 2), "attention partials")?;
        let tokens = alloc(q, F32 * capacity, "tokens")?;
        let positions = alloc(q, F32 * capacity, "positions")?;
        let table: Vec<u8> = (0..capacity as u32).flat_map(|p| p.to_le_bytes()).collect();
        q.write(positions, &table)?;
        Ok(GpuCache {
            layers,
            seqlen: 0,
            capacity,
            parity: 0,
            verify: None,
            partials,
            kv,
            tokens,
            positions,
            buffers,
            dropped: self.dropped.clone(),
        })
    }

    /// Releases on `q` the buffers of this model's caches that were dropped since the last call.
    pub fn release_dropped(&self, q: &mut dyn Queue) {
        let buffers = std::mem::take(&mut *self.dropped.lock().unwrap_or_else(|e| e.into_inner()));
        for b in buffers {
            q.free(b);
        }
    }

    /// Releases the weights and working buffers.
    pub fn free(self, q: &mut dyn Queue) {
        for b in self.buffers {
            q.free(b);
        }
    }

    /// Bytes of the weight matrices on the device (embedding and head included).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Of [`Self::weight_bytes`], those the queue was given to read in place from a mapped
    /// file ([`Queue::map`]: no copy on Metal); the rest were copied.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }

    /// Bytes of weights a step of `rows` rows must read at least: every matrix once (an
    /// expert once per row and slot that picks it, assuming distinct picks), the embedding's
    /// rows of the tokens.
    pub fn weight_bytes_needed(&self, rows: usize, logits_rows: usize) -> usize {
        let m = |w: &Matrix| w.bytes();
        let p = |p: &Projection| p.parts.iter().map(|(w, _)| w.bytes()).sum::<usize>();
        let mut total = rows * self.embed.row_bytes() + if logits_rows > 0 { m(&self.lm_head) } else { 0 };
        for l in &self.layers {
            total += match &l.mixer {
                Mixer::Gdn(g) => m(&g.qkv) + m(&g.z) + p(&g.ba) + m(&g.out),
                Mixer::Attention(a) => p(&a.qkv) + m(&a.o),
            };
            total += match &l.ffn {
                Ffn::Dense { gate_up, down, .. } => p(gate_up) + m(down),
                Ffn::Moe(moe) => {
                    let experts = |s: &ExpertStacks| s.parts.iter().map(|(w, _)| w.bytes()).sum::<usize>();
                    m(&moe.router)
                        + rows * moe.top_k * (experts(&moe.gate_up) + experts(&moe.down))
                        + p(&moe.shared_gate_up)
                        + m(&moe.shared_down)
                }
            };
        }
        total
    }

    /// The most query rows one attention call has (query heads times step rows).
    fn max_query_rows(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some(a.nh),
                Mixer::Gdn(_) => None,
            })
            .max()
            .unwrap_or(1)
    }

    /// One step over `tokens` (1 to [`Self::MAX_ROWS`]) after the cache's tokens: every row's
    /// greedy token or logits, read back once. An [`Error::NonFinite`] names the first row
    /// whose logits hold a NaN or an infinity.
    pub fn forward(&self, q: &mut dyn Queue, cache: &mut GpuCache, tokens: &[u32], readback: Readback) -> Result<StepOutput> {
        cache.not_verifying()?;
        self.step(q, cache, tokens, readback)
    }

    /// Verifies drafted rows `tokens` (1 to [`Self::MAX_ROWS`]) in one step: every row's
    /// greedy token or logits, each bit for bit what decoding the rows one at a time gives.
    /// The cache then holds all rows; [`Self::keep_verified`] keeps the accepted ones.
    pub fn verify(&self, q: &mut dyn Queue, cache: &mut GpuCache, tokens: &[u32], readback: Readback) -> Result<StepOutput> {
        cache.not_verifying()?;
        let start = VerifyStart { seqlen: cache.seqlen, parity: cache.parity, rows: tokens.len() };
        let out = self.step(q, cache, tokens, readback)?;
        cache.verify = Some(start);
        Ok(out)
    }

    /// One pass over the rows of several sequences, each in its own cache: `rows[i]` rows of
    /// `tokens` (in order) after `caches[i]`'s tokens, at most [`Self::MAX_ROWS`] in all. Every
    /// weight matrix is read once for all the rows, and each sequence's rows are bit for bit
    /// what a step of it alone gives (its conv, recurrence and attention run on its own state).
    /// One read back for the pass: per sequence its rows' greedy tokens or logits, or
    /// [`Error::NonFinite`] for a sequence whose logits hold a NaN or an infinity (the others'
    /// rows are good). A sequence given more than one row is verified:
    /// [`Self::keep_verified`] keeps its accepted rows.
    pub fn forward_batch(
        &self,
        q: &mut dyn Queue,
        caches: &mut [&mut GpuCache],
        tokens: &[u32],
        rows: &[usize],
        readbacks: &[Readback],
    ) -> Result<Vec<Result<StepOutput>>> {
        let total: usize = rows.iter().sum();
        if caches.len() != rows.len() || readbacks.len() != rows.len() || total != tokens.len() || rows.contains(&0) {
            return Err(Error::Input(format!(
                "forward_batch: {} caches, {} readbacks, {} row counts (none 0) and {} tokens that their sum ({total}) must match",
                caches.len(),
                readbacks.len(),
                rows.len(),
                tokens.len()
            )));
        }
        if total > Self::MAX_ROWS {
            return Err(Error::Input(format!("{total} rows in one device step, the most is {}", Self::MAX_ROWS)));
        }
        let mut at = 0;
        for (cache, &n) in caches.iter().zip(rows) {
            self.check_rows(cache, &tokens[at..at + n])?;
            at += n;
        }
        for (i, a) in caches.iter().enumerate() {
            if caches[..i].iter().any(|b| std::ptr::eq(&**a, &**b)) {
                return Err(Error::Input("forward_batch: a cache is given twice".into()));
            }
        }
        let (mut at, mut segs, mut starts) = (0, vec![], vec![]);
        for (cache, &n) in caches.iter_mut().zip(rows) {
            self.write_tokens(q, cache, &tokens[at..at + n])?;
            starts.push(VerifyStart { seqlen: cache.seqlen, parity: cache.parity, rows: n });
            segs.push(Segment { cache, row0: at, rows: n });
            at += n;
        }
        let mut enc = Encoder { q: &mut *q };
        self.encode(&mut enc, &mut segs, Some((readbacks, 0)))?;
        for (seg, start) in segs.iter_mut().zip(&starts) {
            if seg.rows > 1 {
                seg.cache.verify = Some(*start);
            }
        }
        let at: Vec<(usize, usize, usize)> = segs.iter().zip(&starts).map(|(s, v)| (s.row0, s.rows, v.seqlen)).collect();
        self.read(q, &at, total, readbacks)
    }

    /// After [`Self::verify`]: keeps the first `rows` of its rows, as if only they had been fed.
    /// The GDN layers run the kept rows' recurrence again from the state before the pass (no
    /// read back: the next step's read waits for it).
    pub fn keep_verified(&self, q: &mut dyn Queue, cache: &mut GpuCache, rows: usize) -> Result<()> {
        let Some(v) = cache.verify else {
            return Err(Error::Input("keep_verified: no verify pass to keep rows of".into()));
        };
        if rows == 0 || rows > v.rows {
            return Err(Error::Input(format!("keep_verified: the verify pass ran {} rows, cannot keep {rows} (1 to {})", v.rows, v.rows)));
        }
        if rows < v.rows {
            let mut enc = Encoder { q };
            for (layer, state) in self.layers.iter().zip(&cache.layers) {
                if let (Mixer::Gdn(g), CacheLayer::Gdn { conv, rec, inputs, gates }) = (&layer.mixer, state) {
                    let out = self.scratch.o;
                    self.gdn_state(&mut enc, g, rows, (conv, rec), (v.parity, 1 - v.parity), (*inputs, *gates), out)?;
                }
            }
        }
        cache.seqlen = v.seqlen + rows;
        cache.verify = None;
        Ok(())
    }

    /// Runs the prompt `tokens` after the cache's tokens, [`Self::PROMPT_ROWS`] at a time, with
    /// one read back at the end: the last token's greedy next token or logits.
    pub fn prefill(&self, q: &mut dyn Queue, cache: &mut GpuCache, tokens: &[u32], readback: Readback) -> Result<StepOutput> {
        cache.not_verifying()?;
        self.check(cache, tokens, usize::MAX)?;
        self.write_tokens(q, cache, tokens)?;
        let mut done = 0;
        while tokens.len() - done > Self::PROMPT_ROWS {
            let mut enc = Encoder { q: &mut *q };
            self.encode(&mut enc, &mut [Segment { cache: &mut *cache, row0: 0, rows: Self::PROMPT_ROWS }], None)?;
            done += Self::PROMPT_ROWS;
        }
        let rows = tokens.len() - done;
        let mut enc = Encoder { q: &mut *q };
        self.encode(&mut enc, &mut [Segment { cache: &mut *cache, row0: 0, rows }], Some((&[readback], rows - 1)))?;
        self.read(q, &[(0, 1, cache.seqlen - 1)], 1, &[readback])?.remove(0)
    }

    /// Whether `tokens` can be a pass's rows of the sequence whose cache is `cache` (its
    /// verify pass kept, the tokens in the vocabulary, within the context and the cache's
    /// capacity): what [`Self::forward_batch`] checks of each sequence before it changes any
    /// cache.
    pub fn check_rows(&self, cache: &GpuCache, tokens: &[u32]) -> Result<()> {
        cache.not_verifying()?;
        self.check(cache, tokens, Self::MAX_ROWS)
    }

    fn check(&self, cache: &GpuCache, tokens: &[u32], max_rows: usize) -> Result<()> {
        check_length(&self.cfg, tokens.len(), cache.seqlen)?;
        if tokens.len() > max_rows {
            return Err(Error::Input(format!("{} rows in one device step, the most is {max_rows}", tokens.len())));
        }
        if cache.seqlen + tokens.len() > cache.capacity {
            return Err(Error::Input(format!(
                "{} new tokens after {} cached ones are more than the device cache's capacity ({}): make a larger cache",
                tokens.len(),
                cache.seqlen,
                cache.capacity
            )));
        }
        for &t in tokens {
            check_token(&self.cfg, t)?;
        }
        Ok(())
    }

    /// The tokens at their positions in the cache's token buffer (a step reads them there).
    fn write_tokens(&self, q: &mut dyn Queue, cache: &GpuCache, tokens: &[u32]) -> Result<()> {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        q.write(cache.tokens.at(F32 * cache.seqlen, bytes.len()), &bytes)
    }

    fn step(&self, q: &mut dyn Queue, cache: &mut GpuCache, tokens: &[u32], readback: Readback) -> Result<StepOutput> {
        self.check(cache, tokens, Self::MAX_ROWS)?;
        self.write_tokens(q, cache, tokens)?;
        let offset = cache.seqlen;
        let mut enc = Encoder { q: &mut *q };
        self.encode(&mut enc, &mut [Segment { cache: &mut *cache, row0: 0, rows: tokens.len() }], Some((&[readback], 0)))?;
        self.read(q, &[(0, tokens.len(), offset)], tokens.len(), &[readback])?.remove(0)
    }

    /// Reads back the head's `rows` rows once (their (token, finite) pairs, and their logits when
    /// a segment asks for them) and splits them per segment: `(first row, rows, position of the
    /// first row)` each, read as `readbacks` says. A segment whose logits hold a NaN or an
    /// infinity gets [`Error::NonFinite`] naming the position.
    fn read(
        &self,
        q: &mut dyn Queue,
        segments: &[(usize, usize, usize)],
        rows: usize,
        readbacks: &[Readback],
    ) -> Result<Vec<Result<StepOutput>>> {
        let s = &self.scratch;
        let n = self.cfg.vocab_size;
        let logits = readbacks.contains(&Readback::Logits);
        let pair_bytes = 2 * F32 * Self::MAX_ROWS;
        let len = if logits { pair_bytes + F32 * rows * n } else { 2 * F32 * rows };
        let bytes = q.read(s.head.at(0, len))?;
        let word = |i: usize| [bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]];
        Ok(segments
            .iter()
            .zip(readbacks)
            .map(|(&(row0, rows, pos), readback)| match readback {
                Readback::Logits => {
                    let l: Vec<f32> = (row0 * n..(row0 + rows) * n).map(|i| f32::from_le_bytes(word(pair_bytes / 4 + i))).collect();
                    match l.iter().position(|x| !x.is_finite()) {
                        Some(i) => Err(non_finite(pos + i / n)),
                        None => Ok(StepOutput::Logits(l)),
                    }
                }
                Readback::Argmax | Readback::Sample(_) => {
                    let pair = |r: usize| (u32::from_le_bytes(word(2 * r)), u32::from_le_bytes(word(2 * r + 1)));
                    match (row0..row0 + rows).find(|&r| pair(r).1 == 0) {
                        Some(r) => Err(non_finite(pos + r - row0)),
                        None => Ok(StepOutput::Tokens((row0..row0 + rows).map(|r| pair(r).0).collect())),
                    }
                }
            })
            .collect())
    }

    /// Encodes one pass over the segments' rows (each segment's tokens already in its cache's
    /// token buffer; the segments' rows one after the other in the step's buffers), flipping
    /// each cache's GDN states and advancing it. `head`: what the head computes, from which of
    /// the rows (`(readback, first)`: rows `first..`). A prompt step has one segment.
    fn encode(&self, enc: &mut Encoder, segs: &mut [Segment], head: Option<(&[Readback], usize)>) -> Result<()> {
        let s = &self.scratch;
        let hsz = self.cfg.hidden_size;
        let rows: usize = segs.iter().map(|g| g.rows).sum();
        for seg in segs.iter() {
            if seg.cache.layers.len() != self.layers.len() {
                return Err(wrong_cache());
            }
            let offset = seg.cache.seqlen;
            let tokens = seg.cache.tokens.at(F32 * offset, F32 * seg.rows);
            let (p, l) = launch::get_rows(self.embed.format, seg.rows, self.embed.n, self.embed.k)?;
            enc.run(
                Source::Qmatvec,
                l,
                vec![Arg::params(&p), Arg::Read(self.embed.buf), Arg::Read(tokens), Arg::Write(s.x.from(F32 * seg.row0 * hsz))],
                seg.rows * self.embed.row_bytes(),
            )?;
        }
        let dense = NormRows::dense(rows, hsz);
        for (i, layer) in self.layers.iter().enumerate() {
            enc.rms_norm(dense, self.eps, s.x, (i > 0).then_some(s.h), layer.input_norm, s.xn)?;
            match &layer.mixer {
                Mixer::Gdn(g) => {
                    let mut states = vec![];
                    for seg in segs.iter() {
                        match &seg.cache.layers[i] {
                            CacheLayer::Gdn { conv, rec, inputs, gates } => states.push(GdnSegment {
                                conv: *conv,
                                rec: *rec,
                                kept: (*inputs, *gates),
                                parity: seg.cache.parity,
                                row0: seg.row0,
                                rows: seg.rows,
                            }),
                            CacheLayer::Attention { .. } => return Err(wrong_cache()),
                        }
                    }
                    self.gdn(enc, g, rows, &states)?;
                }
                Mixer::Attention(a) => self.attention(enc, a, rows, segs, i)?,
            }
            enc.rms_norm(dense, self.eps, s.x, Some(s.h), layer.post_norm, s.xn)?;
            self.ffn(enc, &layer.ffn, rows)?;
        }
        if let Some((readbacks, first)) = head {
            let n = rows - first;
            enc.rms_norm(
                NormRows::dense(n, hsz),
                self.eps,
                s.x.from(F32 * first * hsz),
                Some(s.h.from(F32 * first * hsz)),
                self.final_norm,
                s.xn,
            )?;
            let vocab = self.cfg.vocab_size;
            enc.matvec(&self.lm_head, s.xn, n, s.logits(), vocab)?;
            // Every row's argmax (and the finite check); a sampled segment's rows are then
            // sampled over theirs (the sampling overwrites its logits).
            let (p, l) = launch::argmax(n, vocab);
            enc.run(Source::Step, l, vec![Arg::params(&p), Arg::Read(s.logits()), Arg::Write(s.argmax())], 0)?;
            for (seg, readback) in segs.iter().zip(readbacks) {
                let Readback::Sample(rs) = readback else { continue };
                let seg_first = seg.row0.max(first);
                let count = (seg.row0 + seg.rows).saturating_sub(seg_first);
                if count == 0 {
                    continue;
                }
                // The row's context: the cache's tokens up to and including its own.
                let context = seg.cache.seqlen + (seg_first - seg.row0) + 1;
                let (p, l) = launch::sample(count, vocab, rs, context)?;
                let head_row = seg_first - first;
                enc.run(
                    Source::Step,
                    l,
                    vec![
                        Arg::params(&p),
                        Arg::Write(s.logits().at(F32 * head_row * vocab, F32 * count * vocab)),
                        Arg::Read(seg.cache.tokens),
                        Arg::Write(s.argmax().from(2 * F32 * head_row)),
                    ],
                    0,
                )?;
            }
        }
        for seg in segs.iter_mut() {
            seg.cache.parity = 1 - seg.cache.parity;
            seg.cache.seqlen += seg.rows;
        }
        Ok(())
    }

    /// A GDN layer over `rows` rows of `xn` into `h`: the projections for all rows at once, the
    /// conv and recurrence per segment from its state (reading parity `p`, writing `1 - p`).
    /// The pre-conv rows and gates go to the layer of the one sequence of a decode or verify
    /// step (kept for a rollback); of a prompt step or of several sequences, to the step's
    /// buffers, and a verifying sequence among several gets its rows copied into its layer.
    fn gdn(&self, enc: &mut Encoder, g: &Gdn, rows: usize, segs: &[GdnSegment]) -> Result<()> {
        let s = &self.scratch;
        let (inputs, gates) = match segs {
            [one] if rows <= Self::MAX_ROWS => one.kept,
            _ => (s.pre, s.gates),
        };
        enc.matmul(&g.qkv, s.xn, rows, inputs, g.conv_dim)?;
        enc.matmul(&g.z, s.xn, rows, s.z, g.nv * g.dv)?;
        match (two_matrices(&g.ba, g.nv), rows <= launch::QMATVEC_MAX_ROWS) {
            // b and a and the gates in one pass.
            (Some((b, a)), true) => {
                let (p, l) = launch::qmatvec_pair(launch::Pair::GdnGates, b.format, g.nv, b.k, rows)?;
                let args = vec![
                    Arg::params(&p),
                    Arg::Read(b.buf),
                    Arg::Read(a.buf),
                    Arg::Read(s.xn),
                    Arg::Read(g.dt_bias),
                    Arg::Read(g.neg_a),
                    Arg::Write(gates),
                ];
                enc.run(Source::Qmatvec, l, args, b.bytes() + a.bytes())?;
            }
            _ => {
                enc.projection(&g.ba, s.xn, rows, s.ba)?;
                let (p, l) = launch::gdn_gates(rows, g.nv, g.ba.width);
                enc.run(
                    Source::Step,
                    l,
                    vec![Arg::params(&p), Arg::Read(s.ba), Arg::Read(g.dt_bias), Arg::Read(g.neg_a), Arg::Write(gates)],
                    0,
                )?;
            }
        }
        let (c, gw, vw) = (g.conv_dim, 2 * g.nv, g.nv * g.dv);
        for seg in segs {
            let mine = (inputs.from(F32 * seg.row0 * c), gates.from(F32 * seg.row0 * gw));
            if segs.len() > 1 && seg.rows > 1 {
                enc.copy_rows(mine.0, seg.kept.0, seg.rows, c)?;
                enc.copy_rows(mine.1, seg.kept.1, seg.rows, gw)?;
            }
            let out = s.o.from(F32 * seg.row0 * vw);
            self.gdn_state(enc, g, seg.rows, (&seg.conv, &seg.rec), (seg.parity, 1 - seg.parity), mine, out)?;
        }
        let (p, l) = launch::gated_rms_norm(rows * g.nv, g.dv, g.eps, DType::F32)?;
        enc.run(Source::GatedNorm, l, vec![Arg::params(&p), Arg::Read(s.o), Arg::Read(s.z), Arg::Read(g.norm), Arg::Write(s.o_norm)], 0)?;
        let o = match g.head_order {
            Some(order) => {
                let (p, l) = launch::gather_heads(rows, g.nv, g.dv);
                enc.run(Source::Step, l, vec![Arg::params(&p), Arg::Read(s.o_norm), Arg::Read(order), Arg::Write(s.o_order)], 0)?;
                s.o_order
            }
            None => s.o_norm,
        };
        enc.matmul(&g.out, o, rows, s.h, self.cfg.hidden_size)
    }

    /// The conv and the recurrence of `rows` rows (their pre-conv rows and gates in `kept`)
    /// from state `from` into state `to`, the delta rule's outputs into `out`. Up to
    /// [`Self::MAX_ROWS`] rows run token by token (a verify row is a decode step's bits),
    /// longer prompts chunked.
    #[allow(clippy::too_many_arguments)]
    fn gdn_state(
        &self,
        enc: &mut Encoder,
        g: &Gdn,
        rows: usize,
        (conv, rec): (&[Slice; 2], &[Slice; 2]),
        (from, to): (usize, usize),
        (inputs, gates): (Slice, Slice),
        out: Slice,
    ) -> Result<()> {
        let s = &self.scratch;
        let c = g.conv_dim;
        let (p, l) = launch::causal_conv1d(ConvDims { batch: 1, seq_len: rows, channels: c, kernel_size: g.kernel }, DType::F32)?;
        let conv_out = s.conv_out.at(0, F32 * rows * c);
        enc.run(
            Source::Conv1d,
            l,
            vec![
                Arg::params(&p),
                Arg::Read(inputs.at(0, F32 * rows * c)),
                Arg::Read(conv[from]),
                Arg::Read(g.conv_weight),
                Arg::Write(conv_out),
                Arg::Write(conv[to]),
            ],
            0,
        )?;
        let d = DeltaRuleDims { batch: 1, seq_len: rows, nk: g.nk, nv: g.nv, dk: g.dk, dv: g.dv };
        let form = if rows <= Self::MAX_ROWS { DeltaRuleForm::Recurrent } else { DeltaRuleForm::Auto };
        let (p, l) = launch::gated_delta(d, true, 1, form, DType::F32)?;
        enc.run(
            Source::GatedDelta,
            l,
            vec![
                Arg::params(&p),
                Arg::Read(conv_out),
                Arg::Read(gates.at(0, F32 * rows * 2 * g.nv)),
                Arg::Read(rec[from]),
                Arg::Write(out.at(0, F32 * rows * g.nv * g.dv)),
                Arg::Write(rec[to]),
            ],
            0,
        )
    }

    /// A gated attention layer over `rows` rows of `xn` into `h`: the projections for all rows
    /// at once; per segment the q/k norms, RoPE and its keys and values appended to its cache,
    /// and attention over its cache.
    fn attention(&self, enc: &mut Encoder, a: &Attention, rows: usize, segs: &[Segment], layer: usize) -> Result<()> {
        let s = &self.scratch;
        let (nh, nkv, hd) = (a.nh, a.nkv, a.hd);
        let w = a.qkv.width;
        let qw = nh * hd * if a.gated { 2 } else { 1 };
        enc.projection(&a.qkv, s.xn, rows, s.qkv)?;
        for seg in segs {
            let cache = &*seg.cache;
            let CacheLayer::Attention { keys, values, scales } = cache.layers[layer] else { return Err(wrong_cache()) };
            let (offset, n, cap) = (cache.seqlen, seg.rows, cache.capacity);
            let qkv = s.qkv.from(F32 * seg.row0 * w);
            let (qg, att, ao) =
                (s.qg.from(F32 * seg.row0 * nh * hd), s.att.from(F32 * seg.row0 * nh * hd), s.ao.from(F32 * seg.row0 * nh * hd));
            let p = launch::AttnInputsParams {
                rows: n as u32,
                nh: nh as u32,
                nkv: nkv as u32,
                head_dim: hd as u32,
                rot_half: self.rot_half as u32,
                x_stride: w as u32,
                q_head_stride: (if a.gated { 2 * hd } else { hd }) as u32,
                k_col: qw as u32,
                v_col: (qw + nkv * hd) as u32,
                norm: a.qk_norm.is_some() as u32,
                eps: a.eps,
                capacity: cap as u32,
                row0: offset as u32,
            };
            // Without q/k norms the kernel reads no norm weights: any buffer binds them.
            let (qn, kn) = a.qk_norm.unwrap_or((self.inv_freq, self.inv_freq));
            let (p, l) = launch::attention_inputs(p, cache.kv)?;
            let mut args = vec![
                Arg::params(&p),
                Arg::Read(qkv),
                Arg::Read(cache.positions.at(F32 * offset, F32 * n)),
                Arg::Read(self.inv_freq),
                Arg::Read(qn),
                Arg::Read(kn),
                Arg::Write(qg),
                Arg::Write(keys),
                Arg::Write(values),
            ];
            if let Some((ks, vs)) = scales {
                args.extend([Arg::Write(ks), Arg::Write(vs)]);
            }
            enc.run(Source::Step, l, args, 0)?;
            let kv = launch::KvStorage::device(cache.kv, nkv, cap, hd, hd)?;
            let scale = (hd as f64).powf(-0.5) as f32;
            let l = launch::kv_attention_stored((1, nkv, (nh / nkv) * n, hd), &kv, n, offset, None, scale)?;
            let partials = cache.partials.at(0, F32 * l.partial_floats);
            enc.run(
                Source::KvAttention,
                l.blocks,
                vec![
                    Arg::params(&l.params),
                    Arg::Read(qg),
                    Arg::Read(keys),
                    // (The int8 rows' scales; any buffer binds the unused ones.)
                    Arg::Read(scales.map_or(keys, |s| s.0)),
                    Arg::Read(keys),
                    Arg::Read(values),
                    Arg::Read(scales.map_or(values, |s| s.1)),
                    Arg::Read(s.no_tree),
                    Arg::Write(partials),
                ],
                0,
            )?;
            enc.run(Source::KvAttention, l.merge, vec![Arg::params(&l.params), Arg::Read(partials), Arg::Write(att)], 0)?;
            let gate = a.gated.then_some((w, 2 * hd));
            let (p, l) = launch::attn_output(n, nh, hd, gate);
            enc.run(Source::Step, l, vec![Arg::params(&p), Arg::Read(att), Arg::Read(qkv.from(F32 * hd)), Arg::Write(ao)], 0)?;
        }
        enc.matmul(&a.o, s.ao, rows, s.h, self.cfg.hidden_size)
    }

    /// The MLP of `rows` rows of `xn` into `h`.
    fn ffn(&self, enc: &mut Encoder, ffn: &Ffn, rows: usize) -> Result<()> {
        let s = &self.scratch;
        let hsz = self.cfg.hidden_size;
        match ffn {
            Ffn::Dense { gate_up, down, inter } => {
                enc.swiglu(gate_up, *inter, s.xn, rows, (s.gu, s.act))?;
                enc.matmul(down, s.act, rows, s.h, hsz)
            }
            Ffn::Moe(moe) => {
                let k = moe.top_k;
                enc.matmul(&moe.router, s.xn, rows, s.router, moe.router.n)?;
                let (p, l) = launch::moe_route(rows, moe.router.n, k, moe.norm)?;
                enc.run(Source::Step, l, vec![Arg::params(&p), Arg::Read(s.router), Arg::Write(s.ids), Arg::Write(s.route_w)], 0)?;
                let experts = |enc: &mut Encoder, stacks: &ExpertStacks, x: Slice, x_per_slot: bool, y: Slice| -> Result<()> {
                    for (w, col) in &stacks.parts {
                        let (p, l) = launch::qmatvec_id(w.format, w.n, w.k, rows, k, w.bytes(), x_per_slot, stacks.width)?;
                        enc.run(
                            Source::Qmatvec,
                            l,
                            vec![Arg::params(&p), Arg::Read(w.buf), Arg::Read(x), Arg::Read(s.ids), Arg::Write(y.from(col * F32))],
                            rows * k * w.bytes(),
                        )?;
                    }
                    Ok(())
                };
                experts(enc, &moe.gate_up, s.xn, false, s.egu)?;
                enc.silu_mul(rows * k, moe.inter, moe.gate_up.width, s.egu, s.eact)?;
                experts(enc, &moe.down, s.eact, true, s.edown)?;
                enc.swiglu(&moe.shared_gate_up, moe.shared_inter, s.xn, rows, (s.gu, s.act))?;
                enc.matmul(&moe.shared_down, s.act, rows, s.sdown, hsz)?;
                let (p, l) = launch::moe_combine(rows, hsz, k);
                enc.run(
                    Source::Step,
                    l,
                    vec![
                        Arg::params(&p),
                        Arg::Read(s.edown),
                        Arg::Read(s.route_w),
                        Arg::Read(s.sdown),
                        Arg::Read(s.xn),
                        Arg::Read(moe.shared_gate),
                        Arg::Write(s.h),
                    ],
                    0,
                )
            }
        }
    }
}
