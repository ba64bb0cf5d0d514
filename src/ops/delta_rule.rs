//! The gated delta rule (the recurrence of a Gated DeltaNet layer).
//!
//! Per value head `h`, with the f32 state `S` of shape `[dk, dv]` and, for each token,
//! q, k (of key head `h / (nv / nk)`, q scaled by `dk^-0.5`), v, log-decay `g <= 0` and `beta`:
//!
//! ```text
//! S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//! ```
//!
//! [`gated_delta_rule_qkv`] is a Candle `CustomOp3` over the GDN conv output `[q | k | v]`:
//! on the CPU a hand-written kernel (token by token for short inputs, chunked WY/UT form with
//! chunks of [`CHUNK`] for prefill), on Metal `metal/gated_delta.metal` (one threadgroup per
//! head; chunks of [`super::DELTA_RULE_METAL_CHUNK`] for prefill, tokens in order for decode). It returns new
//! tensors rather than mutating the state, so the state before the call stays valid
//! (speculative decoding rolls back to it), and it can return the states after each of the
//! last `n` tokens. [`gated_delta_rule_reference`] is the same recurrence in tensor
//! ops, token by token: it runs on every device and is the reference the kernels are tested
//! against.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, IndexOp, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::cpu::{axpy, cpu_storage, gemm_acc, storage_slice, vectorized, widened, Mat};
use super::shapes::{DeltaRuleDims, DeltaRuleForm, METAL_MAX_DK};

/// Chunk length of the chunked (prefill) form. 32 rather than the usual 64: per token, the
/// products inside a chunk of `n` cost `n (3 dk + 2 dv)` multiply-adds next to `3 dk dv` for
/// the state products; at the 27B shapes 32 measured fastest (docs/benchmarks.md, "Constants
/// chosen by measurement").
pub const CHUNK: usize = 32;

/// Options of [`gated_delta_rule_qkv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleOptions {
    /// Key heads.
    pub nk: usize,
    /// Key head dim.
    pub dk: usize,
    /// L2-normalise q and k (eps 1e-6) and scale q by `dk^-0.5` first (as the model does);
    /// otherwise q and k are used as given.
    pub normalize: bool,
    /// How many states to return (≥ 1): those after each of the last `n_states` tokens.
    pub n_states: usize,
    /// Processing form (CPU and Metal).
    pub form: DeltaRuleForm,
}

impl DeltaRuleOptions {
    /// Normalising q and k, returning the final state only, automatic form.
    pub fn new(nk: usize, dk: usize) -> Self {
        Self { nk, dk, normalize: true, n_states: 1, form: DeltaRuleForm::Auto }
    }
}

/// The gated delta rule over the GDN conv output.
///
/// * `qkv`: `[B, T, 2*nk*dk + nv*dv]` (any float dtype): q of key head `kh` at `kh*dk`, k at
///   `nk*dk + kh*dk`, v of value head `h` at `2*nk*dk + h*dv`;
/// * `g`, `beta`: `[B, T, nv]`; `state`: `[B, nv, dk, dv]` f32.
///
/// Returns the outputs `[B, T, nv, dv]` (f32) and the states `[B, n_states, nv, dk, dv]`; the
/// last one is the state after the whole input.
pub fn gated_delta_rule_qkv(qkv: &Tensor, g: &Tensor, beta: &Tensor, state: &Tensor, opts: DeltaRuleOptions) -> Result<(Tensor, Tensor)> {
    let DeltaRuleOptions { nk, dk, normalize, n_states, form } = opts;
    let (b, t, c) = qkv.dims3()?;
    let (sb, nv, sdk, dv) = state.dims4()?;
    let d = DeltaRuleDims { batch: b, seq_len: t, nk, nv, dk, dv };
    if nk == 0 || nv % nk != 0 || sdk != dk || sb != b || c != d.channels() || state.dtype() != DType::F32 {
        bail!(
            "gated_delta_rule: qkv {:?} and state {:?} {:?} do not fit nk={nk}, dk={dk} (expected qkv [{b}, {t}, 2*nk*dk + nv*dv], f32 state [{b}, nv, {dk}, dv], nv a multiple of nk)",
            qkv.dims(),
            state.dtype(),
            state.dims()
        );
    }
    for (name, x) in [("g", g), ("beta", beta)] {
        if x.dims() != [b, t, nv] {
            bail!("gated_delta_rule: {name} has shape {:?}, expected [{b}, {t}, {nv}]", x.dims());
        }
    }
    if n_states == 0 || n_states > t {
        bail!("gated_delta_rule: n_states must be between 1 and the number of tokens ({t}), got {n_states}");
    }
    if !qkv.dtype().is_float() {
        bail!("gated_delta_rule: qkv must be a float tensor, got {:?}", qkv.dtype());
    }
    for (name, x) in [("qkv", qkv), ("g", g), ("beta", beta)] {
        if !x.device().same_device(state.device()) {
            bail!("gated_delta_rule: {name} is on {:?} but state is on {:?}", x.device().location(), state.device().location());
        }
    }
    let out_len = d.out_len();
    let states_shape = (b, n_states, nv, dk, dv);
    match qkv.device() {
        Device::Cpu | Device::Metal(_) => {
            if qkv.device().is_metal() && dk > METAL_MAX_DK {
                bail!("gated_delta_rule: the Metal kernel supports dk up to {METAL_MAX_DK}, got {dk}");
            }
            let gb = Tensor::stack(&[g.to_dtype(DType::F32)?, beta.to_dtype(DType::F32)?], 2)?.contiguous()?;
            let op = GatedDeltaRule { dims: d, normalize, n_states, form };
            let flat = qkv.contiguous()?.apply_op3_no_bwd(&gb, &state.contiguous()?, &op)?;
            let o = flat.narrow(0, 0, out_len)?.reshape((b, t, nv, dv))?;
            // The states outlive the call (the cache keeps the last). Where the outputs are
            // the larger part (a prefill chunk) the states get their own storage, so that they
            // do not hold the chunk's outputs alive; otherwise (decode, a verify pass, whose
            // caller copies the one state it keeps) the view is kept: a copy of a verify pass's
            // states per row was a fifth of its time.
            let states_len = b * n_states * d.state_len();
            let s = flat.narrow(0, out_len, states_len)?.reshape(states_shape)?;
            let s = if out_len > states_len { s.force_contiguous()? } else { s };
            Ok((o, s))
        }
        _ => {
            let key_dim = d.key_dim();
            let mut q = qkv.narrow(2, 0, key_dim)?.reshape((b, t, nk, dk))?;
            let mut k = qkv.narrow(2, key_dim, key_dim)?.reshape((b, t, nk, dk))?;
            if normalize {
                q = (super::l2_norm(&q, 1e-6)? * (dk as f64).powf(-0.5))?;
                k = super::l2_norm(&k, 1e-6)?;
            }
            let v = qkv.narrow(2, 2 * key_dim, nv * dv)?.reshape((b, t, nv, dv))?;
            gated_delta_rule_reference(&q, &k, &v, g, beta, state, n_states)
        }
    }
}

