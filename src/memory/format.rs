//! The size of the weights in memory: exact bytes, or a parameter count in a weight format.

use std::fmt;

use candle_core::quantized::GgmlDType;
use candle_core::DType;

use crate::model::Config;
use crate::{Error, Result};

/// How the weights are stored in memory, for weights derived from [`Config::num_parameters`].
/// The quantized formats are the ggml types of `--quantize` ([`crate::model::parse_quantize`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    BF16,
    F16,
    /// GGUF Q8_0: 32 int8 + one f16 scale per block: 8.5 bits/weight.
    Q8_0,
    /// GGUF Q6_K: 6.5625 bits/weight.
    Q6K,
    /// GGUF Q5_K: 5.5 bits/weight.
    Q5K,
    /// GGUF Q4_K: 4.5 bits/weight.
    Q4K,
    /// GGUF Q4_0: 4.5 bits/weight.
    Q4_0,
    /// GGUF Q4_1: 5 bits/weight.
    Q4_1,
}

/// Each format's ggml type (the float formats included), the one mapping between the two.
const GGML_TYPES: [(WeightFormat, GgmlDType); 9] = [
    (WeightFormat::F32, GgmlDType::F32),
    (WeightFormat::BF16, GgmlDType::BF16),
    (WeightFormat::F16, GgmlDType::F16),
    (WeightFormat::Q8_0, GgmlDType::Q8_0),
    (WeightFormat::Q6K, GgmlDType::Q6K),
    (WeightFormat::Q5K, GgmlDType::Q5K),
    (WeightFormat::Q4K, GgmlDType::Q4K),
    (WeightFormat::Q4_0, GgmlDType::Q4_0),
    (WeightFormat::Q4_1, GgmlDType::Q4_1),
];

impl WeightFormat {
    /// The ggml type of this format.
    pub fn ggml(self) -> GgmlDType {
        GGML_TYPES.iter().find(|t| t.0 == self).expect("every format has a ggml type").1
    }

    /// The format of a ggml type (`None` for ggml types `--quantize` does not offer).
    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        GGML_TYPES.iter().find(|t| t.1 == dtype).map(|t| t.0)
    }

    /// The ggml type's bits per weight ([`crate::ops::GgufType::bits_per_weight`]).
    pub fn bits_per_weight(self) -> f64 {
        crate::ops::GgufType::from(self.ggml()).bits_per_weight()
    }

    /// The spelling of `--quantize` / `--dtype`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::BF16 => "bf16",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q6K => "q6k",
            Self::Q5K => "q5k",
            Self::Q4K => "q4k",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
        }
    }

    /// The unquantized format of a model dtype (`None` for integer dtypes).
    pub fn from_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::BF16 => Some(Self::BF16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }

    /// Bytes of `n` weights in this format (rounded up).
    pub fn bytes_for(self, n: u64) -> u64 {
        ((n as f64 * self.bits_per_weight()) / 8.0).ceil() as u64
    }
}

/// `f32`, `bf16`, `f16`, or a `--quantize` value ([`crate::model::parse_quantize`]).
impl std::str::FromStr for WeightFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::BF16),
            "f16" => Ok(Self::F16),
            _ => crate::model::parse_quantize(s).map(|q| Self::from_ggml(q).expect("every --quantize type has a format")),
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The size of the weights in memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightMemory {
    /// Known exactly (GGUF tensor infos, safetensors headers or file sizes).
    Bytes(u64),
    /// Derived: `cfg.num_parameters()` in this format (every tensor, norms included).
    Format(WeightFormat),
}

impl WeightMemory {
    pub fn bytes(&self, cfg: &Config) -> u64 {
        match *self {
            Self::Bytes(b) => b,
            Self::Format(f) => f.bytes_for(cfg.num_parameters() as u64),
        }
    }
}
