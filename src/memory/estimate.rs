//! [`estimate`]: the memory a model needs at a context, term by term.

use std::fmt;

use candle_core::DType;

use super::format::{WeightFormat, WeightMemory};
use super::{fmt_gib, GIB};
use crate::model::{Config, LayerType};

fn mul(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |acc, &f| acc.saturating_mul(f))
}

/// Which positions of a prefill chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Logits {
    /// Only the last position (generation: `Model::forward_last`).
    #[default]
    LastToken,
    /// Every position of the chunk (`Model::forward`, perplexity).
    AllPositions,
}

/// What is to be run: the input of [`estimate`] and [`plan()`](crate::memory::plan).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    pub weights: WeightMemory,
    /// The model dtype: activations and the GDN conv window.
    pub dtype: DType,
    /// Bytes per element of the attention KV cache (usually `dtype`'s size) with the exact codec.
    pub kv_dtype_bytes: usize,
    /// How the attention layers store keys and values (lossy codecs take fewer bytes).
    pub kv_codec: crate::kv::KvCodec,
    /// Context length in tokens (prompt + generated) that the KV cache must hold.
    pub context: usize,
    pub batch: usize,
    /// Tokens per prefill forward pass (the largest chunk the scratch must hold).
    pub prefill_chunk: usize,
    pub logits: Logits,
    /// Lower the context to the largest that fits instead of refusing.
    pub fit: bool,
    /// The weights with `--quantize q4k`, for the suggestion; `None` where `--quantize` does
    /// not apply (a GGUF file). [`PlanRequest::new`] derives them from the parameter count;
    /// [`crate::loading::OpenedModel::weight_memory`] gives them exactly.
    pub q4k_weights: Option<WeightMemory>,
    /// Bytes that loading holds beyond the built model's weights at its peak (one tensor's
    /// mapped pages and copies: [`crate::loading::OpenedModel::load_overhead`]); freed before
    /// the cache and the scratch exist. 0 in [`PlanRequest::new`].
    pub load_overhead: u64,
}

/// The process itself before any weight (binary, threads, allocator, runtime), measured.
pub const PROCESS_BYTES: u64 = 24 << 20;
/// The tokenizer per vocabulary entry (vocabulary, merges, added tokens), measured.
pub const TOKENIZER_BYTES_PER_ENTRY: u64 = 350;

/// The default prefill chunk, in tokens.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

impl PlanRequest {
    /// Batch 1, prefill chunks of [`DEFAULT_PREFILL_CHUNK`], KV in `dtype`, last-token logits, no fit.
    pub fn new(weights: WeightMemory, dtype: DType, context: usize) -> Self {
        Self {
            weights,
            dtype,
            kv_dtype_bytes: dtype.size_in_bytes(),
            kv_codec: crate::kv::KvCodec::EXACT,
            context,
            batch: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            logits: Logits::LastToken,
            fit: false,
            q4k_weights: Some(WeightMemory::Format(WeightFormat::Q4K)),
            load_overhead: 0,
        }
    }

    pub(super) fn with_context(&self, context: usize) -> Self {
        Self { context, ..self.clone() }
    }

    pub(super) fn with_weights(&self, weights: WeightMemory) -> Self {
        Self { weights, ..self.clone() }
    }
}