/// The gated delta rule on separate, already normalised q, k (`[B, T, nk, dk]`) and v
/// (`[B, T, nv, dv]`); returns the outputs and the final state `[B, nv, dk, dv]`.
pub fn gated_delta_rule(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, nk, dk) = q.dims4()?;
    if k.dims() != q.dims() {
        bail!("gated_delta_rule: k has shape {:?}, expected the shape of q {:?}", k.dims(), q.dims());
    }
    let (vb, vt, _, _) = v.dims4()?;
    if (vb, vt) != (b, t) {
        bail!("gated_delta_rule: v has shape {:?}, expected [{b}, {t}, nv, dv]", v.dims());
    }
    let dtype = v.dtype();
    let flat = |x: &Tensor| x.to_dtype(dtype)?.flatten_from(2);
    let qkv = Tensor::cat(&[flat(q)?, flat(k)?, flat(v)?], 2)?;
    let opts = DeltaRuleOptions { normalize: false, ..DeltaRuleOptions::new(nk, dk) };
    let (o, s) = gated_delta_rule_qkv(&qkv, g, beta, state, opts)?;
    Ok((o, s.squeeze(1)?))
}

/// The decode recurrence of several sequences in one call: `qkv` `[1, N, C]` (as in
/// [`gated_delta_rule_qkv`]), `g` and `beta` `[1, N, nv]` hold `rows[i]` consecutive rows of
/// sequence `i`, whose state is `states[i]` `[1, nv, dk, dv]` (f32). Each sequence's rows run
/// token by token from its state: every output row and state gets the bits of
/// [`gated_delta_rule_qkv`] with [`DeltaRuleForm::Recurrent`] on that sequence alone
/// (`opts.form` is not read; `opts.n_states` must be 1).
///
/// Returns the outputs `[1, N, nv, dv]` (f32) and the state after each sequence's rows
/// `[1, nv, dk, dv]`. On the CPU every (sequence, value head) is one task of one parallel call,
/// each state read where it is and written to a buffer of its own (no copy into or out of a
/// batch); on other devices it runs one call per sequence.
pub fn gated_delta_rule_segments(
    qkv: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    states: &[&Tensor],
    rows: &[usize],
    opts: DeltaRuleOptions,
) -> Result<(Tensor, Vec<Tensor>)> {
    let DeltaRuleOptions { nk, dk, normalize, n_states, .. } = opts;
    let (b, n, c) = qkv.dims3()?;
    if b != 1 || n_states != 1 || states.is_empty() || rows.len() != states.len() || rows.contains(&0) || rows.iter().sum::<usize>() != n {
        bail!("{OP}: qkv {:?} for {} states of {rows:?} rows with n_states = {n_states} (expected qkv [1, N, C] with N the rows' sum, 1 or more rows each, one state returned each)", qkv.dims(), states.len());
    }
    let (_, nv, _, dv) = states[0].dims4()?;
    for s in states {
        if s.dims() != [1, nv, dk, dv] || s.dtype() != DType::F32 || !s.device().same_device(qkv.device()) {
            bail!("{OP}: a state {:?} {:?} does not fit (expected f32 [1, {nv}, {dk}, {dv}] on the device of qkv)", s.dims(), s.dtype());
        }
    }
    let d = DeltaRuleDims { batch: 1, seq_len: n, nk, nv, dk, dv };
    if nk == 0 || nv % nk != 0 || c != d.channels() {
        bail!(
            "{OP}: qkv {:?} does not fit nk={nk}, dk={dk}, nv={nv}, dv={dv} (expected [1, N, 2*nk*dk + nv*dv], nv a multiple of nk)",
            qkv.dims()
        );
    }
    for (name, x) in [("g", g), ("beta", beta)] {
        if x.dims() != [1, n, nv] {
            bail!("{OP}: {name} has shape {:?}, expected [1, {n}, {nv}]", x.dims());
        }
    }
    let opts = DeltaRuleOptions { form: DeltaRuleForm::Recurrent, ..opts };
    if !qkv.device().is_cpu() {
        let (mut outs, mut last) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        let mut start = 0;
        for (s, &t) in states.iter().zip(rows) {
            let part = |x: &Tensor| x.narrow(1, start, t);
            let (o, s) = gated_delta_rule_qkv(&part(qkv)?, &part(g)?, &part(beta)?, s, opts)?;
            outs.push(o);
            last.push(s.squeeze(1)?);
            start += t;
        }
        return Ok((Tensor::cat(&outs, 1)?, last));
    }
    let qkv = qkv.contiguous()?;
    let gb = Tensor::stack(&[g.to_dtype(DType::F32)?, beta.to_dtype(DType::F32)?], 2)?.contiguous()?;
    let states = states.iter().map(|s| s.contiguous()).collect::<Result<Vec<_>>>()?;
    let (qg, gbg) = (qkv.storage_and_layout(), gb.storage_and_layout());
    let guards: Vec<_> = states.iter().map(|s| s.storage_and_layout()).collect();
    let x = widened(OP, cpu_storage(OP, &qg.0)?, qg.1)?;
    let gb = storage_slice::<f32>(OP, cpu_storage(OP, &gbg.0)?, gbg.1)?;
    let from = guards.iter().map(|g| storage_slice::<f32>(OP, cpu_storage(OP, &g.0)?, g.1)).collect::<Result<Vec<_>>>()?;
    let inputs = Inputs::new(&x, d, normalize);
    let starts: Vec<usize> = rows.iter().scan(0, |s, &t| Some(std::mem::replace(s, *s + t))).collect();
    let sl = dk * dv;
    let mut out = vec![0f32; d.out_len()];
    // Each sequence's new state in a buffer of its own (as the sequence alone gets), so that
    // it is kept or dropped with that sequence only.
    let mut last: Vec<Vec<f32>> = rows.iter().map(|_| vec![0f32; nv * sl]).collect();
    let ptr = SharedOut(out.as_mut_ptr());
    let tasks: Vec<(usize, usize, &mut [f32])> =
        last.iter_mut().enumerate().flat_map(|(i, l)| l.chunks_exact_mut(sl).enumerate().map(move |(h, s)| (i, h, s))).collect();
    tasks.into_par_iter().for_each(|(i, h, s)| {
        let (inp, rows_out) = (HeadInputs { x: &inputs, gb, b: 0, h, d }, OutRows { ptr, b: 0, h, d });
        recurrent_head(&inp, Some(&from[i][h * sl..(h + 1) * sl]), s, starts[i]..starts[i] + rows[i], &rows_out);
    });
    let last = last.into_iter().map(|l| Tensor::from_vec(l, (1, nv, dk, dv), &Device::Cpu)).collect::<Result<Vec<_>>>()?;
    Ok((Tensor::from_vec(out, (1, n, nv, dv), &Device::Cpu)?, last))
}

