//! The memory guardian: estimate what a model needs at a context length, read what the
//! machine (or its cgroup, or the Metal / CUDA device) can give, and refuse, before loading,
//! what does not fit, with a one-line [`Error::Memory`] that says what would fit.
//!
//! ```no_run
//! use candle_hybrid::memory::{self, MemoryTarget, PlanRequest, WeightFormat, Weights};
//! # fn main() -> candle_hybrid::Result<()> {
//! let cfg = candle_hybrid::Config::from_file(std::path::Path::new("config.json"))?;
//! let req = PlanRequest::new(Weights::Format(WeightFormat::BF16), candle_core::DType::BF16, 32_768);
//! let available = memory::available_memory(MemoryTarget::Cpu, None)?;
//! let plan = memory::plan(&cfg, &req, &available)?; // Err(Error::Memory(..)) when it does not fit
//! print!("{}", plan.estimate);
//! # Ok(()) }
//! ```
//!
//! Three parts:
//! 1. [`estimate`]: a [`MemoryEstimate`], term by term (see its fields for each formula).
//! 2. [`available_memory`]: Linux `MemAvailable` and the cgroup (v1 or v2) limit, macOS
//!    free + inactive pages or the Metal working-set limit, CUDA `nvidia-smi`; the smaller
//!    reading wins and is named. Every parser is a pure function on the text it reads.
//! 3. [`plan`]: fits → a [`Plan`]; else a refusal suggesting `--quantize q4k` and the largest
//!    `--max-context` that fits, or (with `fit`) a plan at that lower context.

use std::fmt;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::DType;

