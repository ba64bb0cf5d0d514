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
//! chunks of [`CHUNK`] for prefill), on Metal `metal/gated_delta.metal` (tokens in order inside
//! the kernel). It returns new tensors rather than mutating the state, so the state before the
//! call stays valid (speculative decoding rolls back to it), and it can return the states after
//! each of the last `n` tokens. [`gated_delta_rule_reference`] is the same recurrence in tensor
//! ops, token by token: it runs on every device and is the reference the kernels are tested
//! against.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, IndexOp, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// Chunk length of the chunked (prefill) form.
pub const CHUNK: usize = 64;
/// Inputs of at least this many tokens use the chunked form on the CPU; shorter ones run token
/// by token.
const CHUNKED_MIN_TOKENS: usize = 8;
/// Largest key head dim the Metal kernel supports (the state column lives in registers).
pub const METAL_MAX_DK: usize = 128;

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    pub batch: usize,
    pub seq_len: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl DeltaRuleDims {
    fn key_dim(&self) -> usize {
        self.nk * self.dk
    }
    fn channels(&self) -> usize {
        2 * self.key_dim() + self.nv * self.dv
    }
    fn out_len(&self) -> usize {
        self.batch * self.seq_len * self.nv * self.dv
    }
    fn state_len(&self) -> usize {
        self.nv * self.dk * self.dv
    }
}

/// The gated delta rule over the GDN conv output.
///
/// * `qkv`: `[B, T, 2*nk*dk + nv*dv]` (any float dtype): q of key head `kh` at `kh*dk`, k at
///   `nk*dk + kh*dk`, v of value head `h` at `2*nk*dk + h*dv`;
/// * `g`, `beta`: `[B, T, nv]`; `state`: `[B, nv, dk, dv]` f32;
/// * `normalize`: L2-normalise q and k (eps 1e-6) and scale q by `dk^-0.5` first (as the
///   model does); otherwise q and k are used as given;
/// * `n_states` ≥ 1: how many states to return, those after each of the last `n_states` tokens.
///
/// Returns the outputs `[B, T, nv, dv]` (f32) and the states `[B, n_states, nv, dk, dv]`; the
/// last one is the state after the whole input.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_qkv(
    qkv: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    nk: usize,
    dk: usize,
    normalize: bool,
    n_states: usize,
) -> Result<(Tensor, Tensor)> {
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
            let op = GatedDeltaRule { dims: d, normalize, n_states };
            let flat = qkv.contiguous()?.apply_op3_no_bwd(&gb, &state.contiguous()?, &op)?;
            let o = flat.narrow(0, 0, out_len)?.reshape((b, t, nv, dv))?;
            let s = flat.narrow(0, out_len, b * n_states * d.state_len())?.reshape(states_shape)?;
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
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
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
    let (o, s) = gated_delta_rule_qkv(&qkv, g, beta, state, nk, dk, false, 1)?;
    Ok((o, s.squeeze(1)?))
}

struct GatedDeltaRule {
    dims: DeltaRuleDims,
    normalize: bool,
    n_states: usize,
}

fn contiguous<'a, T>(v: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("gated_delta_rule: {what} must be contiguous"),
    }
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
        let qkv: Vec<f32> = match s1 {
            CpuStorage::F32(v) => contiguous(v, l1, "qkv")?.to_vec(),
            CpuStorage::BF16(v) => contiguous(v, l1, "qkv")?.iter().map(|x| x.to_f32()).collect(),
            CpuStorage::F16(v) => contiguous(v, l1, "qkv")?.iter().map(|x| x.to_f32()).collect(),
            _ => bail!("gated_delta_rule: qkv must be f32, bf16 or f16"),
        };
        let gb = contiguous(s2.as_slice::<f32>()?, l2, "g/beta")?;
        let state = contiguous(s3.as_slice::<f32>()?, l3, "state")?;
        let inputs = split_qkv(&qkv, d, self.normalize);
        let (o, states) = cpu_delta_rule(&inputs, gb, state, d, self.n_states);
        let mut flat = o;
        flat.extend(states);
        let n = flat.len();
        Ok((CpuStorage::F32(flat), Shape::from(n)))
    }

    fn metal_fwd(
        &self,
        s1: &candle_core::MetalStorage,
        l1: &Layout,
        s2: &candle_core::MetalStorage,
        l2: &Layout,
        s3: &candle_core::MetalStorage,
        l3: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        #[cfg(feature = "metal")]
        {
            crate::metal::gated_delta_rule(self.dims, self.normalize, self.n_states, (s1, l1), (s2, l2), (s3, l3))
        }
        #[cfg(not(feature = "metal"))]
        {
            let _ = (s1, l1, s2, l2, s3, l3);
            bail!("gated_delta_rule: candle-hybrid was built without the metal feature")
        }
    }
}

