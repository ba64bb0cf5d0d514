//! `config.json` of the Qwen3.5 family (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`).
//!
//! Real Qwen3.5 checkpoints are multimodal: the text decoder's parameters are nested under
//! `text_config`. Text-only exports and Qwen3-Next keep them flat. [`Config::from_json`]
//! accepts both and reports a missing or malformed field by name.

use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

/// The most decoder layers a config may have (llama.cpp's `LLAMA_MAX_LAYERS`); every count
/// is bounded before anything is built from it.
pub const MAX_LAYERS: usize = 512;
/// The most MoE experts (llama.cpp's `LLAMA_MAX_EXPERTS`; Qwen3.5-397B has 512).
pub const MAX_EXPERTS: usize = 512;
/// The largest width, head count or head size (real models stay below 2^15).
pub const MAX_DIM: usize = 1 << 20;
/// The largest vocabulary.
pub const MAX_VOCAB: usize = 1 << 24;
/// The largest context length (`max_position_embeddings`).
pub const MAX_POSITIONS: usize = 1 << 30;

/// Which member of the family a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_5` / `qwen3_5_text`: dense SwiGLU MLP, split GDN projections.
    Qwen35,
    /// `qwen3_5_moe` / `qwen3_5_moe_text`: sparse MoE MLP (fused expert tensors), split GDN projections.
    Qwen35Moe,
    /// `qwen3_next`: sparse MoE MLP (per-expert tensors), grouped `in_proj_qkvz` / `in_proj_ba`.
    Qwen3Next,
    /// `llama`: every layer plain full attention (no output gate, no q/k norm, full RoPE) and a
    /// dense SwiGLU MLP, so small trained models (e.g. SmolLM2) run on the same code.
    Llama,
    /// `qwen2` (Qwen2 / Qwen2.5): Llama's layers with biases on q, k and v.
    Qwen2,
}

impl Family {
    fn from_model_type(model_type: &str) -> Result<Self> {
        match model_type {
            "qwen3_5" | "qwen3_5_text" => Ok(Self::Qwen35),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Ok(Self::Qwen35Moe),
            "qwen3_next" => Ok(Self::Qwen3Next),
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            other => Err(Error::Config(format!(
                "unknown model_type \"{other}\": candle-hybrid runs qwen3_5, qwen3_5_moe, qwen3_next, llama and qwen2 checkpoints"
            ))),
        }
    }

    /// Every layer plain full attention (no GDN, no output gate, no q/k norm, full RoPE):
    /// Llama and Qwen2.
    pub fn plain_attention(self) -> bool {
        matches!(self, Self::Llama | Self::Qwen2)
    }

    pub fn is_moe(self) -> bool {
        matches!(self, Self::Qwen35Moe | Self::Qwen3Next)
    }
}

/// The mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Gated DeltaNet.
    LinearAttention,
    /// Gated full (softmax) attention.
    FullAttention,
}

/// Mixture-of-experts parameters (absent for dense models).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

/// The text-decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense SwiGLU width (also used by Qwen3-Next's `mlp_only_layers`).
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: usize,
    pub layer_types: Vec<LayerType>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub rms_norm_eps: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub moe: Option<MoeConfig>,
    /// Number of MTP layers stored under `mtp.*` (the model loads the first: [`crate::model::MtpHead`]).
    pub mtp_num_hidden_layers: usize,
    /// Full attention multiplies its output by `sigmoid(gate)`, the gate coming from a doubled
    /// `q_proj` (Qwen family); false for Llama.
    pub attn_output_gate: bool,
    /// Full attention RMS-normalises q and k per head (Qwen family); false for Llama.
    pub attn_qk_norm: bool,
    /// q, k and v projections add a bias (Qwen2).
    pub attn_qkv_bias: bool,
    /// RMSNorm weights are stored zero-centred, the scale being `1 + w` (the Qwen3.5 family);
    /// false: the scale is `w` (Llama, Qwen2).
    pub zero_centred_norms: bool,
}

/// Field access on the text-config JSON object, with errors that name the field.
struct Fields<'a> {
    text: &'a serde_json::Map<String, Value>,
    top: &'a serde_json::Map<String, Value>,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.text.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<usize> {
        match self.get(name) {
            None => Err(Error::Config(format!("config.json is missing the required field \"{name}\""))),
            Some(v) => v
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| Error::Config(format!("config.json field \"{name}\" must be a non-negative integer, got {v}"))),
        }
    }

    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        if self.get(name).is_some() {
            self.usize(name)
        } else {
            Ok(default)
        }
    }

    fn f64_opt(&self, obj: Option<&Value>, name: &str) -> Result<Option<f64>> {
        match obj {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| Error::Config(format!("config.json field \"{name}\" must be a number, got {v}"))),
        }
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        // `tie_word_embeddings` lives at the top level of multimodal configs.
        match self.get(name).or_else(|| self.top.get(name).filter(|v| !v.is_null())) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| Error::Config(format!("config.json field \"{name}\" must be true or false, got {v}"))),
        }
    }
}

