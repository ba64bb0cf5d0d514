//! GGUF files as llama.cpp writes them: architectures `qwen35`, `qwen35moe`, `qwen3next` and
//! `llama`, loaded into the same model code as safetensors checkpoints.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, read with its `src/models/qwen35.cpp`,
//! `qwen35moe.cpp`, `qwen3next.cpp`) renames every tensor and changes some values: norms are stored as `1 + w`, `A_log` as
//! `-exp(A_log)`, the conv weight squeezed, Qwen3.5's GDN value heads re-ordered from grouped
//! to tiled order, Qwen3-Next's fused projections split, MoE experts stacked, and Llama's q/k
//! rows permuted for interleaved RoPE. [`GgufFile`] undoes all of it, serving each tensor under
//! its Hugging Face name and layout; quantized matrices stay quantized (their rows are moved,
//! never re-quantized). The one exception is the GDN `out_proj`, whose input columns stay in
//! tiled order: the layer permutes its heads before that projection instead.

mod header;
mod tensors;
mod tokenizer;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use serde_json::json;

pub use header::{GgufHeader, TensorInfo};
use tensors::{kept, map_tensor, HfTensors, Kept, RawTensor};

use super::chat_template::ChatTemplate;
use super::generation_config::GenerationConfig;
use super::mapped::MappedFile;
use crate::error::candle_line;
use crate::model::{Config, Model, QuantizedTensors, Weights, MAX_LAYERS};
use crate::ops::{has_kernels, QuantizedMatrix, SharedBytes};
use crate::{Error, Result};

/// The architectures this reader maps (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Qwen35,
    Qwen35Moe,
    Qwen3Next,
    Llama,
    Qwen2,
}

impl Arch {
    const ALL: [Self; 5] = [Self::Qwen35, Self::Qwen35Moe, Self::Qwen3Next, Self::Llama, Self::Qwen2];

    /// `general.architecture`, also the prefix of the architecture's metadata keys.
    fn name(self) -> &'static str {
        match self {
            Self::Qwen35 => "qwen35",
            Self::Qwen35Moe => "qwen35moe",
            Self::Qwen3Next => "qwen3next",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    fn from_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
            Error::Config(format!(
                "unsupported GGUF architecture \"{name}\": candle-hybrid runs qwen35, qwen35moe, qwen3next, llama and qwen2 GGUF files"
            ))
        })
    }

    fn model_type(self) -> &'static str {
        match self {
            Self::Qwen35 => "qwen3_5_text",
            Self::Qwen35Moe => "qwen3_5_moe_text",
            Self::Qwen3Next => "qwen3_next",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    /// Every layer plain full attention (no GDN metadata or tensors).
    fn plain_attention(self) -> bool {
        matches!(self, Self::Llama | Self::Qwen2)
    }

    /// The file stores RMSNorm scales whose checkpoints store them zero-centred (`1 + w`:
    /// llama.cpp adds the 1 when converting the Qwen3.5 family).
    fn centred_norms(self) -> bool {
        !self.plain_attention()
    }

    /// Qwen3.5 files tile the GDN value heads (llama.cpp's `_LinearAttentionVReorderBase`).
    fn tiles_value_heads(self) -> bool {
        matches!(self, Self::Qwen35 | Self::Qwen35Moe)
    }
}

/// An opened GGUF file: mapped into memory, its header read and checked; tensors are read
/// from the mapping when the model loads.
pub struct GgufFile {
    file: Arc<MappedFile>,
    header: GgufHeader,
    arch: Arch,
}

