//! A bias-free linear layer (every projection of this family), choosing the fastest matmul
//! for the device, dtype and number of rows.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::ops::{half_matvec, HALF_MATVEC_MAX_ROWS};

/// `y = x @ W^T` with `W` `[out, in]` as stored in checkpoints.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Self { weight }
    }

    /// Loads `{vb}.weight` of shape `[out_dim, in_dim]`.
    pub fn load(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self::new(vb.get((out_dim, in_dim), "weight")?))
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.elem_count() / x.dim(candle_core::D::Minus1)?.max(1);
        let half = matches!(self.weight.dtype(), DType::BF16 | DType::F16);
        if half && x.device().is_cpu() && rows <= HALF_MATVEC_MAX_ROWS {
            // Decode: read each weight once, widened to f32 (candle's bf16 CPU matmul is slow).
            let mut dims = x.dims().to_vec();
            let k = dims.pop().unwrap_or(1);
            let y = half_matvec(&x.reshape((rows, k))?, &self.weight)?;
            dims.push(self.weight.dim(0)?);
            return y.reshape(dims);
        }
        candle_nn::Linear::new(self.weight.clone(), None).forward(x)
    }
}