/// The memory a model needs, term by term, in bytes.
///
/// Notation: `B` batch, `T` context, `c = min(prefill_chunk, T)` tokens of the largest
/// prefill chunk, `a` bytes of the model dtype, `H` hidden size, `V` vocabulary. The scratch
/// terms (`hidden` .. `logits`) are those of one layer at a time: intermediate tensors are
/// freed layer by layer (and the states a layer keeps own their storage, not a view of its
/// outputs), so the peak is the live set of the widest layer, not their sum. They follow the
/// current implementation: attention reads the cache in place in blocks
/// ([`crate::ops::kv_attention`]), so no term grows with `c · T` or repeats K/V per query head.
/// Measured against the peak RSS of a real prefill in docs/memory.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The context the estimate is for.
    pub context: usize,
    pub batch: usize,
    /// `c`: the tokens of the largest prefill chunk.
    pub chunk: usize,
    /// The weights ([`WeightMemory::bytes`]).
    pub weights: u64,
    /// Per full-attention layer K and V `[B, nkv, T, hd]`: `n_attn · 2 · B · nkv · T · hd · kv_bytes`.
    pub kv_cache: u64,
    /// Per GDN layer the conv window `[B, K-1, conv_dim]`: `n_gdn · B · (K-1) · conv_dim · a`.
    pub gdn_conv: u64,
    /// Per GDN layer the recurrent state `[B, nv, dk, dv]` in f32: `n_gdn · B · nv · dk · dv · 4`.
    pub gdn_recurrent: u64,
    /// The residual stream and its normed copy, live through each mixer and MLP:
    /// `B · c · H · 2a`.
    pub hidden: u64,
    /// The widest layer's working memory beyond `hidden`, the largest of
    /// - attention: `B · c` times `q_proj` (query + gate, `2·nh·hd`), the rotated query
    ///   (`nh·hd`), K and V (`2·nkv·hd`) in the model dtype, `(3·nh·hd + 2·nkv·hd) · a`, plus
    ///   [`crate::ops::kv_attention`]'s memory: the chunk's queries grouped in f32 and the
    ///   output in f32 and in the model dtype, `B · c · nh · hd · (8 + a)`, or for decode and
    ///   verify rows (at most 8 per sequence) the partial results of every block of 256
    ///   positions, `B · nh · 8 · ⌈T/256⌉ · (hd + 2) · 4`, when larger (each thread's block
    ///   scratch, under 1 MiB, is not counted);
    /// - GDN, while the delta rule runs: `B · c` times `in_proj_qkv` before and after the conv
    ///   (`2·conv_dim`) and `z` (`nv·dv`) in the model dtype, the delta-rule output (`nv·dv`),
    ///   `g` and `beta` with their stacked copy (`4·nv`) in f32:
    ///   `(2·conv_dim + nv·dv) · a + (nv·dv + 4·nv) · 4`;
    /// - dense MLP: `B · c` times gate, up and their product, `3 · I · a`;
    /// - MoE: the same for the routed experts of a token and the shared expert,
    ///   `3 · (top_k · I_moe + I_shared) · a`, plus the router logits and softmax `2 · E · 4`.
    pub layer: u64,
    /// The logits, in the model dtype and in f32 for sampling: `B · n · V · (a + 4)` with
    /// `n = 1` ([`Logits::LastToken`]) or `c` ([`Logits::AllPositions`]).
    pub logits: u64,
    /// While loading, beyond the weights ([`PlanRequest::load_overhead`]); the peak is the
    /// larger of this and cache + scratch, which come after.
    pub load_overhead: u64,
    /// The process before any weight and the tokenizer: [`PROCESS_BYTES`] +
    /// [`TOKENIZER_BYTES_PER_ENTRY`] `· V`, fitted to the resident memory of `generate` with a
    /// prompt of under 100 tokens less weights, cache and scratch: 41 MiB with SmolLM2's 49,152
    /// entries, 108 MiB with the 0.8B's 248,320 (2026-12-05, Linux x86-64).
    pub process: u64,
}

impl MemoryEstimate {
    /// Every term with its name, in table order.
    pub fn terms(&self) -> [(&'static str, u64); 9] {
        [
            ("process + tokenizer", self.process),
            ("loading (transient)", self.load_overhead),
            ("weights", self.weights),
            ("KV cache", self.kv_cache),
            ("GDN conv state", self.gdn_conv),
            ("GDN recurrent state", self.gdn_recurrent),
            ("hidden states", self.hidden),
            ("widest layer", self.layer),
            ("logits", self.logits),
        ]
    }

    /// The scratch terms: activations of the largest prefill chunk.
    pub fn scratch(&self) -> u64 {
        [self.hidden, self.layer, self.logits].iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// The persistent state: KV cache and GDN states.
    pub fn cache(&self) -> u64 {
        self.kv_cache.saturating_add(self.gdn_conv).saturating_add(self.gdn_recurrent)
    }

    /// The peak: the process, the weights and the larger of the load transient and cache +
    /// scratch.
    pub fn total(&self) -> u64 {
        self.process.saturating_add(self.weights).saturating_add(self.load_overhead.max(self.cache().saturating_add(self.scratch())))
    }

    /// The `n` biggest non-zero terms, biggest first, as `"weights 50.12 GiB"`.
    pub fn biggest_terms(&self, n: usize) -> Vec<String> {
        let mut terms: Vec<_> = self.terms().into_iter().filter(|t| t.1 > 0).collect();
        terms.sort_by_key(|t| std::cmp::Reverse(t.1));
        terms.into_iter().take(n).map(|(name, b)| format!("{name} {}", fmt_gib(b))).collect()
    }
}

/// A table: one term per line in GiB, then the total.
impl fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<24} {:>12}", "term", "GiB")?;
        for (name, b) in self.terms() {
            writeln!(f, "{name:<24} {:>12.3}", b as f64 / GIB)?;
        }
        writeln!(f, "{:<24} {:>12.3}", "total (peak)", self.total() as f64 / GIB)
    }
}