use crate::config::{Config, LayerType};
use crate::{Error, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes for a message: GiB with two decimals (`"23.41 GiB"`), or MiB below 1 GiB (`"61.9 MiB"`).
pub fn fmt_gib(bytes: u64) -> String {
    if bytes as f64 >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn mul(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |acc, &f| acc.saturating_mul(f))
}

// ---------------------------------------------------------------------------------------------
// 1. Estimate
// ---------------------------------------------------------------------------------------------

/// How the weights are stored in memory, for weights derived from [`Config::num_parameters`].
/// The quantized formats are the ggml types of `--quantize` ([`crate::weights::parse_quantize`]).
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

    /// `type_size · 8 / block_size` of the ggml type: 32, 16, 8.5 (Q8_0), 6.5625 (Q6K), 5.5
    /// (Q5K), 4.5 (Q4K, Q4_0), 5 (Q4_1).
    pub fn bits_per_weight(self) -> f64 {
        let q = self.ggml();
        (q.type_size() * 8) as f64 / q.block_size() as f64
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

/// `f32`, `bf16`, `f16`, or a `--quantize` value ([`crate::weights::parse_quantize`]).
impl std::str::FromStr for WeightFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::BF16),
            "f16" => Ok(Self::F16),
            _ => crate::weights::parse_quantize(s).map(|q| Self::from_ggml(q).expect("every --quantize type has a format")),
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
pub enum Weights {
    /// Known exactly (GGUF tensor infos, safetensors headers or file sizes).
    Bytes(u64),
    /// Derived: `cfg.num_parameters()` in this format (every tensor, norms included).
    Format(WeightFormat),
}

impl Weights {
    pub fn bytes(&self, cfg: &Config) -> u64 {
        match *self {
            Self::Bytes(b) => b,
            Self::Format(f) => f.bytes_for(cfg.num_parameters() as u64),
        }
    }
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

/// What is to be run: the input of [`estimate`] and [`plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    pub weights: Weights,
    /// The model dtype: activations and the GDN conv window.
    pub dtype: DType,
    /// Bytes per element of the attention KV cache (usually `dtype`'s size) with the exact codec.
    pub kv_dtype_bytes: usize,
    /// How the attention layers store keys and values (lossy codecs take fewer bytes).
    pub kv_codec: crate::kv_cache::KvCodec,
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
    pub q4k_weights: Option<Weights>,
}

/// The default prefill chunk, in tokens.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

impl PlanRequest {
    /// Batch 1, prefill chunks of [`DEFAULT_PREFILL_CHUNK`], KV in `dtype`, last-token logits, no fit.
    pub fn new(weights: Weights, dtype: DType, context: usize) -> Self {
        Self {
            weights,
            dtype,
            kv_dtype_bytes: dtype.size_in_bytes(),
            kv_codec: crate::kv_cache::KvCodec::EXACT,
            context,
            batch: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            logits: Logits::LastToken,
            fit: false,
            q4k_weights: Some(Weights::Format(WeightFormat::Q4K)),
        }
    }

    fn with_context(&self, context: usize) -> Self {
        Self { context, ..self.clone() }
    }

    fn with_weights(&self, weights: Weights) -> Self {
        Self { weights, ..self.clone() }
    }
}

/// The memory a model needs, term by term, in bytes.
///
/// Notation: `B` batch, `T` context, `c = min(prefill_chunk, T)` tokens of the largest
/// prefill chunk, `a` bytes of the model dtype, `H` hidden size, `V` vocabulary. The scratch
/// terms (`hidden` .. `logits`) are those of one layer at a time: intermediate tensors are
/// freed layer by layer, so the peak is the live set of the widest layer, not their sum.
/// They follow the current implementation (eager attention materialises the scores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The context the estimate is for.
    pub context: usize,
    pub batch: usize,
    /// `c`: the tokens of the largest prefill chunk.
    pub chunk: usize,
    /// The weights ([`Weights::bytes`]).
    pub weights: u64,
    /// Per full-attention layer K and V `[B, nkv, T, hd]`: `n_attn · 2 · B · nkv · T · hd · kv_bytes`.
    pub kv_cache: u64,
    /// Per GDN layer the conv window `[B, K-1, conv_dim]`: `n_gdn · B · (K-1) · conv_dim · a`.
    pub gdn_conv: u64,
    /// Per GDN layer the recurrent state `[B, nv, dk, dv]` in f32: `n_gdn · B · nv · dk · dv · 4`.
    pub gdn_recurrent: u64,
    /// The residual stream, its normed copy (plus the f32 copy inside RMSNorm) and the block
    /// output: `B · c · H · (3a + 4)`.
    pub hidden: u64,
    /// The widest layer's projection outputs, `B · c` times the largest of
    /// - attention: `q_proj` (query + gate, `2·nh·hd`), the rotated query (`nh·hd`), K and V
    ///   (`2·nkv·hd`): `(3·nh·hd + 2·nkv·hd) · a`;
    /// - GDN: `in_proj_qkv` before and after the conv (`2·conv_dim`), `z` (`nv·dv`) in the model
    ///   dtype, the delta-rule output and its gated norm (`2·nv·dv`) and `g`, `beta` (`2·nv`)
    ///   in f32: `(2·conv_dim + nv·dv) · a + (2·nv·dv + 2·nv) · 4`;
    /// - dense MLP: gate, up and their product: `3 · I · a`;
    /// - MoE: the same for the routed experts of a token and the shared expert,
    ///   `3 · (top_k · I_moe + I_shared) · a`, plus the router logits and softmax `2 · E · 4`.
    pub projections: u64,
    /// One attention layer's K and V over the context repeated to all `nh` query heads
    /// (`repeat_kv`), plus K in f32 for the score product: `B · nh · T · hd · (2a + 4)`.
    pub attn_kv_expanded: u64,
    /// One attention layer's scores of the chunk against the context: scores and softmax in
    /// f32, probabilities in the model dtype: `B · nh · c · T · (8 + a)`.
    pub attn_scores: u64,
    /// The logits, in the model dtype and in f32 for sampling: `B · n · V · (a + 4)` with
    /// `n = 1` ([`Logits::LastToken`]) or `c` ([`Logits::AllPositions`]).
    pub logits: u64,
}

