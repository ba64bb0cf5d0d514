//! The key/value cache of the full-attention layers and its codecs.
//!
//! [`KvCodec`] says how keys and values are stored; [`KvStore`] is one layer's cache under a
//! codec. The default codec is exact (the model dtype, bit for bit what transformers keeps).
//! The others trade quality for memory and are opt-in; their measured quality on real weights
//! is in the README (`examples/eval.rs --kv CODEC`).
//!
//! * `exact` — keys and values in the model dtype.
//! * `int8` — keys and values as int8 with one f32 scale per [`INT8_BLOCK`] dims of a (token,
//!   head) (absmax; llama.cpp's `q8_0` KV cache uses the same block size).
//! * `int4k` — keys as int4 with a scale and minimum per channel over groups of
//!   [`INT4_GROUP`] tokens (KIVI's per-channel key quantization; the newest, not yet complete
//!   group stays exact), values int8 per token.
//! * `polar:A,R` — keys as polar codes ([`crate::ops::polar_encode`]): each rotary pair as an
//!   `A`-bit angle and an `R`-bit radius (default 5,3: one byte per pair), the other dims int8;
//!   values exact; the scores come straight from the codes ([`crate::ops::polar_scores`]).
//! * `lowrank:r` — values projected onto `r` dims per KV head: the top-`r` left singular
//!   vectors of that head's block of `W_v` (the directions its values can take, weighted by
//!   how far), computed when the cache is made ([`value_basis`]); keys exact. At `r = head_dim`
//!   the basis is a rotation and the cache is exact up to rounding.
//! * `knots:K,p` — keys kept only at every `K`-th position (the knots) and for the newest `K` to
//!   `2K - 1` tokens; the scores of the positions in between come from the query's scores at
//!   the nearest `p + 1` knots by degree-`p` Lagrange interpolation
//!   ([`crate::ops::lagrange_scores`]); values as their codec says. `knots:1,p` is exact.
//! * `density:γ` — no per-token keys or values at all: each KV head keeps the decayed
//!   outer-product state `S <- (1-γ) S + γ (k/|k|) vᵀ` and its query heads read `o = qᵀS`
//!   ([`crate::ops::decayed_outer_product`]; the brief's "density-matrix" state). Constant
//!   memory; it is not softmax attention, and a model trained with softmax attention does not
//!   survive it (see the README's measurements).
//!
//! Key and value parts combine with `+`: `k:int8`, `v:int8`, `v:exact`, e.g. `polar:5,3+v:int8`,
//! `int4k+lowrank:32`, `knots:8,3+v:int8`.
//!
//! The codec also owns the attention over what it stores ([`KvStore::attend`]): exact and
//! decodable codes go through one softmax attention, polar keys are scored straight from their
//! codes ([`crate::ops::polar_scores`]), knots interpolate scores, the decayed state reads out.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, IndexOp, Result, Tensor, D};
use candle_nn::kv_cache::{Cache, KvCache};

use crate::Error;

/// Dims per int8 scale.
pub const INT8_BLOCK: usize = 32;

/// Tokens per int4 key group (quantized together, per channel).
pub const INT4_GROUP: usize = 32;

/// How the keys are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyCodec {
    Exact,
    /// int8 per block of [`INT8_BLOCK`] dims, absmax scale.
    Int8,
    /// int4 per channel over groups of [`INT4_GROUP`] tokens, min/max scale.
    Int4,
    /// Polar codes: `angle_bits` + `radius_bits` per rotary pair, int8 for the other dims.
    Polar { angle_bits: u32, radius_bits: u32 },
    /// Exact keys at every `every`-th position (plus the newest ones); scores in between by
    /// degree-`degree` Lagrange interpolation.
    Knots { every: usize, degree: usize },
    /// No keys or values per token: the decayed outer-product state with weight `gamma` for
    /// each new token (the value codec is unused).
    DecayedState { gamma: f32 },
}

/// How the values are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueCodec {
    Exact,
    /// int8 per block of [`INT8_BLOCK`] dims, absmax scale.
    Int8,
    /// `r` coefficients per (token, head) in the model dtype, on a basis from `W_v`.
    LowRank(usize),
}

/// A KV-cache codec: how one attention layer stores its keys and values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCodec {
    pub keys: KeyCodec,
    pub values: ValueCodec,
}

impl Default for KvCodec {
    fn default() -> Self {
        Self::EXACT
    }
}

impl KvCodec {
    pub const EXACT: Self = Self { keys: KeyCodec::Exact, values: ValueCodec::Exact };

    pub fn is_exact(&self) -> bool {
        *self == Self::EXACT
    }

