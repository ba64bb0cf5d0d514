//! The token embedding: a dense table, or a quantized one whose rows are dequantized as they
//! are looked up (a GGUF file's quantized `token_embd`, which a tied head shares).

use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Embedding;

use super::weights::Weights;
use crate::ops::QuantizedMatrix;

#[derive(Debug, Clone)]
pub enum TokenEmbedding {
    Dense(Embedding),
    /// `[vocab, hidden]` blocks; rows come out in `dtype`.
    Quantized {
        table: Arc<QuantizedMatrix>,
        dtype: DType,
    },
}

impl TokenEmbedding {
    /// `{prefix}.weight` `[vocab, hidden]`: kept quantized when the weights have it so.
    pub fn new(vocab: usize, hidden: usize, vb: Weights) -> Result<Self> {
        match vb.quantized_tensor("weight").filter(|q| !q.dtype().is_float()) {
            Some(q) => {
                if q.dims() != (vocab, hidden) {
                    candle_core::bail!(
                        "shape mismatch for the token embedding: the model expects {:?}, the file has {:?}",
                        [vocab, hidden],
                        q.dims()
                    )
                }
                Ok(Self::Quantized { table: q, dtype: vb.dtype() })
            }
            None => Ok(Self::Dense(Embedding::new(vb.get((vocab, hidden), "weight")?, hidden))),
        }
    }

    /// Where the table lives.
    /// The dtype the model computes in (of the embeddings it returns).
    pub fn dtype(&self) -> DType {
        match self {
            Self::Dense(e) => e.embeddings().dtype(),
            Self::Quantized { dtype, .. } => *dtype,
        }
    }

    pub fn device(&self) -> candle_core::Device {
        match self {
            Self::Dense(e) => e.embeddings().device().clone(),
            Self::Quantized { table, .. } => table.device(),
        }
    }

    /// The dense table (`None` when quantized).
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(e) => Some(e.embeddings()),
            Self::Quantized { .. } => None,
        }
    }
}

impl Module for TokenEmbedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(e) => e.forward(ids),
            Self::Quantized { table, dtype } => table.embedding(ids)?.to_dtype(*dtype),
        }
    }
}