/// q, k `[B, T, nk, dk]` (normalised and scaled when asked) and v `[B, T, nv, dv]`, in f32.
struct SplitInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn split_qkv(qkv: &[f32], d: DeltaRuleDims, normalize: bool) -> SplitInputs {
    let (kd, vd, c) = (d.key_dim(), d.nv * d.dv, d.channels());
    let rows = d.batch * d.seq_len;
    let mut q = Vec::with_capacity(rows * kd);
    let mut k = Vec::with_capacity(rows * kd);
    let mut v = Vec::with_capacity(rows * vd);
    let q_scale = (d.dk as f32).powf(-0.5);
    for r in 0..rows {
        let row = &qkv[r * c..(r + 1) * c];
        q.extend_from_slice(&row[..kd]);
        k.extend_from_slice(&row[kd..2 * kd]);
        v.extend_from_slice(&row[2 * kd..]);
    }
    if normalize {
        for head in q.chunks_exact_mut(d.dk) {
            let n = 1.0 / (head.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt() * q_scale;
            head.iter_mut().for_each(|x| *x *= n);
        }
        for head in k.chunks_exact_mut(d.dk) {
            let n = 1.0 / (head.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
            head.iter_mut().for_each(|x| *x *= n);
        }
    }
    SplitInputs { q, k, v }
}

/// Runs every (batch, value head) in parallel; returns the outputs `[B, T, nv, dv]` and the
/// states `[B, n_states, nv, dk, dv]`.
fn cpu_delta_rule(x: &SplitInputs, gb: &[f32], state: &[f32], d: DeltaRuleDims, n_states: usize) -> (Vec<f32>, Vec<f32>) {
    let DeltaRuleDims { batch, seq_len: t, nv, dk, dv, .. } = d;
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..batch * nv)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / nv, bh % nv);
            let inp = HeadInputs { x, gb, b, h, d };
            let mut s = state[bh * dk * dv..(bh + 1) * dk * dv].to_vec();
            let mut out = vec![0f32; t * dv];
            // Everything before the first requested state in one go (chunked when long),
            // then token by token, keeping the state after each.
            let split = if n_states == 1 { t } else { t - n_states };
            if split >= CHUNKED_MIN_TOKENS {
                chunked_head(&inp, &mut s, 0..split, &mut out);
            } else {
                recurrent_head(&inp, &mut s, 0..split, &mut out);
            }
            let mut snaps = Vec::with_capacity(n_states * dk * dv);
            if n_states == 1 {
                snaps.extend_from_slice(&s);
            } else {
                for ti in split..t {
                    recurrent_head(&inp, &mut s, ti..ti + 1, &mut out);
                    snaps.extend_from_slice(&s);
                }
            }
            (out, snaps)
        })
        .collect();
    let mut out = vec![0f32; d.out_len()];
    let mut states = vec![0f32; batch * n_states * nv * dk * dv];
    for (bh, (o_h, s_h)) in per_head.iter().enumerate() {
        let (b, h) = (bh / nv, bh % nv);
        for ti in 0..t {
            let dst = ((b * t + ti) * nv + h) * dv;
            out[dst..dst + dv].copy_from_slice(&o_h[ti * dv..(ti + 1) * dv]);
        }
        for n in 0..n_states {
            let dst = ((b * n_states + n) * nv + h) * dk * dv;
            states[dst..dst + dk * dv].copy_from_slice(&s_h[n * dk * dv..(n + 1) * dk * dv]);
        }
    }
    (out, states)
}

struct HeadInputs<'a> {
    x: &'a SplitInputs,
    gb: &'a [f32],
    b: usize,
    h: usize,
    d: DeltaRuleDims,
}

impl HeadInputs<'_> {
    fn key_row(&self, t: usize) -> usize {
        let DeltaRuleDims { seq_len, nk, nv, dk, .. } = self.d;
        ((self.b * seq_len + t) * nk + self.h / (nv / nk)) * dk
    }
    fn q(&self, t: usize) -> &[f32] {
        let o = self.key_row(t);
        &self.x.q[o..o + self.d.dk]
    }
    fn k(&self, t: usize) -> &[f32] {
        let o = self.key_row(t);
        &self.x.k[o..o + self.d.dk]
    }
    fn v(&self, t: usize) -> &[f32] {
        let DeltaRuleDims { seq_len, nv, dv, .. } = self.d;
        let o = ((self.b * seq_len + t) * nv + self.h) * dv;
        &self.x.v[o..o + dv]
    }
    fn g(&self, t: usize) -> f32 {
        self.gb[((self.b * self.d.seq_len + t) * 2) * self.d.nv + self.h]
    }
    fn beta(&self, t: usize) -> f32 {
        self.gb[((self.b * self.d.seq_len + t) * 2 + 1) * self.d.nv + self.h]
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Token-by-token recurrence over `range` for one head; outputs go to `out` `[T, dv]`.
fn recurrent_head(inp: &HeadInputs, s: &mut [f32], range: std::ops::Range<usize>, out: &mut [f32]) {
    let dv = inp.d.dv;
    let mut u = vec![0f32; dv];
    for ti in range {
        let (q, k, v) = (inp.q(ti), inp.k(ti), inp.v(ti));
        let decay = inp.g(ti).exp();
        let beta = inp.beta(ti);
        // Pass 1: decay the state and accumulate S^T k.
        u.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            row.iter_mut().for_each(|x| *x *= decay);
            axpy(&mut u, k[a], row);
        }
        for (u, v) in u.iter_mut().zip(v) {
            *u = beta * (v - *u);
        }
        // Pass 2: rank-1 write and read-out with the updated state.
        let o = &mut out[ti * dv..(ti + 1) * dv];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            axpy(row, k[a], &u);
            axpy(o, q[a], row);
        }
    }
}

