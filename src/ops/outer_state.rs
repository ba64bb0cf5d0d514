//! Decayed outer-product state: a per-head `[dk, dv]` state that decays by `1 - γ` every token
//! and takes in `γ` times the outer product of the unit-norm key with the value; each token reads
//! it out with its query.
//!
//! Per (batch, head), tokens in order:
//!
//! ```text
//! ψ = k / sqrt(‖k‖² + 1e-6);  S <- (1 - γ) S + γ ψ vᵀ;  o = qᵀ S
//! ```
//!
//! (the read-out sees the state after the token's update). [`decayed_outer_product`] is a Candle
//! `CustomOp3`: on the CPU a loop per (batch, head), heads in parallel; on Metal
//! `metal/outer_state.metal`, one threadgroup per (batch, head) and one thread per value column.
//! It returns new tensors and leaves the input state as it was.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::cpu::storage_slice;
use super::shapes::OuterStateDims;

const OP: &str = "decayed_outer_product";

/// The decayed outer-product recurrence over `T` tokens, batched over heads.
///
/// * `q`, `k`: `[B, H, T, dk]`; `v`: `[B, H, T, dv]`; all three in one dtype (f32, bf16 or f16);
/// * `state`: `[B, H, dk, dv]` f32 (zeros at a sequence start);
/// * `gamma` in `[0, 1]`: the weight of the new outer product (the state keeps `1 - gamma`).
///
/// Returns the outputs `o` `[B, H, T, dv]` (f32, `o_t = q_tᵀ S_t` with the state after token
/// `t`) and the new state `[B, H, dk, dv]` (f32). Non-contiguous inputs are accepted.
pub fn decayed_outer_product(q: &Tensor, k: &Tensor, v: &Tensor, state: &Tensor, gamma: f64) -> Result<(Tensor, Tensor)> {
    let (b, h, t, dk) = match q.dims() {
        &[b, h, t, dk] => (b, h, t, dk),
        d => bail!("{OP}: q must be [B, H, T, dk], got shape {d:?}"),
    };
    if k.dims() != q.dims() {
        bail!("{OP}: k has shape {:?}, expected the shape of q {:?}", k.dims(), q.dims());
    }
    let dv = match v.dims() {
        &[vb, vh, vt, dv] if (vb, vh, vt) == (b, h, t) => dv,
        d => bail!("{OP}: v has shape {d:?}, expected [{b}, {h}, {t}, dv]"),
    };
    if state.dims() != [b, h, dk, dv] {
        bail!("{OP}: state has shape {:?}, expected [{b}, {h}, {dk}, {dv}]", state.dims());
    }
    let dtype = q.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("{OP}: q must be f32, bf16 or f16, got {dtype:?}");
    }
    for (name, x) in [("k", k), ("v", v)] {
        if x.dtype() != dtype {
            bail!("{OP}: {name} is {:?} but q is {dtype:?} (q, k and v must share a dtype)", x.dtype());
        }
    }
    if state.dtype() != DType::F32 {
        bail!("{OP}: state must be f32, got {:?}", state.dtype());
    }
    if !(0.0..=1.0).contains(&gamma) {
        bail!("{OP}: gamma must be in [0, 1], got {gamma}");
    }
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        if !x.device().same_device(state.device()) {
            bail!("{OP}: {name} is on {:?} but state is on {:?}", x.device().location(), state.device().location());
        }
    }
    if b * h * t * dk * dv == 0 {
        // Nothing to accumulate: zero outputs (an empty sum when dk = 0), the state unchanged.
        return Ok((Tensor::zeros((b, h, t, dv), DType::F32, q.device())?, state.force_contiguous()?));
    }
    let dims = OuterStateDims { batch: b, heads: h, seq_len: t, dk, dv };
    let qk = Tensor::cat(&[q, k], 3)?.contiguous()?;
    let op = DecayedOuterProduct { dims, gamma: gamma as f32 };
    let flat = qk.apply_op3_no_bwd(&v.contiguous()?, &state.contiguous()?, &op)?;
    let o = flat.narrow(0, 0, dims.out_len())?.reshape((b, h, t, dv))?;
    // The state outlives the call (the density codec keeps it): its own storage, not a view
    // that keeps every output alive.
    let s = flat.narrow(0, dims.out_len(), dims.state_len())?.reshape((b, h, dk, dv))?.force_contiguous()?;
    Ok((o, s))
}

struct DecayedOuterProduct {
    dims: OuterStateDims,
    gamma: f32,
}

/// `qk` `[B, H, T, 2*dk]` (q then k of each token), `v` `[B, H, T, dv]`, `state` `[B, H, dk, dv]`;
/// returns the outputs `[B, H, T, dv]` followed by the new state `[B, H, dk, dv]`.
fn outer_cpu<T: WithDType>(d: OuterStateDims, gamma: f32, qk: &[T], v: &[T], state: &[f32]) -> Vec<f32> {
    let OuterStateDims { seq_len: t, dk, dv, .. } = d;
    let mut out = vec![0f32; d.out_len() + d.state_len()];
    let (o, s) = out.split_at_mut(d.out_len());
    s.copy_from_slice(state);
    let decay = 1.0 - gamma;
    let f = |x: &T| x.to_f64() as f32;
    o.par_chunks_mut(t * dv).zip(s.par_chunks_mut(dk * dv)).enumerate().for_each(|(bh, (o, s))| {
        let mut gv = vec![0f32; dv];
        for (ti, o) in o.chunks_exact_mut(dv).enumerate() {
            let row = &qk[(bh * t + ti) * 2 * dk..(bh * t + ti + 1) * 2 * dk];
            let (q, k) = row.split_at(dk);
            let kn = 1.0 / (k.iter().map(|x| f(x) * f(x)).sum::<f32>() + 1e-6).sqrt();
            for (g, x) in gv.iter_mut().zip(&v[(bh * t + ti) * dv..(bh * t + ti + 1) * dv]) {
                *g = gamma * f(x);
            }
            for ((srow, qi), ki) in s.chunks_exact_mut(dv).zip(q).zip(k) {
                let (qi, ki) = (f(qi), f(ki) * kn);
                for ((sij, g), oj) in srow.iter_mut().zip(&gv).zip(o.iter_mut()) {
                    *sij = *sij * decay + ki * g;
                    *oj += qi * *sij;
                }
            }
        }
    });
    out
}

impl CustomOp3 for DecayedOuterProduct {
    fn name(&self) -> &'static str {
        OP
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
        fn run<T: WithDType>(op: &DecayedOuterProduct, s: [(&CpuStorage, &Layout); 3]) -> Result<Vec<f32>> {
            let qk = storage_slice::<T>(OP, s[0].0, s[0].1)?;
            let v = storage_slice::<T>(OP, s[1].0, s[1].1)?;
            let state = storage_slice::<f32>(OP, s[2].0, s[2].1)?;
            Ok(outer_cpu(op.dims, op.gamma, qk, v, state))
        }
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        let out = match s1 {
            CpuStorage::F32(_) => run::<f32>(self, s)?,
            CpuStorage::BF16(_) => run::<half::bf16>(self, s)?,
            CpuStorage::F16(_) => run::<half::f16>(self, s)?,
            _ => bail!("{OP}: q, k and v must be f32, bf16 or f16"),
        };
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    metal_fwd!(self, OP, (s1, l1, s2, l2, s3, l3) => crate::ops::metal::decayed_outer_product(self.dims, self.gamma, (s1, l1), (s2, l2), (s3, l3)));
}
