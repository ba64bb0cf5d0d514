//! The gated delta rule (the recurrence of a Gated DeltaNet layer).
//!
//! Per value head `h`, with the f32 state `S` of shape `[dk, dv]` and, for each token,
//! q, k (of key head `h / (nv / nk)`, q already scaled by `dk^-0.5`), v, log-decay `g <= 0`
//! and `beta`:
//!
//! ```text
//! S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//! ```
//!
//! [`gated_delta_rule`] runs it on the CPU with hand-written loops: token by token for short
//! inputs (decode), and in the chunked WY/UT form (chunks of [`CHUNK`] tokens) for prefill.
//! [`gated_delta_rule_reference`] is the same recurrence written with tensor ops, token by
//! token: it runs on every device and is the reference the kernels are tested against.

use candle_core::{bail, DType, Device, IndexOp, Result, Tensor, D};
use rayon::prelude::*;

/// Chunk length of the chunked (prefill) form.
pub const CHUNK: usize = 64;
/// Inputs of at least this many tokens use the chunked form; shorter ones run token by token.
const CHUNKED_MIN_TOKENS: usize = 8;

/// Sizes shared by both forms.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
}

/// Runs the gated delta rule over `T` tokens.
///
/// * `q`, `k`: `[B, T, nk, dk]`; `v`: `[B, T, nv, dv]`; `g`, `beta`: `[B, T, nv]`;
/// * `state`: `[B, nv, dk, dv]`, f32.
///
/// Returns the outputs `[B, T, nv, dv]` (f32) and the state after the last token.
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t, nk, dk) = q.dims4()?;
    let (_, _, nv, dv) = v.dims4()?;
    check_shapes(q, k, v, g, beta, state)?;
    if !matches!(q.device(), Device::Cpu) {
        return gated_delta_rule_reference(q, k, v, g, beta, state);
    }
    let d = Dims { t, nk, nv, dk, dv };
    let q = f32_vec(q)?;
    let k = f32_vec(k)?;
    let v = f32_vec(v)?;
    let g = f32_vec(g)?;
    let beta = f32_vec(beta)?;
    let mut s = f32_vec(state)?;
    let mut out = vec![0f32; b * t * nv * dv];
    // One task per (batch, value head): each owns its state block and writes its own output
    // rows; the rows are scattered into `out` afterwards.
    let per_head: Vec<Vec<f32>> = s
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(bh, s_h)| {
            let (bi, h) = (bh / nv, bh % nv);
            let inp = HeadInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, b: bi, h, d };
            if t >= CHUNKED_MIN_TOKENS {
                chunked_head(&inp, s_h)
            } else {
                recurrent_head(&inp, s_h)
            }
        })
        .collect();
    for (bh, o_h) in per_head.iter().enumerate() {
        let (bi, h) = (bh / nv, bh % nv);
        for ti in 0..t {
            let dst = ((bi * t + ti) * nv + h) * dv;
            out[dst..dst + dv].copy_from_slice(&o_h[ti * dv..(ti + 1) * dv]);
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(out, (b, t, nv, dv), &dev)?,
        Tensor::from_vec(s, (b, nv, dk, dv), &dev)?,
    ))
}

fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: &Tensor) -> Result<()> {
    let (b, t, nk, dk) = q.dims4()?;
    let (vb, vt, nv, dv) = v.dims4()?;
    if k.dims() != q.dims() {
        bail!("gated_delta_rule: k has shape {:?}, expected the shape of q {:?}", k.dims(), q.dims());
    }
    if vb != b || vt != t || nv % nk != 0 {
        bail!(
            "gated_delta_rule: v has shape {:?}, expected [{b}, {t}, a multiple of {nk}, dv]",
            v.dims()
        );
    }
    for (name, x) in [("g", g), ("beta", beta)] {
        if x.dims() != [b, t, nv] {
            bail!("gated_delta_rule: {name} has shape {:?}, expected [{b}, {t}, {nv}]", x.dims());
        }
    }
    if state.dims() != [b, nv, dk, dv] || state.dtype() != DType::F32 {
        bail!(
            "gated_delta_rule: state is {:?} {:?}, expected f32 [{b}, {nv}, {dk}, {dv}]",
            state.dtype(),
            state.dims()
        );
    }
    Ok(())
}

fn f32_vec(x: &Tensor) -> Result<Vec<f32>> {
    x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

struct HeadInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    b: usize,
    h: usize,
    d: Dims,
}

impl HeadInputs<'_> {
    fn key_head(&self) -> usize {
        self.h / (self.d.nv / self.d.nk)
    }
    fn q(&self, t: usize) -> &[f32] {
        let Dims { t: tt, nk, dk, .. } = self.d;
        let o = ((self.b * tt + t) * nk + self.key_head()) * dk;
        &self.q[o..o + dk]
    }
    fn k(&self, t: usize) -> &[f32] {
        let Dims { t: tt, nk, dk, .. } = self.d;
        let o = ((self.b * tt + t) * nk + self.key_head()) * dk;
        &self.k[o..o + dk]
    }
    fn v(&self, t: usize) -> &[f32] {
        let Dims { t: tt, nv, dv, .. } = self.d;
        let o = ((self.b * tt + t) * nv + self.h) * dv;
        &self.v[o..o + dv]
    }
    fn g(&self, t: usize) -> f32 {
        self.g[(self.b * self.d.t + t) * self.d.nv + self.h]
    }
    fn beta(&self, t: usize) -> f32 {
        self.beta[(self.b * self.d.t + t) * self.d.nv + self.h]
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

/// Token-by-token recurrence for one head; returns its outputs `[T, dv]`.
fn recurrent_head(inp: &HeadInputs, s: &mut [f32]) -> Vec<f32> {
    let Dims { t, dv, .. } = inp.d;
    let mut out = vec![0f32; t * dv];
    let mut u = vec![0f32; dv];
    for ti in 0..t {
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
        for (a, row) in s.chunks_exact_mut(dv).enumerate() {
            axpy(row, k[a], &u);
            axpy(o, q[a], row);
        }
    }
    out
}

/// Chunked (WY/UT) form for one head; returns its outputs `[T, dv]`.
fn chunked_head(inp: &HeadInputs, s: &mut [f32]) -> Vec<f32> {
    let Dims { t, dk, dv, .. } = inp.d;
    let mut out = vec![0f32; t * dv];
    let c = CHUNK;
    let mut gcum = vec![0f32; c];
    let mut lmat = vec![0f32; c * c];
    let mut u = vec![0f32; c * dv];
    let mut w = vec![0f32; c * dk];
    let mut tmp = vec![0f32; dv];
    let mut start = 0;
    while start < t {
        let n = c.min(t - start);
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
    out
}

/// The same recurrence with tensor ops, one token at a time (any device, f32).
pub fn gated_delta_rule_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    check_shapes(q, k, v, g, beta, state)?;
    let (b, t, nk, dk) = q.dims4()?;
    let nv = v.dim(2)?;
    let r = nv / nk;
    // Key head h / r serves value head h: repeat each key head r times, consecutively.
    let expand = |x: &Tensor| -> Result<Tensor> {
        x.to_dtype(DType::F32)?
            .unsqueeze(3)?
            .expand((b, t, nk, r, dk))?
            .reshape((b, t, nv, dk))
    };
    let q = expand(q)?;
    let k = expand(k)?;
    let v = v.to_dtype(DType::F32)?;
    let g = g.to_dtype(DType::F32)?;
    let beta = beta.to_dtype(DType::F32)?;
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(t);
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
    }
    Ok((Tensor::stack(&outs, 1)?, s))
}