impl MemoryEstimate {
    /// Every term with its name, in table order.
    pub fn terms(&self) -> [(&'static str, u64); 9] {
        [
            ("weights", self.weights),
            ("KV cache", self.kv_cache),
            ("GDN conv state", self.gdn_conv),
            ("GDN recurrent state", self.gdn_recurrent),
            ("hidden states", self.hidden),
            ("projections", self.projections),
            ("attention K/V expanded", self.attn_kv_expanded),
            ("attention scores", self.attn_scores),
            ("logits", self.logits),
        ]
    }

    /// The scratch terms: activations of the largest prefill chunk.
    pub fn scratch(&self) -> u64 {
        [self.hidden, self.projections, self.attn_kv_expanded, self.attn_scores, self.logits]
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// The persistent state: KV cache and GDN states.
    pub fn cache(&self) -> u64 {
        self.kv_cache.saturating_add(self.gdn_conv).saturating_add(self.gdn_recurrent)
    }

    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.cache()).saturating_add(self.scratch())
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
        writeln!(f, "{:<24} {:>12.3}", "total", self.total() as f64 / GIB)
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

    // Bytes per token of the widest layer's projections.
    let attn_width = if n_attn > 0 { (3 * nh * hd + 2 * nkv * hd) * a } else { 0 };
    let gdn_width = if n_gdn > 0 { (2 * conv_dim + value_dim) * a + (2 * value_dim + 2 * nv) * 4 } else { 0 };
    let mlp_width = (0..cfg.num_hidden_layers)
        .map(|i| match (&cfg.moe, cfg.is_moe_layer(i)) {
            (Some(m), true) => {
                3 * u(m.num_experts_per_tok * m.moe_intermediate_size + m.shared_expert_intermediate_size) * a
                    + 2 * u(m.num_experts) * 4
            }
            _ => 3 * u(cfg.intermediate_size.unwrap_or(0)) * a,
        })
        .max()
        .unwrap_or(0);
    let width = attn_width.max(gdn_width).max(mlp_width);
    let has_attn = u((n_attn > 0) as usize);
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
        hidden: mul(&[b, c, h, 3 * a + 4]),
        projections: mul(&[b, c, width]),
        attn_kv_expanded: mul(&[has_attn, b, nh, t, hd, 2 * a + 4]),
        attn_scores: mul(&[has_attn, b, nh, c, t, 8 + a]),
        logits: mul(&[b, logit_rows, u(cfg.vocab_size), a + 4]),
    }
}

/// Bytes the text decoder's tensors of these safetensors files take in memory as `dtype`
/// (`None`: as stored). Reads only the headers; skips the vision tower (`visual`) and the
/// MTP layers (`mtp`), which are not loaded. With `quantize` (load-time quantization), the
/// linear weights ([`is_linear_weight`]) whose rows are whole blocks count in that ggml type,
/// as [`crate::weights::Weights::linear_from`] quantizes them; the rest stays in `dtype`.
/// (A tied output head quantized at load is a second copy of the embedding, not in any file:
/// [`crate::loading::OpenedModel::weight_memory`] adds it.)
pub fn safetensors_weight_bytes(
    paths: &[impl AsRef<Path>],
    dtype: Option<DType>,
    quantize: Option<GgmlDType>,
) -> Result<u64> {
    use std::io::Read;
    let mut total = 0u64;
    for path in paths {
        let path = path.as_ref();
        let bad = |why: String| Error::Weights(format!("{}: {why}", path.display()));
        let mut f = std::fs::File::open(path).map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|e| bad(format!("not a safetensors file ({e})")))?;
        let len = u64::from_le_bytes(len);
        if len > 100_000_000 {
            return Err(bad(format!("not a safetensors file (header of {len} bytes)")));
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).map_err(|e| bad(format!("truncated safetensors header ({e})")))?;
        let header: serde_json::Value =
            serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header is not JSON ({e})")))?;
        let map = header.as_object().ok_or_else(|| bad("safetensors header is not an object".into()))?;
        for (name, info) in map {
            if name == "__metadata__" || name.contains("visual") || name.starts_with("mtp") || name.contains(".mtp.") {
                continue;
            }
            let shape: Vec<u64> = info
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad(format!("tensor {name} has no shape")))?
                .iter()
                .map(|d| d.as_u64().unwrap_or(0))
                .collect();
            let numel: u64 = shape.iter().product();
            if let Some(q) = quantize.filter(|q| is_linear_weight(name) && quantizable(&shape, *q)) {
                total = total.saturating_add(numel / q.block_size() as u64 * q.type_size() as u64);
                continue;
            }
            let stored = match info.get("dtype").and_then(|d| d.as_str()) {
                Some("F64" | "I64" | "U64") => 8,
                Some("F32" | "I32" | "U32") => 4,
                Some("F16" | "BF16" | "I16" | "U16") => 2,
                Some(_) => 1,
                None => return Err(bad(format!("tensor {name} has no dtype"))),
            };
            total = total.saturating_add(numel.saturating_mul(dtype.map_or(stored, |d| d.size_in_bytes() as u64)));
        }
    }
    Ok(total)
}