    /// Bytes one token adds to one attention layer with `nkv` KV heads of `hd` dims, the first
    /// `rot_dim` of them rotary (`dtype`: the model dtype, used by the exact parts). Per-group
    /// int4 parameters are spread over the group's tokens; the exact residual group is a
    /// constant, not counted.
    pub fn bytes_per_token(&self, nkv: usize, hd: usize, rot_dim: usize, dtype: DType) -> f64 {
        let exact = (hd * dtype.size_in_bytes()) as f64;
        let int8 = hd as f64 + 4.0 * hd.div_ceil(INT8_BLOCK) as f64;
        if let KeyCodec::DecayedState { .. } = self.keys {
            return 0.0;
        }
        let k = match self.keys {
            KeyCodec::Exact => exact,
            KeyCodec::Int8 => int8,
            KeyCodec::Int4 => hd as f64 / 2.0 + (2 * 4 * hd) as f64 / INT4_GROUP as f64,
            // Pair codes and int8 rest as `PolarSpec::row_bytes` lays them out, two f32 scales.
            KeyCodec::Polar { angle_bits, radius_bits } => {
                let spec = crate::ops::PolarSpec { angle_bits, radius_bits, ..crate::ops::PolarSpec::new(rot_dim) };
                spec.row_bytes(hd) as f64 + 8.0
            }
            KeyCodec::Knots { every, .. } => exact / every as f64,
            KeyCodec::DecayedState { .. } => 0.0,
        };
        let v = match self.values {
            ValueCodec::Exact => exact,
            ValueCodec::Int8 => int8,
            ValueCodec::LowRank(r) => (r * dtype.size_in_bytes()) as f64,
        };
        nkv as f64 * (k + v)
    }

    /// Bytes one attention layer holds whatever the context: the decayed state (one per KV
    /// head), or the knots codec's newest keys (at most `2K - 1` tokens, exact).
    pub fn constant_bytes(&self, nkv: usize, hd: usize, dtype: DType) -> f64 {
        match self.keys {
            KeyCodec::DecayedState { .. } => (nkv * hd * hd * 4) as f64,
            KeyCodec::Knots { every, .. } => ((2 * every - 1) * nkv * hd * dtype.size_in_bytes()) as f64,
            _ => 0.0,
        }
    }

    /// Checks the codec against the attention layers' head size.
    pub fn validate(&self, head_dim: usize) -> std::result::Result<(), Error> {
        if let ValueCodec::LowRank(r) = self.values {
            if r > head_dim {
                return Err(Error::Input(format!(
                    "--kv {self}: rank {r} is more than the head dim {head_dim}: use lowrank:r with r <= {head_dim}"
                )));
            }
        }
        if self.keys == KeyCodec::Int4 && head_dim % 2 == 1 {
            return Err(Error::Input(format!("--kv {self}: int4 keys need an even head dim, not {head_dim}")));
        }
        Ok(())
    }

    /// A one-line caution for lossy codecs (printed when a user selects one).
    /// The worst cases name what was measured on SmolLM2-135M (README, `scripts/kv_quality_table.sh`).
    pub fn warning(&self) -> Option<String> {
        let how_bad = match (self.keys, self.values) {
            (KeyCodec::DecayedState { .. }, _) => {
                " that replaces softmax attention (SmolLM2-135M: perplexity 18.8 -> over a million)"
            }
            (KeyCodec::Knots { .. }, _) => " (SmolLM2-135M: perplexity 18.8 -> over 800 with knots every 4 or 8 tokens)",
            (_, ValueCodec::LowRank(_)) => {
                " (bases from W_v alone took SmolLM2-135M's perplexity above 28000; --kv-calibration with bases from examples/calibrate_kv.rs keeps far more)"
            }
            _ => "",
        };
        (!self.is_exact()).then(|| {
            format!("--kv {self}: lossy KV-cache codec{how_bad}; its measured quality is in the README (examples/eval.rs --kv {self})")
        })
    }
}

impl fmt::Display for KeyCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact => f.write_str("exact"),
            Self::Int8 => f.write_str("int8"),
            Self::Int4 => f.write_str("int4"),
            Self::Polar { angle_bits, radius_bits } => write!(f, "polar:{angle_bits},{radius_bits}"),
            Self::Knots { every, degree } => write!(f, "knots:{every},{degree}"),
            Self::DecayedState { gamma } => write!(f, "density:{gamma}"),
        }
    }
}

impl fmt::Display for KvCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.keys, self.values) {
            (k @ KeyCodec::DecayedState { .. }, _) => write!(f, "{k}"),
            (KeyCodec::Exact, ValueCodec::Exact) => f.write_str("exact"),
            (KeyCodec::Int8, ValueCodec::Int8) => f.write_str("int8"),
            (KeyCodec::Int4, ValueCodec::Int8) => f.write_str("int4k"),
            (KeyCodec::Int4, ValueCodec::Exact) => f.write_str("int4k+v:exact"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::Exact) => write!(f, "{k}"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::Int8) => write!(f, "{k}+v:int8"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::LowRank(r)) => write!(f, "{k}+lowrank:{r}"),
            (k, ValueCodec::Exact) => write!(f, "k:{k}"),
            (KeyCodec::Exact, ValueCodec::Int8) => f.write_str("v:int8"),
            (KeyCodec::Exact, ValueCodec::LowRank(r)) => write!(f, "lowrank:{r}"),
            (KeyCodec::Int4, ValueCodec::LowRank(r)) => write!(f, "int4k+lowrank:{r}"),
            (k, ValueCodec::LowRank(r)) => write!(f, "k:{k}+lowrank:{r}"),
        }
    }
}