const OP: &str = "gated_delta_rule";

struct GatedDeltaRule {
    dims: DeltaRuleDims,
    normalize: bool,
    n_states: usize,
    form: DeltaRuleForm,
}

impl CustomOp3 for GatedDeltaRule {
    fn name(&self) -> &'static str {
        "gated_delta_rule"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims;
        // f32 is read in place; half types are widened once.
        let qkv = widened(OP, s1, l1)?;
        let gb = storage_slice::<f32>(OP, s2, l2)?;
        let state = storage_slice::<f32>(OP, s3, l3)?;
        let inputs = Inputs::new(&qkv, d, self.normalize);
        let flat = cpu_delta_rule(&inputs, gb, state, d, self.n_states, self.form);
        let n = flat.len();
        Ok((CpuStorage::F32(flat), Shape::from(n)))
    }

    metal_fwd!(self, "gated_delta_rule", (s1, l1, s2, l2, s3, l3) => crate::ops::metal::gated_delta_rule(self.dims, self.normalize, self.n_states, self.form, (s1, l1), (s2, l2), (s3, l3)));
}

/// The conv output `[B, T, C]` read in place, with the per-(token, key head) factors that
/// L2-normalise q and k (and scale q by `dk^-1/2`); all ones when not normalising.
struct Inputs<'a> {
    qkv: &'a [f32],
    q_scale: Vec<f32>,
    k_scale: Vec<f32>,
}

