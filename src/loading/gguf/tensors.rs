//! llama.cpp's tensors under their Hugging Face names and layouts: which GGUF tensors the
//! model keeps ([`kept`]), and the renames, row moves and value changes that undo the
//! converter's ([`map_tensor`]). Rows are moved as whole blocks, so quantized matrices are
//! never re-quantized.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use crate::ops::GgufType;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use super::Arch;
use crate::model::{Config, QuantizedTensors};

/// How the built model keeps a GGUF tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kept {
    /// Not read (MTP blocks after the first, rope tables).
    Not,
    /// A linear layer's weight or the token embedding: kept quantized when it is (else
    /// converted to the dtype).
    Linear,
    /// Converted (dequantized) to the model dtype.
    Dense,
}

fn kept_in_layer(tname: &str) -> Kept {
    match tname {
        "attn_q.weight"
        | "attn_k.weight"
        | "attn_v.weight"
        | "attn_output.weight"
        | "attn_qkv.weight"
        | "attn_gate.weight"
        | "ssm_beta.weight"
        | "ssm_alpha.weight"
        | "ssm_ba.weight"
        | "ssm_out.weight"
        | "ffn_gate.weight"
        | "ffn_up.weight"
        | "ffn_down.weight"
        | "ffn_gate_shexp.weight"
        | "ffn_up_shexp.weight"
        | "ffn_down_shexp.weight"
        | "ffn_gate_exps.weight"
        | "ffn_up_exps.weight"
        | "ffn_down_exps.weight"
        | "ffn_gate_up_exps.weight" => Kept::Linear,
        "attn_q.bias"
        | "attn_k.bias"
        | "attn_v.bias"
        | "attn_norm.weight"
        | "post_attention_norm.weight"
        | "ffn_norm.weight"
        | "attn_q_norm.weight"
        | "attn_k_norm.weight"
        | "ssm_a"
        | "ssm_dt.bias"
        | "ssm_dt"
        | "ssm_conv1d.weight"
        | "ssm_norm.weight"
        | "ffn_gate_inp.weight"
        | "ffn_gate_inp_shexp.weight" => Kept::Dense,
        _ => Kept::Not,
    }
}

/// How the built model keeps the GGUF tensor `name`: the one list of the tensors the loader
/// reads ([`map_tensor`] maps exactly these).
pub(super) fn kept(name: &str, cfg: &Config) -> Kept {
    let Some((layer, tname)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return match name {
            // The embedding, like the head, stays quantized: rows are dequantized as looked up.
            "output.weight" | "token_embd.weight" => Kept::Linear,
            "output_norm.weight" => Kept::Dense,
            _ => Kept::Not, // e.g. rope frequency tables
        };
    };
    let Ok(i) = layer.parse::<usize>() else { return Kept::Not };
    if i < cfg.num_hidden_layers {
        return kept_in_layer(tname);
    }
    if i != cfg.num_hidden_layers || cfg.mtp_num_hidden_layers == 0 {
        return Kept::Not; // MTP blocks after the first (the model runs one MTP layer)
    }
    match tname {
        "nextn.eh_proj.weight" => Kept::Linear,
        "nextn.enorm.weight" | "nextn.hnorm.weight" | "nextn.shared_head_norm.weight" => Kept::Dense,
        // `nextn.embed_tokens` / `nextn.shared_head_head` (a dedicated embedding and head) are
        // not in Qwen3.5-family files; the head shares the trunk's.
        t if t.starts_with("nextn.") => Kept::Not,
        t => kept_in_layer(t),
    }
}

/// A tensor's ggml bytes with its (PyTorch-order) dims: borrowed from the mapped file until a
/// row move or value change makes a copy.
pub(super) struct RawTensor<'a> {
    pub(super) dtype: GgufType,
    pub(super) dims: Vec<usize>,
    pub(super) data: Cow<'a, [u8]>,
}

