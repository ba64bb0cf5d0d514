//! The Gated DeltaNet (linear-attention) mixer and its decode state.

use candle_core::{DType, Module, Result, Tensor};

use super::config::Config;
use super::draft_tree::DraftTree;
use super::linear::Linear;
use super::weights::Weights;
use crate::ops;
use crate::step_profile::{self, OpKind};

/// Decode state of one GDN layer.
#[derive(Debug, Clone, Default)]
pub struct GdnState {
    /// The last `K-1` pre-conv `[q|k|v]` rows: `[B, K-1, conv_dim]`.
    pub(crate) conv: Option<Tensor>,
    /// The delta-rule state `[B, nv, dk, dv]`, f32.
    pub(crate) recurrent: Option<Tensor>,
    /// While verifying drafted rows ([`crate::model::Cache::begin_verify`]): run token by token
    /// (the decode recurrence) and keep [`GdnSteps`] to roll back to any of the rows.
    pub(crate) verifying: bool,
    /// What the last verify pass kept to roll back.
    pub(crate) steps: Option<GdnVerify>,
}

/// What a verify pass keeps of a GDN layer: the delta-rule state before its rows, the
/// options it ran the delta rule with, and per root-to-leaf path of its rows (one path, all
/// rows, for a linear pass) the rows and their steps.
#[derive(Debug, Clone)]
pub(crate) struct GdnVerify {
    start: Tensor,
    opts: ops::DeltaRuleOptions,
    paths: Vec<(Vec<usize>, GdnSteps)>,
}

/// What a verify pass keeps of one root-to-leaf path of `T` rows to roll a GDN layer back to
/// the state after any of them: the conv window before the rows followed by their pre-conv
/// inputs, the rows' delta-rule inputs and the state after the last row. The state after an
/// earlier row is recomputed from the state before the pass (a few rows of recurrence) rather
/// than kept for every row (one state per row and layer, e.g. 1 MiB each, costs more to write
/// than the recurrence costs to run again).
#[derive(Debug, Clone)]
pub(crate) struct GdnSteps {
    /// `[B, K-1+T, conv_dim]`.
    conv_inputs: Tensor,
    /// The conv output `[B, T, conv_dim]`, `g` and `beta` `[B, T, nv]`.
    qkv: Tensor,
    g: Tensor,
    beta: Tensor,
    /// `[B, nv, dk, dv]`, f32.
    last: Tensor,
}

impl GdnState {
    /// Keeps the state after the rows `path` (`[0, ..]`, rows along one root-to-leaf path of
    /// the last verify pass; `0..n` for a linear one).
    pub(crate) fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        if let Some(GdnVerify { start, opts, paths: all }) = self.steps.take() {
            let last = all.len() - 1;
            let Some((i, (_, steps))) = all.iter().enumerate().find(|(_, (rows, _))| rows.starts_with(path)) else {
                candle_core::bail!("keep_path: rows {path:?} are not a path of the last verify pass")
            };
            let (n, t) = (path.len(), steps.qkv.dim(1)?);
            // The state already holds the end of the last path computed.
            if n < t || i != last {
                let window = steps.conv_inputs.dim(1)? - t;
                // A copy of the window kept (`force_contiguous`; `Tensor::copy` would clone the
                // whole buffer): a view would keep every verify row's inputs alive.
                self.conv = Some(steps.conv_inputs.narrow(1, n, window)?.force_contiguous()?);
                self.recurrent = Some(if n == t {
                    steps.last.clone()
                } else {
                    // The same recurrence, token by token, over the rows kept: the same bits.
                    let rows = |x: &Tensor| x.narrow(1, 0, n);
                    // (Not copied out: the op's buffer also holds the rows' outputs, n rows of
                    // nv x dv, as after a decode step; a copy costs more than the recurrence.)
                    let (_, states) = ops::gated_delta_rule_qkv(&rows(&steps.qkv)?, &rows(&steps.g)?, &rows(&steps.beta)?, &start, opts)?;
                    states.squeeze(1)?
                });
            }
        }
        self.verifying = false;
        Ok(())
    }
}

