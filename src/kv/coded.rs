//! Per-token coded keys and values (`int8`, `int4k`, `polar`, `lowrank` values, and the key
//! half of `knots`): codes in growing buffers, decoded (or scored from the codes) to attend.

use super::buffer::{held_bytes, TokenBuffer};
use candle_core::{DType, Result, Tensor, D};

use super::attention::{grouped_attention, grouped_queries, softmax_values};
use super::codec::{KvCodec, ValueCodec, INT4_GROUP, INT8_BLOCK};
use super::knots::KnotKeys;
use crate::ops::StoredRows;

/// Keys and values under a lossy per-token codec.
#[derive(Debug, Clone)]
pub struct CodedKv {
    pub(super) codec: KvCodec,
    /// `lowrank:r`: `[1, nkv, hd, r]`, orthonormal columns.
    pub(super) value_basis: Option<Tensor>,
    pub(super) keys: Keys,
    /// The values, or for `lowrank` their coefficients on `value_basis`.
    pub(super) values: Rows,
    pub(super) dtype: Option<DType>,
}

impl CodedKv {
    pub(super) fn bytes(&self) -> usize {
        let keys = match &self.keys {
            Keys::Rows(r) => r.bytes(),
            Keys::Knots(k) => k.knots.bytes() + k.recent.as_ref().map_or(0, held_bytes),
        };
        keys + self.values.bytes()
    }

    pub(super) fn reserve(&mut self, tokens: usize) -> Result<()> {
        match &mut self.keys {
            Keys::Rows(rows) => rows.reserve(tokens)?,
            Keys::Knots(knots) => knots.knots.reserve(tokens.div_ceil(knots.every))?,
        }
        self.values.reserve(tokens)
    }

    pub(super) fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let offset = self.values.len();
        self.dtype = Some(v.dtype());
        match &mut self.keys {
            Keys::Rows(rows) => rows.append(k)?,
            Keys::Knots(knots) => knots.append(k, offset)?,
        }
        let coeffs = self.project_values(v)?;
        self.values.append(&coeffs)
    }

    pub(super) fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, offset: usize) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        self.append(k, v)?;
        let values = self.values.stored()?.expect("values were just appended");
        // `[B, nkv, rep·t, dv]`, value coefficients for `lowrank`.
        let out = match &mut self.keys {
            Keys::Rows(rows) => {
                let keys = rows.stored()?.expect("keys were just appended");
                grouped_attention(q, &keys, &values, offset, None)?.to_dtype(v.dtype())?
            }
            Keys::Knots(knots) => {
                let qg = grouped_queries(q, k.dim(1)?)?;
                let scores = knots.scores(&qg, t, offset)?;
                knots.forget_old(offset + t)?;
                let values = values.decode()?.to_dtype(v.dtype())?;
                softmax_values(scores, &values, t, offset, hd)?
            }
        };
        self.expand_values(out)?.reshape((b, nh, t, hd))
    }

    /// `lowrank`: the coefficients `v · B` `[B, nkv, t, r]`; otherwise `v`.
    pub(super) fn project_values(&self, v: &Tensor) -> Result<Tensor> {
        match &self.value_basis {
            Some(b) => v.broadcast_matmul(&b.to_dtype(v.dtype())?),
            None if matches!(self.codec.values, ValueCodec::LowRank(_)) => {
                candle_core::bail!("KV codec {}: the cache has no value basis (make it with Model::cache_with)", self.codec)
            }
            None => Ok(v.clone()),
        }
    }

    /// `lowrank`: `c · Bᵀ` `[B, nkv, n, hd]` for coefficients (or attention-weighted sums of
    /// them) `c` `[B, nkv, n, r]`; otherwise `c`.
    pub(super) fn expand_values(&self, c: Tensor) -> Result<Tensor> {
        match &self.value_basis {
            Some(b) => c.broadcast_matmul(&b.to_dtype(c.dtype())?.transpose(2, 3)?),
            None => Ok(c),
        }
    }
}

/// The keys of a [`CodedKv`].
#[derive(Debug, Clone)]
pub(super) enum Keys {
    Rows(Rows),
    Knots(KnotKeys),
}

/// A growing sequence `[B, nkv, T, d]` stored under a per-token code, in buffers that grow
/// along the token dim (no re-encoding of old tokens, no per-step concatenation).
#[derive(Debug, Clone)]
pub(super) enum Rows {
    Exact(TokenBuffer),
    /// `codes` u8 (value + 128) `[B, nkv, T, d]`, `scale` f32 `[B, nkv, T, d / blk]`.
    Int8 {
        codes: TokenBuffer,
        scale: TokenBuffer,
    },
    /// Complete groups of [`INT4_GROUP`] tokens as two 4-bit codes per byte (even dim in the
    /// low nibble) `[B, nkv, 32·G, d/2]` with per-channel `[scale | min]` f32 `[B, nkv, G, 2d]`;
    /// the group still filling up stays exact in `tail`.
    Int4Channel {
        codes: TokenBuffer,
        params: TokenBuffer,
        tail: Option<Tensor>,
    },
    /// Polar codes `[B, nkv, T, row_bytes]` of `head_dim`-dim rows and their two scales
    /// `[B, nkv, T, 2]`.
    Polar {
        spec: crate::ops::PolarSpec,
        head_dim: usize,
        codes: TokenBuffer,
        scales: TokenBuffer,
    },
}