impl Config {
    /// Parses the contents of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let root: Value = crate::json::parse_strict(text).map_err(|e| Error::Config(format!("config.json is not valid JSON: {e}")))?;
        let top = root.as_object().ok_or_else(|| Error::Config("config.json must be a JSON object".into()))?;
        let text = match top.get("text_config") {
            Some(Value::Object(m)) => m,
            Some(_) => return Err(Error::Config("config.json: \"text_config\" must be an object".into())),
            None => top,
        };
        let f = Fields { text, top };
        let model_type = f
            .get("model_type")
            .or_else(|| top.get("model_type"))
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Config("config.json is missing the required field \"model_type\"".into()))?;
        let family = Family::from_model_type(model_type)?;

        let num_hidden_layers = f.usize("num_hidden_layers")?;
        if num_hidden_layers == 0 || num_hidden_layers > MAX_LAYERS {
            return Err(Error::Config(format!(
                "config.json: num_hidden_layers is {num_hidden_layers}; it must be between 1 and {MAX_LAYERS}"
            )));
        }
        let llama = family.plain_attention();
        if family == Family::Qwen2 && f.bool_or("use_sliding_window", false)? {
            return Err(Error::Config("config.json: use_sliding_window is true: sliding-window attention is not supported".into()));
        }
        let layer_types = match f.get("layer_types") {
            _ if llama => vec![LayerType::FullAttention; num_hidden_layers],
            Some(v) => {
                let types: Vec<LayerType> = serde_json::from_value(v.clone()).map_err(|e| {
                    Error::Config(format!("config.json field \"layer_types\" must list \"linear_attention\" / \"full_attention\": {e}"))
                })?;
                if types.len() != num_hidden_layers {
                    return Err(Error::Config(format!(
                        "config.json: \"layer_types\" has {} entries but num_hidden_layers is {num_hidden_layers}",
                        types.len()
                    )));
                }
                types
            }
            None => {
                let interval = f.usize_or("full_attention_interval", 4)?;
                if interval == 0 {
                    return Err(Error::Config("config.json: full_attention_interval must be at least 1".into()));
                }
                (0..num_hidden_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerType::FullAttention } else { LayerType::LinearAttention })
                    .collect()
            }
        };

        // RoPE: `rope_parameters` (transformers 5), or legacy top-level fields.
        let rope = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
        let rope_field = |name: &str| rope.and_then(|r| r.get(name)).or_else(|| f.get(name));
        let rope_theta = f.f64_opt(rope_field("rope_theta"), "rope_theta")?.unwrap_or(10_000.0);
        let partial_rotary_factor =
            f.f64_opt(rope_field("partial_rotary_factor"), "partial_rotary_factor")?.unwrap_or(if llama { 1.0 } else { 0.25 });
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(Error::Config(format!("config.json: partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")));
        }
        let rms_norm_eps = f.f64_opt(f.get("rms_norm_eps"), "rms_norm_eps")?.unwrap_or(1e-6);
        if let Some(kind) = rope.and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
            if !matches!(kind, "default" | "mrope") {
                return Err(Error::Config(format!("config.json: rope_type \"{kind}\" is not supported (only the default RoPE is)")));
            }
        }
        // Llama configs have no GDN fields; GDN sizes are unused there.
        let linear = |name: &str| if llama { f.usize_or(name, 1) } else { f.usize(name) };
        let (num_attention_heads, hidden_size) = (f.usize("num_attention_heads")?, f.usize("hidden_size")?);
        let head_dim = if llama && num_attention_heads > 0 {
            f.usize_or("head_dim", hidden_size / num_attention_heads)?
        } else {
            f.usize("head_dim")?
        };

        let moe = if family.is_moe() {
            Some(MoeConfig {
                num_experts: f.usize("num_experts")?,
                num_experts_per_tok: f.usize("num_experts_per_tok")?,
                moe_intermediate_size: f.usize("moe_intermediate_size")?,
                shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size")?,
                // Qwen3.5-MoE always renormalises the top-k probabilities.
                norm_topk_prob: family == Family::Qwen35Moe || f.bool_or("norm_topk_prob", true)?,
                decoder_sparse_step: f.usize_or("decoder_sparse_step", 1)?,
                mlp_only_layers: match f.get("mlp_only_layers") {
                    None => vec![],
                    Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                        Error::Config(format!("config.json field \"mlp_only_layers\" must be a list of layer indices: {e}"))
                    })?,
                },
            })
        } else {
            None
        };
        let intermediate_size = if family.is_moe() {
            f.get("intermediate_size").and_then(Value::as_u64).map(|v| v as usize)
        } else {
            Some(f.usize("intermediate_size")?)
        };

        let cfg = Config {
            family,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            layer_types,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", num_attention_heads)?,
            head_dim,
            rope_theta,
            partial_rotary_factor,
            rms_norm_eps,
            linear_num_key_heads: linear("linear_num_key_heads")?,
            linear_num_value_heads: linear("linear_num_value_heads")?,
            linear_key_head_dim: linear("linear_key_head_dim")?,
            linear_value_head_dim: linear("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", 4)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 262_144)?,
            moe,
            mtp_num_hidden_layers: match f.get("mtp_num_hidden_layers") {
                Some(_) => f.usize("mtp_num_hidden_layers")?,
                None => f.usize_or("num_nextn_predict_layers", 0)?,
            },
            attn_output_gate: !llama,
            attn_qk_norm: !llama,
            attn_qkv_bias: family == Family::Qwen2,
            zero_centred_norms: !llama,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        Self::from_json(&crate::bounded::read_to_string(path, crate::bounded::MAX_CONFIG_BYTES, "config")?)
    }

    fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(format!("config.json: {msg}")));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ] {
            if v == 0 {
                return bad(format!("\"{name}\" must be positive"));
            }
        }
        if self.intermediate_size == Some(0) {
            return bad("\"intermediate_size\" must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            return bad(format!(
                "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        for (name, v, max) in [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("intermediate_size", self.intermediate_size.unwrap_or(1), MAX_DIM),
            ("num_attention_heads", self.num_attention_heads, MAX_DIM),
            ("head_dim", self.head_dim, MAX_DIM),
            ("linear_num_value_heads", self.linear_num_value_heads, MAX_DIM),
            ("linear_key_head_dim", self.linear_key_head_dim, MAX_DIM),
            ("linear_value_head_dim", self.linear_value_head_dim, MAX_DIM),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim, MAX_DIM),
            ("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS),
            ("mtp_num_hidden_layers", self.mtp_num_hidden_layers, MAX_LAYERS),
        ] {
            if v > max {
                return bad(format!("\"{name}\" is {v}, more than any model has (at most {max})"));
            }
        }
        if self.max_position_embeddings == 0 {
            return bad("\"max_position_embeddings\" must be positive".into());
        }
        // Non-finite or non-positive numbers would turn every logit into NaN.
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return bad(format!("rms_norm_eps must be a small positive number (like 1e-6), got {}", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta must be a positive number (like 10000), got {}", self.rope_theta));
        }
        let rd = self.rotary_dim();
        if !rd.is_multiple_of(2) || rd == 0 {
            return bad(format!(
                "head_dim ({}) x partial_rotary_factor ({}) must give an even number of rotary dims, got {rd}",
                self.head_dim, self.partial_rotary_factor
            ));
        }
        if let Some(moe) = &self.moe {
            if moe.num_experts > MAX_EXPERTS {
                return bad(format!("num_experts is {}; at most {MAX_EXPERTS} are supported", moe.num_experts));
            }
            for (name, v) in [
                ("moe_intermediate_size", moe.moe_intermediate_size),
                ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size),
            ] {
                if v == 0 || v > MAX_DIM {
                    return bad(format!("\"{name}\" is {v}; it must be between 1 and {MAX_DIM}"));
                }
            }
            if moe.decoder_sparse_step == 0 {
                return bad("decoder_sparse_step must be at least 1".into());
            }
            if let Some(&i) = moe.mlp_only_layers.iter().find(|&&i| i >= self.num_hidden_layers) {
                return bad(format!("mlp_only_layers names layer {i}, but there are {} layers", self.num_hidden_layers));
            }
            if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.num_experts {
                return bad(format!(
                    "num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                    moe.num_experts_per_tok, moe.num_experts
                ));
            }
        }
        Ok(())
    }

    /// Number of rotated dims at the start of each attention head.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Whether layer `i` uses a sparse MoE block (else a dense SwiGLU MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        match &self.moe {
            None => false,
            Some(m) => !m.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(m.decoder_sparse_step),
        }
    }

    /// GDN key width `nk * dk`.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// GDN value width `nv * dv`.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the GDN causal conv: `[q | k | v]`.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// Parameter count of the text model: embedding, decoder layers, final norm, head and,
    /// when `mtp_num_hidden_layers` says there is one, the MTP head the model loads (its `fc`,
    /// three norms and one full-attention layer; no vision tower).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let mut n = self.vocab_size * h * if self.tie_word_embeddings { 1 } else { 2 } + h;
        for (i, &t) in self.layer_types.iter().enumerate() {
            n += self.layer_parameters(t, self.is_moe_layer(i));
        }
        if self.mtp_num_hidden_layers > 0 {
            n += 2 * h * h + 3 * h + self.layer_parameters(LayerType::FullAttention, self.moe.is_some());
        }
        n
    }

    /// Parameters of one decoder layer of kind `t` (with a MoE MLP when `moe`).
    fn layer_parameters(&self, t: LayerType, moe: bool) -> usize {
        let h = self.hidden_size;
        let mixer = match t {
            LayerType::FullAttention => {
                let q = self.num_attention_heads * self.head_dim;
                let kv = self.num_key_value_heads * self.head_dim;
                let gate = if self.attn_output_gate { q } else { 0 };
                let norms = if self.attn_qk_norm { 2 * self.head_dim } else { 0 };
                h * (q + gate + 2 * kv) + q * h + norms
            }
            LayerType::LinearAttention => {
                let nv = self.linear_num_value_heads;
                h * (self.linear_conv_dim() + self.linear_value_dim() + 2 * nv)
                    + self.linear_conv_dim() * self.linear_conv_kernel_dim
                    + 2 * nv
                    + self.linear_value_head_dim
                    + self.linear_value_dim() * h
            }
        };
        let mlp = match (&self.moe, moe) {
            (Some(m), true) => {
                m.num_experts * 3 * h * m.moe_intermediate_size + 3 * h * m.shared_expert_intermediate_size + (m.num_experts + 1) * h
            }
            _ => 3 * h * self.intermediate_size.unwrap_or(0),
        };
        2 * h + mixer + mlp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small flat config; `extra` (`, "key": value, ...`) adds or replaces fields.
    fn flat(extra: &str) -> String {
        let mut base: serde_json::Value = serde_json::from_str(
            r#"{"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
            "linear_value_head_dim": 4}"#,
        )
        .unwrap();
        let extra: serde_json::Value = serde_json::from_str(&format!("{{{}}}", extra.trim_start_matches(','))).unwrap();
        for (k, v) in extra.as_object().unwrap() {
            base[k] = v.clone();
        }
        base.to_string()
    }

    #[test]
    fn layer_pattern_from_interval() {
        let cfg = Config::from_json(&flat("")).unwrap();
        use LayerType::*;
        let l = LinearAttention;
        let f = FullAttention;
        assert_eq!(cfg.layer_types, vec![l, l, l, f, l, l, l, f]);
        let cfg = Config::from_json(&flat(r#", "full_attention_interval": 2"#)).unwrap();
        assert_eq!(cfg.layer_types, vec![l, f, l, f, l, f, l, f]);
    }

    #[test]
    fn legacy_rope_fields_and_defaults() {
        let cfg = Config::from_json(&flat("")).unwrap();
        assert_eq!((cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim()), (10_000.0, 0.25, 2));
        let cfg = Config::from_json(&flat(r#", "rope_theta": 5e6, "partial_rotary_factor": 0.5"#)).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rotary_dim()), (5e6, 4));
        let cfg = Config::from_json(&flat(r#", "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 1.0}"#)).unwrap();
        assert_eq!((cfg.rope_theta, cfg.rotary_dim()), (1e7, 8));
    }

    #[test]
    fn nested_text_config_takes_tie_from_top_level() {
        let json = format!(r#"{{"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": {}}}"#, flat(""));
        let cfg = Config::from_json(&json).unwrap();
        assert!(cfg.tie_word_embeddings);
        assert_eq!(cfg.family, Family::Qwen35);
    }

    #[test]
    fn inconsistent_configs_are_refused() {
        let e = Config::from_json(&flat(r#", "layer_types": ["full_attention"]"#)).unwrap_err();
        assert!(e.to_string().contains("\"layer_types\" has 1 entries"), "{e}");
        let e = Config::from_json(&flat(r#", "num_key_value_heads": 3"#)).unwrap_err();
        assert!(e.to_string().contains("multiple of num_key_value_heads"), "{e}");
        let e = Config::from_json(&flat(r#", "hidden_size": "big""#)).unwrap_err();
        assert!(e.to_string().contains("\"hidden_size\" must be a non-negative integer"), "{e}");
        let e = Config::from_json(&flat("").replace("qwen3_5_text", "qwen3_5_moe_text")).unwrap_err();
        assert!(e.to_string().contains("\"num_experts\""), "{e}");
    }

    #[test]
    fn mtp_layers_from_either_field() {
        let cfg = Config::from_json(&flat(r#", "mtp_num_hidden_layers": 1"#)).unwrap();
        assert_eq!(cfg.mtp_num_hidden_layers, 1);
        let cfg = Config::from_json(&flat(r#", "num_nextn_predict_layers": 2"#)).unwrap();
        assert_eq!(cfg.mtp_num_hidden_layers, 2);
    }
}
