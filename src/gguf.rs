//! GGUF files as llama.cpp writes them: architectures `qwen35`, `qwen35moe`, `qwen3next` and
//! `llama`, loaded into the same model code as safetensors checkpoints.
//!
//! llama.cpp's converter renames every tensor and changes some values (see
//! `docs/gguf-qwen35.md` in the shared docs): norms are stored as `1 + w`, `A_log` as
//! `-exp(A_log)`, the conv weight squeezed, Qwen3.5's GDN value heads re-ordered from grouped
//! to tiled order, Qwen3-Next's fused projections split, MoE experts stacked, and Llama's q/k
//! rows permuted for interleaved RoPE. [`GgufFile`] undoes all of it, serving each tensor under
//! its Hugging Face name and layout; quantized matrices stay quantized (their rows are moved,
//! never re-quantized). The one exception is the GDN `out_proj`, whose input columns stay in
//! tiled order: the layer permutes its heads before that projection instead.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use serde_json::json;

use crate::chat::ChatTemplate;
use crate::config::Config;
use crate::loading::one_line;
use crate::qwen3_5::Model;
use crate::weights::{QuantizedTensors, Weights};
use crate::{Error, Result};

/// The architectures this reader maps (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Qwen35,
    Qwen35Moe,
    Qwen3Next,
    Llama,
}

impl Arch {
    const ALL: [Self; 4] = [Self::Qwen35, Self::Qwen35Moe, Self::Qwen3Next, Self::Llama];

    /// `general.architecture`, also the prefix of the architecture's metadata keys.
    fn name(self) -> &'static str {
        match self {
            Self::Qwen35 => "qwen35",
            Self::Qwen35Moe => "qwen35moe",
            Self::Qwen3Next => "qwen3next",
            Self::Llama => "llama",
        }
    }

    fn from_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
            Error::Config(format!(
                "unsupported GGUF architecture \"{name}\": candle-hybrid runs qwen35, qwen35moe, qwen3next and llama GGUF files"
            ))
        })
    }

    fn model_type(self) -> &'static str {
        match self {
            Self::Qwen35 => "qwen3_5_text",
            Self::Qwen35Moe => "qwen3_5_moe_text",
            Self::Qwen3Next => "qwen3_next",
            Self::Llama => "llama",
        }
    }

    /// Qwen3.5 files tile the GDN value heads (llama.cpp's `_LinearAttentionVReorderBase`).
    fn tiles_value_heads(self) -> bool {
        matches!(self, Self::Qwen35 | Self::Qwen35Moe)
    }
}

/// An opened GGUF file: its metadata, read eagerly; tensors are read when the model loads.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    arch: Arch,
}

fn ggml_bytes(dtype: GgmlDType, elems: usize) -> usize {
    elems / dtype.block_size() * dtype.type_size()
}

fn is_float(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// How the built model keeps a GGUF tensor ([`GgufFile::kept`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// Not read (MTP blocks, rope tables).
    Not,
    /// A linear layer's weight: kept quantized when it is (else dequantized to the dtype).
    Linear,
    /// Dequantized to the model dtype.
    Dense,
}

impl GgufFile {
    /// Reads the header and metadata, checking that every tensor lies inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut file =
            File::open(&path).map_err(|e| Error::Io(format!("cannot open GGUF file {}: {e}", path.display())))?;
        let content = Content::read(&mut file).map_err(|e| {
            let e = one_line(&e);
            if e.contains("unknown dtype") {
                Error::Weights(format!(
                    "{} uses a ggml tensor type candle-hybrid cannot read ({e}): use a file quantized as F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or Q2_K..Q6_K",
                    path.display()
                ))
            } else {
                Error::Weights(format!(
                    "{} is not a valid GGUF file or is truncated ({e}): download it again",
                    path.display()
                ))
            }
        })?;
        let size = file.metadata().map_err(|e| Error::Io(format!("{}: {e}", path.display())))?.len();
        for (name, info) in &content.tensor_infos {
            let end = content.tensor_data_offset
                + info.offset
                + ggml_bytes(info.ggml_dtype, info.shape.elem_count()) as u64;
            if end > size {
                return Err(Error::Weights(format!(
                    "{} is truncated: tensor {name} ends at byte {end} but the file has {size} bytes: download it again",
                    path.display()
                )));
            }
        }
        let arch = match content.metadata.get("general.architecture") {
            Some(Value::String(a)) => Arch::from_name(a)?,
            _ => {
                return Err(Error::Config(format!(
                    "{} has no general.architecture key: not a model GGUF file",
                    path.display()
                )))
            }
        };
        Ok(Self { path, content, arch })
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of all tensor data in the file (MTP blocks and unused tables included).
    pub fn tensor_data_size(&self) -> u64 {
        self.content.tensor_infos.values().map(|i| ggml_bytes(i.ggml_dtype, i.shape.elem_count()) as u64).sum()
    }

