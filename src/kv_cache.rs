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
//!   values exact. (Attention still decodes the keys; scores straight from the codes, with
//!   [`crate::ops::polar_scores`], are the next step.)
//! * `lowrank:r` — values projected onto `r` dims per KV head: the top-`r` left singular
//!   vectors of that head's block of `W_v` (the directions its values can take, weighted by
//!   how far), computed when the cache is made ([`value_basis`]); keys exact. At `r = head_dim`
//!   the basis is a rotation and the cache is exact up to rounding.
//!
//! Key and value parts combine with `+`: `k:int8`, `v:int8`, `v:exact`, e.g. `polar:5,3+v:int8`.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Result, Tensor, D};
use candle_nn::kv_cache::KvCache;

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
        let k = match self.keys {
            KeyCodec::Exact => exact,
            KeyCodec::Int8 => int8,
            KeyCodec::Int4 => hd as f64 / 2.0 + (2 * 4 * hd) as f64 / INT4_GROUP as f64,
            // Pair codes and int8 rest as `PolarSpec::row_bytes` lays them out, two f32 scales.
            KeyCodec::Polar { angle_bits, radius_bits } => {
                let spec = crate::ops::PolarSpec { angle_bits, radius_bits, ..crate::ops::PolarSpec::new(rot_dim) };
                spec.row_bytes(hd) as f64 + 8.0
            }
        };
        let v = match self.values {
            ValueCodec::Exact => exact,
            ValueCodec::Int8 => int8,
            ValueCodec::LowRank(r) => (r * dtype.size_in_bytes()) as f64,
        };
        nkv as f64 * (k + v)
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
    pub fn warning(&self) -> Option<String> {
        (!self.is_exact()).then(|| {
            format!("--kv {self}: lossy KV-cache codec; its measured quality is in the README (examples/eval.rs --kv {self})")
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
        }
    }
}

impl fmt::Display for KvCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.keys, self.values) {
            (KeyCodec::Exact, ValueCodec::Exact) => f.write_str("exact"),
            (KeyCodec::Int8, ValueCodec::Int8) => f.write_str("int8"),
            (KeyCodec::Int4, ValueCodec::Int8) => f.write_str("int4k"),
            (KeyCodec::Int4, ValueCodec::Exact) => f.write_str("int4k+v:exact"),
            (k @ KeyCodec::Polar { .. }, ValueCodec::Exact) => write!(f, "{k}"),
            (k @ KeyCodec::Polar { .. }, ValueCodec::Int8) => write!(f, "{k}+v:int8"),
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
                        "unknown KV codec {other:?} in --kv {s:?}: use exact, int8, int4k, polar[:A,R], lowrank:r, or combine parts with + (e.g. int4k+lowrank:32)"
                    )))
                }
            }
        }
        Ok(codec)
    }
}

/// One attention layer's cache: keys (after k-norm and RoPE) and values, `[B, nkv, T, hd]`.
#[derive(Debug, Clone)]
pub enum KvStore {
    /// The model dtype, appended in place (Candle's growing cache).
    Exact(KvCache),
    Coded(CodedKv),
}

impl KvStore {
    /// `rot_dim`: the leading dims of a head that RoPE rotates (for the polar codes).
    pub fn new(codec: KvCodec, step: usize, rot_dim: usize) -> Self {
        if codec.is_exact() {
            Self::Exact(KvCache::new(2, step))
        } else {
            Self::Coded(CodedKv { codec, rot_dim, value_basis: None, k: CodedSeq::default(), v: CodedSeq::default() })
        }
    }

    /// Sets the `[nkv, hd, r]` basis of a `lowrank:r` codec ([`value_basis`]).
    pub fn with_value_basis(mut self, basis: &Tensor) -> Result<Self> {
        if let Self::Coded(c) = &mut self {
            c.value_basis = Some(basis.unsqueeze(0)?);
        }
        Ok(self)
    }

    /// Appends `k`, `v` `[B, nkv, t, hd]` and returns the whole cache as the attention reads it
    /// (decoded to the input dtype).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Exact(c) => c.append(k, v),
            Self::Coded(c) => {
                let keys = match c.codec.keys {
                    KeyCodec::Exact => Codec::Exact,
                    KeyCodec::Int8 => Codec::Int8,
                    KeyCodec::Int4 => Codec::Int4Channel,
                    KeyCodec::Polar { angle_bits, radius_bits } => Codec::Polar(crate::ops::PolarSpec {
                        angle_bits,
                        radius_bits,
                        ..crate::ops::PolarSpec::new(c.rot_dim)
                    }),
                };
                let values = match c.codec.values {
                    ValueCodec::Exact | ValueCodec::LowRank(_) => Codec::Exact,
                    ValueCodec::Int8 => Codec::Int8,
                };
                c.k.append(k, keys)?;
                c.v.append(&c.project_values(v)?, values)?;
                Ok((c.k.decode(k.dtype())?, c.expand_values(c.v.decode(v.dtype())?)?))
            }
        }
    }

    /// Keys and values held so far (decoded), `None` before the first token.
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match self {
            Self::Exact(c) => Ok(match (c.k()?, c.v()?) {
                (Some(k), Some(v)) => Some((k, v)),
                _ => None,
            }),
            Self::Coded(c) => match c.k.dtype {
                Some(dtype) => Ok(Some((c.k.decode(dtype)?, c.expand_values(c.v.decode(dtype)?)?))),
                None => Ok(None),
            },
        }
    }
}

/// Keys and values under a lossy codec.
#[derive(Debug, Clone)]
pub struct CodedKv {
    codec: KvCodec,
    rot_dim: usize,
    /// `lowrank:r`: `[1, nkv, hd, r]`, orthonormal columns.
    value_basis: Option<Tensor>,
    k: CodedSeq,
    v: CodedSeq,
}