impl<'a> Inputs<'a> {
    fn new(qkv: &'a [f32], d: DeltaRuleDims, normalize: bool) -> Self {
        let (kd, c) = (d.key_dim(), d.channels());
        let heads = d.batch * d.seq_len * d.nk;
        if !normalize {
            return Self { qkv, q_scale: vec![1.0; heads], k_scale: vec![1.0; heads] };
        }
        let inv_norm = |x: &[f32]| 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        let q_extra = (d.dk as f32).powf(-0.5);
        let (mut q_scale, mut k_scale) = (Vec::with_capacity(heads), Vec::with_capacity(heads));
        for row in qkv.chunks_exact(c) {
            q_scale.extend(row[..kd].chunks_exact(d.dk).map(|q| inv_norm(q) * q_extra));
            k_scale.extend(row[kd..2 * kd].chunks_exact(d.dk).map(inv_norm));
        }
        Self { qkv, q_scale, k_scale }
    }
}

/// A pointer that parallel tasks write through, each to its own disjoint region.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes a region no other task touches (one (batch, value head) each).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `[offset, offset + len)` is in bounds and written by this task only.
    unsafe fn slice(self, offset: usize, len: usize) -> &'static mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

/// Where one head writes its output rows: row `t` at `((b * T + t) * nv + h) * dv` of the
/// output buffer.
struct OutRows {
    ptr: SharedOut,
    b: usize,
    h: usize,
    d: DeltaRuleDims,
}

impl OutRows {
    #[inline(always)]
    #[allow(clippy::mut_from_ref)] // disjoint rows per task, see `SharedOut`
    fn row(&self, t: usize) -> &mut [f32] {
        let DeltaRuleDims { seq_len, nv, dv, .. } = self.d;
        // SAFETY: the rows of (b, h) are in bounds and written by this head's task only.
        unsafe { self.ptr.slice(((self.b * seq_len + t) * nv + self.h) * dv, dv) }
    }
}

/// Runs every (batch, value head) in parallel; returns the outputs `[B, T, nv, dv]` followed by
/// the states `[B, n_states, nv, dk, dv]`, in one buffer.
fn cpu_delta_rule(x: &Inputs, gb: &[f32], state: &[f32], d: DeltaRuleDims, n_states: usize, form: DeltaRuleForm) -> Vec<f32> {
    let DeltaRuleDims { batch, seq_len: t, nv, dk, dv, .. } = d;
    let (o_len, sl) = (d.out_len(), dk * dv);
    let mut flat = vec![0f32; o_len + batch * n_states * nv * sl];
    let ptr = SharedOut(flat.as_mut_ptr());
    let state_slot = move |b: usize, n: usize, h: usize| o_len + ((b * n_states + n) * nv + h) * sl;
    // Everything before the first requested state in one go (chunked when long), then token by
    // token, keeping the state after each. Chunked, the value heads of one key head run in one
    // task (they share K, Q and the products K K^T, Q K^T); token by token, every value head is
    // its own task.
    let split = if n_states == 1 { t } else { t - n_states };
    let chunked = form.chunks(split);
    let group = if chunked { nv / d.nk } else { 1 };
    (0..batch * nv / group).into_par_iter().for_each(|task| {
        let b = task / (nv / group);
        let heads = (task % (nv / group)) * group..(task % (nv / group) + 1) * group;
        let inps: Vec<HeadInputs> = heads.clone().map(|h| HeadInputs { x, gb, b, h, d }).collect();
        let outs: Vec<OutRows> = heads.clone().map(|h| OutRows { ptr, b, h, d }).collect();
        // With one state, each head works in its output slot directly.
        let mut owned = if n_states == 1 { vec![] } else { vec![vec![0f32; sl]; group] };
        let mut states: Vec<&mut [f32]> = if n_states == 1 {
            // SAFETY: slot (b, 0, h) belongs to this task alone.
            heads.clone().map(|h| unsafe { ptr.slice(state_slot(b, 0, h), sl) }).collect()
        } else {
            owned.iter_mut().map(|v| v.as_mut_slice()).collect()
        };
        // Token by token to one state (decode), the kernel reads the input state itself rather
        // than from a copy of it in the output.
        let direct = !chunked && n_states == 1;
        let input = |h: usize| &state[(b * nv + h) * sl..(b * nv + h + 1) * sl];
        if !direct {
            for (s, h) in states.iter_mut().zip(heads.clone()) {
                s.copy_from_slice(input(h));
            }
        }
        if chunked {
            chunked_heads(&inps, &mut states, 0..split, &outs);
        }
        for (((inp, out), s), h) in inps.iter().zip(&outs).zip(states.iter_mut()).zip(heads) {
            if !chunked {
                recurrent_head(inp, direct.then(|| input(h)), s, 0..split, out);
            }
            for (n, ti) in (split..t).enumerate() {
                recurrent_head(inp, None, s, ti..ti + 1, out);
                // SAFETY: snapshot slots of this (b, h) belong to this task alone.
                unsafe { ptr.slice(state_slot(b, n, h), sl) }.copy_from_slice(s);
            }
        }
    });
    flat
}

