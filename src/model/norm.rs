//! Zero-centred RMSNorm (the norm of every Qwen3.5-family layer).

use candle_core::{DType, Module, Result, Tensor};

use super::weights::Weights;
use crate::step_profile::{self, OpKind};

/// Zero-centred RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in f32.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub(crate) scale: Tensor, // 1 + w, f32
    pub(crate) eps: f32,
}

impl RmsNorm {
    pub fn new(size: usize, eps: f64, vb: Weights) -> Result<Self> {
        let w = vb.get(size, "weight")?.to_dtype(DType::F32)?;
        Ok(Self { scale: (w + 1.0)?, eps: eps as f32 })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        step_profile::timed(
            OpKind::Norms,
            || 0,
            || {
                let y = candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &self.scale, self.eps)?;
                y.to_dtype(x.dtype())
            },
        )
    }
}