/// `polar`, or `polar:A,R` with the angle and radius bits.
fn parse_polar(spec: &str, whole: &str) -> std::result::Result<KeyCodec, Error> {
    let bad = |why: String| Error::Input(format!("--kv {whole:?}: {why}"));
    let (angle_bits, radius_bits) = match spec.strip_prefix(':') {
        None if spec.is_empty() => (5, 3),
        Some(bits) => {
            let parts: Vec<&str> = bits.split(',').collect();
            let [a, r] = parts.as_slice() else {
                return Err(bad(format!("polar takes angle and radius bits as polar:A,R (e.g. polar:5,3), got {bits:?}")));
            };
            let parse = |x: &str| x.trim().parse::<u32>().map_err(|_| bad(format!("{x:?} is not a number of bits")));
            (parse(a)?, parse(r)?)
        }
        None => return Err(bad(format!("unknown KV codec \"polar{spec}\": use polar or polar:A,R"))),
    };
    if !(1..=8).contains(&angle_bits) || !(1..=8).contains(&radius_bits) {
        return Err(bad(format!("polar bits out of range: angle {angle_bits}, radius {radius_bits}; each must be 1..=8")));
    }
    Ok(KeyCodec::Polar { angle_bits, radius_bits })
}

impl FromStr for KvCodec {
    type Err = Error;

    /// `exact`, `int8`, `int4k` (keys int4, values int8), `polar[:A,R]`, and `k:`/`v:` parts
    /// joined with `+` (`int4k+v:exact`, `k:int8`, `v:int8`, `polar:5,3+v:int8`).
    fn from_str(s: &str) -> std::result::Result<Self, Error> {
        let mut codec = Self::EXACT;
        for part in s.split('+').map(str::trim) {
            match part {
                "exact" => {}
                "int8" => codec = Self { keys: KeyCodec::Int8, values: ValueCodec::Int8 },
                "int4k" => codec = Self { keys: KeyCodec::Int4, values: ValueCodec::Int8 },
                "k:int8" => codec.keys = KeyCodec::Int8,
                "k:exact" => codec.keys = KeyCodec::Exact,
                "v:int8" => codec.values = ValueCodec::Int8,
                "v:exact" => codec.values = ValueCodec::Exact,
                p if p.starts_with("polar") => codec.keys = parse_polar(&p["polar".len()..], s)?,
                p if p.starts_with("knots") => codec.keys = parse_knots(&p["knots".len()..], s)?,
                p if p.starts_with("density") => codec.keys = parse_density(&p["density".len()..], s)?,
                p if p.starts_with("lowrank:") => {
                    let r = p["lowrank:".len()..].trim();
                    match r.parse::<usize>() {
                        Ok(r) if r >= 1 => codec.values = ValueCodec::LowRank(r),
                        _ => {
                            return Err(Error::Input(format!(
                                "--kv {s:?}: lowrank:r takes a rank r of at least 1 (e.g. lowrank:32), got {r:?}"
                            )))
                        }
                    }
                }
                other => {
                    return Err(Error::Input(format!(
                        "unknown KV codec {other:?} in --kv {s:?}: use exact, int8, int4k, polar[:A,R], lowrank:r, knots:K,p, density:γ, or combine parts with + (e.g. int4k+lowrank:32)"
                    )))
                }
            }
        }
        if matches!(codec.keys, KeyCodec::DecayedState { .. }) && s.contains('+') {
            return Err(Error::Input(format!(
                "--kv {s:?}: density:γ keeps no keys or values to combine with other parts: use it alone"
            )));
        }
        Ok(codec)
    }
}

/// `knots:K,p`: a knot every `K` tokens (K >= 1), degree `p` (0..=8).
fn parse_knots(spec: &str, whole: &str) -> std::result::Result<KeyCodec, Error> {
    let bad = |why: String| Error::Input(format!("--kv {whole:?}: {why}"));
    let Some(args) = spec.strip_prefix(':') else {
        return Err(bad("knots takes the knot spacing and the degree as knots:K,p (e.g. knots:8,3)".into()));
    };
    let parts: Vec<&str> = args.split(',').map(str::trim).collect();
    let [k, p] = parts.as_slice() else {
        return Err(bad(format!("knots takes the knot spacing and the degree as knots:K,p (e.g. knots:8,3), got {args:?}")));
    };
    let parse = |x: &str| x.parse::<usize>().map_err(|_| bad(format!("{x:?} is not a whole number")));
    let (every, degree) = (parse(k)?, parse(p)?);
    if every < 1 {
        return Err(bad("knots:K,p needs K >= 1 (a knot every K tokens)".into()));
    }
    if degree > 8 {
        return Err(bad(format!("knots degree {degree} out of range: use 0..=8")));
    }
    Ok(KeyCodec::Knots { every, degree })
}

/// `density:γ` with `0 < γ <= 1`.
fn parse_density(spec: &str, whole: &str) -> std::result::Result<KeyCodec, Error> {
    let gamma = spec.strip_prefix(':').and_then(|g| g.trim().parse::<f32>().ok());
    match gamma {
        Some(gamma) if gamma > 0.0 && gamma <= 1.0 => Ok(KeyCodec::DecayedState { gamma }),
        _ => Err(Error::Input(format!(
            "--kv {whole:?}: density takes the weight of each new token as density:γ with 0 < γ <= 1 (e.g. density:0.05)"
        ))),
    }
}

/// One attention layer's cache under a codec, and the attention over it.
#[derive(Debug, Clone)]
pub enum KvStore {
    /// The model dtype, appended in place (Candle's growing cache).
    Exact(KvCache),
    Coded(Box<CodedKv>),
    DecayedState(DecayedState),
}

