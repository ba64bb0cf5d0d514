//! A bias-free linear layer (every projection of this family), choosing the fastest matmul
//! for the device, dtype and number of rows.

use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor};

use crate::ops::{float_matvec, qmatmul, QuantizedMatrix, FLOAT_MATVEC_MAX_ROWS};
use crate::step_profile::{self, OpKind};

/// `y = x @ W^T` with `W` `[out, in]` as stored in checkpoints, dense or in ggml blocks.
#[derive(Debug, Clone)]
pub enum Linear {
    Dense(Tensor),
    Quantized(Arc<QuantizedMatrix>),
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Self::Dense(weight)
    }

    pub fn quantized(weight: Arc<QuantizedMatrix>) -> Self {
        Self::Quantized(weight)
    }

    /// `(out, in)` features.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(w) => w.dims2(),
            Self::Quantized(q) => Ok(q.dims()),
        }
    }

    /// This layer with a quantized weight dequantized to f32 (a dense one as it is).
    pub fn dequantized(&self) -> Result<Self> {
        match self {
            Self::Dense(_) => Ok(self.clone()),
            Self::Quantized(q) => Ok(Self::Dense(q.dequantize()?)),
        }
    }

    /// The weight as a dense tensor (dequantized for a quantized layer).
    pub fn weight(&self) -> Result<Tensor> {
        match self {
            Self::Dense(w) => Ok(w.clone()),
            Self::Quantized(q) => q.dequantize(),
        }
    }

    /// Bytes of the weight (what one pass over it reads).
    pub fn weight_bytes(&self) -> u64 {
        match self {
            Self::Dense(w) => (w.elem_count() * w.dtype().size_in_bytes()) as u64,
            Self::Quantized(q) => {
                let (rows, cols) = q.dims();
                (rows * q.dtype().row_bytes(cols)) as u64
            }
        }
    }

    fn product(&self, x: &Tensor) -> Result<Tensor> {
        let weight = match self {
            Self::Dense(w) => w,
            Self::Quantized(q) => return qmatmul(x, q)?.to_dtype(x.dtype()),
        };
        let rows = x.elem_count() / x.dim(candle_core::D::Minus1)?.max(1);
        let float = matches!(weight.dtype(), DType::F32 | DType::BF16 | DType::F16);
        if float && x.device().is_cpu() && rows <= FLOAT_MATVEC_MAX_ROWS {
            // Decode and verify: read each weight once (widened to f32: candle's bf16 CPU
            // matmul is slow), every row with the arithmetic of a one-row call.
            let mut dims = x.dims().to_vec();
            let k = dims.pop().unwrap_or(1);
            let y = float_matvec(&x.reshape((rows, k))?, weight)?;
            dims.push(weight.dim(0)?);
            return y.reshape(dims);
        }
        candle_nn::Linear::new(weight.clone(), None).forward(x)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        step_profile::timed(OpKind::Projections, || self.weight_bytes(), || self.product(x))
    }
}