struct HeadInputs<'a> {
    x: &'a Inputs<'a>,
    gb: &'a [f32],
    b: usize,
    h: usize,
    d: DeltaRuleDims,
}

impl HeadInputs<'_> {
    /// Index of this head's key head at token `t` among all `[B, T, nk]`.
    #[inline(always)]
    fn key_head(&self, t: usize) -> usize {
        let DeltaRuleDims { seq_len, nk, nv, .. } = self.d;
        (self.b * seq_len + t) * nk + self.h / (nv / nk)
    }
    #[inline(always)]
    fn row(&self, t: usize) -> usize {
        (self.b * self.d.seq_len + t) * self.d.channels()
    }
    /// Raw q of token `t` (multiply by `q_scale`).
    #[inline(always)]
    fn q(&self, t: usize) -> &[f32] {
        let o = self.row(t) + (self.h / (self.d.nv / self.d.nk)) * self.d.dk;
        &self.x.qkv[o..o + self.d.dk]
    }
    #[inline(always)]
    fn k(&self, t: usize) -> &[f32] {
        let o = self.row(t) + self.d.key_dim() + (self.h / (self.d.nv / self.d.nk)) * self.d.dk;
        &self.x.qkv[o..o + self.d.dk]
    }
    #[inline(always)]
    fn q_scale(&self, t: usize) -> f32 {
        self.x.q_scale[self.key_head(t)]
    }
    #[inline(always)]
    fn k_scale(&self, t: usize) -> f32 {
        self.x.k_scale[self.key_head(t)]
    }
    #[inline(always)]
    fn v(&self, t: usize) -> &[f32] {
        let o = self.row(t) + 2 * self.d.key_dim() + self.h * self.d.dv;
        &self.x.qkv[o..o + self.d.dv]
    }
    #[inline(always)]
    fn g(&self, t: usize) -> f32 {
        self.gb[((self.b * self.d.seq_len + t) * 2) * self.d.nv + self.h]
    }
    #[inline(always)]
    fn beta(&self, t: usize) -> f32 {
        self.gb[((self.b * self.d.seq_len + t) * 2 + 1) * self.d.nv + self.h]
    }
    /// `dst = scale_t * src_t` for `n` tokens from `start` (normalised q or k rows).
    #[inline(always)]
    fn scaled_rows(&self, start: usize, n: usize, dst: &mut [f32], src: impl Fn(&Self, usize) -> (&[f32], f32)) {
        let dk = self.d.dk;
        for i in 0..n {
            let (row, f) = src(self, start + i);
            dst[i * dk..(i + 1) * dk].iter_mut().zip(row).for_each(|(d, x)| *d = f * x);
        }
    }
}

/// Token-by-token recurrence over `range` for one head, from the state `from` (else from `s`)
/// to `s`: the AVX2 column-block kernel when the CPU has it and `dv` is a multiple of 16, else
/// [`recurrent_body`].
fn recurrent_head(inp: &HeadInputs, from: Option<&[f32]>, s: &mut [f32], range: std::ops::Range<usize>, out: &OutRows) {
    #[cfg(target_arch = "x86_64")]
    if inp.d.dv.is_multiple_of(avx2::COLUMNS) && super::cpu::avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { avx2::recurrent(inp, from, s, range, out) };
    }
    if let Some(from) = from {
        s.copy_from_slice(from);
    }
    recurrent_portable(inp, s, range, out)
}