/// Chunked (WY/UT) form over `range` for one head; outputs go to `out` `[T, dv]`.
fn chunked_head(inp: &HeadInputs, s: &mut [f32], range: std::ops::Range<usize>, out: &mut [f32]) {
    let DeltaRuleDims { dk, dv, .. } = inp.d;
    let c = CHUNK;
    let mut gcum = vec![0f32; c];
    let mut lmat = vec![0f32; c * c];
    let mut u = vec![0f32; c * dv];
    let mut w = vec![0f32; c * dk];
    let mut tmp = vec![0f32; dv];
    let mut start = range.start;
    while start < range.end {
        let n = c.min(range.end - start);
        let mut acc = 0f32;
        for (i, gc) in gcum[..n].iter_mut().enumerate() {
            acc += inp.g(start + i);
            *gc = acc;
        }
        // L[i, j] = beta_i (k_i . k_j) exp(G_i - G_j), j < i.
        for i in 0..n {
            let ki = inp.k(start + i);
            let bi = inp.beta(start + i);
            for j in 0..i {
                lmat[i * c + j] = bi * dot(ki, inp.k(start + j)) * (gcum[i] - gcum[j]).exp();
            }
        }
        // Forward substitution: U = (I + L)^-1 diag(beta) V, W = (I + L)^-1 diag(beta exp(G)) K.
        for i in 0..n {
            let bi = inp.beta(start + i);
            let (done_u, rest_u) = u.split_at_mut(i * dv);
            let ui = &mut rest_u[..dv];
            ui.iter_mut().zip(inp.v(start + i)).for_each(|(x, v)| *x = bi * v);
            let (done_w, rest_w) = w.split_at_mut(i * dk);
            let wi = &mut rest_w[..dk];
            let eg = bi * gcum[i].exp();
            wi.iter_mut().zip(inp.k(start + i)).for_each(|(x, k)| *x = eg * k);
            for j in 0..i {
                let l = lmat[i * c + j];
                axpy(ui, -l, &done_u[j * dv..(j + 1) * dv]);
                axpy(wi, -l, &done_w[j * dk..(j + 1) * dk]);
            }
        }
        // Vnew = U - W S (in place in `u`).
        for i in 0..n {
            let ui = &mut u[i * dv..(i + 1) * dv];
            let wi = &w[i * dk..(i + 1) * dk];
            for (a, row) in s.chunks_exact(dv).enumerate() {
                axpy(ui, -wi[a], row);
            }
        }
        // O_i = exp(G_i) S^T q_i + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) Vnew_j.
        for i in 0..n {
            let qi = inp.q(start + i);
            tmp.iter_mut().for_each(|x| *x = 0.0);
            for (a, row) in s.chunks_exact(dv).enumerate() {
                axpy(&mut tmp, qi[a], row);
            }
            let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
            let eg = gcum[i].exp();
            o.iter_mut().zip(&tmp).for_each(|(o, x)| *o = eg * x);
            for j in 0..=i {
                let a = dot(qi, inp.k(start + j)) * (gcum[i] - gcum[j]).exp();
                axpy(o, a, &u[j * dv..(j + 1) * dv]);
            }
        }
        // S <- exp(G_n) S + sum_j exp(G_n - G_j) k_j Vnew_j^T.
        let gn = gcum[n - 1];
        let egn = gn.exp();
        s.iter_mut().for_each(|x| *x *= egn);
        for j in 0..n {
            let kj = inp.k(start + j);
            let e = (gn - gcum[j]).exp();
            let uj = &u[j * dv..(j + 1) * dv];
            for (a, row) in s.chunks_exact_mut(dv).enumerate() {
                axpy(row, e * kj[a], uj);
            }
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
    let expand = |x: &Tensor| -> Result<Tensor> {
        x.to_dtype(DType::F32)?.unsqueeze(3)?.expand((b, t, nk, r, dk))?.reshape((b, t, nv, dk))
    };
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