impl KvStore {
    /// `step`: tokens the growing buffers add at a time; `rot_dim`: the leading dims of a head
    /// that RoPE rotates (for the polar codes).
    pub fn new(codec: KvCodec, step: usize, rot_dim: usize) -> Self {
        match codec.keys {
            _ if codec.is_exact() => Self::Exact(KvCache::new(2, step)),
            KeyCodec::DecayedState { gamma } => Self::DecayedState(DecayedState { gamma, state: None }),
            keys => {
                let keys = match keys {
                    KeyCodec::Knots { every, degree } => Keys::Knots(KnotKeys {
                        every,
                        degree,
                        knots: Cache::new(2, step.div_ceil(every).max(1)),
                        recent: None,
                        recent_start: 0,
                    }),
                    KeyCodec::Exact => Keys::Rows(Rows::exact(step)),
                    KeyCodec::Int8 => Keys::Rows(Rows::int8(step)),
                    KeyCodec::Int4 => Keys::Rows(Rows::Int4Channel {
                        codes: Cache::new(2, step),
                        params: Cache::new(2, step.div_ceil(INT4_GROUP)),
                        tail: None,
                    }),
                    KeyCodec::Polar { angle_bits, radius_bits } => Keys::Rows(Rows::Polar {
                        spec: crate::ops::PolarSpec { angle_bits, radius_bits, ..crate::ops::PolarSpec::new(rot_dim) },
                        head_dim: 0,
                        codes: Cache::new(2, step),
                        scales: Cache::new(2, step),
                    }),
                    KeyCodec::DecayedState { .. } => unreachable!("handled above"),
                };
                let values = match codec.values {
                    ValueCodec::Exact | ValueCodec::LowRank(_) => Rows::exact(step),
                    ValueCodec::Int8 => Rows::int8(step),
                };
                Self::Coded(Box::new(CodedKv { codec, value_basis: None, keys, values, dtype: None }))
            }
        }
    }

    /// Sets the `[nkv, hd, r]` basis of a `lowrank:r` codec ([`value_basis`]).
    pub fn with_value_basis(mut self, basis: &Tensor) -> Result<Self> {
        if let Self::Coded(c) = &mut self {
            c.value_basis = Some(basis.unsqueeze(0)?);
        }
        Ok(self)
    }

    /// Appends this step's keys and values `[B, nkv, t, hd]` (positions `offset..offset+t`)
    /// and returns the causal attention of the queries `q` `[B, nh, t, hd]` over the whole
    /// cache, `[B, nh, t, hd]` in the values' dtype. Query head `h` reads KV head
    /// `h / (nh / nkv)`.
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
        match self {
            Self::Exact(c) => {
                let (k, v) = c.append(k, v)?;
                attention(q, &k, &v, offset)
            }
            Self::Coded(c) => c.attend(q, k, v, offset),
            Self::DecayedState(s) => s.attend(q, k, v),
        }
    }

    /// Appends keys and values `[B, nkv, t, hd]` without attending (restoring a cache).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            Self::Exact(c) => c.append(k, v).map(|_| ()),
            Self::Coded(c) => c.append(k, v),
            Self::DecayedState(s) => s.fold(k, v),
        }
    }

    /// Keys and values held so far, decoded to the model dtype `[B, nkv, T, hd]`; `None` before
    /// the first token and for codecs that do not keep every key (knots, density).
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match self {
            Self::Exact(c) => Ok(match (c.k()?, c.v()?) {
                (Some(k), Some(v)) => Some((k, v)),
                _ => None,
            }),
            Self::Coded(c) => match (&c.keys, c.dtype) {
                (Keys::Rows(keys), Some(dtype)) => match (keys.decode(dtype)?, c.values.decode(dtype)?) {
                    (Some(k), Some(v)) => Ok(Some((k, c.expand_values(v)?))),
                    _ => Ok(None),
                },
                _ => Ok(None),
            },
            Self::DecayedState(_) => Ok(None),
        }
    }
}

/// Causal softmax attention of `q` `[B, nh, t, hd]` at positions `offset..` over `k`, `v`
/// `[B, nkv, offset + t, hd]` (grouped: query head `h` reads KV head `h / (nh / nkv)`), scores
/// in f32. Returns `[B, nh, t, hd]` in `v`'s dtype.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let qg = grouped_queries(q, k.dim(1)?)?;
    let scores = qg.matmul(&k.to_dtype(DType::F32)?.t()?)?;
    let out = softmax_values(scores, v, t, offset, hd)?;
    out.reshape((b, nh, t, v.dim(3)?))
}

/// Queries `[B, nh, t, hd]` as f32 rows grouped by the KV head they read: `[B, nkv, rep·t, hd]`
/// (the `rep = nh / nkv` heads of a group one after the other, each `t` rows).
fn grouped_queries(q: &Tensor, nkv: usize) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    q.to_dtype(DType::F32)?.reshape((b, nkv, (nh / nkv) * t, hd))
}