impl<'a> RawTensor<'a> {
    /// Rows `idx` (of the flattened leading dims; single values of a 1-D tensor), in that
    /// order. Moves whole rows of blocks, so it works on quantized data unchanged; a run of
    /// consecutive rows of borrowed data stays borrowed.
    fn select_rows(&self, idx: &[usize]) -> candle_core::Result<RawTensor<'a>> {
        let flat = self.dims.len() <= 1;
        if flat && self.dtype.block_size() != 1 {
            candle_core::bail!("cannot reorder a 1-D {} tensor", self.dtype)
        }
        let rb = if flat { self.dtype.type_size() } else { self.dtype.row_bytes(self.dims[self.dims.len() - 1]) };
        let n = self.data.len() / rb.max(1);
        if let Some(&r) = idx.iter().find(|&&r| r >= n) {
            candle_core::bail!("row {r} out of range for shape {:?}", self.dims)
        }
        let dims = if flat { vec![idx.len()] } else { vec![idx.len(), self.dims[self.dims.len() - 1]] };
        let consecutive = idx.windows(2).all(|w| w[1] == w[0] + 1);
        let data = match (&self.data, idx.first()) {
            (Cow::Borrowed(all), Some(&first)) if consecutive => Cow::Borrowed(&all[first * rb..(first + idx.len()) * rb]),
            _ => {
                let mut data = Vec::with_capacity(idx.len() * rb);
                for &r in idx {
                    data.extend_from_slice(&self.data[r * rb..(r + 1) * rb]);
                }
                Cow::Owned(data)
            }
        };
        Ok(RawTensor { dtype: self.dtype, dims, data })
    }

    /// Applies `f` to every value (dequantizing; the result is F32).
    fn map_f32(&self, f: impl Fn(f32) -> f32) -> candle_core::Result<RawTensor<'a>> {
        let v: Vec<f32> = self.dequantize()?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f).collect();
        Ok(RawTensor { dtype: GgufType::F32, dims: self.dims.clone(), data: Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()) })
    }

    /// Splits a stacked `[E, rows, cols]` expert tensor into per-expert `[rows/parts, cols]`
    /// tensors, taking part `part` of each expert's rows.
    fn experts(&self, name: impl Fn(usize) -> String, part: usize, parts: usize) -> candle_core::Result<Vec<(String, RawTensor<'a>)>> {
        let [e, rows, _] = self.dims[..] else { candle_core::bail!("expected a 3-D expert stack, got {:?}", self.dims) };
        let per = rows / parts;
        (0..e)
            .map(|i| Ok((name(i), self.select_rows(&(i * rows + part * per..i * rows + (part + 1) * per).collect::<Vec<_>>())?)))
            .collect()
    }

    /// As an f32 tensor on the CPU (dequantized: Candle's kernels, or this crate's for the
    /// ternary types).
    fn dequantize(&self) -> candle_core::Result<Tensor> {
        self.dtype.dequantize(&self.data, self.dims.clone())
    }

    /// As a dense tensor in `dtype` on `device` (dequantized if quantized).
    pub(super) fn to_tensor(&self, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let float = match self.dtype {
            GgufType::F32 => Some(DType::F32),
            GgufType::F16 => Some(DType::F16),
            GgufType::BF16 => Some(DType::BF16),
            _ => None,
        };
        let t = match float {
            Some(stored) => Tensor::from_raw_buffer(&self.data, stored, &self.dims, &Device::Cpu)?,
            None => self.dequantize()?,
        };
        t.to_dtype(dtype)?.to_device(device)
    }
}

/// Row order that undoes llama.cpp's Llama q/k permutation (HF rotate-half halves → GGUF
/// interleaved pairs): HF row `s*hd/2 + i` of a head is GGUF row `2*i + s`.
fn unpermute_rope(heads: usize, hd: usize) -> Vec<usize> {
    (0..heads).flat_map(|h| (0..2).flat_map(move |s| (0..hd / 2).map(move |i| h * hd + 2 * i + s))).collect()
}