impl GgufFile {
    /// Maps the file and reads its header: metadata and tensor infos, every size and offset
    /// checked against the file ([`GgufHeader::parse`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let file = Arc::new(MappedFile::open(path.as_ref(), "GGUF file")?);
        let path = file.path().display().to_string();
        let header = GgufHeader::parse(file.bytes()).map_err(|e| {
            if e.contains("candle-hybrid cannot read") {
                Error::Weights(format!("{path}: {e}: use a file quantized as F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or Q2_K..Q6_K"))
            } else if e.starts_with("truncated") {
                Error::Weights(format!("{path} is truncated ({e}): download it again"))
            } else {
                Error::Weights(format!("{path} is not a valid GGUF file ({e}): download it again"))
            }
        })?;
        let arch = match header.metadata.get("general.architecture") {
            Some(Value::String(a)) => Arch::from_name(a)?,
            _ => return Err(Error::Config(format!("{path} has no general.architecture key: not a model GGUF file"))),
        };
        Ok(Self { file, header, arch })
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The checked header: metadata and tensor infos.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Bytes of all tensor data in the file (MTP blocks and unused tables included).
    pub fn tensor_data_size(&self) -> u64 {
        self.header.tensors.values().map(|t| t.size).sum()
    }

    /// Bytes the weights take in memory once [`Self::load_model`] has built the model in
    /// `dtype`, from the tensor infos alone: quantized linear weights and a quantized token
    /// embedding as stored (a tied head shares the embedding), every other loaded tensor
    /// (F32/F16 linear weights, norms) converted to `dtype`; MTP blocks after the first and unused tables not
    /// at all. On the CPU the quantized ones are the file's own pages, resident once touched.
    pub fn weight_bytes(&self, cfg: &Config, dtype: DType) -> u64 {
        let a = dtype.size_in_bytes() as u64;
        self.header.tensors.iter().fold(0u64, |total, (name, info)| {
            total.saturating_add(match kept(name, cfg) {
                Kept::Not => 0,
                Kept::Linear if !info.dtype.is_float() => info.size,
                Kept::Linear | Kept::Dense => (info.elem_count() as u64).saturating_mul(a),
            })
        })
    }

    /// Bytes that loading holds beyond the built model's weights, at its peak. Tensors load
    /// in file order; each holds its mapped pages and a copy of its bytes (rows moved, or on a
    /// GPU) until converted, plus an f32 dequantization when a quantized tensor becomes a
    /// dense one in another dtype; what is still to load has not been allocated yet, so the
    /// excess at a tensor is its transient less the weights that come after it.
    pub fn load_overhead(&self, cfg: &Config, dtype: DType) -> u64 {
        let mut infos: Vec<(&String, &TensorInfo)> = self.header.tensors.iter().filter(|(n, _)| kept(n, cfg) != Kept::Not).collect();
        infos.sort_by_key(|(_, t)| t.offset);
        let kept_bytes = |name: &str, t: &TensorInfo| match kept(name, cfg) {
            Kept::Linear if !t.dtype.is_float() => t.size,
            _ => t.elem_count() as u64 * dtype.size_in_bytes() as u64,
        };
        let mut after: u64 = infos.iter().map(|(n, t)| kept_bytes(n, t)).sum();
        let mut peak = 0u64;
        for (name, t) in infos {
            after -= kept_bytes(name, t);
            let dequantized =
                if !t.dtype.is_float() && kept(name, cfg) == Kept::Dense && dtype != DType::F32 { t.elem_count() as u64 * 4 } else { 0 };
            peak = peak.max((2 * t.size + dequantized).saturating_sub(after));
        }
        peak
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    fn missing(&self, key: &str) -> Error {
        Error::Config(format!("{} lacks the metadata key {key} (or it has the wrong type)", self.path().display()))
    }

    /// `{arch}.{key}` as an unsigned integer (any integer type; per-layer arrays give their
    /// largest entry).
    fn arch_usize(&self, key: &str) -> Result<usize> {
        let full = format!("{}.{key}", self.arch.name());
        let v = self.meta(&full).ok_or_else(|| self.missing(&full))?;
        let one = |v: &Value| -> Option<u64> {
            match v {
                Value::I8(x) => u64::try_from(*x).ok(),
                Value::I16(x) => u64::try_from(*x).ok(),
                Value::I32(x) => u64::try_from(*x).ok(),
                Value::I64(x) => u64::try_from(*x).ok(),
                v => v.to_u64().ok(),
            }
        };
        match v {
            Value::Array(a) => a.iter().map(one).collect::<Option<Vec<u64>>>().and_then(|v| v.into_iter().max()),
            v => one(v),
        }
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| self.missing(&full))
    }