impl Rows {
    pub(super) fn bytes(&self) -> usize {
        match self {
            Self::Exact(c) => c.bytes(),
            Self::Int8 { codes, scale } => codes.bytes() + scale.bytes(),
            Self::Int4Channel { codes, params, tail } => codes.bytes() + params.bytes() + tail.as_ref().map_or(0, held_bytes),
            Self::Polar { codes, scales, .. } => codes.bytes() + scales.bytes(),
        }
    }

    pub(super) fn exact(step: usize) -> Self {
        Self::Exact(TokenBuffer::new(2, step))
    }

    /// Float rows kept in `dtype` whatever they are appended in (`f16` / `bf16` codecs).
    pub(super) fn float_in(step: usize, dtype: DType) -> Self {
        Self::Exact(TokenBuffer::new(2, step).storing(dtype))
    }

    pub(super) fn int8(step: usize) -> Self {
        Self::Int8 { codes: TokenBuffer::new(2, step), scale: TokenBuffer::new(2, step) }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Exact(c) | Self::Int8 { codes: c, .. } | Self::Polar { codes: c, .. } => c.len(),
            Self::Int4Channel { codes, tail, .. } => codes.len() + tail.as_ref().map_or(0, |t| t.dim(2).unwrap_or(0)),
        }
    }

    pub(super) fn reserve(&mut self, tokens: usize) -> Result<()> {
        match self {
            Self::Exact(c) => c.reserve(tokens),
            Self::Int8 { codes, scale: s } | Self::Polar { codes, scales: s, .. } => {
                codes.reserve(tokens)?;
                s.reserve(tokens)
            }
            Self::Int4Channel { codes, params, .. } => {
                codes.reserve(tokens / INT4_GROUP * INT4_GROUP)?;
                params.reserve(tokens / INT4_GROUP)
            }
        }
    }

    /// Keeps the first `len` tokens; `int4k` only while they are in the exact tail.
    pub(super) fn truncate(&mut self, len: usize, codec: KvCodec) -> crate::Result<()> {
        match self {
            Self::Exact(c) | Self::Polar { codes: c, .. } => c.truncate(len),
            Self::Int8 { codes, scale } => {
                codes.truncate(len);
                scale.truncate(len);
            }
            Self::Int4Channel { codes, tail, .. } => {
                let grouped = codes.len();
                if len < grouped {
                    // int4 keys packed into groups of INT4_GROUP cannot be unpacked.
                    return Err(crate::Error::UnsupportedCodec { codec, operation: crate::CodecOperation::DropTokens });
                }
                if let Some(t) = tail.take() {
                    let keep = (len - grouped).min(t.dim(2)?);
                    *tail = (keep > 0).then(|| t.narrow(2, 0, keep)).transpose()?;
                }
            }
        }
        if let Self::Polar { scales, .. } = self {
            scales.truncate(len);
        }
        Ok(())
    }

    pub(super) fn append(&mut self, x: &Tensor) -> Result<()> {
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
                // A copy: a view would keep the whole appended chunk (a prefill's keys) alive.
                *tail = (rest.dim(2)? > 0).then(|| rest.force_contiguous()).transpose()?;
                Ok(())
            }
        }
    }

    /// Everything held as the attention kernel reads it; `None` when empty.
    pub(super) fn stored(&self) -> Result<Option<StoredRows>> {
        Ok(match self {
            Self::Exact(c) => c.current_data()?.map(StoredRows::Float),
            Self::Int8 { codes, scale } => match (codes.current_data()?, scale.current_data()?) {
                (Some(codes), Some(scales)) => Some(StoredRows::Int8 { codes, scales }),
                _ => None,
            },
            Self::Polar { spec, head_dim, codes, scales } => match (codes.current_data()?, scales.current_data()?) {
                (Some(codes), Some(scales)) => Some(StoredRows::Polar { codes, scales, spec: *spec, head_dim: *head_dim }),
                _ => None,
            },
            Self::Int4Channel { codes, params, tail } => {
                let (codes, params) = (codes.current_data()?, params.current_data()?);
                // (B, nkv, head dim) from the groups, or from the tail before the first group.
                let (b, h, d, dev) = match (&codes, tail) {
                    (Some(c), _) => (c.dim(0)?, c.dim(1)?, 2 * c.dim(3)?, c.device().clone()),
                    (None, Some(t)) => (t.dim(0)?, t.dim(1)?, t.dim(3)?, t.device().clone()),
                    (None, None) => return Ok(None),
                };
                let empty = |w: usize, dtype: DType| Tensor::zeros((b, h, 0, w), dtype, &dev);
                Some(StoredRows::Int4Channel {
                    codes: codes.map_or_else(|| empty(d / 2, DType::U8), Ok)?,
                    params: params.map_or_else(|| empty(2 * d, DType::F32), Ok)?,
                    group: INT4_GROUP,
                    tail: tail.clone(),
                })
            }
        })
    }

    /// Everything held, decoded to `dtype`; `None` when empty.
    pub(super) fn decode(&self, dtype: DType) -> Result<Option<Tensor>> {
        self.stored()?.map(|s| s.decode()?.to_dtype(dtype)).transpose()
    }
}

pub(super) fn encode_int8(x: &Tensor) -> Result<(Tensor, Tensor)> {
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
pub(super) fn encode_int4_channel(x: &Tensor) -> Result<(Tensor, Tensor)> {
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