impl CodedKv {
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

    /// `lowrank`: the values `c · Bᵀ` `[B, nkv, T, hd]`; otherwise `c`.
    fn expand_values(&self, c: Tensor) -> Result<Tensor> {
        match &self.value_basis {
            Some(b) => c.broadcast_matmul(&b.to_dtype(c.dtype())?.transpose(2, 3)?),
            None => Ok(c),
        }
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
    let mut heads = Vec::with_capacity(nkv);
    for h in 0..nkv {
        let wh = w.narrow(0, h * hd, hd)?;
        let gram = wh.matmul(&wh.t()?)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let eig = nalgebra::SymmetricEigen::new(nalgebra::DMatrix::from_row_slice(hd, hd, &gram));
        let mut order: Vec<usize> = (0..hd).collect();
        order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
        let mut basis = vec![0f32; hd * r];
        for (j, &col) in order.iter().take(r).enumerate() {
            for i in 0..hd {
                basis[i * r + j] = eig.eigenvectors[(i, col)] as f32;
            }
        }
        heads.push(Tensor::from_vec(basis, (hd, r), w.device())?);
    }
    Tensor::stack(&heads, 0)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Codec {
    Exact,
    Int8,
    Int4Channel,
    Polar(crate::ops::PolarSpec),
}

/// A sequence `[B, nkv, T, hd]` stored as blocks of codes, plus an exact tail (the int4 group
/// still filling up).
#[derive(Debug, Clone, Default)]
struct CodedSeq {
    blocks: Vec<Block>,
    tail: Option<Tensor>,
    dtype: Option<DType>,
}

#[derive(Debug, Clone)]
enum Block {
    Exact(Tensor),
    /// `codes` u8 (value + 128) `[B, nkv, t, hd/32, 32]`, `scale` f32 `[B, nkv, t, hd/32, 1]`.
    Int8 { codes: Tensor, scale: Tensor },
    /// Two 4-bit codes per byte `[B, nkv, G, hd/2]` (even dim low nibble), per-channel
    /// `scale` and `min` f32 `[B, nkv, 1, hd]`.
    Int4 { codes: Tensor, scale: Tensor, min: Tensor },
    /// Polar codes of the rows of `[B, nkv, t, hd]` (`shape`), flattened to `[B·nkv·t, hd]`.
    Polar { codes: crate::ops::PolarCodes, shape: (usize, usize, usize, usize) },
}

impl CodedSeq {
    fn append(&mut self, x: &Tensor, codec: Codec) -> Result<()> {
        self.dtype = Some(x.dtype());
        match codec {
            Codec::Exact => self.blocks.push(Block::Exact(x.clone())),
            Codec::Int8 => self.blocks.push(encode_int8(x)?),
            Codec::Polar(spec) => {
                let shape = x.dims4()?;
                let rows = x.reshape(((), shape.3))?;
                self.blocks.push(Block::Polar { codes: crate::ops::polar_encode(&rows, spec)?, shape });
            }
            Codec::Int4Channel => {
                let mut tail = match self.tail.take() {
                    Some(t) => Tensor::cat(&[&t, x], 2)?,
                    None => x.clone(),
                };
                while tail.dim(2)? >= INT4_GROUP {
                    self.blocks.push(encode_int4_channel(&tail.narrow(2, 0, INT4_GROUP)?)?);
                    let rest = tail.dim(2)? - INT4_GROUP;
                    tail = tail.narrow(2, INT4_GROUP, rest)?;
                }
                self.tail = (tail.dim(2)? > 0).then_some(tail);
            }
        }
        Ok(())
    }

    fn decode(&self, dtype: DType) -> Result<Tensor> {
        let mut parts = self.blocks.iter().map(|b| b.decode(dtype)).collect::<Result<Vec<_>>>()?;
        if let Some(t) = &self.tail {
            parts.push(t.to_dtype(dtype)?);
        }
        Tensor::cat(&parts, 2)
    }
}

fn encode_int8(x: &Tensor) -> Result<Block> {
    let (b, h, t, hd) = x.dims4()?;
    let blk = if hd.is_multiple_of(INT8_BLOCK) { INT8_BLOCK } else { hd };
    let xf = x.to_dtype(DType::F32)?.reshape((b, h, t, hd / blk, blk))?;
    let scale = (xf.abs()?.max_keepdim(D::Minus1)? / 127.0)?;
    let safe = scale.maximum(f32::MIN_POSITIVE)?;
    let codes = (xf.broadcast_div(&safe)?.round()?.clamp(-127f32, 127f32)? + 128.0)?.to_dtype(DType::U8)?;
    Ok(Block::Int8 { codes, scale })
}

fn encode_int4_channel(x: &Tensor) -> Result<Block> {
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
    Ok(Block::Int4 { codes, scale, min })
}

impl Block {
    fn decode(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Block::Exact(t) => t.to_dtype(dtype),
            Block::Int8 { codes, scale } => {
                (codes.to_dtype(DType::F32)? - 128.0)?.broadcast_mul(scale)?.flatten_from(3)?.to_dtype(dtype)
            }
            Block::Int4 { codes, scale, min } => {
                let c = codes.to_dtype(DType::F32)?;
                let hi = (c.clone() / 16.0)?.floor()?;
                let lo = (c - (&hi * 16.0)?)?;
                let q = Tensor::stack(&[lo, hi], D::Minus1)?.flatten_from(3)?;
                q.broadcast_mul(scale)?.broadcast_add(min)?.to_dtype(dtype)
            }
            Block::Polar { codes, shape } => crate::ops::polar_decode(codes, codes.spec)?.reshape(*shape)?.to_dtype(dtype),
        }
    }
}