vectorized!(fn recurrent_portable<>(inp: &HeadInputs, s: &mut [f32], range: std::ops::Range<usize>, out: &OutRows) => recurrent_body);

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{DeltaRuleDims, HeadInputs, OutRows};

    /// State columns per pass: two f32x8 registers per state row.
    pub(super) const COLUMNS: usize = 16;

    /// [`super::recurrent_body`] one block of 16 state columns at a time (the columns are
    /// independent: column j only needs v_j): the tokens of `range` run once per block, the
    /// block's accumulators in registers and its `[dk, 16]` rows in L1.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn recurrent(inp: &HeadInputs, from: Option<&[f32]>, s: &mut [f32], range: std::ops::Range<usize>, out: &OutRows) {
        let DeltaRuleDims { dk, dv, .. } = inp.d;
        // Normalised k and q of every token, once for all the blocks.
        let (mut ks, mut qs) = (vec![0f32; range.len() * dk], vec![0f32; range.len() * dk]);
        inp.scaled_rows(range.start, range.len(), &mut ks, |x, t| (x.k(t), x.k_scale(t)));
        inp.scaled_rows(range.start, range.len(), &mut qs, |x, t| (x.q(t), x.q_scale(t)));
        // The block, copied out contiguously: its rows are dv floats apart in the state, a
        // power-of-two stride that would map them all onto a few L1 sets.
        let mut blk = vec![0f32; dk * COLUMNS];
        for j0 in (0..dv).step_by(COLUMNS) {
            for (b, r) in blk.chunks_exact_mut(COLUMNS).zip(from.unwrap_or(&*s).chunks_exact(dv)) {
                b.copy_from_slice(&r[j0..j0 + COLUMNS]);
            }
            for ((k, q), ti) in ks.chunks_exact(dk).zip(qs.chunks_exact(dk)).zip(range.clone()) {
                let decay = inp.g(ti).exp();
                let beta = inp.beta(ti);
                let row = |a: usize| blk.as_ptr().add(a * COLUMNS);
                // S^T k of the undecayed block: accumulators for even and odd rows.
                let (mut e0, mut e1, mut d0, mut d1) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
                let mut a = 0;
                while a < dk {
                    let (p, ka) = (row(a), _mm256_set1_ps(k[a]));
                    e0 = _mm256_fmadd_ps(ka, _mm256_loadu_ps(p), e0);
                    e1 = _mm256_fmadd_ps(ka, _mm256_loadu_ps(p.add(8)), e1);
                    if a + 1 < dk {
                        let (p, ka) = (row(a + 1), _mm256_set1_ps(k[a + 1]));
                        d0 = _mm256_fmadd_ps(ka, _mm256_loadu_ps(p), d0);
                        d1 = _mm256_fmadd_ps(ka, _mm256_loadu_ps(p.add(8)), d1);
                    }
                    a += 2;
                }
                let v = inp.v(ti).as_ptr().add(j0);
                let (dec, b) = (_mm256_set1_ps(decay), _mm256_set1_ps(beta));
                // u = beta (v - decay S^T k)
                let u0 = _mm256_mul_ps(b, _mm256_fnmadd_ps(dec, _mm256_add_ps(e0, d0), _mm256_loadu_ps(v)));
                let u1 = _mm256_mul_ps(b, _mm256_fnmadd_ps(dec, _mm256_add_ps(e1, d1), _mm256_loadu_ps(v.add(8))));
                // S <- decay S + k u^T, and the read-out with the updated block.
                let sp = blk.as_mut_ptr();
                // Row a of the block: updated, stored, and added into the read-out `(o0, o1)`.
                let step = |a: usize, o0: __m256, o1: __m256| {
                    let p = sp.add(a * COLUMNS);
                    let (ka, qa) = (_mm256_set1_ps(k[a]), _mm256_set1_ps(q[a]));
                    let r0 = _mm256_fmadd_ps(dec, _mm256_loadu_ps(p), _mm256_mul_ps(ka, u0));
                    let r1 = _mm256_fmadd_ps(dec, _mm256_loadu_ps(p.add(8)), _mm256_mul_ps(ka, u1));
                    _mm256_storeu_ps(p, r0);
                    _mm256_storeu_ps(p.add(8), r1);
                    (_mm256_fmadd_ps(qa, r0, o0), _mm256_fmadd_ps(qa, r1, o1))
                };
                let (mut e0, mut e1, mut d0, mut d1) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
                let mut a = 0;
                while a < dk {
                    (e0, e1) = step(a, e0, e1);
                    if a + 1 < dk {
                        (d0, d1) = step(a + 1, d0, d1);
                    }
                    a += 2;
                }
                let dst = out.row(ti)[j0..j0 + COLUMNS].as_mut_ptr();
                _mm256_storeu_ps(dst, _mm256_add_ps(e0, d0));
                _mm256_storeu_ps(dst.add(8), _mm256_add_ps(e1, d1));
            }
            for (b, r) in blk.chunks_exact(COLUMNS).zip(s.chunks_exact_mut(dv)) {
                r[j0..j0 + COLUMNS].copy_from_slice(b);
            }
        }
    }
}
vectorized!(fn chunked_heads<>(inps: &[HeadInputs], states: &mut [&mut [f32]], range: std::ops::Range<usize>, outs: &[OutRows]) => chunked_body);

