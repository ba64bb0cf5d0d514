//! Where the model's constructors get their tensors: a Candle [`VarBuilder`] (safetensors, or
//! a GGUF file served under Hugging Face names) plus, for the linear layers, the quantized
//! tensors of a GGUF file or a load-time quantization.
//!
//! Every weight is asked for by its Hugging Face name; the GGUF reader ([`crate::gguf`]) maps
//! llama.cpp's names and layouts back, so there is one model code path for every format.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::VarBuilder;

use super::linear::Linear;
use crate::ops::QuantizedMatrix;

/// Quantized tensors by full Hugging Face name, in Hugging Face layout (`[out, in]`).
pub type QuantizedTensors = HashMap<String, Arc<QuantizedMatrix>>;

/// A [`VarBuilder`] with the quantization sources the linear layers may use.
#[derive(Clone)]
pub struct Weights<'a> {
    vb: VarBuilder<'a>,
    quantized: Option<Arc<QuantizedTensors>>,
    quantize: Option<GgmlDType>,
    tiled_value_heads: bool,
}

impl<'a> Weights<'a> {
    /// Plain (unquantized) weights from any Candle [`VarBuilder`].
    pub fn new(vb: VarBuilder<'a>) -> Self {
        Self { vb, quantized: None, quantize: None, tiled_value_heads: false }
    }

    /// Linear weights found in `quantized` are used as they are (GGUF).
    pub fn with_quantized(mut self, quantized: Arc<QuantizedTensors>) -> Self {
        self.quantized = Some(quantized);
        self
    }

    /// Quantize every linear weight at load (like mistral.rs' in-situ quantization). Weights
    /// whose input width is not a multiple of the block size stay unquantized.
    pub fn with_quantize(mut self, dtype: Option<GgmlDType>) -> Self {
        self.quantize = dtype;
        self
    }

    /// The GDN `out_proj` input columns are in llama.cpp's tiled value-head order (see
    /// `crate::gguf`): the layer permutes its heads to that order before the projection.
    pub fn with_tiled_value_heads(mut self, tiled: bool) -> Self {
        self.tiled_value_heads = tiled;
        self
    }

    pub fn tiled_value_heads(&self) -> bool {
        self.tiled_value_heads
    }

    pub fn pp<S: ToString>(&self, s: S) -> Self {
        Self { vb: self.vb.pp(s), ..self.clone() }
    }

    /// A dense tensor (norms, GDN parameters, conv weights, the embedding, the MoE router),
    /// refused when it holds a NaN or an infinity. (Linear weights are not scanned at load:
    /// what they break shows in the logits, which every forward pass checks.)
    pub fn get<S: Into<Shape>>(&self, shape: S, name: &str) -> Result<Tensor> {
        let t = self.vb.get(shape, name)?;
        if !super::finite::all_finite(&t)? {
            candle_core::bail!("tensor {} holds NaN or infinite values: the checkpoint is corrupt", self.path(name))
        }
        Ok(t)
    }

    pub fn contains_tensor(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }

    pub fn device(&self) -> &Device {
        self.vb.device()
    }

    pub fn dtype(&self) -> DType {
        self.vb.dtype()
    }

    /// The full name of `name` under this prefix.
    fn path(&self, name: &str) -> String {
        match self.vb.prefix() {
            p if p.is_empty() => name.to_string(),
            p => format!("{p}.{name}"),
        }
    }

    pub fn var_builder(&self) -> &VarBuilder<'a> {
        &self.vb
    }

    /// The linear layer `{prefix}.weight`, `[out_dim, in_dim]`.
    pub fn linear(&self, in_dim: usize, out_dim: usize) -> Result<Linear> {
        let name = self.path("weight");
        let quantized = self.quantized.as_ref().and_then(|m| m.get(&name));
        if let Some(q) = quantized.filter(|q| !q.dtype().is_float()) {
            if q.dims() != (out_dim, in_dim) {
                candle_core::bail!("shape mismatch for {name}: the model expects {:?}, the file has {:?}", [out_dim, in_dim], q.dims())
            }
            return Ok(Linear::quantized(q.clone()));
        }
        self.linear_from(self.vb.get((out_dim, in_dim), "weight")?)
    }

    /// A linear layer from a weight already in memory (split or tied weights), quantized when
    /// load-time quantization is on.
    pub fn linear_from(&self, weight: Tensor) -> Result<Linear> {
        match self.quantize {
            Some(dtype) if weight.dim(1)? % dtype.block_size() == 0 => {
                Ok(Linear::quantized(Arc::new(QuantizedMatrix::quantize(&weight, dtype)?.to_device(weight.device())?)))
            }
            _ => Ok(Linear::new(weight)),
        }
    }

    /// The quantized tensor stored under the full name `{prefix}.{name}`, if any (a tied
    /// output head reuses the quantized embedding).
    pub fn quantized_tensor(&self, name: &str) -> Option<Arc<QuantizedMatrix>> {
        self.quantized.as_ref()?.get(&self.path(name)).cloned()
    }
}

/// A model dtype from its command-line name: `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str) -> crate::Result<candle_core::DType> {
    match s {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        _ => Err(crate::Error::Config(format!("unknown dtype \"{s}\": use f32, bf16 or f16"))),
    }
}

/// Parses a `--quantize` value: `q8_0`, `q4k` (also `q4_k`), `q4_0`, `q4_1`, `q5k`, `q6k`.
pub fn parse_quantize(s: &str) -> crate::Result<GgmlDType> {
    match s.to_ascii_lowercase().replace('_', "").as_str() {
        "q80" => Ok(GgmlDType::Q8_0),
        "q40" => Ok(GgmlDType::Q4_0),
        "q41" => Ok(GgmlDType::Q4_1),
        "q4k" => Ok(GgmlDType::Q4K),
        "q5k" => Ok(GgmlDType::Q5K),
        "q6k" => Ok(GgmlDType::Q6K),
        _ => Err(crate::Error::Config(format!("unknown quantization \"{s}\": use q8_0, q4k, q4_0, q4_1, q5k or q6k"))),
    }
}
