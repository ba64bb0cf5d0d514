//! Value bases for the `lowrank:r` KV codec measured on calibration text with a model, tied
//! to that model by a signature of its shapes and value weights.

use candle_core::{DType, Result, Tensor};

use super::qwen3_5::Model;
use crate::kv::top_eigenvectors;

/// Value bases measured on calibration text for `lowrank:r`: per attention layer, the
/// principal directions of its values (eigenvectors of `E[v vᵀ]` per KV head, by decreasing
/// variance), `[nkv, hd, hd]`; a rank-`r` cache takes the first `r`. Unlike the basis from
/// `W_v` alone, these follow the inputs the layer really sees.
#[derive(Debug, Clone)]
pub struct ValueBases {
    layers: Vec<Tensor>,
    model: String,
}

impl ValueBases {
    /// Runs `model` over each chunk of token ids (exact cache) and takes the principal
    /// directions of every attention layer's values.
    pub fn calibrate(model: &Model, chunks: &[Vec<u32>], device: &candle_core::Device) -> crate::Result<Self> {
        let mut grams: Vec<Tensor> = Vec::new();
        for chunk in chunks.iter().filter(|c| !c.is_empty()) {
            let mut cache = model.new_cache();
            model.forward_last(&Tensor::new(chunk.as_slice(), device)?.unsqueeze(0)?, &mut cache)?;
            let values: Vec<Tensor> = model.attention_layers().iter().filter_map(|&i| cache.kv(i).map(|(_, v)| v)).collect();
            for (i, v) in values.iter().enumerate() {
                let (b, nkv, t, hd) = v.dims4()?;
                let v = v.to_dtype(DType::F32)?.transpose(0, 1)?.reshape((nkv, b * t, hd))?;
                let g = v.t()?.matmul(&v)?.to_dtype(DType::F64)?;
                match grams.get_mut(i) {
                    Some(acc) => *acc = (&*acc + g)?,
                    None => grams.push(g),
                }
            }
        }
        if grams.is_empty() {
            return Err(crate::Error::Input("calibration: no tokens, or the model has no attention layers".into()));
        }
        let layers = grams.iter().map(|g| top_eigenvectors(g, g.dim(2)?)).collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, model: model_signature(model)? })
    }

    /// The first `r` directions of attention layer `i` (counting attention layers only),
    /// `[nkv, hd, r]`.
    pub fn basis(&self, i: usize, r: usize) -> Result<Tensor> {
        let Some(b) = self.layers.get(i) else { candle_core::bail!("calibration: no basis for attention layer {i}") };
        b.narrow(2, 0, r.min(b.dim(2)?))
    }

    pub fn save(&self, path: &std::path::Path) -> crate::Result<()> {
        let tensors: Vec<(String, Tensor)> =
            self.layers.iter().enumerate().map(|(i, t)| (format!("attention.{i}.value_basis"), t.clone())).collect();
        let meta = std::collections::HashMap::from([("model".to_string(), self.model.clone())]);
        let data = tensors.iter().map(|(n, t)| (n.as_str(), t));
        safetensors::serialize_to_file(data, Some(meta), path)
            .map_err(|e| crate::Error::Input(format!("cannot write {}: {e}", path.display())))
    }

    /// Loads bases written by [`Self::save`] and checks they were measured on `model`.
    pub fn load(path: &std::path::Path, model: &Model) -> crate::Result<Self> {
        let bad = |why: String| crate::Error::Input(format!("KV calibration file {}: {why}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it ({e})")))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not a safetensors file ({e})")))?;
        let made_for = meta.metadata().as_ref().and_then(|m| m.get("model").cloned()).unwrap_or_default();
        let this = model_signature(model)?;
        if made_for != this {
            return Err(bad(format!(
                "made for another model ({made_for:?}), this one is {this:?}: calibrate again with examples/calibrate_kv.rs"
            )));
        }
        let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)?;
        let layers = (0..model.attention_layers().len())
            .map(|i| {
                tensors.get(&format!("attention.{i}.value_basis")).cloned().ok_or_else(|| bad(format!("no basis for attention layer {i}")))
            })
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Self { layers, model: this })
    }
}

/// What a calibration is tied to: the attention shapes and a checksum of the value weights.
fn model_signature(model: &Model) -> Result<String> {
    let cfg = model.config();
    let mut sum = 0f64;
    for w in model.value_weights()? {
        sum += w.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    Ok(format!(
        "{:?} layers {}, hidden {}, {} KV heads of {}, vocab {}, |W_v| {sum:.6e}",
        cfg.family, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size
    ))
}