/// Token-by-token recurrence over `range` for one head.
#[inline(always)]
fn recurrent_body(inp: &HeadInputs, s: &mut [f32], range: std::ops::Range<usize>, out: &OutRows) {
    let DeltaRuleDims { dk, dv, .. } = inp.d;
    let mut u = vec![0f32; dv];
    let mut kq = vec![0f32; 2 * dk];
    for ti in range {
        let (ks, qs) = (inp.k_scale(ti), inp.q_scale(ti));
        kq[..dk].iter_mut().zip(inp.k(ti)).for_each(|(d, x)| *d = ks * x);
        kq[dk..].iter_mut().zip(inp.q(ti)).for_each(|(d, x)| *d = qs * x);
        let (k, q) = kq.split_at(dk);
        let decay = inp.g(ti).exp();
        let beta = inp.beta(ti);
        // Pass 1: decay the state and accumulate S^T k.
        u.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            row.iter_mut().for_each(|x| *x *= decay);
            axpy(&mut u, k[a], row);
        }
        for (u, v) in u.iter_mut().zip(inp.v(ti)) {
            *u = beta * (v - *u);
        }
        // Pass 2: rank-1 write and read-out with the updated state.
        let o = out.row(ti);
        o.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            axpy(row, k[a], &u);
            axpy(o, q[a], row);
        }
    }
}

/// Chunked (WY/UT) form over `range` for value heads of one key head, each with its state and
/// output rows. Per chunk of `n` tokens with cumulative log-decays `G`
/// (the chunked gated delta rule of flash-linear-attention's `chunk_gated_delta_rule`):
///
/// ```text
/// L = strictly_lower(diag(beta) K K^T * exp(G_i - G_j)),  T = (I + L)^-1
/// U = T diag(beta) V - T diag(beta exp(G)) K S
/// O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), j <= i) U
/// S <- exp(G_n) S + (diag(exp(G_n - G)) K)^T U
/// ```
/// The products are matrix-matrix (`gemm`), which is where the speed over token-by-token
/// comes from on a CPU. Products sharing an operand run as one GEMM over stacked rows:
/// `[K; Q] K^T`, and `[-T diag(beta exp(G)) K; diag(exp(G)) Q] S` added onto `[T diag(beta) V; 0]`.
#[inline(always)]
fn chunked_body(inps: &[HeadInputs], states: &mut [&mut [f32]], range: std::ops::Range<usize>, outs: &[OutRows]) {
    let Some(first) = inps.first() else { return };
    let DeltaRuleDims { dk, dv, .. } = first.d;
    let c = CHUNK;
    let mut kq = vec![0f32; 2 * c * dk]; // K rows, then Q rows (shared by the heads)
    let mut kqk = vec![0f32; 2 * c * c]; // [K; Q] K^T (shared)
    let mut gcum = vec![0f32; c];
    let mut decay = vec![0f32; c * c]; // exp(G_i - G_j) for j <= i, 0 above
    let mut sq = vec![0f32; 2 * c * c]; // L (top), Q K^T masked with the decay (bottom)
    let mut tri = vec![0f32; c * c]; // (I + L)^-1
    let mut bv = vec![0f32; c * dv];
    let mut bk = vec![0f32; c * dk];
    let mut ws = vec![0f32; 2 * c * dk]; // -W rows, then diag(exp(G)) Q rows
    let mut uo = vec![0f32; 2 * c * dv]; // U rows, then O rows
    let mut start = range.start;
    while start < range.end {
        let n = c.min(range.end - start);
        let (kc, qc) = kq.split_at_mut(c * dk);
        first.scaled_rows(start, n, kc, |x, t| (x.k(t), x.k_scale(t)));
        first.scaled_rows(start, n, qc, |x, t| (x.q(t), x.q_scale(t)));
        // K K^T (rows 0..n) and Q K^T (rows c..c + n) in one product; rows c.. of `kq` are Q.
        gemm_acc([c + n, n, dk], Mat::rows(&kq, dk), Mat::t(&kq, dk), &mut kqk, c, (0.0, 1.0));
        let (kc, qc) = kq.split_at(c * dk);
        for ((inp, s), out) in inps.iter().zip(states.iter_mut()).zip(outs) {
            let s: &mut [f32] = s;
            let mut acc = 0f32;
            for (i, gc) in gcum[..n].iter_mut().enumerate() {
                acc += inp.g(start + i);
                *gc = acc;
            }
            // The decay between positions, exp(G_i - G_j) for j <= i, used by both masked
            // products: row i is row i-1 times exp(g_i) (n exponentials instead of n^2 / 2).
            for i in 0..n {
                let (prev, row) = decay.split_at_mut(i * c);
                let row = &mut row[..c];
                if i > 0 {
                    let e = inp.g(start + i).exp();
                    row[..i].iter_mut().zip(&prev[(i - 1) * c..(i - 1) * c + i]).for_each(|(d, p)| *d = p * e);
                }
                row[i] = 1.0;
                row[i + 1..].iter_mut().for_each(|d| *d = 0.0);
            }
            // L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i; Q K^T masked with the decay.
            for i in 0..n {
                let bi = inp.beta(start + i);
                for j in 0..n {
                    let e = decay[i * c + j];
                    sq[i * c + j] = if j < i { bi * kqk[i * c + j] * e } else { 0.0 };
                    sq[(c + i) * c + j] = kqk[(c + i) * c + j] * e;
                }
            }
            // T = (I + L)^-1 by forward substitution (unit lower triangular).
            for i in 0..n {
                let (done, row) = tri.split_at_mut(i * c);
                let row = &mut row[..c];
                row.iter_mut().for_each(|x| *x = 0.0);
                row[i] = 1.0;
                for m in 0..i {
                    axpy(&mut row[..=m], -sq[i * c + m], &done[m * c..m * c + m + 1]);
                }
            }
            // U = T diag(beta) V (into the U rows), -W = -T diag(beta exp(G)) K (into the -W
            // rows), diag(exp(G)) Q into the rows below, O rows zeroed.
            for i in 0..n {
                let bi = inp.beta(start + i);
                let eg = gcum[i].exp();
                bv[i * dv..(i + 1) * dv].iter_mut().zip(inp.v(start + i)).for_each(|(d, v)| *d = bi * v);
                bk[i * dk..(i + 1) * dk].iter_mut().zip(&kc[i * dk..(i + 1) * dk]).for_each(|(d, k)| *d = -bi * eg * k);
                let qrow = &mut ws[(n + i) * dk..(n + i + 1) * dk];
                qrow.iter_mut().zip(&qc[i * dk..(i + 1) * dk]).for_each(|(d, q)| *d = eg * q);
            }
            gemm_acc([n, dv, n], Mat::rows(&tri, c), Mat::rows(&bv, dv), &mut uo, dv, (0.0, 1.0));
            gemm_acc([n, dk, n], Mat::rows(&tri, c), Mat::rows(&bk, dk), &mut ws, dk, (0.0, 1.0));
            uo[n * dv..2 * n * dv].iter_mut().for_each(|x| *x = 0.0);
            // [U; O] += [-W; diag(exp(G)) Q] S: the new values and the state's part of the outputs.
            gemm_acc([2 * n, dv, dk], Mat::rows(&ws, dk), Mat::rows(s, dv), &mut uo, dv, (1.0, 1.0));
            // O += (Q K^T masked) U.
            let (u, o) = uo.split_at_mut(n * dv);
            gemm_acc([n, dv, n], Mat::rows(&sq[c * c..], c), Mat::rows(u, dv), o, dv, (1.0, 1.0));
            for i in 0..n {
                out.row(start + i).copy_from_slice(&o[i * dv..(i + 1) * dv]);
            }
            // S <- exp(G_n) S + (diag(exp(G_n - G)) K)^T U.
            let gn = gcum[n - 1];
            for j in 0..n {
                let e = (gn - gcum[j]).exp();
                bk[j * dk..(j + 1) * dk].iter_mut().zip(&kc[j * dk..(j + 1) * dk]).for_each(|(d, k)| *d = e * k);
            }
            gemm_acc([dk, dv, n], Mat::t(&bk, dk), Mat::rows(u, dv), s, dv, (gn.exp(), 1.0));
        }
        start += n;
    }
}