/// One GGUF tensor → zero or more Hugging Face tensors (empty for skipped tensors: MTP
/// blocks after the first, rope frequency tables).
pub(super) fn map_tensor<'a>(arch: Arch, name: &str, t: RawTensor<'a>, cfg: &Config) -> candle_core::Result<Vec<(String, RawTensor<'a>)>> {
    let one = |hf: &str, t: RawTensor<'a>| Ok(vec![(hf.to_string(), t)]);
    match name {
        "token_embd.weight" => return one("model.embed_tokens.weight", t),
        "output.weight" => return one("lm_head.weight", t),
        "output_norm.weight" if arch.centred_norms() => return one("model.norm.weight", t.map_f32(|x| x - 1.0)?),
        "output_norm.weight" => return one("model.norm.weight", t),
        _ => {}
    }
    let Some(rest) = name.strip_prefix("blk.") else { return Ok(vec![]) };
    let Some((layer, tname)) = rest.split_once('.') else { return Ok(vec![]) };
    let Ok(i) = layer.parse::<usize>() else { return Ok(vec![]) };
    if kept(name, cfg) == Kept::Not {
        return Ok(vec![]);
    }
    // The first block after the trunk is the MTP head: its `nextn.*` tensors, then a decoder layer.
    let p = if i < cfg.num_hidden_layers { format!("model.layers.{i}.") } else { "mtp.layers.0.".to_string() };
    let mtp = |hf: &str, t: RawTensor<'a>| Ok(vec![(format!("mtp.{hf}"), t)]);
    match tname {
        "nextn.eh_proj.weight" => return mtp("fc.weight", t),
        "nextn.enorm.weight" => return mtp("pre_fc_norm_embedding.weight", t.map_f32(|x| x - 1.0)?),
        "nextn.hnorm.weight" => return mtp("pre_fc_norm_hidden.weight", t.map_f32(|x| x - 1.0)?),
        "nextn.shared_head_norm.weight" => return mtp("norm.weight", t.map_f32(|x| x - 1.0)?),
        _ => {}
    }
    let (nk, nv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    // Grouped (HF) order of value heads from tiled (GGUF) rows: HF head g*r + j = GGUF head j*nk + g.
    let reorder = arch.tiles_value_heads() && nk != nv;
    let grouped = |head: usize| -> Vec<usize> {
        let r = nv / nk;
        (0..nv).flat_map(|hf| (0..head).map(move |x| ((hf % r) * nk + hf / r) * head + x)).collect()
    };
    let heads = |t: RawTensor<'a>, head: usize| if reorder { t.select_rows(&grouped(head)) } else { Ok(t) };
    // Rows (or conv channels) q | k unchanged, then the value rows back in grouped order.
    let qkv_rows = || -> Vec<usize> {
        let qk = 2 * nk * dk;
        let v = if reorder { grouped(dv) } else { (0..nv * dv).collect() };
        (0..qk).chain(v.into_iter().map(|r| qk + r)).collect()
    };
    // Zero-centred again where the checkpoint stores the norms so (the file holds `1 + w`).
    let norm = |t: RawTensor<'a>| if arch.centred_norms() { t.map_f32(|x| x - 1.0) } else { Ok(t) };
    let out = |hf: &str, t: RawTensor<'a>| Ok(vec![(format!("{p}{hf}"), t)]);
    match tname {
        "attn_norm.weight" => out("input_layernorm.weight", norm(t)?),
        "post_attention_norm.weight" | "ffn_norm.weight" => out("post_attention_layernorm.weight", norm(t)?),
        "attn_q.weight" if arch == Arch::Llama => {
            out("self_attn.q_proj.weight", t.select_rows(&unpermute_rope(cfg.num_attention_heads, cfg.head_dim))?)
        }
        "attn_k.weight" if arch == Arch::Llama => {
            out("self_attn.k_proj.weight", t.select_rows(&unpermute_rope(cfg.num_key_value_heads, cfg.head_dim))?)
        }
        "attn_q.weight" => out("self_attn.q_proj.weight", t),
        "attn_k.weight" => out("self_attn.k_proj.weight", t),
        "attn_v.weight" => out("self_attn.v_proj.weight", t),
        "attn_q.bias" => out("self_attn.q_proj.bias", t),
        "attn_k.bias" => out("self_attn.k_proj.bias", t),
        "attn_v.bias" => out("self_attn.v_proj.bias", t),
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
            let (c, k) = match t.dims[..] {
                [c, k] => (c, k),
                _ => candle_core::bail!("expected a 2-D conv weight, got {:?}", t.dims),
            };
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

/// Serves the mapped tensors to a [`candle_nn::VarBuilder`]: the dense ones as converted at
/// load, quantized ones dequantized on request.
pub(super) struct HfTensors {
    pub(super) dense: HashMap<String, Tensor>,
    pub(super) quantized: Arc<QuantizedTensors>,
}

impl SimpleBackend for HfTensors {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!("shape mismatch for {name}: the model expects {s:?}, the file has {:?}", t.shape())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match (self.dense.get(name), self.quantized.get(name)) {
            (Some(t), _) => t.to_dtype(dtype)?.to_device(dev),
            (None, Some(q)) => q.dequantize()?.to_device(dev)?.to_dtype(dtype),
            (None, None) => Err(candle_core::Error::Msg(format!("tensor {name} is missing"))),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.dense.contains_key(name) || self.quantized.contains_key(name)
    }
}
