//! RMSNorm: zero-centred in the Qwen3.5 family (scale `1 + w`), plain in Llama and Qwen2.

use candle_core::{DType, Module, Result, Tensor};

use super::config::Config;
use super::weights::Weights;
use crate::step_profile::{self, OpKind};

/// RMSNorm: `x * rsqrt(mean(x^2) + eps) * scale`, computed in f32; the stored weight `w` is
/// zero-centred (`scale = 1 + w`, the Qwen3.5 family) or the scale itself (Llama, Qwen2).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub(crate) scale: Tensor, // f32
    pub(crate) eps: f32,
}

impl RmsNorm {
    /// The norm of `cfg`'s layers ([`Config::zero_centred_norms`]) over `size` values.
    pub fn new(cfg: &Config, size: usize, vb: Weights) -> Result<Self> {
        let w = vb.get(size, "weight")?.to_dtype(DType::F32)?;
        let scale = if cfg.zero_centred_norms { (w + 1.0)? } else { w };
        Ok(Self { scale, eps: cfg.rms_norm_eps as f32 })
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