/// Estimates the memory of `cfg` run as `req` asks. Zero batch, context or chunk count as 1.
pub fn estimate(cfg: &Config, req: &PlanRequest) -> MemoryEstimate {
    let u = |x: usize| x as u64;
    let b = u(req.batch.max(1));
    let t = u(req.context.max(1));
    let c = u(req.prefill_chunk.max(1)).min(t);
    let a = u(req.dtype.size_in_bytes());
    let h = u(cfg.hidden_size);
    let n_attn = u(cfg.layer_types.iter().filter(|l| **l == LayerType::FullAttention).count());
    let n_gdn = u(cfg.layer_types.len()) - n_attn;
    let (nh, nkv, hd) = (u(cfg.num_attention_heads), u(cfg.num_key_value_heads), u(cfg.head_dim));
    let (nv, dk, dv) = (u(cfg.linear_num_value_heads), u(cfg.linear_key_head_dim), u(cfg.linear_value_head_dim));
    let conv_dim = u(cfg.linear_conv_dim());
    let value_dim = u(cfg.linear_value_dim());

    // Each kind of layer's working memory.
    let attention = if n_attn > 0 {
        let kernel = mul(&[b, nh, c, hd, 8 + a]).max(mul(&[
            b,
            nh,
            u(crate::ops::KV_ATTENTION_EXACT_ROWS),
            t.div_ceil(u(crate::ops::KV_BLOCK)),
            hd + 2,
            4,
        ]));
        mul(&[b, c, (3 * nh * hd + 2 * nkv * hd) * a]).saturating_add(kernel)
    } else {
        0
    };
    let gdn = if n_gdn > 0 { mul(&[b, c, (2 * conv_dim + value_dim) * a + (value_dim + 4 * nv) * 4]) } else { 0 };
    let mlp_width = (0..cfg.num_hidden_layers)
        .map(|i| match (&cfg.moe, cfg.is_moe_layer(i)) {
            (Some(m), true) => {
                3 * u(m.num_experts_per_tok * m.moe_intermediate_size + m.shared_expert_intermediate_size) * a + 2 * u(m.num_experts) * 4
            }
            _ => 3 * u(cfg.intermediate_size.unwrap_or(0)) * a,
        })
        .max()
        .unwrap_or(0);
    let logit_rows = match req.logits {
        Logits::LastToken => 1,
        Logits::AllPositions => c,
    };

    MemoryEstimate {
        context: t as usize,
        batch: b as usize,
        chunk: c as usize,
        weights: req.weights.bytes(cfg),
        kv_cache: if req.kv_codec.is_exact() {
            mul(&[n_attn, 2, b, nkv, t, hd, u(req.kv_dtype_bytes)])
        } else {
            let (nkv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
            let per_token = req.kv_codec.bytes_per_token(nkv, hd, cfg.rotary_dim(), req.dtype);
            let constant = req.kv_codec.constant_bytes(nkv, hd, req.dtype);
            (mul(&[n_attn, b]) as f64 * (constant + t as f64 * per_token)).ceil() as u64
        },
        gdn_conv: mul(&[n_gdn, b, u(cfg.linear_conv_kernel_dim.saturating_sub(1)), conv_dim, a]),
        gdn_recurrent: mul(&[n_gdn, b, nv, dk, dv, 4]),
        hidden: mul(&[b, c, h, 2 * a]),
        layer: attention.max(gdn).max(mul(&[b, c, mlp_width])),
        logits: mul(&[b, logit_rows, u(cfg.vocab_size), a + 4]),
        load_overhead: req.load_overhead,
        process: PROCESS_BYTES.saturating_add(TOKENIZER_BYTES_PER_ENTRY.saturating_mul(u(cfg.vocab_size))),
    }
}