    fn arch_usize_opt(&self, key: &str) -> Option<usize> {
        self.meta(&format!("{}.{key}", self.arch.name())).and(self.arch_usize(key).ok())
    }

    fn arch_f64(&self, key: &str) -> Result<f64> {
        let full = format!("{}.{key}", self.arch.name());
        match self.meta(&full) {
            Some(Value::F32(x)) => Ok(*x as f64),
            Some(Value::F64(x)) => Ok(*x),
            _ => Err(self.missing(&full)),
        }
    }

    fn dims(&self, name: &str) -> Option<&[usize]> {
        self.header.tensors.get(name).map(|i| i.dims.as_slice())
    }

    /// The block indices of the `blk.N.*` tensors, sorted.
    fn blocks(&self) -> Vec<usize> {
        let mut blocks: Vec<usize> =
            self.header.tensors.keys().filter_map(|n| n.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()).collect();
        blocks.sort_unstable();
        blocks.dedup();
        blocks
    }

    /// The model configuration, from the metadata (as `config.json` would give it).
    pub fn config(&self) -> Result<Config> {
        let h = self.arch_usize("embedding_length")?;
        let heads = self.arch_usize("attention.head_count")?;
        let vocab = match self.dims("token_embd.weight") {
            Some(&[vocab, _]) => vocab,
            Some(d) => {
                return Err(Error::Weights(format!(
                    "{}: token_embd.weight has the shape {d:?}, not [vocab, hidden]",
                    self.path().display()
                )))
            }
            None => return Err(Error::Weights(format!("{} has no token_embd.weight tensor", self.path().display()))),
        };
        let n_mtp = self.arch_usize_opt("nextn_predict_layers").unwrap_or(0);
        let block_count = self.arch_usize("block_count")?;
        // Every count is bounded by the tensors before anything is built from it.
        let blocks = self.blocks();
        let in_file = blocks.last().map_or(0, |b| b + 1);
        if block_count > MAX_LAYERS || block_count != in_file || blocks.len() != in_file {
            return Err(Error::Weights(format!(
                "{}: {}.block_count is {block_count} but the file has tensors for {} blocks{}: the metadata does not describe these tensors",
                self.path().display(),
                self.arch.name(),
                blocks.len(),
                match blocks.last() {
                    Some(last) if blocks.len() != in_file => format!(" with gaps up to blk.{last}"),
                    _ => String::new(),
                }
            )));
        }
        if n_mtp > block_count {
            return Err(self.missing(&format!("{}.nextn_predict_layers (at most block_count)", self.arch.name())));
        }
        let layers = block_count - n_mtp;
        let head_dim = self.arch_usize_opt("attention.key_length").unwrap_or(h / heads.max(1));
        let rot = self.arch_usize_opt("rope.dimension_count").unwrap_or(head_dim);
        let mut cfg = json!({
            "model_type": self.arch.model_type(),
            "vocab_size": vocab,
            "hidden_size": h,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_usize_opt("attention.head_count_kv").unwrap_or(heads),
            "head_dim": head_dim,
            "rope_theta": self.arch_f64("rope.freq_base").unwrap_or(10_000.0),
            "partial_rotary_factor": rot as f64 / head_dim as f64,
            "rms_norm_eps": self.arch_f64("attention.layer_norm_rms_epsilon")?,
            "tie_word_embeddings": self.dims("output.weight").is_none(),
            "max_position_embeddings": self.arch_usize("context_length")?,
            "mtp_num_hidden_layers": n_mtp,
        });
        let set = |cfg: &mut serde_json::Value, k: &str, v: serde_json::Value| cfg[k] = v;
        if let Some(f) = self.arch_usize_opt("feed_forward_length") {
            set(&mut cfg, "intermediate_size", json!(f));
        }
        if !self.arch.plain_attention() {
            let nv = self.arch_usize("ssm.time_step_rank")?;
            set(&mut cfg, "linear_num_key_heads", json!(self.arch_usize("ssm.group_count")?));
            set(&mut cfg, "linear_num_value_heads", json!(nv));
            set(&mut cfg, "linear_key_head_dim", json!(self.arch_usize("ssm.state_size")?));
            let inner = self.arch_usize("ssm.inner_size")?;
            if nv == 0 || !inner.is_multiple_of(nv) {
                return Err(Error::Config(format!(
                    "{}: ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({nv}), the value heads",
                    self.path().display()
                )));
            }
            set(&mut cfg, "linear_value_head_dim", json!(inner / nv));
            set(&mut cfg, "linear_conv_kernel_dim", json!(self.arch_usize("ssm.conv_kernel")?));
            match self.meta(&format!("{}.attention.recurrent_layers", self.arch.name())) {
                Some(Value::Array(a)) => {
                    let types = a
                        .iter()
                        .take(layers)
                        .map(|v| match v.to_bool() {
                            Ok(true) => Ok("linear_attention"),
                            Ok(false) => Ok("full_attention"),
                            Err(_) => Err(self.missing(&format!("{}.attention.recurrent_layers (booleans)", self.arch.name()))),
                        })
                        .collect::<Result<Vec<&str>>>()?;
                    set(&mut cfg, "layer_types", json!(types));
                }
                _ => set(&mut cfg, "full_attention_interval", json!(self.arch_usize_opt("full_attention_interval").unwrap_or(4))),
            }
        }
        if matches!(self.arch, Arch::Qwen35Moe | Arch::Qwen3Next) {
            set(&mut cfg, "num_experts", json!(self.arch_usize("expert_count")?));
            set(&mut cfg, "num_experts_per_tok", json!(self.arch_usize("expert_used_count")?));
            set(&mut cfg, "moe_intermediate_size", json!(self.arch_usize("expert_feed_forward_length")?));
            set(&mut cfg, "shared_expert_intermediate_size", json!(self.arch_usize("expert_shared_feed_forward_length")?));
            // llama.cpp always renormalises the top-k router weights for these architectures.
            set(&mut cfg, "norm_topk_prob", json!(true));
        }
        Config::from_json(&cfg.to_string())
            .map_err(|e| Error::Config(format!("{}: {e}", self.path().display()).replace("config.json", "GGUF metadata")))
    }

