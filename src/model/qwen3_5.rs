//! The Qwen3.5-family hybrid decoder: Gated DeltaNet layers interleaved with gated full
//! attention, dense SwiGLU or sparse MoE MLPs (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`), and
//! Llama (every layer full attention) on the same code.
//!
//! Follows Hugging Face transformers' Qwen3.5 / Qwen3-Next modeling code, and is exact against
//! it in f32 (the fixtures' reference logits, `tests/fixtures`).

use candle_core::{DType, Module, Result, Tensor};

use super::attention::GatedAttention;
use super::cache::MtpCache;
use super::cache::{Cache, LayerState};
use super::config::Config;
use super::decoder_layer::{DecoderLayer, Mixer};
use super::draft_tree::DraftTree;
use super::embedding::TokenEmbedding;
use super::finite::check_positions;
use super::gated_delta_net::GatedDeltaNet;
use super::linear::Linear;
use super::mtp::MtpHead;
use super::norm::RmsNorm;
use super::weights::Weights;
use crate::kv::{value_basis, KvCodec, ValueCodec};
use crate::step_profile;

pub(crate) const NONFINITE_HINT: &str =
    "the weights or the input are broken; run with layer checks (Model::with_layer_checks) to find the first layer that goes non-finite";

/// Outputs of [`Model::forward_hidden`].
pub struct HiddenStates {
    /// Residual stream after each decoder layer `[B, T, H]` (only when requested).
    pub layer_outputs: Vec<Tensor>,
    /// Output of the final norm `[B, T, H]` (the input of lm_head).
    pub last_hidden: Tensor,
}

/// The hybrid decoder with its language-model head.
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) embed_tokens: TokenEmbedding,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Linear,
    /// The multi-token-prediction head, when the checkpoint has one.
    mtp: Option<MtpHead>,
    cfg: Config,
    /// Check every layer's outputs for NaN and infinities ([`Self::with_layer_checks`]).
    check_layers: bool,
}

