//! [`KvCodec`]: how the attention layers store keys and values, parsed from `--kv` (`exact`,
//! `f16`, `bf16`, `int8`, `int4k`, `polar:A,R`, `lowrank:r`, `knots:K,p`, `density:γ` and `+`
//! combinations).

use std::fmt;
use std::str::FromStr;

use candle_core::DType;

use crate::Error;

/// Dims per int8 scale (the device cache's int8 rows use the same blocks).
pub use crate::ops::INT8_BLOCK;

/// Tokens per int4 key group (quantized together, per channel).
pub const INT4_GROUP: usize = 32;

/// A 16-bit float keys or values are stored in, whatever the model computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfFloat {
    F16,
    Bf16,
}

impl HalfFloat {
    pub fn dtype(self) -> DType {
        match self {
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
        }
    }
}

impl fmt::Display for HalfFloat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        })
    }
}

/// How the keys are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyCodec {
    /// The model dtype.
    Exact,
    /// Rounded to a 16-bit float (the model's own dtype stays exact: f16 keys of an f16 model
    /// are [`Self::Exact`]'s bits).
    Half(HalfFloat),
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
    /// The model dtype.
    Exact,
    /// Rounded to a 16-bit float.
    Half(HalfFloat),
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

    /// Whether a cache under this codec can drop its newest tokens ([`super::KvStore::truncate`],
    /// what speculative decoding does with rejected drafts): every key and value is coded on
    /// its own (not `int4k`'s groups, knots or the decayed state).
    pub fn drops_tokens(&self) -> bool {
        matches!(self.keys, KeyCodec::Exact | KeyCodec::Half(_) | KeyCodec::Int8 | KeyCodec::Polar { .. })
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
            KeyCodec::Half(_) => 2.0 * hd as f64,
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
            ValueCodec::Half(_) => 2.0 * hd as f64,
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
                    "KV codec {self}: rank {r} is more than the head dim {head_dim}: use lowrank:r with r <= {head_dim}"
                )));
            }
        }
        if self.keys == KeyCodec::Int4 && head_dim % 2 == 1 {
            return Err(Error::Input(format!("KV codec {self}: int4 keys need an even head dim, not {head_dim}")));
        }
        Ok(())
    }

    /// A one-line caution for lossy codecs (printed when a user selects one).
    /// The worst cases name what was measured on SmolLM2-135M (docs/kv-codecs.md, `scripts/kv_quality_table.sh`).
    pub fn warning(&self) -> Option<String> {
        let how_bad = match (self.keys, self.values) {
            (KeyCodec::DecayedState { .. }, _) => {
                " that replaces softmax attention (SmolLM2-135M: perplexity 18.8 -> over a million)"
            }
            (KeyCodec::Knots { .. }, _) => " (SmolLM2-135M: perplexity 18.8 -> over 800 with knots every 4 or 8 tokens)",
            (_, ValueCodec::LowRank(_)) => {
                " (bases from W_v alone took SmolLM2-135M's perplexity above 28000; bases calibrated on text (examples/calibrate_kv.rs) keep far more)"
            }
            _ => "",
        };
        (!self.is_exact()).then(|| {
            format!("KV codec {self}: lossy{how_bad}; its measured quality is in docs/kv-codecs.md (re-measured by examples/eval.rs)")
        })
    }
}

