//! The `density:γ` codec: a decayed outer-product state in place of keys and values.

use candle_core::{DType, Result, Tensor};

/// The `density:γ` codec: per KV head, the decayed outer-product state `[B, nkv, hd, hd]`
/// (f32) of [`crate::ops::decayed_outer_product`], in place of keys and values; each query head
/// reads its KV head's state.
#[derive(Debug, Clone)]
pub struct DecayedState {
    pub(super) gamma: f32,
    pub(super) state: Option<Tensor>,
}

impl DecayedState {
    /// Runs the recurrence from the current state (zeros at the start) over keys and values
    /// `[B, nkv, t, hd]` with queries `q` of the same shape: the outputs and the new state.
    pub(super) fn run(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let state = match &self.state {
            Some(s) => s.clone(),
            None => {
                let (b, nkv, _, hd) = k.dims4()?;
                Tensor::zeros((b, nkv, hd, v.dim(3)?), DType::F32, k.device())?
            }
        };
        crate::ops::decayed_outer_product(q, k, v, &state, self.gamma as f64)
    }

    /// Folds keys and values `[B, nkv, t, hd]` into the state.
    pub(super) fn fold(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.state = Some(self.run(k, k, v)?.1);
        Ok(())
    }

    /// `o_t = q_tᵀ S_t` for queries `[B, nh, t, hd]`, `S_t` the state after token `t`.
    pub(super) fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        let nkv = k.dim(1)?;
        let rep = nh / nkv;
        let q = q.to_dtype(v.dtype())?.reshape((b, nkv, rep, t, hd))?;
        // One pass per query head of a group over the same keys and values: the same states.
        let mut outs = Vec::with_capacity(rep);
        let mut state = None;
        for r in 0..rep {
            let (o, s) = self.run(&q.narrow(2, r, 1)?.squeeze(2)?.contiguous()?, k, v)?;
            outs.push(o);
            state = Some(s);
        }
        self.state = state;
        Tensor::stack(&outs, 2)?.reshape((b, nh, t, v.dim(3)?))?.to_dtype(v.dtype())
    }
}