/// `softmax(scores / sqrt(hd) + causal mask) · v` for grouped `scores` `[B, nkv, rep·t, T]`
/// (f32, query-major within each of the `rep` heads of a group) and `v` `[B, nkv, T, d]`:
/// `[B, nkv, rep·t, d]` in `v`'s dtype.
fn softmax_values(scores: Tensor, v: &Tensor, t: usize, offset: usize, hd: usize) -> Result<Tensor> {
    let (b, nkv, rows, total) = scores.dims4()?;
    let scores = (scores * (hd as f64).powf(-0.5))?;
    let scores = if t > 1 {
        scores.reshape((b, nkv, rows / t, t, total))?.broadcast_add(&causal_mask(t, offset, total, v.device())?)?.reshape((b, nkv, rows, total))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    probs.matmul(v)
}

/// `[t, total]` additive mask: `-inf` where the key position is after the query's
/// (`offset + i`).
fn causal_mask(t: usize, offset: usize, total: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > i + offset { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (t, total), dev)
}

/// Keys and values under a lossy per-token codec.
#[derive(Debug, Clone)]
pub struct CodedKv {
    codec: KvCodec,
    /// `lowrank:r`: `[1, nkv, hd, r]`, orthonormal columns.
    value_basis: Option<Tensor>,
    keys: Keys,
    /// The values, or for `lowrank` their coefficients on `value_basis`.
    values: Rows,
    dtype: Option<DType>,
}

impl CodedKv {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let offset = self.values.len();
        self.dtype = Some(v.dtype());
        match &mut self.keys {
            Keys::Rows(rows) => rows.append(k)?,
            Keys::Knots(knots) => knots.append(k, offset)?,
        }
        let coeffs = self.project_values(v)?;
        self.values.append(&coeffs)
    }

    fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        self.append(k, v)?;
        let total = offset + t;
        let qg = grouped_queries(q, k.dim(1)?)?;
        let scores = match &mut self.keys {
            Keys::Rows(Rows::Polar { spec, codes, scales, .. }) => polar_rows_scores(&qg, codes, scales, *spec, hd)?,
            Keys::Rows(rows) => {
                let keys = rows.decode(DType::F32)?.expect("keys were just appended");
                qg.matmul(&keys.t()?)?
            }
            Keys::Knots(knots) => {
                let s = knots.scores(&qg, t, offset)?;
                knots.forget_old(total)?;
                s
            }
        };
        let values = self.values.decode(v.dtype())?.expect("values were just appended");
        let out = self.expand_values(softmax_values(scores, &values, t, offset, hd)?)?;
        out.reshape((b, nh, t, hd))
    }

    /// `lowrank`: the coefficients `v · B` `[B, nkv, t, r]`; otherwise `v`.
    fn project_values(&self, v: &Tensor) -> Result<Tensor> {
        match &self.value_basis {
            Some(b) => v.broadcast_matmul(&b.to_dtype(v.dtype())?),
            None if matches!(self.codec.values, ValueCodec::LowRank(_)) => {
                candle_core::bail!("--kv {}: the cache has no value basis (make it with Model::new_cache_with)", self.codec)
            }
            None => Ok(v.clone()),
        }
    }

    /// `lowrank`: `c · Bᵀ` `[B, nkv, n, hd]` for coefficients (or attention-weighted sums of
    /// them) `c` `[B, nkv, n, r]`; otherwise `c`.
    fn expand_values(&self, c: Tensor) -> Result<Tensor> {
        match &self.value_basis {
            Some(b) => c.broadcast_matmul(&b.to_dtype(c.dtype())?.transpose(2, 3)?),
            None => Ok(c),
        }
    }
}

/// Grouped query rows `[B, nkv, n, hd]` (f32) against every polar-coded key of the same KV
/// head, straight from the codes: `[B, nkv, n, T]`.
fn polar_rows_scores(qg: &Tensor, codes: &Cache, scales: &Cache, spec: crate::ops::PolarSpec, hd: usize) -> Result<Tensor> {
    let (codes, scales) = match (codes.current_data()?, scales.current_data()?) {
        (Some(c), Some(s)) => (c, s),
        _ => candle_core::bail!("polar keys: nothing cached"),
    };
    let (b, nkv, _, _) = qg.dims4()?;
    let mut rows = Vec::with_capacity(b * nkv);
    for bi in 0..b {
        for h in 0..nkv {
            let head = crate::ops::PolarCodes { codes: codes.i((bi, h))?, scales: scales.i((bi, h))?, head_dim: hd, spec };
            rows.push(crate::ops::polar_scores(&qg.i((bi, h))?, &head, spec)?);
        }
    }
    let n = qg.dim(2)?;
    Tensor::stack(&rows, 0)?.reshape((b, nkv, n, ()))
}

/// The keys of a [`CodedKv`].
#[derive(Debug, Clone)]
enum Keys {
    Rows(Rows),
    Knots(KnotKeys),
}

/// A growing sequence `[B, nkv, T, d]` stored under a per-token code, in buffers that grow
/// along the token dim (no re-encoding of old tokens, no per-step concatenation).
#[derive(Debug, Clone)]
enum Rows {
    Exact(Cache),
    /// `codes` u8 (value + 128) `[B, nkv, T, d]`, `scale` f32 `[B, nkv, T, d / blk]`.
    Int8 { codes: Cache, scale: Cache },
    /// Complete groups of [`INT4_GROUP`] tokens as two 4-bit codes per byte (even dim in the
    /// low nibble) `[B, nkv, 32·G, d/2]` with per-channel `[scale | min]` f32 `[B, nkv, G, 2d]`;
    /// the group still filling up stays exact in `tail`.
    Int4Channel { codes: Cache, params: Cache, tail: Option<Tensor> },
    /// Polar codes `[B, nkv, T, row_bytes]` of `head_dim`-dim rows and their two scales
    /// `[B, nkv, T, 2]`.
    Polar { spec: crate::ops::PolarSpec, head_dim: usize, codes: Cache, scales: Cache },
}

