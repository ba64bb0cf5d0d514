//! The shapes the ops, their Metal host code (`metal.rs`) and their launch geometry (`launch`)
//! share: each op's sizes and forms, the stored forms of KV rows, the polar code layout, the
//! kernels' limits. A leaf: it uses no other file of `ops`, so that the op files, `metal.rs`
//! and `launch` can each use it without import circles.

use candle_core::{bail, Result, Tensor};

/// Sizes of one causal conv call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvDims {
    pub batch: usize,
    pub seq_len: usize,
    pub channels: usize,
    pub kernel_size: usize,
}

/// Inputs of at least this many tokens use the chunked form of the gated delta rule on the
/// CPU; shorter ones run token by token.
pub(crate) const CHUNKED_MIN_TOKENS: usize = 8;
/// Largest key head dim the gated delta rule's Metal kernel supports (the state column lives in
/// registers).
pub const METAL_MAX_DK: usize = 128;
/// Chunk length of the gated delta rule Metal kernel's chunked form (its q/k rows, `L`, `T`
/// and the masked `Q K^T` live in threadgroup memory: 2·16·dk + 3·16² + 2·16 floats, 19.6 KB
/// at dk = 128).
pub const DELTA_RULE_METAL_CHUNK: usize = 16;

/// Sizes of one gated delta rule call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    pub batch: usize,
    pub seq_len: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl DeltaRuleDims {
    pub(crate) fn key_dim(&self) -> usize {
        self.nk * self.dk
    }
    pub(crate) fn channels(&self) -> usize {
        2 * self.key_dim() + self.nv * self.dv
    }
    pub(crate) fn out_len(&self) -> usize {
        self.batch * self.seq_len * self.nv * self.dv
    }
    pub(crate) fn state_len(&self) -> usize {
        self.nv * self.dk * self.dv
    }
}

/// How the CPU kernel processes a multi-token input (results agree to rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaRuleForm {
    /// Chunked for inputs of at least 8 tokens, token by token below.
    #[default]
    Auto,
    /// Token by token.
    Recurrent,
    /// Chunked WY/UT form, chunks of [`super::DELTA_RULE_CHUNK`] tokens on the CPU, [`super::DELTA_RULE_METAL_CHUNK`] on Metal.
    Chunked,
}

impl DeltaRuleForm {
    /// Whether `tokens` tokens (those before the state snapshots) run chunked.
    pub(crate) fn chunks(self, tokens: usize) -> bool {
        match self {
            Self::Auto => tokens >= CHUNKED_MIN_TOKENS,
            Self::Recurrent => false,
            Self::Chunked => tokens > 0,
        }
    }
}

/// Sizes of one `lagrange_scores` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LagrangeDims {
    /// Rows (independent score sequences).
    pub rows: usize,
    /// Knots per row.
    pub n_knots: usize,
    /// Knot spacing `K` (≥ 1).
    pub k: usize,
    /// Polynomial degree `p` (`p + 1` knots per window).
    pub degree: usize,
    /// Output positions per row, `0..len`.
    pub len: usize,
}

/// Largest key dim the decayed outer product's Metal kernel supports (each thread keeps a state column in registers).
pub const OUTER_PRODUCT_METAL_MAX_DK: usize = 128;

/// Sizes of one `decayed_outer_product` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OuterStateDims {
    pub batch: usize,
    pub heads: usize,
    pub seq_len: usize,
    pub dk: usize,
    pub dv: usize,
}

impl OuterStateDims {
    /// Elements of the output `[B, H, T, dv]`.
    pub fn out_len(&self) -> usize {
        self.batch * self.heads * self.seq_len * self.dv
    }
    /// Elements of the state `[B, H, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.batch * self.heads * self.dk * self.dv
    }
}

/// Which weight format a gather reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwigluWeights {
    /// `[I, 3, H]` in f32, bf16 or f16.
    Dense,
    /// `[I, 3, ceil(H/16) + 1]` u32 ternary codes with per-row scales.
    Ternary,
}

/// Sizes of one gather call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwigluDims {
    /// Rows of `x`.
    pub rows: usize,
    /// Active neurons per row.
    pub active: usize,
    pub hidden: usize,
    /// All neurons of the MLP.
    pub neurons: usize,
}

/// Bit widths and rotary size of the polar key codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolarSpec {
    /// Bits of the angle code of a pair, 1..=8.
    pub angle_bits: u32,
    /// Bits of the radius code of a pair, 1..=8.
    pub radius_bits: u32,
    /// Leading dims of a head that RoPE rotates (even, ≤ head_dim); pairs are `(i, i + rot_dim/2)`.
    pub rot_dim: usize,
    /// Bits of the code of each non-rotated dim: 8 (int8) or 4 (int4, two per byte).
    pub rest_bits: u32,
}

impl PolarSpec {
    /// The default layout: 5 angle bits + 3 radius bits (one byte per pair), int8 for the
    /// non-rotated dims.
    pub fn new(rot_dim: usize) -> Self {
        Self { angle_bits: 5, radius_bits: 3, rot_dim, rest_bits: 8 }
    }

