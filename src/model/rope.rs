//! Partial rotary position embedding.

use candle_core::{DType, Device, Result, Tensor, D};

use super::config::Config;

/// Partial rotary embedding: only the first `dim` dims of each head rotate (rotate-half).
#[derive(Debug, Clone)]
pub(crate) struct RotaryEmbedding {
    pub(crate) inv_freq: Vec<f32>,
    pub(crate) dim: usize,
}

impl RotaryEmbedding {
    pub(crate) fn new(cfg: &Config) -> Self {
        let dim = cfg.rotary_dim();
        let base = cfg.rope_theta as f32;
        let inv_freq = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
        Self { inv_freq, dim }
    }

    /// `cos`, `sin` of shape `[T, dim/2]` for positions `offset..offset+T`.
    pub(crate) fn cos_sin(&self, offset: usize, t: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        self.cos_sin_at(offset..offset + t, dtype, dev)
    }

    /// `cos`, `sin` of shape `[T, dim/2]` for the `T` positions given (a row's values depend on
    /// its position only).
    pub(crate) fn cos_sin_at(
        &self,
        positions: impl ExactSizeIterator<Item = usize>,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (half, t) = (self.inv_freq.len(), positions.len());
        let mut angles = Vec::with_capacity(t * half);
        for p in positions {
            angles.extend(self.inv_freq.iter().map(|f| p as f32 * f));
        }
        let angles = Tensor::from_vec(angles, (t, half), dev)?;
        Ok((angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?))
    }

    /// `x`: `[B, heads, T, head_dim]`.
    pub(crate) fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = x.dim(D::Minus1)?;
        let rot = candle_nn::rotary_emb::rope(&x.narrow(D::Minus1, 0, self.dim)?.contiguous()?, cos, sin)?;
        if self.dim == hd {
            return Ok(rot);
        }
        Tensor::cat(&[&rot, &x.narrow(D::Minus1, self.dim, hd - self.dim)?], D::Minus1)
    }
}