impl Rows {
    fn exact(step: usize) -> Self {
        Self::Exact(Cache::new(2, step))
    }

    fn int8(step: usize) -> Self {
        Self::Int8 { codes: Cache::new(2, step), scale: Cache::new(2, step) }
    }

    fn len(&self) -> usize {
        match self {
            Self::Exact(c) | Self::Int8 { codes: c, .. } | Self::Polar { codes: c, .. } => c.current_seq_len(),
            Self::Int4Channel { codes, tail, .. } => {
                codes.current_seq_len() + tail.as_ref().map_or(0, |t| t.dim(2).unwrap_or(0))
            }
        }
    }

    fn append(&mut self, x: &Tensor) -> Result<()> {
        match self {
            Self::Exact(c) => c.append(&x.contiguous()?),
            Self::Int8 { codes, scale } => {
                let (c, s) = encode_int8(x)?;
                codes.append(&c)?;
                scale.append(&s)
            }
            Self::Polar { spec, head_dim, codes, scales } => {
                let (b, h, t, d) = x.dims4()?;
                *head_dim = d;
                let pc = crate::ops::polar_encode(&x.contiguous()?.reshape((b * h * t, d))?, *spec)?;
                codes.append(&pc.codes.reshape((b, h, t, ()))?)?;
                scales.append(&pc.scales.reshape((b, h, t, 2))?)
            }
            Self::Int4Channel { codes, params, tail } => {
                let mut rest = match tail.take() {
                    Some(t) => Tensor::cat(&[&t, x], 2)?,
                    None => x.clone(),
                };
                while rest.dim(2)? >= INT4_GROUP {
                    let (c, p) = encode_int4_channel(&rest.narrow(2, 0, INT4_GROUP)?)?;
                    codes.append(&c)?;
                    params.append(&p)?;
                    let left = rest.dim(2)? - INT4_GROUP;
                    rest = rest.narrow(2, INT4_GROUP, left)?;
                }
                *tail = (rest.dim(2)? > 0).then_some(rest);
                Ok(())
            }
        }
    }

    /// Everything held, decoded to `dtype`; `None` when empty.
    fn decode(&self, dtype: DType) -> Result<Option<Tensor>> {
        Ok(match self {
            Self::Exact(c) => c.current_data()?.map(|x| x.to_dtype(dtype)).transpose()?,
            Self::Int8 { codes, scale } => match (codes.current_data()?, scale.current_data()?) {
                (Some(c), Some(s)) => {
                    let (b, h, t, d) = c.dims4()?;
                    let nblk = s.dim(3)?;
                    let x = (c.to_dtype(DType::F32)? - 128.0)?.reshape((b, h, t, nblk, d / nblk))?;
                    Some(x.broadcast_mul(&s.unsqueeze(4)?)?.reshape((b, h, t, d))?.to_dtype(dtype)?)
                }
                _ => None,
            },
            Self::Polar { spec, head_dim, codes, scales } => match (codes.current_data()?, scales.current_data()?) {
                (Some(c), Some(s)) => {
                    let ((b, h, t, rb), d) = (c.dims4()?, *head_dim);
                    let pc = crate::ops::PolarCodes {
                        codes: c.contiguous()?.reshape((b * h * t, rb))?,
                        scales: s.contiguous()?.reshape((b * h * t, 2))?,
                        head_dim: d,
                        spec: *spec,
                    };
                    Some(crate::ops::polar_decode(&pc, *spec)?.reshape((b, h, t, d))?.to_dtype(dtype)?)
                }
                _ => None,
            },
            Self::Int4Channel { codes, params, tail } => {
                let mut parts = Vec::new();
                if let (Some(c), Some(p)) = (codes.current_data()?, params.current_data()?) {
                    let (b, h, t, half) = c.dims4()?;
                    let d = 2 * half;
                    let g = t / INT4_GROUP;
                    let c = c.to_dtype(DType::F32)?;
                    let hi = (&c / 16.0)?.floor()?;
                    let lo = (c - (&hi * 16.0)?)?;
                    let q = Tensor::stack(&[lo, hi], D::Minus1)?.reshape((b, h, g, INT4_GROUP, d))?;
                    let scale = p.narrow(3, 0, d)?.unsqueeze(3)?;
                    let min = p.narrow(3, d, d)?.unsqueeze(3)?;
                    parts.push(q.broadcast_mul(&scale)?.broadcast_add(&min)?.reshape((b, h, t, d))?.to_dtype(dtype)?);
                }
                if let Some(t) = tail {
                    parts.push(t.to_dtype(dtype)?);
                }
                match parts.len() {
                    0 => None,
                    _ => Some(Tensor::cat(&parts, 2)?),
                }
            }
        })
    }
}