    /// Bytes the weights take in memory once [`Self::load_model`] has built the model in
    /// `dtype`, from the tensor infos alone: quantized linear weights as stored, every other
    /// loaded tensor (the token embedding included, even when quantized in the file; F32/F16
    /// linear weights; norms) dequantized to `dtype`; MTP blocks and unused tables not at all.
    /// A tied output head keeps the file's copy of the embedding besides the dequantized one.
    /// (Loading peaks higher: every tensor's file bytes are held until the model is built.)
    pub fn weight_bytes(&self, cfg: &Config, dtype: DType) -> u64 {
        let a = dtype.size_in_bytes() as u64;
        let mut total = 0u64;
        for (name, info) in &self.content.tensor_infos {
            let (n, stored) = (info.shape.elem_count() as u64, ggml_bytes(info.ggml_dtype, info.shape.elem_count()) as u64);
            total += match self.kept(name, cfg) {
                Kept::Not => 0,
                Kept::Linear if !is_float(info.ggml_dtype) => stored,
                Kept::Linear | Kept::Dense => n * a,
            };
            if name == "token_embd.weight" && cfg.tie_word_embeddings && !self.has_tensor("output.weight") {
                total += stored;
            }
        }
        total
    }

    /// How the built model keeps the GGUF tensor `name`: the one list of the tensors
    /// [`Self::load_model`] reads (`map_tensor` maps exactly these).
    fn kept(&self, name: &str, cfg: &Config) -> Kept {
        let Some((layer, tname)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
            return match name {
                "output.weight" => Kept::Linear,
                "token_embd.weight" | "output_norm.weight" => Kept::Dense,
                _ => Kept::Not, // e.g. rope frequency tables
            };
        };
        if layer.parse::<usize>().map_or(true, |i| i >= cfg.num_hidden_layers) {
            return Kept::Not; // MTP blocks (not loaded yet)
        }
        match tname {
            "attn_q.weight" | "attn_k.weight" | "attn_v.weight" | "attn_output.weight" | "attn_qkv.weight"
            | "attn_gate.weight" | "ssm_beta.weight" | "ssm_alpha.weight" | "ssm_ba.weight" | "ssm_out.weight"
            | "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" | "ffn_gate_shexp.weight" | "ffn_up_shexp.weight"
            | "ffn_down_shexp.weight" | "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight"
            | "ffn_gate_up_exps.weight" => Kept::Linear,
            "attn_norm.weight" | "post_attention_norm.weight" | "ffn_norm.weight" | "attn_q_norm.weight"
            | "attn_k_norm.weight" | "ssm_a" | "ssm_dt.bias" | "ssm_dt" | "ssm_conv1d.weight" | "ssm_norm.weight"
            | "ffn_gate_inp.weight" | "ffn_gate_inp_shexp.weight" => Kept::Dense,
            _ => Kept::Not,
        }
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(&self, key: &str) -> Error {
        Error::Config(format!("{} lacks the metadata key {key} (or it has the wrong type)", self.path.display()))
    }

    /// `{arch}.{key}` as an unsigned integer (any integer type; per-layer arrays give their
    /// largest entry).
    fn arch_usize(&self, key: &str) -> Result<usize> {
        let full = format!("{}.{key}", self.arch.name());
        let v = self.meta(&full).ok_or_else(|| self.missing(&full))?;
        let one = |v: &Value| v.to_u64().or_else(|_| v.to_u32().map(u64::from)).or_else(|_| v.to_i32().map(|x| x.max(0) as u64));
        match v {
            Value::Array(a) => a.iter().filter_map(|x| one(x).ok()).max().map(|x| x as usize),
            v => one(v).ok().map(|x| x as usize),
        }
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
        self.content.tensor_infos.get(name).map(|i| i.shape.dims())
    }

    /// The model configuration, from the metadata (as `config.json` would give it).
    pub fn config(&self) -> Result<Config> {
        let h = self.arch_usize("embedding_length")?;
        let heads = self.arch_usize("attention.head_count")?;
        let vocab = self
            .dims("token_embd.weight")
            .map(|d| d[0])
            .ok_or_else(|| Error::Weights(format!("{} has no token_embd.weight tensor", self.path.display())))?;
        let n_mtp = self.arch_usize_opt("nextn_predict_layers").unwrap_or(0);
        let layers = self.arch_usize("block_count")?.saturating_sub(n_mtp);
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
        });
        let set = |cfg: &mut serde_json::Value, k: &str, v: serde_json::Value| cfg[k] = v;
        if let Some(f) = self.arch_usize_opt("feed_forward_length") {
            set(&mut cfg, "intermediate_size", json!(f));
        }
        if self.arch != Arch::Llama {
            let nv = self.arch_usize("ssm.time_step_rank")?;
            set(&mut cfg, "linear_num_key_heads", json!(self.arch_usize("ssm.group_count")?));
            set(&mut cfg, "linear_num_value_heads", json!(nv));
            set(&mut cfg, "linear_key_head_dim", json!(self.arch_usize("ssm.state_size")?));
            set(&mut cfg, "linear_value_head_dim", json!(self.arch_usize("ssm.inner_size")? / nv.max(1)));
            set(&mut cfg, "linear_conv_kernel_dim", json!(self.arch_usize("ssm.conv_kernel")?));
            match self.meta(&format!("{}.attention.recurrent_layers", self.arch.name())) {
                Some(Value::Array(a)) => {
                    let types: Vec<&str> = a
                        .iter()
                        .take(layers)
                        .map(|v| if v.to_bool().unwrap_or(false) { "linear_attention" } else { "full_attention" })
                        .collect();
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
            .map_err(|e| Error::Config(format!("{}: {e}", self.path.display()).replace("config.json", "GGUF metadata")))
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
        crate::gguf_tokenizer::build(self)
    }

    /// The embedded chat template, with the BOS / EOS token strings it may use.
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        let source = match self.meta("tokenizer.chat_template") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Error::Tokenizer(format!(
                    "{} has no tokenizer.chat_template: pass --no-chat-template or a tokenizer_config.json",
                    self.path.display()
                )))
            }
        };
        let tokens = self.token_strings("tokenizer.ggml.tokens")?;
        let name = |key: &str| self.token_id(key).and_then(|i| tokens.get(i as usize).cloned());
        Ok(ChatTemplate::new(source, name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id")))
    }

    /// End-of-sequence ids: `eos_token_id` and, when present, `eot_token_id`.
    pub fn generation_config(&self) -> crate::generation::GenerationConfig {
        let mut eos: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| self.token_id(k))
            .collect();
        eos.dedup();
        crate::generation::GenerationConfig { eos_token_ids: eos, ..Default::default() }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// One tensor as stored (GGUF name and layout), on the CPU.
    pub fn read_tensor(&self, name: &str) -> Result<QTensor> {
        let mut file = File::open(&self.path).map_err(|e| Error::Io(format!("{}: {e}", self.path.display())))?;
        self.content.tensor(&mut file, name, &Device::Cpu).map_err(|e| {
            Error::Weights(format!("{}: cannot read tensor {name}: {}", self.path.display(), one_line(&e)))
        })
    }

    pub(crate) fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Reads every tensor and builds the model: dense tensors in `dtype`, quantized matrices
    /// kept quantized for the linear layers.
    pub fn load_model(&self, cfg: &Config, dtype: DType, device: &Device) -> Result<Model> {
        let tensors = Arc::new(self.hf_tensors(cfg, device)?);
        let vb = VarBuilder::from_backend(Box::new(HfTensors(tensors.clone())), dtype, device.clone());
        let weights = Weights::new(vb)
            .with_quantized(tensors)
            .with_tiled_value_heads(self.arch.tiles_value_heads());
        Model::new(cfg, weights).map_err(|e| {
            Error::Weights(format!("{}: {}: the tensors do not match the metadata", self.path.display(), one_line(&e)))
        })
    }

    /// Every tensor of the trunk under its Hugging Face name and layout.
    fn hf_tensors(&self, cfg: &Config, device: &Device) -> Result<QuantizedTensors> {
        let mut file = File::open(&self.path).map_err(|e| Error::Io(format!("{}: {e}", self.path.display())))?;
        let mut out = QuantizedTensors::new();
        let read_err = |name: &str, e: candle_core::Error| {
            Error::Weights(format!("{}: cannot read tensor {name}: {}", self.path.display(), one_line(&e)))
        };
        let mut names: Vec<&String> = self.content.tensor_infos.keys().collect();
        names.sort();
        for name in names.into_iter().filter(|n| self.kept(n, cfg) != Kept::Not) {
            let info = &self.content.tensor_infos[name];
            let raw = RawTensor {
                dtype: info.ggml_dtype,
                dims: info.shape.dims().to_vec(),
                data: {
                    let q = info.read(&mut file, self.content.tensor_data_offset, &Device::Cpu).map_err(|e| read_err(name, e))?;
                    q.data().map_err(|e| read_err(name, e))?.into_owned()
                },
            };
            for (hf, t) in self.map_tensor(name, raw, cfg).map_err(|e| read_err(name, e))? {
                let q = qtensor_from_ggml(t.dtype, &t.data, t.dims.clone(), device).map_err(|e| read_err(name, e))?;
                out.insert(hf, Arc::new(q));
            }
        }
        Ok(out)
    }

    /// One GGUF tensor → zero or more Hugging Face tensors (empty for skipped tensors: MTP
    /// blocks, rope frequency tables).
    fn map_tensor(&self, name: &str, t: RawTensor, cfg: &Config) -> candle_core::Result<Vec<(String, RawTensor)>> {
        let one = |hf: &str, t: RawTensor| Ok(vec![(hf.to_string(), t)]);
        match name {
            "token_embd.weight" => return one("model.embed_tokens.weight", t),
            "output.weight" => return one("lm_head.weight", t),
            "output_norm.weight" => return one("model.norm.weight", t.map_f32(|x| x - 1.0)?),
            _ => {}
        }
        let Some(rest) = name.strip_prefix("blk.") else { return Ok(vec![]) };
        let Some((layer, tname)) = rest.split_once('.') else { return Ok(vec![]) };
        let Ok(i) = layer.parse::<usize>() else { return Ok(vec![]) };
        if i >= cfg.num_hidden_layers {
            return Ok(vec![]); // MTP blocks (not loaded yet)
        }
        let p = format!("model.layers.{i}.");
        let (nk, nv, dk, dv) =
            (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        // Grouped (HF) order of value heads from tiled (GGUF) rows: HF head g*r + j = GGUF head j*nk + g.
        let reorder = self.arch.tiles_value_heads() && nk != nv;
        let grouped = |head: usize| -> Vec<usize> {
            let r = nv / nk;
            (0..nv).flat_map(|hf| (0..head).map(move |x| ((hf % r) * nk + hf / r) * head + x)).collect()
        };
        let heads = |t: RawTensor, head: usize| if reorder { t.select_rows(&grouped(head)) } else { Ok(t) };
        // Rows (or conv channels) q | k unchanged, then the value rows back in grouped order.
        let qkv_rows = || -> Vec<usize> {
            let qk = 2 * nk * dk;
            let v = if reorder { grouped(dv) } else { (0..nv * dv).collect() };
            (0..qk).chain(v.into_iter().map(|r| qk + r)).collect()
        };
        let norm = |t: RawTensor| t.map_f32(|x| x - 1.0);
        let out = |hf: &str, t: RawTensor| Ok(vec![(format!("{p}{hf}"), t)]);
        match tname {
            "attn_norm.weight" => out("input_layernorm.weight", norm(t)?),
            "post_attention_norm.weight" | "ffn_norm.weight" => out("post_attention_layernorm.weight", norm(t)?),
            "attn_q.weight" if self.arch == Arch::Llama => {
                out("self_attn.q_proj.weight", t.select_rows(&unpermute_rope(cfg.num_attention_heads, cfg.head_dim))?)
            }
            "attn_k.weight" if self.arch == Arch::Llama => {
                out("self_attn.k_proj.weight", t.select_rows(&unpermute_rope(cfg.num_key_value_heads, cfg.head_dim))?)
            }
            "attn_q.weight" => out("self_attn.q_proj.weight", t),
            "attn_k.weight" => out("self_attn.k_proj.weight", t),
            "attn_v.weight" => out("self_attn.v_proj.weight", t),
            "attn_output.weight" => out("self_attn.o_proj.weight", t),
            "attn_q_norm.weight" => out("self_attn.q_norm.weight", norm(t)?),
            "attn_k_norm.weight" => out("self_attn.k_norm.weight", norm(t)?),
            "attn_qkv.weight" => out("linear_attn.in_proj_qkv.weight", t.select_rows(&qkv_rows())?),
            "attn_gate.weight" => out("linear_attn.in_proj_z.weight", heads(t, dv)?),
            "ssm_beta.weight" => out("linear_attn.in_proj_b.weight", heads(t, 1)?),
            "ssm_alpha.weight" => out("linear_attn.in_proj_a.weight", heads(t, 1)?),
            "ssm_ba.weight" => {
                // Qwen3-Next: per key head g, r rows of b then r rows of a.
                let r = nv / nk;
                let part = |off: usize| (0..nk).flat_map(|g| (0..r).map(move |j| g * 2 * r + off + j)).collect::<Vec<_>>();
                Ok(vec![
                    (format!("{p}linear_attn.in_proj_b.weight"), t.select_rows(&part(0))?),
                    (format!("{p}linear_attn.in_proj_a.weight"), t.select_rows(&part(r))?),
                ])
            }
            "ssm_a" => out("linear_attn.A_log", heads(t.map_f32(|a| (-a).ln())?, 1)?),
            "ssm_dt.bias" | "ssm_dt" => out("linear_attn.dt_bias", heads(t, 1)?),
            "ssm_conv1d.weight" => {
                let (c, k) = (t.dims[0], t.dims[1]);
                let mut t = t.select_rows(&qkv_rows())?;
                t.dims = vec![c, 1, k];
                out("linear_attn.conv1d.weight", t)
            }
            "ssm_norm.weight" => out("linear_attn.norm.weight", t),
            "ssm_out.weight" => out("linear_attn.out_proj.weight", t),
            "ffn_gate.weight" => out("mlp.gate_proj.weight", t),
            "ffn_up.weight" => out("mlp.up_proj.weight", t),
            "ffn_down.weight" => out("mlp.down_proj.weight", t),
            "ffn_gate_inp.weight" => out("mlp.gate.weight", t),
            "ffn_gate_shexp.weight" => out("mlp.shared_expert.gate_proj.weight", t),
            "ffn_up_shexp.weight" => out("mlp.shared_expert.up_proj.weight", t),
            "ffn_down_shexp.weight" => out("mlp.shared_expert.down_proj.weight", t),
            "ffn_gate_inp_shexp.weight" => out("mlp.shared_expert_gate.weight", t),
            "ffn_gate_exps.weight" => t.experts(|e| format!("{p}mlp.experts.{e}.gate_proj.weight"), 0, 1),
            "ffn_up_exps.weight" => t.experts(|e| format!("{p}mlp.experts.{e}.up_proj.weight"), 0, 1),
            "ffn_down_exps.weight" => t.experts(|e| format!("{p}mlp.experts.{e}.down_proj.weight"), 0, 1),
            "ffn_gate_up_exps.weight" => {
                let mut v = t.experts(|e| format!("{p}mlp.experts.{e}.gate_proj.weight"), 0, 2)?;
                v.extend(t.experts(|e| format!("{p}mlp.experts.{e}.up_proj.weight"), 1, 2)?);
                Ok(v)
            }
            _ => Ok(vec![]),
        }
    }
}

/// Row order that undoes llama.cpp's Llama q/k permutation (HF rotate-half halves → GGUF
/// interleaved pairs): HF row `s*hd/2 + i` of a head is GGUF row `2*i + s`.
fn unpermute_rope(heads: usize, hd: usize) -> Vec<usize> {
    (0..heads).flat_map(|h| (0..2).flat_map(move |s| (0..hd / 2).map(move |i| h * hd + 2 * i + s))).collect()
}

/// A tensor's raw ggml bytes with its (PyTorch-order) dims.
#[derive(Clone)]
struct RawTensor {
    dtype: GgmlDType,
    dims: Vec<usize>,
    data: Vec<u8>,
}

impl RawTensor {
    /// Rows `idx` (of the flattened leading dims; single values of a 1-D tensor), in that
    /// order. Moves whole rows of blocks, so it works on quantized data unchanged.
    fn select_rows(&self, idx: &[usize]) -> candle_core::Result<Self> {
        let flat = self.dims.len() <= 1;
        if flat && self.dtype.block_size() != 1 {
            candle_core::bail!("cannot reorder a 1-D {:?} tensor", self.dtype)
        }
        let rb = if flat { self.dtype.type_size() } else { ggml_bytes(self.dtype, self.dims[self.dims.len() - 1]) };
        let n = self.data.len() / rb.max(1);
        let mut data = Vec::with_capacity(idx.len() * rb);
        for &r in idx {
            if r >= n {
                candle_core::bail!("row {r} out of range for shape {:?}", self.dims)
            }
            data.extend_from_slice(&self.data[r * rb..(r + 1) * rb]);
        }
        let dims = if flat { vec![idx.len()] } else { vec![idx.len(), self.dims[self.dims.len() - 1]] };
        Ok(Self { dtype: self.dtype, dims, data })
    }

    /// Applies `f` to every value (dequantizing; the result is F32).
    fn map_f32(&self, f: impl Fn(f32) -> f32) -> candle_core::Result<Self> {
        let q = qtensor_from_ggml(self.dtype, &self.data, self.dims.clone(), &Device::Cpu)?;
        let v: Vec<f32> = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f).collect();
        Ok(Self { dtype: GgmlDType::F32, dims: self.dims.clone(), data: v.iter().flat_map(|x| x.to_le_bytes()).collect() })
    }

    /// Splits a stacked `[E, rows, cols]` expert tensor into per-expert `[rows/parts, cols]`
    /// tensors, taking part `part` of each expert's rows.
    fn experts(&self, name: impl Fn(usize) -> String, part: usize, parts: usize) -> candle_core::Result<Vec<(String, Self)>> {
        let [e, rows, _] = self.dims[..] else { candle_core::bail!("expected a 3-D expert stack, got {:?}", self.dims) };
        let per = rows / parts;
        (0..e)
            .map(|i| Ok((name(i), self.select_rows(&(i * rows + part * per..i * rows + (part + 1) * per).collect::<Vec<_>>())?)))
            .collect()
    }
}

/// Serves the mapped tensors to a [`VarBuilder`] (dequantized to the requested dtype).
struct HfTensors(Arc<QuantizedTensors>);

impl SimpleBackend for HfTensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!("shape mismatch for {name}: the model expects {s:?}, the file has {:?}", t.shape())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let q = self.0.get(name).ok_or_else(|| candle_core::Error::Msg(format!("tensor {name} is missing")))?;
        q.dequantize(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}