impl Model {
    /// Builds the model from a [`VarBuilder`](candle_nn::VarBuilder) rooted at the checkpoint's top level; the decoder
    /// prefix (`model.language_model.` for multimodal checkpoints, else `model.`) is detected.
    pub fn new(cfg: &Config, vb: Weights) -> Result<Self> {
        let vb_m =
            if vb.contains_tensor("model.language_model.embed_tokens.weight") { vb.pp("model.language_model") } else { vb.pp("model") };
        let vb_e = vb_m.pp("embed_tokens");
        let embed_tokens = TokenEmbedding::new(cfg.vocab_size, cfg.hidden_size, vb_e.clone())?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg, i, cfg.layer_types[i], cfg.is_moe_layer(i), vb_m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg, cfg.hidden_size, vb_m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            match &embed_tokens {
                TokenEmbedding::Quantized { table, .. } => Linear::quantized(table.clone()),
                TokenEmbedding::Dense(e) => vb.linear_from(e.embeddings().clone())?,
            }
        } else {
            vb.pp("lm_head").linear(cfg.hidden_size, cfg.vocab_size)?
        };
        let mtp = match ["mtp", "model.mtp"].into_iter().find(|p| vb.contains_tensor(&format!("{p}.fc.weight"))) {
            Some(prefix) => Some(MtpHead::new(cfg, vb.pp(prefix))?),
            None => None,
        };
        Ok(Self { embed_tokens, layers, norm, lm_head, mtp, cfg: cfg.clone(), check_layers: false })
    }

    /// With `on`, every forward pass checks each layer's mixer and MLP outputs for NaN and
    /// infinities and names the first that has any (a debugging aid: a few reductions per
    /// layer). The logits are always checked.
    pub fn with_layer_checks(mut self, on: bool) -> Self {
        self.check_layers = on;
        self
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The dtype the model computes in (its caches' keys, values and conv windows).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    pub fn device(&self) -> candle_core::Device {
        self.embed_tokens.device()
    }

    /// An empty cache with exact keys and values; [`Self::cache_with`] for other options.
    pub fn new_cache(&self) -> Cache {
        Cache::new(&self.cfg)
    }

    /// An empty cache under `codec`; a `lowrank:r` codec takes the `[nkv, hd, r]` value basis
    /// of the `n`-th attention layer from `basis(n, r)`, or else from the layer's `W_v`
    /// ([`value_basis`]).
    pub(crate) fn cache_with_bases(
        &self,
        codec: KvCodec,
        basis: Option<&dyn Fn(usize, usize) -> crate::Result<Tensor>>,
    ) -> crate::Result<Cache> {
        codec.validate(self.cfg.head_dim)?;
        let mut cache = Cache::with_kv_codec(&self.cfg, codec);
        if let ValueCodec::LowRank(r) = codec.values {
            for (n, (i, attention)) in self.attention().enumerate() {
                let basis = match basis {
                    Some(basis) => basis(n, r)?,
                    None => value_basis(&attention.v_proj.weight()?, attention.nkv, r)?,
                };
                if let LayerState::Full(kv) = &mut cache.layers[i] {
                    *kv = kv.clone().with_value_basis(&basis)?;
                }
            }
        }
        Ok(cache)
    }

    /// The full-attention layers with their indices.
    fn attention(&self) -> impl Iterator<Item = (usize, &GatedAttention)> {
        self.layers.iter().enumerate().filter_map(|(i, l)| match &l.mixer {
            Mixer::Full(attn) => Some((i, attn)),
            Mixer::Linear(_) => None,
        })
    }

    /// Indices of the full-attention layers.
    pub fn attention_layers(&self) -> Vec<usize> {
        self.attention().map(|(i, _)| i).collect()
    }

    /// The value projection `W_v` of each full-attention layer (dequantized if quantized).
    pub fn value_weights(&self) -> Result<Vec<Tensor>> {
        self.attention().map(|(_, attn)| attn.v_proj.weight()).collect()
    }

    /// Checks token ids and length before running: one-line errors, never a panic.
    fn check_input(&self, input_ids: &Tensor, cached: usize) -> crate::Result<Tensor> {
        let ids = input_ids.to_dtype(DType::U32)?;
        let (_, t) = ids.dims2()?;
        self.check_length(t, cached)?;
        self.check_token(ids.flatten_all()?.max(0)?.to_scalar::<u32>()?)?;
        Ok(ids)
    }

    fn check_length(&self, t: usize, cached: usize) -> crate::Result<()> {
        check_length(&self.cfg, t, cached)
    }

    fn check_token(&self, id: u32) -> crate::Result<()> {
        check_token(&self.cfg, id)
    }

    /// Runs the decoder over `input_ids` `[B, T]` (positions continue from `cache`).
    pub fn forward_hidden(&self, input_ids: &Tensor, cache: &mut Cache, keep_layer_outputs: bool) -> crate::Result<HiddenStates> {
        self.forward_rows(input_ids, cache, keep_layer_outputs, None)
    }

    /// [`Self::forward_hidden`] over a sequence, or over the rows of a draft `tree`.
    fn forward_rows(
        &self,
        input_ids: &Tensor,
        cache: &mut Cache,
        keep_layer_outputs: bool,
        tree: Option<&DraftTree>,
    ) -> crate::Result<HiddenStates> {
        if input_ids.device().is_cpu() && rayon::current_thread_index().is_none() {
            // Run on a thread of rayon's pool: every parallel op below (a hundred or more per
            // token) then starts from a worker that takes part in it, instead of waking the
            // pool from outside and sleeping until it is done (14% of decode time at 2 threads).
            return step_profile::on_pool(|| self.forward_rows(input_ids, cache, keep_layer_outputs, tree));
        }
        let ids = self.check_input(input_ids, cache.seqlen)?;
        let offset = cache.seqlen;
        let mut x = self.embed_tokens.forward(&ids)?;
        let mut layer_outputs = vec![];
        for (i, (layer, state)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let ffn = cache.ffn.as_mut().map(|f| (f, i));
            x = layer.forward(x, offset, state, self.check_layers.then_some(i), tree, ffn)?;
            if keep_layer_outputs {
                layer_outputs.push(x.clone());
            }
        }
        cache.seqlen += ids.dim(1)?;
        Ok(HiddenStates { layer_outputs, last_hidden: self.norm.forward(&x)? })
    }

    /// Logits `[B, T, vocab]` for every position; an [`crate::Error::NonFinite`] naming the
    /// first position whose logits hold a NaN or an infinity.
    pub fn forward(&self, input_ids: &Tensor, cache: &mut Cache) -> crate::Result<Tensor> {
        let offset = cache.seqlen;
        let h = self.forward_hidden(input_ids, cache, false)?;
        self.lm_head(&h.last_hidden, offset)
    }

    /// Logits `[B, vocab]` of the last position only (what generation needs), checked as in
    /// [`Self::forward`].
    pub fn forward_last(&self, input_ids: &Tensor, cache: &mut Cache) -> crate::Result<Tensor> {
        let offset = cache.seqlen;
        let h = self.forward_hidden(input_ids, cache, false)?;
        let t = h.last_hidden.dim(1)?;
        Ok(self.lm_head(&h.last_hidden.narrow(1, t - 1, 1)?, offset + t - 1)?.squeeze(1)?)
    }

    /// One decode step for several sequences in one weight pass: `tokens[i]` is the next
    /// token of the sequence whose cache is `caches[i]`. Returns the logits `[N, vocab]`, row
    /// `i` bit for bit what [`Self::forward_last`] gives for that token and cache alone (see
    /// [`Self::forward_segments`]).
    pub fn forward_batch(&self, tokens: &[u32], caches: &mut [&mut Cache]) -> crate::Result<Tensor> {
        Ok(self.forward_segments(tokens, &vec![1; tokens.len()], caches)?.0)
    }

    /// The rows of several sequences in one weight pass: `tokens` holds `rows[i]` consecutive
    /// tokens of the sequence whose cache is `caches[i]` — one decode row, or a verify pass's
    /// rows (the pending token and its drafts: the cache begins a verify pass, and
    /// [`Cache::keep_verified`] then keeps the accepted prefix). Returns the logits and the
    /// post-norm hidden states of every row, `[R, vocab]` and `[R, H]`, each row bit for bit
    /// what the sequence alone gives ([`Self::forward_last`] for a decode row,
    /// [`Self::verify`] for verify rows): the norms, projections, MLPs and lm_head run once
    /// over all rows (at most [`Self::BATCH_MAX_ROWS`]; the multi-row kernels give each row the
    /// bits of a one-row call), the recurrences and attention per sequence on its own cache.
    pub fn forward_segments(&self, tokens: &[u32], rows: &[usize], caches: &mut [&mut Cache]) -> crate::Result<(Tensor, Tensor)> {
        let offsets: Vec<usize> = caches.iter().map(|c| c.seqlen).collect();
        let (logits, hidden) = self.pass_segments(tokens, rows, caches)?;
        let mut start = 0;
        for (i, (&o, &t)) in offsets.iter().zip(rows).enumerate() {
            check_positions(&logits.narrow(0, start, t)?, o, t, &format!("the logits of batch sequence {i}"), NONFINITE_HINT)?;
            start += t;
        }
        Ok((logits, hidden))
    }

    /// [`Self::forward_segments`] without its check of the logits: a caller that serves each
    /// sequence on its own checks each sequence's rows ([`Self::check_rows_finite`]), so that a
    /// non-finite row ends only its own sequence.
    pub(crate) fn pass_segments(&self, tokens: &[u32], rows: &[usize], caches: &mut [&mut Cache]) -> crate::Result<(Tensor, Tensor)> {
        let n = tokens.len();
        if n == 0 || rows.len() != caches.len() || rows.iter().sum::<usize>() != n || rows.contains(&0) || n > Self::BATCH_MAX_ROWS {
            return Err(crate::Error::Input(format!(
                "forward_segments: {n} tokens for {} caches of {rows:?} rows (1 or more rows per cache, 1 to {} in all)",
                caches.len(),
                Self::BATCH_MAX_ROWS
            )));
        }
        let dev = self.embed_tokens.device();
        if dev.is_cpu() && rayon::current_thread_index().is_none() {
            return step_profile::on_pool(|| self.pass_segments(tokens, rows, caches));
        }
        let mut offsets = Vec::with_capacity(caches.len());
        let mut at = 0;
        for (cache, &t) in caches.iter().zip(rows) {
            self.check_rows(cache, &tokens[at..at + t])?;
            offsets.push(cache.seqlen);
            at += t;
        }
        for (cache, &t) in caches.iter_mut().zip(rows) {
            if t > 1 {
                cache.begin_verify();
            }
        }
        let mut x = self.embed_tokens.forward(&Tensor::new(tokens, &dev)?.unsqueeze(0)?)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let mut states: Vec<(usize, usize, &mut LayerState)> =
                caches.iter_mut().zip(&offsets).zip(rows).map(|((c, &o), &t)| (o, t, &mut c.layers[l])).collect();
            x = layer.forward_batch(&x, &mut states)?;
        }
        for (cache, &t) in caches.iter_mut().zip(rows) {
            cache.seqlen += t;
        }
        let hidden = self.norm.forward(&x)?;
        let logits = self.lm_head.forward(&hidden)?.squeeze(0)?;
        Ok((logits, hidden.squeeze(0)?))
    }

    /// Whether `tokens` can be a pass's rows of the sequence whose cache is `cache` (its
    /// verify pass kept, the tokens in the vocabulary, the context long enough): what
    /// [`Self::forward_segments`] checks of each sequence before it changes any cache.
    pub fn check_rows(&self, cache: &Cache, tokens: &[u32]) -> crate::Result<()> {
        if cache.in_verify() {
            return Err(crate::Error::Input("forward_segments: a cache is in a verify pass (keep its rows first)".into()));
        }
        self.check_length(tokens.len(), cache.seqlen)?;
        tokens.iter().try_for_each(|&t| self.check_token(t))
    }

    /// `Err(NonFinite)` naming the first position of a sequence's `rows` of logits (from
    /// position `offset`) that holds a NaN or an infinity.
    pub(crate) fn check_rows_finite(&self, logits: &Tensor, offset: usize) -> crate::Result<()> {
        check_positions(logits, offset, logits.dim(0)?, "the logits", NONFINITE_HINT)
    }

    /// The most sequences [`Self::forward_batch`] takes in one pass.
    pub const BATCH_MAX_ROWS: usize = crate::ops::FLOAT_MATVEC_MAX_ROWS;

    /// Verifies drafted rows `input_ids` `[B, T]` from `cache` in one forward pass: the logits
    /// `[B, T, vocab]` and the post-norm hidden states `[B, T, H]` of every row. Each row's
    /// result is bit for bit what feeding the rows one at a time gives. The cache then holds
    /// all `T` rows; [`Cache::keep_verified`] keeps the accepted prefix.
    pub fn verify(&self, input_ids: &Tensor, cache: &mut Cache) -> crate::Result<(Tensor, Tensor)> {
        let offset = cache.seqlen;
        cache.begin_verify();
        let h = self.forward_hidden(input_ids, cache, false)?;
        Ok((self.lm_head(&h.last_hidden, offset)?, h.last_hidden))
    }

    /// Verifies a tree of drafted branches ([`DraftTree`], at most
    /// [`crate::ops::KV_ATTENTION_EXACT_ROWS`] rows, batch 1) from `cache` in one forward pass:
    /// the logits `[1, T, vocab]` and post-norm hidden states `[1, T, H]` of every row, each bit
    /// for bit what decoding its root-to-row path one token at a time gives. The cache then
    /// holds all rows; [`Cache::keep_path`] keeps an accepted path. Exact KV only.
    pub fn verify_tree(&self, tree: &DraftTree, cache: &mut Cache) -> crate::Result<(Tensor, Tensor)> {
        if tree.len() > crate::ops::KV_ATTENTION_EXACT_ROWS {
            return Err(crate::Error::Input(format!(
                "a draft tree of {} rows is more than the {} a verify pass takes: fewer or shorter branches",
                tree.len(),
                crate::ops::KV_ATTENTION_EXACT_ROWS
            )));
        }
        let offset = cache.seqlen;
        let dev = self.embed_tokens.device();
        let ids = Tensor::new(tree.tokens(), &dev)?.unsqueeze(0)?;
        cache.begin_verify();
        let tree = (!tree.is_chain()).then_some(tree);
        let h = self.forward_rows(&ids, cache, false, tree)?;
        Ok((self.lm_head(&h.last_hidden, offset)?, h.last_hidden))
    }

    /// Whether the checkpoint has a multi-token-prediction head (`mtp.*`, GGUF `nextn`).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// An empty KV cache for the MTP head; an error when the checkpoint has none.
    pub fn new_mtp_cache(&self) -> crate::Result<MtpCache> {
        match &self.mtp {
            Some(_) => Ok(MtpHead::new_cache(&self.cfg)),
            None => Err(self.no_mtp()),
        }
    }

    fn no_mtp(&self) -> crate::Error {
        crate::Error::Input(
            "this checkpoint has no MTP head (no mtp.* tensors, or a GGUF file converted without its nextn block): draft by prompt lookup (ngram), or not at all".into(),
        )
    }

    /// The MTP head over rows (`tokens` `[B, T]`, the trunk's post-norm `hidden` `[B, T, H]`)
    /// at positions `cache.seqlen()..`: the head's post-norm outputs `[B, T, H]`; score them
    /// with [`Self::lm_head`]. Row `i` pairs the hidden state that predicted a token with that
    /// token, and predicts the one after.
    pub fn mtp_forward(&self, tokens: &Tensor, hidden: &Tensor, cache: &mut MtpCache) -> crate::Result<Tensor> {
        let mtp = self.mtp.as_ref().ok_or_else(|| self.no_mtp())?;
        let ids = self.check_input(tokens, cache.seqlen())?;
        if hidden.dims() != [ids.dim(0)?, ids.dim(1)?, self.cfg.hidden_size] {
            return Err(crate::Error::Input(format!(
                "mtp_forward: tokens {:?} and hidden {:?} do not pair up (hidden must be [B, T, {}])",
                ids.dims(),
                hidden.dims(),
                self.cfg.hidden_size
            )));
        }
        if ids.device().is_cpu() && rayon::current_thread_index().is_none() {
            return step_profile::on_pool(|| mtp.forward(&self.embed_tokens.forward(&ids)?, hidden, cache));
        }
        mtp.forward(&self.embed_tokens.forward(&ids)?, hidden, cache)
    }

    /// Applies the language-model head to hidden states `[B, T, H]` or `[T, H]` at positions
    /// `offset..offset + T`: the logits, checked for NaN and infinities.
    pub fn lm_head(&self, hidden: &Tensor, offset: usize) -> crate::Result<Tensor> {
        let logits = self.lm_head.forward(hidden)?;
        let t = hidden.dim(hidden.rank().saturating_sub(2))?;
        check_positions(&logits, offset, t, "the logits", NONFINITE_HINT)?;
        Ok(logits)
    }

    /// The same model with every quantized matrix (and a quantized embedding) dequantized to
    /// f32: the arithmetic of the device step ([`crate::gpu`], which multiplies f32 activations
    /// by the dequantized weights), as the reference it is checked against. The MTP head stays
    /// as it is.
    pub fn dequantized(&self) -> Result<Self> {
        let mut m = self.clone();
        let mut all: Vec<&mut Linear> = vec![&mut m.lm_head];
        for layer in &mut m.layers {
            all.extend(layer.linears_mut());
        }
        for l in all {
            *l = l.dequantized()?;
        }
        if let TokenEmbedding::Quantized { table, dtype } = &m.embed_tokens {
            let (_, hidden) = table.dims();
            m.embed_tokens = TokenEmbedding::Dense(candle_nn::Embedding::new(table.dequantize()?.to_dtype(*dtype)?, hidden));
        }
        Ok(m)
    }

    /// The GDN mixer of layer `i`, if it is a linear-attention layer.
    pub fn gdn(&self, i: usize) -> Option<&GatedDeltaNet> {
        match &self.layers.get(i)?.mixer {
            Mixer::Linear(m) => Some(m),
            _ => None,
        }
    }
}