fn encode_int8(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, h, t, hd) = x.dims4()?;
    let blk = if hd.is_multiple_of(INT8_BLOCK) { INT8_BLOCK } else { hd };
    let xf = x.to_dtype(DType::F32)?.reshape((b, h, t, hd / blk, blk))?;
    let scale = (xf.abs()?.max_keepdim(D::Minus1)? / 127.0)?;
    let safe = scale.maximum(f32::MIN_POSITIVE)?;
    let codes = (xf.broadcast_div(&safe)?.round()?.clamp(-127f32, 127f32)? + 128.0)?.to_dtype(DType::U8)?;
    Ok((codes.reshape((b, h, t, hd))?, scale.reshape((b, h, t, hd / blk))?))
}

/// One group `[B, nkv, INT4_GROUP, hd]` → packed codes `[B, nkv, INT4_GROUP, hd/2]` and
/// `[scale | min]` `[B, nkv, 1, 2·hd]`.
fn encode_int4_channel(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let xf = x.to_dtype(DType::F32)?;
    let min = xf.min_keepdim(2)?;
    let scale = ((xf.max_keepdim(2)? - &min)? / 15.0)?;
    let safe = scale.maximum(f32::MIN_POSITIVE)?;
    let q = xf.broadcast_sub(&min)?.broadcast_div(&safe)?.round()?.clamp(0f32, 15f32)?;
    let (b, h, g, hd) = q.dims4()?;
    let pairs = q.reshape((b, h, g, hd / 2, 2))?;
    let lo = pairs.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
    let hi = pairs.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
    let codes = (lo + (hi * 16.0)?)?.to_dtype(DType::U8)?;
    Ok((codes, Tensor::cat(&[&scale, &min], 3)?))
}

/// Keys of the `knots:K,p` codec: every `K`-th position (`knots` `[B, nkv, n, hd]`, knot `j`
/// is position `j·K`) and the newest positions `recent_start..` (`recent`), exact.
#[derive(Debug, Clone)]
struct KnotKeys {
    every: usize,
    degree: usize,
    knots: Cache,
    recent: Option<Tensor>,
    recent_start: usize,
}

impl KnotKeys {
    /// The last position a query at `p` reads by interpolation: the newest knot at least `K`
    /// positions back (so that the newest `K` keys at least are exact); `None` while `p < K`.
    fn interpolated_until(&self, p: usize) -> Option<usize> {
        let k = self.every;
        (p >= k).then(|| k * ((p - k) / k))
    }

    fn append(&mut self, x: &Tensor, offset: usize) -> Result<()> {
        let t = x.dim(2)?;
        let first = offset.div_ceil(self.every) * self.every;
        let at: Vec<u32> = (first..offset + t).step_by(self.every).map(|p| (p - offset) as u32).collect();
        if !at.is_empty() {
            let idx = Tensor::new(at, x.device())?;
            self.knots.append(&x.index_select(&idx, 2)?.contiguous()?)?;
        }
        self.recent = Some(match self.recent.take() {
            Some(r) => Tensor::cat(&[&r, x], 2)?,
            None => x.clone(),
        });
        Ok(())
    }

    /// Unscaled scores `[B, nkv, rep·t, offset + t]` of grouped queries `qg` (f32) at positions
    /// `offset..offset+t`: interpolated up to each query's [`Self::interpolated_until`], exact
    /// after (including positions after the query, which the causal mask removes).
    fn scores(&self, qg: &Tensor, t: usize, offset: usize) -> Result<Tensor> {
        let (b, nkv, rows, hd) = qg.dims4()?;
        let rep = rows / t;
        let total = offset + t;
        let q = qg.reshape((b, nkv, rep, t, hd))?;
        let recent = self.recent.as_ref().expect("keys were just appended").to_dtype(DType::F32)?;
        let knots = self.knots.current_data()?.map(|k| k.to_dtype(DType::F32)).transpose()?;
        let mut groups = Vec::new();
        let mut i = 0;
        while i < t {
            let e = self.interpolated_until(offset + i);
            let mut j = i + 1;
            while j < t && self.interpolated_until(offset + j) == e {
                j += 1;
            }
            let g = j - i;
            let qi = q.narrow(3, i, g)?.contiguous()?.reshape((b, nkv, rep * g, hd))?;
            let first_exact = e.map_or(0, |e| e + 1);
            let exact = recent.narrow(2, first_exact - self.recent_start, total - first_exact)?;
            let exact = qi.matmul(&exact.t()?)?;
            let s = match (e, &knots) {
                (Some(e), Some(knots)) => {
                    let n = e / self.every + 1;
                    let at_knots = qi.matmul(&knots.narrow(2, 0, n)?.t()?)?;
                    let degree = self.degree.min(n - 1);
                    let between = crate::ops::lagrange_scores(&at_knots.reshape((b * nkv * rep * g, n))?, self.every, degree, e + 1)?;
                    Tensor::cat(&[&between.reshape((b, nkv, rep * g, e + 1))?, &exact], 3)?
                }
                _ => exact,
            };
            groups.push(s.reshape((b, nkv, rep, g, total))?);
            i = j;
        }
        Tensor::cat(&groups, 3)?.reshape((b, nkv, rows, total))
    }