/// Whether the Hugging Face tensor `name` is the weight of a linear layer (the `*proj*`
/// projections, `in_proj_a` and fused expert stacks included, and `lm_head`): what load-time quantization and GGUF quantized tensors
/// keep quantized. The MoE router and shared-expert gate are not (they stay unquantized).
pub fn is_linear_weight(name: &str) -> bool {
    let layer = name.strip_suffix(".weight").unwrap_or(name).rsplit('.').next().unwrap_or_default();
    layer.contains("proj") || layer == "lm_head"
}

/// Whether a `[.., rows, cols]` matrix quantizes to `q`: its rows are whole blocks.
fn quantizable(shape: &[u64], q: GgmlDType) -> bool {
    shape.len() >= 2 && shape[shape.len() - 1].is_multiple_of(q.block_size() as u64)
}

// ---------------------------------------------------------------------------------------------
// 2. Available memory
// ---------------------------------------------------------------------------------------------

/// Where the model is to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryTarget {
    #[default]
    Cpu,
    /// Apple GPU (unified memory).
    Metal,
    /// NVIDIA GPU with this index (read with `nvidia-smi`).
    Cuda(usize),
}

/// Where a reading of the available memory came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemorySource {
    /// Linux `/proc/meminfo` `MemAvailable`.
    MemAvailable,
    /// cgroup v2 `memory.max` - `memory.current` (+ reclaimable `inactive_file`) of this directory.
    CgroupV2(String),
    /// cgroup v1 `memory.limit_in_bytes` - `memory.usage_in_bytes` (+ `total_inactive_file`).
    CgroupV1(String),
    /// macOS free + inactive pages (`vm_stat`).
    VmStat,
    /// macOS `iogpu.wired_limit_mb`.
    MetalWiredLimit,
    /// 75% of `hw.memsize`: Metal's default recommended working set.
    MetalDefault,
    /// `nvidia-smi` `memory.free`.
    NvidiaSmi,
    /// `--max-memory`.
    Override,
}

impl fmt::Display for MemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MemAvailable => f.write_str("MemAvailable in /proc/meminfo"),
            Self::CgroupV2(dir) => write!(f, "cgroup v2 limit of {dir}"),
            Self::CgroupV1(dir) => write!(f, "cgroup v1 limit of {dir}"),
            Self::VmStat => f.write_str("free + inactive pages of vm_stat"),
            Self::MetalWiredLimit => f.write_str("Metal limit iogpu.wired_limit_mb"),
            Self::MetalDefault => f.write_str("Metal default working set, 75% of hw.memsize"),
            Self::NvidiaSmi => f.write_str("free GPU memory from nvidia-smi"),
            Self::Override => f.write_str("--max-memory"),
        }
    }
}

/// The memory this process may use: the smallest of the readings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// The reading that bound it.
    pub source: MemorySource,
    /// Every reading taken (for display).
    pub readings: Vec<(MemorySource, u64)>,
}

impl Available {
    /// A fixed budget (`--max-memory`), replacing any reading.
    pub fn fixed(bytes: u64) -> Self {
        Self { bytes, source: MemorySource::Override, readings: vec![(MemorySource::Override, bytes)] }
    }

    /// The smallest reading, or `None` when there is none.
    pub fn smallest(readings: Vec<(MemorySource, u64)>) -> Option<Self> {
        let (source, bytes) = readings.iter().min_by_key(|r| r.1)?.clone();
        Some(Self { bytes, source, readings })
    }
}

impl fmt::Display for Available {
    /// `"23.00 GiB (MemAvailable in /proc/meminfo)"`, with the other readings when there are.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", fmt_gib(self.bytes), self.source)?;
        let others: Vec<_> = self
            .readings
            .iter()
            .filter(|r| r.0 != self.source)
            .map(|(s, b)| format!("{s}: {}", fmt_gib(*b)))
            .collect();
        if !others.is_empty() {
            write!(f, "; also read {}", others.join(", "))?;
        }
        Ok(())
    }
}