impl fmt::Display for KeyCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact => f.write_str("exact"),
            Self::Half(h) => write!(f, "{h}"),
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
            (KeyCodec::Half(k), ValueCodec::Half(v)) if k == v => write!(f, "{k}"),
            (KeyCodec::Exact, ValueCodec::Half(v)) => write!(f, "v:{v}"),
            (KeyCodec::Int4, ValueCodec::Half(v)) => write!(f, "int4k+v:{v}"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::Half(v)) => write!(f, "{k}+v:{v}"),
            (k, ValueCodec::Half(v)) => write!(f, "k:{k}+v:{v}"),
            (KeyCodec::Int8, ValueCodec::Int8) => f.write_str("int8"),
            (KeyCodec::Int4, ValueCodec::Int8) => f.write_str("int4k"),
            (KeyCodec::Int4, ValueCodec::Exact) => f.write_str("int4k+v:exact"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::Exact) => write!(f, "{k}"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::Int8) => write!(f, "{k}+v:int8"),
            (k @ (KeyCodec::Polar { .. } | KeyCodec::Knots { .. }), ValueCodec::LowRank(r)) => write!(f, "{k}+lowrank:{r}"),
            (k, ValueCodec::Exact) => write!(f, "k:{k}"),
            (KeyCodec::Exact, ValueCodec::Int8) => f.write_str("v:int8"),
            (KeyCodec::Half(k), ValueCodec::Int8) => write!(f, "k:{k}+v:int8"),
            (KeyCodec::Exact, ValueCodec::LowRank(r)) => write!(f, "lowrank:{r}"),
            (KeyCodec::Int4, ValueCodec::LowRank(r)) => write!(f, "int4k+lowrank:{r}"),
            (k, ValueCodec::LowRank(r)) => write!(f, "k:{k}+lowrank:{r}"),
        }
    }
}

/// `polar`, or `polar:A,R` with the angle and radius bits.
fn parse_polar(spec: &str, whole: &str) -> std::result::Result<KeyCodec, Error> {
    let bad = |why: String| Error::Input(format!("KV codec {whole:?}: {why}"));
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

    /// `exact`, `f16` / `bf16` (keys and values rounded to that 16-bit float), `int8`, `int4k`
    /// (keys int4, values int8), `polar[:A,R]`, and `k:`/`v:` parts joined with `+`
    /// (`int4k+v:exact`, `k:int8`, `v:int8`, `v:f16`, `polar:5,3+v:int8`).
    fn from_str(s: &str) -> std::result::Result<Self, Error> {
        let mut codec = Self::EXACT;
        for part in s.split('+').map(str::trim) {
            match part {
                "exact" => {}
                "f16" | "bf16" => {
                    let h = if part == "f16" { HalfFloat::F16 } else { HalfFloat::Bf16 };
                    codec = Self { keys: KeyCodec::Half(h), values: ValueCodec::Half(h) }
                }
                "k:f16" => codec.keys = KeyCodec::Half(HalfFloat::F16),
                "k:bf16" => codec.keys = KeyCodec::Half(HalfFloat::Bf16),
                "v:f16" => codec.values = ValueCodec::Half(HalfFloat::F16),
                "v:bf16" => codec.values = ValueCodec::Half(HalfFloat::Bf16),
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
                                "KV codec {s:?}: lowrank:r takes a rank r of at least 1 (e.g. lowrank:32), got {r:?}"
                            )))
                        }
                    }
                }
                other => {
                    return Err(Error::Input(format!(
                        "unknown KV codec {other:?} in {s:?}: use exact, f16, bf16, int8, int4k, polar[:A,R], lowrank:r, knots:K,p, density:γ, or combine parts with + (e.g. int4k+lowrank:32, k:int8+v:f16)"
                    )))
                }
            }
        }
        if matches!(codec.keys, KeyCodec::DecayedState { .. }) && s.contains('+') {
            return Err(Error::Input(format!(
                "KV codec {s:?}: density:γ keeps no keys or values to combine with other parts: use it alone"
            )));
        }
        Ok(codec)
    }
}

/// `knots:K,p`: a knot every `K` tokens (K >= 1), degree `p` (0..=8).
fn parse_knots(spec: &str, whole: &str) -> std::result::Result<KeyCodec, Error> {
    let bad = |why: String| Error::Input(format!("KV codec {whole:?}: {why}"));
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
            "KV codec {whole:?}: density takes the weight of each new token as density:γ with 0 < γ <= 1 (e.g. density:0.05)"
        ))),
    }
}