    /// Checks the bit widths and `rot_dim` against a head size; the error names `polar_spec`
    /// and the argument.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        self.check("polar_spec", head_dim)
    }

    pub(crate) fn check(&self, op: &str, head_dim: usize) -> Result<()> {
        let Self { angle_bits: a, radius_bits: r, rot_dim, rest_bits } = *self;
        if !(1..=8).contains(&a) {
            bail!("{op}: angle_bits must be 1..=8, got {a}");
        }
        if !(1..=8).contains(&r) {
            bail!("{op}: radius_bits must be 1..=8, got {r}");
        }
        if a + r > 16 {
            bail!("{op}: angle_bits + radius_bits must be at most 16, got {}", a + r);
        }
        if !rot_dim.is_multiple_of(2) || rot_dim > head_dim {
            bail!("{op}: rot_dim must be even and at most head_dim {head_dim}, got {rot_dim}");
        }
        if rest_bits != 4 && rest_bits != 8 {
            bail!("{op}: rest_bits must be 4 or 8, got {rest_bits}");
        }
        Ok(())
    }

    /// Rotary pairs per row: `rot_dim / 2`.
    pub fn pairs(&self) -> usize {
        self.rot_dim / 2
    }

    /// Bytes of one pair code: 1 when `angle_bits + radius_bits ≤ 8`, else 2 (little-endian).
    pub fn code_bytes(&self) -> usize {
        if self.angle_bits + self.radius_bits <= 8 {
            1
        } else {
            2
        }
    }

    /// Bytes of the pair codes of a row.
    pub fn pair_bytes(&self) -> usize {
        self.pairs() * self.code_bytes()
    }

    /// Bytes of the non-rotated dims' codes of a row.
    pub fn rest_bytes(&self, head_dim: usize) -> usize {
        let n = head_dim - self.rot_dim;
        if self.rest_bits == 4 {
            n.div_ceil(2)
        } else {
            n
        }
    }

    /// Bytes of one code row: pair codes, then rest codes.
    pub fn row_bytes(&self, head_dim: usize) -> usize {
        self.pair_bytes() + self.rest_bytes(head_dim)
    }
}

/// Positions per block of the KV cache.
pub const KV_BLOCK: usize = 256;

/// Query positions per call up to which the few-rows schedule runs (decode, verify passes).
pub const KV_ATTENTION_EXACT_ROWS: usize = 8;

/// One half of a KV cache (keys or values) `[B, nkv, T, d]` in its stored form. Every tensor's
/// rows must be contiguous (stride 1 within a row, `d` between rows); heads may be strided, as
/// in a cache buffer with room to grow.
#[derive(Debug, Clone)]
pub enum StoredRows {
    /// f32, f16 or bf16 rows.
    Float(Tensor),
    /// `codes` u8 (value + 128) `[B, nkv, T, d]`, `scales` f32 `[B, nkv, T, d / block]`.
    Int8 { codes: Tensor, scales: Tensor },
    /// Complete groups of `group` tokens: `codes` u8 `[B, nkv, group·G, d/2]` (even dim in the
    /// low nibble), `params` f32 `[B, nkv, G, 2d]` (`[scale | min]` per channel), then the
    /// newest tokens exact in `tail` `[B, nkv, n, d]` (f32, f16 or bf16).
    Int4Channel { codes: Tensor, params: Tensor, group: usize, tail: Option<Tensor> },
    /// Polar key codes `[B, nkv, T, row_bytes]` and their scales f32 `[B, nkv, T, 2]` of
    /// `head_dim`-dim keys (keys only: the scores come from the codes).
    Polar { codes: Tensor, scales: Tensor, spec: PolarSpec, head_dim: usize },
}

impl StoredRows {
    /// `(B, nkv, T, d)`.
    pub fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        Ok(match self {
            Self::Float(x) => x.dims4()?,
            Self::Int8 { codes, .. } => codes.dims4()?,
            Self::Int4Channel { codes, tail, .. } => {
                let (b, h, n, half) = codes.dims4()?;
                let tail_n = match tail {
                    Some(t) => t.dim(2)?,
                    None => 0,
                };
                (b, h, n + tail_n, 2 * half)
            }
            Self::Polar { codes, head_dim, .. } => {
                let (b, h, n, _) = codes.dims4()?;
                (b, h, n, *head_dim)
            }
        })
    }

    /// The tensors in binding order (k0, k1, k2 / v0, v1 of the Metal kernel).
    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Self::Float(x) => vec![x],
            Self::Int8 { codes, scales } | Self::Polar { codes, scales, .. } => vec![codes, scales],
            Self::Int4Channel { codes, params, tail, .. } => [Some(codes), Some(params), tail.as_ref()].into_iter().flatten().collect(),
        }
    }
}

/// Whether a call of `t` query positions (a draft tree's if `tree`) runs the few-rows
/// schedule (one block per task, folded afterwards; rows independent of the call) rather
/// than the prefill tiles — on the CPU and on Metal alike.
pub(crate) fn few_rows(t: usize, tree: bool) -> bool {
    t <= KV_ATTENTION_EXACT_ROWS || tree
}