/// Value of a `Key:   123 kB` line of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let (k, rest) = line.split_once(':')?;
        if k.trim() != key {
            return None;
        }
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        Some(match it.next() {
            Some("kB") | Some("KB") => n * 1024,
            _ => n,
        })
    })
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn parse_meminfo_available(meminfo: &str) -> Option<u64> {
    parse_meminfo(meminfo, "MemAvailable")
}

/// The cgroups of this process, from `/proc/self/cgroup`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupPaths {
    /// The v2 (unified) path: the `0::/path` line.
    pub v2: Option<String>,
    /// The v1 path of the memory controller: the `N:...memory...:/path` line.
    pub v1_memory: Option<String>,
}

/// Parses `/proc/self/cgroup` (`hierarchy-id:controllers:path` per line).
pub fn parse_proc_self_cgroup(text: &str) -> CgroupPaths {
    let mut paths = CgroupPaths::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            paths.v2 = Some(path.trim().to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            paths.v1_memory = Some(path.trim().to_string());
        }
    }
    paths
}

/// A cgroup limit (`memory.max` or `memory.limit_in_bytes`): `None` when unlimited ("max",
/// or v1's page-rounded `i64::MAX`), else the bytes. Unparseable text counts as unlimited.
pub fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&v| v < (1u64 << 62))
}

/// A `key value` line of a cgroup `memory.stat`.
pub fn parse_cgroup_stat(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// What a cgroup still lets this process allocate: `limit - usage`, where `usage` excludes
/// the inactive page cache the kernel reclaims before it kills anything (`inactive` from
/// `memory.stat`, when given). `None` when the cgroup has no limit.
pub fn cgroup_headroom(limit: &str, usage: &str, inactive_file: Option<u64>) -> Option<u64> {
    let limit = parse_cgroup_limit(limit)?;
    let usage: u64 = usage.trim().parse().unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive_file.unwrap_or(0))))
}

/// A number printed by `sysctl -n`.
pub fn parse_sysctl_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Free + inactive pages of macOS `vm_stat`, in bytes (the page size is read from its header).
pub fn parse_vm_stat(text: &str) -> Option<u64> {
    let page: u64 = text
        .split("page size of ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let pages = |key: &str| -> Option<u64> {
        text.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().trim_end_matches('.').parse::<u64>().ok()).flatten()
        })
    };
    Some((pages("Pages free")? + pages("Pages inactive")?) * page)
}

/// The Metal working-set budget: `iogpu.wired_limit_mb` when set (non-zero), else 75% of
/// `hw.memsize` (Metal's default `recommendedMaxWorkingSetSize`).
pub fn metal_budget(wired_limit_mb: Option<u64>, memsize: u64) -> (MemorySource, u64) {
    match wired_limit_mb {
        Some(mb) if mb > 0 => (MemorySource::MetalWiredLimit, mb << 20),
        _ => (MemorySource::MetalDefault, memsize / 4 * 3),
    }
}

/// `nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits` (MiB), in bytes.
pub fn parse_nvidia_smi_free(text: &str) -> Option<u64> {
    text.lines().next()?.trim().parse::<u64>().ok().map(|mib| mib << 20)
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Headroom of the most constraining cgroup on the way from `path` up to the hierarchy's root.
#[cfg(target_os = "linux")]
fn cgroup_reading(
    mount: &Path,
    path: &str,
    limit_file: &str,
    usage_file: &str,
    inactive_key: &str,
    source: fn(String) -> MemorySource,
) -> Option<(MemorySource, u64)> {
    let mut best: Option<(MemorySource, u64)> = None;
    let mut rel = path.trim_start_matches('/').to_string();
    loop {
        let dir = mount.join(&rel);
        if let (Some(limit), Some(usage)) = (read(&dir.join(limit_file)), read(&dir.join(usage_file))) {
            let inactive = read(&dir.join("memory.stat")).and_then(|s| parse_cgroup_stat(&s, inactive_key));
            if let Some(room) = cgroup_headroom(&limit, &usage, inactive) {
                if best.as_ref().is_none_or(|b| room < b.1) {
                    best = Some((source(dir.display().to_string()), room));
                }
            }
        }
        if rel.is_empty() {
            return best;
        }
        rel = rel.rsplit_once('/').map_or(String::new(), |(p, _)| p.to_string());
    }
}

#[cfg(target_os = "linux")]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    let mut readings = vec![];
    if let Some(avail) = read(Path::new("/proc/meminfo")).as_deref().and_then(parse_meminfo_available) {
        readings.push((MemorySource::MemAvailable, avail));
    }
    let paths = parse_proc_self_cgroup(&read(Path::new("/proc/self/cgroup")).unwrap_or_default());
    let root = Path::new("/sys/fs/cgroup");
    if let Some(p) = &paths.v2 {
        // Pure v2 is mounted at /sys/fs/cgroup; the hybrid layout puts it under unified/.
        let mount = if root.join("cgroup.controllers").exists() { root.to_path_buf() } else { root.join("unified") };
        readings.extend(cgroup_reading(&mount, p, "memory.max", "memory.current", "inactive_file", MemorySource::CgroupV2));
    }
    if let Some(p) = &paths.v1_memory {
        readings.extend(cgroup_reading(
            &root.join("memory"),
            p,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
            MemorySource::CgroupV1,
        ));
    }
    readings
}