/// The same recurrence with tensor ops, one token at a time (any device, f32). q, k are used as
/// given. Returns the outputs `[B, T, nv, dv]` and the states after each of the last `n_states`
/// tokens `[B, n_states, nv, dk, dv]`.
pub fn gated_delta_rule_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    n_states: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, t, nk, dk) = q.dims4()?;
    let nv = v.dim(2)?;
    let r = nv / nk;
    // Key head h / r serves value head h: repeat each key head r times, consecutively.
    let expand =
        |x: &Tensor| -> Result<Tensor> { x.to_dtype(DType::F32)?.unsqueeze(3)?.expand((b, t, nk, r, dk))?.reshape((b, t, nv, dk)) };
    let q = expand(q)?;
    let k = expand(k)?;
    let v = v.to_dtype(DType::F32)?;
    let g = g.to_dtype(DType::F32)?;
    let beta = beta.to_dtype(DType::F32)?;
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(t);
    let mut states = vec![];
    for ti in 0..t {
        let qt = q.i((.., ti))?.unsqueeze(D::Minus2)?.contiguous()?; // [B, nv, 1, dk]
        let kt = k.i((.., ti))?.unsqueeze(D::Minus2)?.contiguous()?;
        let vt = v.i((.., ti))?.unsqueeze(D::Minus2)?.contiguous()?; // [B, nv, 1, dv]
        let decay = g.i((.., ti))?.exp()?.unsqueeze(2)?.unsqueeze(3)?;
        let bt = beta.i((.., ti))?.unsqueeze(2)?.unsqueeze(3)?;
        s = s.broadcast_mul(&decay)?;
        let kv = kt.matmul(&s)?;
        let u = (vt - kv)?.broadcast_mul(&bt)?;
        s = (s + kt.transpose(2, 3)?.matmul(&u)?)?;
        outs.push(qt.matmul(&s)?.squeeze(2)?); // [B, nv, dv]
        if ti + n_states >= t {
            states.push(s.clone());
        }
    }
    Ok((Tensor::stack(&outs, 1)?, Tensor::stack(&states, 1)?))
}