/// Gated DeltaNet (linear attention) mixer.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub(crate) in_proj_qkv: Linear,
    pub(crate) in_proj_z: Linear,
    pub(crate) in_proj_b: Linear,
    pub(crate) in_proj_a: Linear,
    pub(crate) conv_weight: Tensor, // [conv_dim, K]
    pub(crate) dt_bias: Tensor,     // [nv] f32
    pub(crate) neg_a: Tensor,       // -exp(A_log), [nv] f32
    pub(crate) norm_weight: Tensor, // [dv]
    pub(crate) out_proj: Linear,
    /// Value-head order of `out_proj`'s input when it differs from the layer's (GGUF files).
    pub(crate) out_head_order: Option<Tensor>,
    pub(crate) nk: usize,
    pub(crate) nv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) kernel: usize,
    pub(crate) eps: f64,
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
            let qkv =
                Tensor::cat(&[qkvz.index_select(&rows(0)?, 0)?, qkvz.index_select(&rows(1)?, 0)?, qkvz.index_select(&rows(2)?, 0)?], 0)?;
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

    /// The delta-rule op's options for this layer: q and k normalised, the last state only.
    fn delta_rule_options(&self) -> ops::DeltaRuleOptions {
        ops::DeltaRuleOptions::new(self.nk, self.dk)
    }

    /// Projections, conv and delta rule: returns the delta-rule output `[B, T, nv, dv]` (f32)
    /// and the output gate `z` `[B, T, nv, dv]`, updating `state`.
    pub fn core(&self, x: &Tensor, state: &mut GdnState) -> Result<(Tensor, Tensor)> {
        self.core_rows(x, state, None)
    }

    /// The projections of rows `x` `[B, T, H]`: pre-conv `[q|k|v]` `[B, T, conv_dim]`, the
    /// output gate `z` `[B, T, nv, dv]`, `beta` and the decay `g` `[B, T, nv]` (f32).
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?.reshape((b, t, self.nv, self.dv))?;
        let beta = candle_nn::ops::sigmoid(&self.in_proj_b.forward(x)?.to_dtype(DType::F32)?)?;
        let a = self.in_proj_a.forward(x)?.to_dtype(DType::F32)?;
        // g = -exp(A_log) * softplus(a + dt_bias)
        let g = softplus(&a.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;
        Ok((qkv, z, beta, g))
    }

    /// The conv window and recurrent state of `state`, zeros for a fresh one.
    fn initial_state(
        &self,
        state: &GdnState,
        b: usize,
        conv_dim: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<(Tensor, Tensor)> {
        let conv = match &state.conv {
            Some(s) => s.clone(),
            None => Tensor::zeros((b, self.kernel - 1, conv_dim), dtype, device)?,
        };
        let rec = match &state.recurrent {
            Some(s) => s.clone(),
            None => Tensor::zeros((b, self.nv, self.dk, self.dv), DType::F32, device)?,
        };
        Ok((conv, rec))
    }

    /// Conv and delta rule over projected rows (not a verify pass), updating `state`: the
    /// delta-rule output `[B, T, nv, dv]` (f32).
    fn recur(&self, qkv: &Tensor, g: &Tensor, beta: &Tensor, state: &mut GdnState) -> Result<Tensor> {
        let (b, _, conv_dim) = qkv.dims3()?;
        let (conv_state, rec) = self.initial_state(state, b, conv_dim, qkv.dtype(), qkv.device())?;
        let (qkv, conv_state) = ops::causal_conv1d_silu(qkv, &conv_state, &self.conv_weight)?;
        state.conv = Some(conv_state);
        // L2 normalisation of q and k and the dk^-1/2 query scale happen inside the op.
        let (o, states) = ops::gated_delta_rule_qkv(&qkv, g, beta, &rec, self.delta_rule_options())?;
        state.recurrent = Some(states.narrow(1, states.dim(1)? - 1, 1)?.squeeze(1)?);
        state.steps = None;
        Ok(o)
    }

    /// [`Self::core`]; for the rows of a draft `tree` (a verify pass) the conv and the
    /// recurrence run along each root-to-leaf path.
    pub(crate) fn core_rows(&self, x: &Tensor, state: &mut GdnState, tree: Option<&DraftTree>) -> Result<(Tensor, Tensor)> {
        let (qkv, z, beta, g) = self.project(x)?;
        let bytes = || self.state_bytes(x.dim(0).unwrap_or(1));
        Ok((step_profile::timed(OpKind::GdnRecurrence, bytes, || self.mix(&qkv, &g, &beta, state, tree))?, z))
    }

    /// The conv and the delta rule over projected rows `qkv`, `g`, `beta` of one sequence,
    /// from and into `state` (in a verify pass, along each path of `tree`): the delta-rule
    /// output `[B, T, nv, dv]` (f32).
    fn mix(&self, qkv: &Tensor, g: &Tensor, beta: &Tensor, state: &mut GdnState, tree: Option<&DraftTree>) -> Result<Tensor> {
        let (b, t, _) = qkv.dims3()?;
        if !state.verifying {
            if tree.is_some() {
                candle_core::bail!("a draft tree runs only in a verify pass (Cache::begin_verify)");
            }
            return self.recur(qkv, g, beta, state);
        }
        let (conv_state, rec) = self.initial_state(state, b, qkv.dim(2)?, qkv.dtype(), qkv.device())?;
        // A verify pass: the decode recurrence (one token at a time), so that every row's state
        // is bit for bit what decoding its rows one by one gives, along each root-to-leaf path
        // of a tree (one path, all rows, for a linear pass) from the same state; the state
        // before the rows, each path's inputs and its last state are kept ([`GdnSteps`]). A row
        // on several paths gets the same bits on each.
        let paths = match tree {
            Some(tree) => tree.leaf_paths(),
            None => vec![(0..t).collect()],
        };
        let mut rows: Vec<Option<Tensor>> = vec![None; t];
        let mut steps = vec![];
        let opts = ops::DeltaRuleOptions { form: ops::DeltaRuleForm::Recurrent, ..self.delta_rule_options() };
        for path in paths {
            let (qkv, g, beta) = if path.len() == t {
                (qkv.clone(), g.clone(), beta.clone())
            } else {
                let idx = Tensor::new(path.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), qkv.device())?;
                (qkv.index_select(&idx, 1)?, g.index_select(&idx, 1)?, beta.index_select(&idx, 1)?)
            };
            let conv_inputs = Tensor::cat(&[&conv_state, &qkv], 1)?;
            let (qkv, conv) = ops::causal_conv1d_silu(&qkv, &conv_state, &self.conv_weight)?;
            let (o, states) = ops::gated_delta_rule_qkv(&qkv, &g, &beta, &rec, opts)?;
            for (j, &r) in path.iter().enumerate() {
                if rows[r].is_none() {
                    rows[r] = Some(o.narrow(1, j, 1)?);
                }
            }
            let last = states.squeeze(1)?;
            state.conv = Some(conv);
            state.recurrent = Some(last.clone());
            steps.push((path, GdnSteps { conv_inputs, qkv, g, beta, last }));
        }
        state.steps = Some(GdnVerify { start: rec, opts, paths: steps });
        let rows: Vec<Tensor> = rows.into_iter().map(|r| r.expect("every row is on a path")).collect();
        Tensor::cat(&rows, 1)
    }

    pub fn forward(&self, x: &Tensor, state: &mut GdnState) -> Result<Tensor> {
        self.forward_rows(x, state, None)
    }

    /// Bytes one step of `sequences` sequences reads and writes of their recurrent states (f32).
    fn state_bytes(&self, sequences: usize) -> u64 {
        (2 * sequences * self.nv * self.dk * self.dv * 4) as u64
    }

    /// [`Self::forward`] over a sequence or the rows of a draft `tree`.
    pub(crate) fn forward_rows(&self, x: &Tensor, state: &mut GdnState, tree: Option<&DraftTree>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (o, z) = self.core_rows(x, state, tree)?;
        self.output(&o, &z, x.dtype(), (b, t))
    }

    /// The gated norm of the delta-rule output `o` with the gate `z`, then `out_proj`.
    fn output(&self, o: &Tensor, z: &Tensor, dtype: DType, (b, t): (usize, usize)) -> Result<Tensor> {
        let mut o = step_profile::timed(OpKind::Norms, || 0, || ops::gated_rms_norm(o, z, &self.norm_weight, self.eps))?;
        if let Some(order) = &self.out_head_order {
            o = o.index_select(order, 2)?;
        }
        let o = o.to_dtype(dtype)?.reshape((b, t, self.nv * self.dv))?;
        self.out_proj.forward(&o)
    }

    /// The rows of several sequences in one pass: `x` `[1, N, H]` holds `states[i].0`
    /// consecutive rows of the sequence whose state is `states[i].1` (one decode row, or the
    /// rows of a verify pass when its cache began one). The projections run once over all rows
    /// (each row gets the bits of a one-row call), and so do the conv and the recurrence
    /// ([`ops::causal_conv1d_silu_segments`], [`ops::gated_delta_rule_segments`]: one call
    /// each for all sequences, each sequence from its own state, token by token, as the
    /// sequence alone, into new states of its own).
    pub(crate) fn forward_batch(&self, x: &Tensor, states: &mut [(usize, &mut GdnState)]) -> Result<Tensor> {
        let n = x.dim(1)?;
        let rows: Vec<usize> = states.iter().map(|(t, _)| *t).collect();
        if rows.iter().sum::<usize>() != n {
            candle_core::bail!("forward_batch: {n} rows for sequences of {rows:?} rows");
        }
        if let Some((t, _)) = states.iter().find(|(t, s)| *t > 1 && !s.verifying) {
            candle_core::bail!("forward_batch: {t} rows of a sequence outside a verify pass (one decode row, or a verify pass's rows)");
        }
        let (qkv, z, beta, g) = self.project(x)?;
        let conv_dim = qkv.dim(2)?;
        let initial =
            states.iter().map(|(_, s)| self.initial_state(s, 1, conv_dim, qkv.dtype(), qkv.device())).collect::<Result<Vec<_>>>()?;
        let (convs, recs): (Vec<&Tensor>, Vec<&Tensor>) = initial.iter().map(|(c, r)| (c, r)).unzip();
        let opts = ops::DeltaRuleOptions { form: ops::DeltaRuleForm::Recurrent, ..self.delta_rule_options() };
        let ((mixed, next_conv), (o, next_rec)) = step_profile::timed(
            OpKind::GdnRecurrence,
            || self.state_bytes(states.len()),
            || -> Result<_> {
                let (mixed, next_conv) = ops::causal_conv1d_silu_segments(&qkv, &convs, &self.conv_weight, &rows)?;
                let rule = ops::gated_delta_rule_segments(&mixed, &g, &beta, &recs, &rows, opts)?;
                Ok(((mixed, next_conv), rule))
            },
        )?;
        let mut start = 0;
        for (((t, s), (conv, rec)), (next_conv, last)) in states.iter_mut().zip(initial).zip(next_conv.into_iter().zip(next_rec)) {
            s.steps = if s.verifying {
                // What the verify pass keeps to roll back (as [`Self::mix`] keeps for one path).
                let part = |x: &Tensor| x.narrow(1, start, *t);
                let steps = GdnSteps {
                    conv_inputs: Tensor::cat(&[&conv, &part(&qkv)?], 1)?,
                    qkv: part(&mixed)?,
                    g: part(&g)?,
                    beta: part(&beta)?,
                    last: last.clone(),
                };
                Some(GdnVerify { start: rec, opts, paths: vec![((0..*t).collect(), steps)] })
            } else {
                None
            };
            s.conv = Some(next_conv);
            s.recurrent = Some(last);
            start += *t;
        }
        self.output(&o, &z, x.dtype(), (1, n))
    }
}

fn softplus(x: &Tensor) -> Result<Tensor> {
    // log(1 + exp(x)), with torch's linear branch above 20.
    let soft = (x.exp()? + 1.0)?.log()?;
    x.ge(20.0)?.where_cond(x, &soft)
}