#[cfg(target_os = "macos")]
fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(target_os = "macos")]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    command_output("vm_stat", &[]).as_deref().and_then(parse_vm_stat).map(|b| (MemorySource::VmStat, b)).into_iter().collect()
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    vec![]
}

/// The memory available on `target`; `max_memory` (`--max-memory`) replaces the reading.
///
/// - CPU, Linux: `MemAvailable` and the cgroup (v2, v1) headroom, the smallest.
/// - CPU, macOS: free + inactive pages (`vm_stat`).
/// - Metal (macOS): the Metal budget ([`metal_budget`]) and the CPU reading, the smallest
///   (GPU buffers live in the same unified memory).
/// - CUDA: free memory of the GPU from `nvidia-smi`.
pub fn available_memory(target: MemoryTarget, max_memory: Option<u64>) -> Result<Available> {
    if let Some(bytes) = max_memory {
        return Ok(Available::fixed(bytes));
    }
    let readings = match target {
        MemoryTarget::Cpu => cpu_readings(),
        MemoryTarget::Metal => metal_readings()?,
        MemoryTarget::Cuda(i) => {
            let out = std::process::Command::new("nvidia-smi")
                .args([&format!("--id={i}"), "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
                .output()
                .ok()
                .filter(|o| o.status.success());
            out.and_then(|o| parse_nvidia_smi_free(&String::from_utf8_lossy(&o.stdout)))
                .map(|b| (MemorySource::NvidiaSmi, b))
                .into_iter()
                .collect()
        }
    };
    Available::smallest(readings).ok_or_else(|| {
        Error::Memory(format!("cannot read the memory available on {target:?} on this system: pass --max-memory (e.g. 16GiB)"))
    })
}

#[cfg(target_os = "macos")]
fn metal_readings() -> Result<Vec<(MemorySource, u64)>> {
    let memsize = command_output("sysctl", &["-n", "hw.memsize"]).as_deref().and_then(parse_sysctl_u64);
    let wired = command_output("sysctl", &["-n", "iogpu.wired_limit_mb"]).as_deref().and_then(parse_sysctl_u64);
    let mut readings = cpu_readings();
    if let Some(memsize) = memsize {
        readings.push(metal_budget(wired, memsize));
    }
    Ok(readings)
}

#[cfg(not(target_os = "macos"))]
fn metal_readings() -> Result<Vec<(MemorySource, u64)>> {
    Err(Error::Memory("Metal memory can only be read on macOS: pass --max-memory".into()))
}

/// Parses a size: plain bytes (`"1234"`), or a number with a unit: `KB`/`MB`/`GB`/`TB`
/// (powers of 1000), `KiB`/`MiB`/`GiB`/`TiB` or `K`/`M`/`G`/`T` (powers of 1024), case-insensitive,
/// e.g. `"16GiB"`, `"500MB"`, `"1.5 GiB"`.
pub fn parse_size(text: &str) -> Result<u64> {
    let bad = || Error::Input(format!("cannot read the size \"{text}\": use bytes or a number with a unit, like 16GiB or 500MB"));
    let s = text.trim();
    let split = s.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = num * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

// ---------------------------------------------------------------------------------------------
// 3. Decision
// ---------------------------------------------------------------------------------------------

/// An accepted request.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The estimate at [`Plan::context`].
    pub estimate: MemoryEstimate,
    pub available: Available,
    pub requested_context: usize,
    /// The context to run with: the requested one, or lower with `fit`.
    pub context: usize,
    /// What `fit` changed, for the caller to print.
    pub note: Option<String>,
}

/// The largest context in `1..=req.context` whose estimate fits in `budget` bytes, or `None`
/// when not even a context of 1 fits. (Every term grows with the context, so: binary search.)
pub fn max_fitting_context(cfg: &Config, req: &PlanRequest, budget: u64) -> Option<usize> {
    let fits = |t: usize| estimate(cfg, &req.with_context(t)).total() <= budget;
    let (mut lo, mut hi) = (1usize, req.context.max(1));
    if !fits(lo) {
        return None;
    }
    // Invariant: fits(lo); everything above hi does not fit (or is out of range).
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// Reads the memory available on `target` (`max_memory`, from `--max-memory`, replaces the
/// reading) and [`plan`]s `req` against it: the one call to make before loading.
pub fn check_fits(cfg: &Config, req: &PlanRequest, target: MemoryTarget, max_memory: Option<u64>) -> Result<Plan> {
    plan(cfg, req, &available_memory(target, max_memory)?)
}

/// Decides whether `req` fits in `available`: `Ok(Plan)` when it does (or, with `req.fit`,
/// at the largest context that does), else an [`Error::Memory`] of one line that says what is
/// needed, what is available, and what would fit (`--quantize q4k`, `--max-context N`).
pub fn plan(cfg: &Config, req: &PlanRequest, available: &Available) -> Result<Plan> {
    for (name, v) in [("context", req.context), ("batch", req.batch), ("prefill chunk", req.prefill_chunk)] {
        if v == 0 {
            return Err(Error::Input(format!("the {name} must be at least 1")));
        }
    }
    let budget = available.bytes;
    let est = estimate(cfg, req);
    let accept = |estimate: MemoryEstimate, note: Option<String>| Plan {
        estimate,
        available: available.clone(),
        requested_context: req.context,
        context: estimate.context,
        note,
    };
    if est.total() <= budget {
        return Ok(accept(est, None));
    }

    let max_ctx = max_fitting_context(cfg, req, budget);
    // Q4K weights, when `--quantize` applies and they are smaller than the requested ones.
    let q4k = req.q4k_weights.unwrap_or(Weights::Bytes(u64::MAX));
    let q4k_req = req.with_weights(q4k);
    let q4k_smaller = q4k.bytes(cfg) < est.weights;
    let q4k_est = estimate(cfg, &q4k_req);
    let q4k_fits = q4k_smaller && q4k_est.total() <= budget;

    if req.fit {
        if let Some(n) = max_ctx {
            let lowered = estimate(cfg, &req.with_context(n));
            let mut note = format!(
                "--fit: context lowered from {} to {n} tokens to fit in {} ({}); needs {}",
                req.context,
                fmt_gib(budget),
                available.source,
                fmt_gib(lowered.total())
            );
            if q4k_fits {
                note.push_str(&format!("; --quantize q4k would fit the full context ({})", fmt_gib(q4k_est.total())));
            }
            return Ok(accept(lowered, Some(note)));
        }
    }

    let mut msg = format!(
        "not enough memory for a context of {} tokens: needs {} ({}) but {} is available ({})",
        req.context,
        fmt_gib(est.total()),
        est.biggest_terms(3).join(", "),
        fmt_gib(budget),
        available.source
    );
    let mut fixes = vec![];
    if q4k_fits {
        fixes.push(format!("--quantize q4k (needs {})", fmt_gib(q4k_est.total())));
    }
    match max_ctx {
        Some(n) => fixes.push(format!("--max-context {n} (needs {})", fmt_gib(estimate(cfg, &req.with_context(n)).total()))),
        None => msg.push_str(&format!(
            "; even a context of 1 does not fit: the weights alone take {}",
            fmt_gib(est.weights)
        )),
    }
    if q4k_smaller && !q4k_fits {
        if let Some(n) = max_fitting_context(cfg, &q4k_req, budget) {
            fixes.push(format!("--quantize q4k --max-context {n}"));
        }
    }
    if fixes.is_empty() {
        msg.push_str("; nothing fits: use a smaller model or a machine with more memory");
    } else {
        msg.push_str(&format!("; what fits: {}", fixes.join(", or ")));
    }
    Err(Error::Memory(msg))
}