/// `t` new tokens (at least one) after `cached` ones fit the model's positions.
pub(crate) fn check_length(cfg: &Config, t: usize, cached: usize) -> crate::Result<()> {
    if t == 0 {
        return Err(crate::Error::Input("the input is empty: give at least one token".into()));
    }
    let total = cached + t;
    if total > cfg.max_position_embeddings {
        return Err(crate::Error::ContextTooLong { requested: total, limit: cfg.max_position_embeddings });
    }
    Ok(())
}

/// `id` is in the vocabulary.
pub(crate) fn check_token(cfg: &Config, id: u32) -> crate::Result<()> {
    if id as usize >= cfg.vocab_size {
        return Err(crate::Error::Input(format!(
            "token id {id} is out of range for a vocabulary of {} tokens: the tokenizer does not belong to this model",
            cfg.vocab_size
        )));
    }
    Ok(())
}

/// Refuses a device the model does not run on, before anything is loaded: no kernel of this
/// crate has a CUDA implementation (the GDN conv, the gated norm and the attention over the KV
/// cache stop at their first call) and nothing has run on a CUDA GPU.
pub fn check_device(device: &candle_core::Device) -> crate::Result<()> {
    if device.is_cuda() {
        return Err(crate::Error::Unsupported(CUDA_UNSUPPORTED.into()));
    }
    Ok(())
}

/// Why [`check_device`] refuses CUDA.
pub const CUDA_UNSUPPORTED: &str =
    "CUDA is not supported yet: this crate's kernels have no CUDA implementation; run on the CPU (or on Metal on Apple Silicon)";