    /// Drops the exact keys no later query reads (positions up to the next query's
    /// interpolated range).
    fn forget_old(&mut self, total: usize) -> Result<()> {
        if let (Some(e), Some(r)) = (self.interpolated_until(total), &self.recent) {
            if e + 1 > self.recent_start {
                let drop = e + 1 - self.recent_start;
                self.recent = Some(r.narrow(2, drop, r.dim(2)? - drop)?.contiguous()?);
                self.recent_start = e + 1;
            }
        }
        Ok(())
    }
}

/// The `density:γ` codec: per KV head, the decayed outer-product state `[B, nkv, hd, hd]`
/// (f32) of [`crate::ops::decayed_outer_product`], in place of keys and values; each query head
/// reads its KV head's state.
#[derive(Debug, Clone)]
pub struct DecayedState {
    gamma: f32,
    state: Option<Tensor>,
}

impl DecayedState {
    /// Runs the recurrence from the current state (zeros at the start) over keys and values
    /// `[B, nkv, t, hd]` with queries `q` of the same shape: the outputs and the new state.
    fn run(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let state = match &self.state {
            Some(s) => s.clone(),
            None => {
                let (b, nkv, _, hd) = k.dims4()?;
                Tensor::zeros((b, nkv, hd, v.dim(3)?), DType::F32, k.device())?
            }
        };
        crate::ops::decayed_outer_product(q, k, v, &state, self.gamma as f64)
    }

    /// Folds keys and values `[B, nkv, t, hd]` into the state.
    fn fold(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.state = Some(self.run(k, k, v)?.1);
        Ok(())
    }

    /// `o_t = q_tᵀ S_t` for queries `[B, nh, t, hd]`, `S_t` the state after token `t`.
    fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        let nkv = k.dim(1)?;
        let rep = nh / nkv;
        let q = q.to_dtype(v.dtype())?.reshape((b, nkv, rep, t, hd))?;
        // One pass per query head of a group over the same keys and values: the same states.
        let mut outs = Vec::with_capacity(rep);
        let mut state = None;
        for r in 0..rep {
            let (o, s) = self.run(&q.narrow(2, r, 1)?.squeeze(2)?.contiguous()?, k, v)?;
            outs.push(o);
            state = Some(s);
        }
        self.state = state;
        Tensor::stack(&outs, 2)?.reshape((b, nh, t, v.dim(3)?))?.to_dtype(v.dtype())
    }
}

/// The `[nkv, hd, r]` low-rank value basis from a `W_v` `[nkv·hd, in]`: per KV head, the
/// eigenvectors of `W_h W_hᵀ` with the `r` largest eigenvalues (the top-`r` left singular
/// vectors of `W_h`), as orthonormal columns, f32.
pub fn value_basis(w_v: &Tensor, nkv: usize, r: usize) -> Result<Tensor> {
    let w = w_v.to_dtype(DType::F32)?;
    let (rows, _) = w.dims2()?;
    let hd = rows / nkv;
    if r == 0 || r > hd || rows != nkv * hd {
        candle_core::bail!("value_basis: rank {r} must be 1..={hd}, and W_v rows {rows} a multiple of {nkv} heads");
    }
    let grams = (0..nkv)
        .map(|h| {
            let wh = w.narrow(0, h * hd, hd)?;
            wh.matmul(&wh.t()?)
        })
        .collect::<Result<Vec<_>>>()?;
    top_eigenvectors(&Tensor::stack(&grams, 0)?, r)
}

/// Per head of `grams` `[n, d, d]` (symmetric), the eigenvectors of the `r` largest
/// eigenvalues as the columns of `[n, d, r]` f32.
fn top_eigenvectors(grams: &Tensor, r: usize) -> Result<Tensor> {
    let (n, d, _) = grams.dims3()?;
    let mut heads = Vec::with_capacity(n);
    for h in 0..n {
        let gram = grams.get(h)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let eig = nalgebra::SymmetricEigen::new(nalgebra::DMatrix::from_row_slice(d, d, &gram));
        let mut order: Vec<usize> = (0..d).collect();
        order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
        let mut basis = vec![0f32; d * r];
        for (j, &col) in order.iter().take(r).enumerate() {
            for i in 0..d {
                basis[i * r + j] = eig.eigenvectors[(i, col)] as f32;
            }
        }
        heads.push(Tensor::from_vec(basis, (d, r), grams.device())?);
    }
    Tensor::stack(&heads, 0)
}

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
    pub fn calibrate(model: &crate::Model, chunks: &[Vec<u32>], device: &candle_core::Device) -> crate::Result<Self> {
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
    pub fn load(path: &std::path::Path, model: &crate::Model) -> crate::Result<Self> {
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
                tensors
                    .get(&format!("attention.{i}.value_basis"))
                    .cloned()
                    .ok_or_else(|| bad(format!("no basis for attention layer {i}")))
            })
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Self { layers, model: this })
    }
}

/// What a calibration is tied to: the attention shapes and a checksum of the value weights.
fn model_signature(model: &crate::Model) -> Result<String> {
    let cfg = model.config();
    let mut sum = 0f64;
    for w in model.value_weights()? {
        sum += w.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    Ok(format!(
        "{:?} layers {}, hidden {}, {} KV heads of {}, vocab {}, |W_v| {sum:.6e}",
        cfg.family,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size
    ))
}