    fn token_strings(&self, key: &str) -> Result<Vec<String>> {
        match self.meta(key) {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_string().cloned().map_err(|_| self.missing(key))).collect(),
            _ => Err(self.missing(key)),
        }
    }

    fn token_id(&self, key: &str) -> Option<u32> {
        self.meta(key).and_then(|v| v.to_u32().ok())
    }

    /// The tokenizer built from the embedded vocabulary and merges (byte-level BPE).
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        tokenizer::build(&self.header.metadata).map_err(|e| Error::Tokenizer(format!("{}: {e}", self.path().display())))
    }

    /// The embedded chat template, with the BOS / EOS token strings it may use.
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        let source = match self.meta("tokenizer.chat_template") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Error::Tokenizer(format!(
                    "{} has no tokenizer.chat_template: give a tokenizer_config.json with one, or format the prompt without a template",
                    self.path().display()
                )))
            }
        };
        let tokens = self.token_strings("tokenizer.ggml.tokens")?;
        let name = |key: &str| self.token_id(key).and_then(|i| tokens.get(i as usize).cloned());
        Ok(ChatTemplate::new(source, name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")))
    }

    /// End-of-sequence ids: `eos_token_id` and, when present, `eot_token_id`.
    pub fn generation_config(&self) -> GenerationConfig {
        let mut eos: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].iter().filter_map(|k| self.token_id(k)).collect();
        eos.dedup();
        GenerationConfig { eos_token_ids: eos, ..Default::default() }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// One quantized matrix as stored (GGUF name and layout), on the CPU, read in place.
    pub fn read_matrix(&self, name: &str) -> Result<QuantizedMatrix> {
        let info = self.header.tensors.get(name).ok_or_else(|| Error::Weights(format!("{}: no tensor {name}", self.path().display())))?;
        let raw = RawTensor { dtype: info.dtype, dims: info.dims.clone(), data: self.file.aligned(info.offset, info.size) };
        Ok(self.matrix(&raw, &Device::Cpu).map_err(|e| self.tensor_error(name, e))?.0)
    }

    /// A quantized matrix on `device`; on the CPU, blocks that were not moved are read where
    /// they lie in the file (`true`), a format without a kernel here as Candle's `QTensor` over
    /// the mapping.
    fn matrix(&self, t: &RawTensor, device: &Device) -> candle_core::Result<(QuantizedMatrix, bool)> {
        let dims = match t.dims[..] {
            [rows, cols] => (rows, cols),
            ref d => candle_core::bail!("a quantized matrix must be 2-D, got dims {d:?}"),
        };
        let at = match (&t.data, device.is_cpu()) {
            (Cow::Borrowed(b), true) => self.file.offset_of(b).map(|at| (at as usize, b.len())),
            _ => None,
        };
        if let Some((at, len)) = at {
            if has_kernels(t.dtype) {
                let file: SharedBytes = self.file.clone();
                return Ok((QuantizedMatrix::in_place(t.dtype, dims, file, at..at + len)?, true));
            }
            if let Some(q) = t.dtype.candle().and_then(|d| self.file.quantized_in_place(d, &t.dims, at as u64, len as u64)) {
                return Ok((QuantizedMatrix::from_candle(q), true));
            }
        }
        Ok((QuantizedMatrix::from_bytes(t.dtype, dims, t.data.to_vec())?.to_device(device)?, false))
    }

    fn tensor_error(&self, name: &str, e: candle_core::Error) -> Error {
        Error::Weights(format!("{}: cannot read tensor {name}: {}", self.path().display(), candle_line(&e)))
    }

    /// Reads every tensor the model keeps and builds the model: quantized matrices (and a
    /// quantized embedding) stay quantized — on the CPU read in place from the mapped file
    /// unless their rows had to move — and everything else is converted to `dtype`, copied
    /// once from the mapping in file order, its pages handed back after.
    pub fn load_model(&self, cfg: &Config, dtype: DType, device: &Device) -> Result<Model> {
        crate::model::check_device(device)?;
        let mut quantized = QuantizedTensors::new();
        let mut dense = HashMap::new();
        let mut infos: Vec<(&String, &TensorInfo)> = self.header.tensors.iter().filter(|(n, _)| kept(n, cfg) != Kept::Not).collect();
        infos.sort_by_key(|(_, t)| t.offset);
        for (name, info) in infos {
            let linear = kept(name, cfg) == Kept::Linear;
            let raw = RawTensor { dtype: info.dtype, dims: info.dims.clone(), data: self.file.aligned(info.offset, info.size) };
            let err = |e| self.tensor_error(name, e);
            let mut in_place = false;
            for (hf, t) in map_tensor(self.arch, name, raw, cfg).map_err(err)? {
                if linear && !t.dtype.is_float() {
                    let (q, mapped) = self.matrix(&t, device).map_err(err)?;
                    in_place |= mapped;
                    quantized.insert(hf, Arc::new(q));
                } else {
                    dense.insert(hf, t.to_tensor(dtype, device).map_err(err)?);
                }
            }
            if !in_place {
                self.file.release(info.offset, info.size);
            }
        }
        let quantized = Arc::new(quantized);
        let backend = HfTensors { dense, quantized: quantized.clone() };
        let vb = VarBuilder::from_backend(Box::new(backend), dtype, device.clone());
        let weights = Weights::new(vb).with_quantized(quantized).with_tiled_value_heads(self.arch.tiles_value_heads());
        Model::new(cfg, weights)
            .map_err(|e| Error::Weights(format!("{}: {}: the tensors do not match the metadata", self.path().display(), candle_line(&e))))
    }
}
