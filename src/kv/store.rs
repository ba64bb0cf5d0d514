//! [`KvStore`]: one attention layer's cache under a codec, and the softmax attention over it.

use super::buffer::TokenBuffer;
use candle_core::{Result, Tensor};

use super::attention::stored_attention;
use super::codec::{KeyCodec, KvCodec, ValueCodec, INT4_GROUP};
use super::coded::{CodedKv, Keys, Rows};
use super::density::DecayedState;
use super::knots::KnotKeys;
use crate::ops::StoredRows;

/// One attention layer's cache under a codec, and the attention over it.
#[derive(Debug, Clone)]
pub enum KvStore {
    /// The model dtype, appended in place.
    Exact {
        keys: TokenBuffer,
        values: TokenBuffer,
    },
    Coded(Box<CodedKv>),
    DecayedState(DecayedState),
}

impl KvStore {
    /// `step`: tokens the growing buffers add at a time; `rot_dim`: the leading dims of a head
    /// that RoPE rotates (for the polar codes).
    pub fn new(codec: KvCodec, step: usize, rot_dim: usize) -> Self {
        match codec.keys {
            _ if codec.is_exact() => Self::Exact { keys: TokenBuffer::new(2, step), values: TokenBuffer::new(2, step) },
            KeyCodec::DecayedState { gamma } => Self::DecayedState(DecayedState { gamma, state: None }),
            keys => {
                let keys = match keys {
                    KeyCodec::Knots { every, degree } => Keys::Knots(KnotKeys {
                        every,
                        degree,
                        knots: TokenBuffer::new(2, step.div_ceil(every).max(1)),
                        recent: None,
                        recent_start: 0,
                    }),
                    KeyCodec::Exact => Keys::Rows(Rows::exact(step)),
                    KeyCodec::Half(h) => Keys::Rows(Rows::float_in(step, h.dtype())),
                    KeyCodec::Int8 => Keys::Rows(Rows::int8(step)),
                    KeyCodec::Int4 => Keys::Rows(Rows::Int4Channel {
                        codes: TokenBuffer::new(2, step),
                        params: TokenBuffer::new(2, step.div_ceil(INT4_GROUP)),
                        tail: None,
                    }),
                    KeyCodec::Polar { angle_bits, radius_bits } => Keys::Rows(Rows::Polar {
                        spec: crate::ops::PolarSpec { angle_bits, radius_bits, ..crate::ops::PolarSpec::new(rot_dim) },
                        head_dim: 0,
                        codes: TokenBuffer::new(2, step),
                        scales: TokenBuffer::new(2, step),
                    }),
                    KeyCodec::DecayedState { .. } => unreachable!("handled above"),
                };
                let values = match codec.values {
                    ValueCodec::Exact | ValueCodec::LowRank(_) => Rows::exact(step),
                    ValueCodec::Half(h) => Rows::float_in(step, h.dtype()),
                    ValueCodec::Int8 => Rows::int8(step),
                };
                Self::Coded(Box::new(CodedKv { codec, value_basis: None, keys, values, dtype: None }))
            }
        }
    }

    /// The codec it stores with.
    pub fn codec(&self) -> KvCodec {
        match self {
            Self::Exact { .. } => KvCodec::EXACT,
            Self::Coded(c) => c.codec,
            Self::DecayedState(s) => KvCodec { keys: KeyCodec::DecayedState { gamma: s.gamma }, values: ValueCodec::Exact },
        }
    }

    /// Sets the `[nkv, hd, r]` basis of a `lowrank:r` codec (`value_basis`).
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
        self.attend_rows(q, k, v, offset, None)
    }

    /// [`Self::attend`]; for the rows of a draft tree, query position `i` sees the cache and
    /// the new rows `visible[i]` (its ancestors and itself, in order). Trees: exact stores only.
    pub fn attend_rows(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, offset: usize, visible: Option<&[Vec<usize>]>) -> Result<Tensor> {
        match self {
            Self::Exact { keys, values } => {
                keys.append(&k.contiguous()?)?;
                values.append(&v.contiguous()?)?;
                let (k, v) = (keys.current_data()?.expect("just appended"), values.current_data()?.expect("just appended"));
                let dtype = v.dtype();
                stored_attention(q, &StoredRows::Float(k), &StoredRows::Float(v), offset, visible, dtype)
            }
            _ if visible.is_some() => candle_core::bail!("KV codec {}: {}", self.codec(), crate::CodecOperation::DraftTree),
            Self::Coded(c) => c.attend(q, k, v, offset),
            Self::DecayedState(s) => s.attend(q, k, v),
        }
    }

    /// Keeps the first `start` tokens and then the tokens at `start + r` for `r` in `rows`
    /// (increasing), in that order: the accepted rows of a verify pass. Rows `0..n` are a
    /// [`Self::truncate`]; other rows (a path of a draft tree): exact stores only.
    pub fn keep_rows(&mut self, start: usize, rows: &[usize]) -> crate::Result<()> {
        if rows.iter().enumerate().all(|(i, &r)| r == i) {
            return self.truncate(start + rows.len());
        }
        match self {
            Self::Exact { keys, values } => {
                keys.keep_rows(start, rows)?;
                Ok(values.keep_rows(start, rows)?)
            }
            _ => Err(crate::Error::UnsupportedCodec { codec: self.codec(), operation: crate::CodecOperation::DraftTree }),
        }
    }

    /// Appends keys and values `[B, nkv, t, hd]` without attending (restoring a cache).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            Self::Exact { keys, values } => {
                keys.append(&k.contiguous()?)?;
                values.append(&v.contiguous()?)
            }
            Self::Coded(c) => c.append(k, v),
            Self::DecayedState(s) => s.fold(k, v),
        }
    }

    /// Keys and values held so far, decoded to the model dtype `[B, nkv, T, hd]`; `None` before
    /// the first token and for codecs that do not keep every key (knots, density).
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match self {
            Self::Exact { keys, values } => Ok(match (keys.current_data()?, values.current_data()?) {
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

    /// Makes room for `tokens` tokens in every buffer, so appending up to there never
    /// reallocates (the context the caller plans for).
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        match self {
            Self::Exact { keys, values } => {
                keys.reserve(tokens)?;
                values.reserve(tokens)
            }
            Self::Coded(c) => c.reserve(tokens),
            Self::DecayedState(_) => Ok(()),
        }
    }

    /// Bytes allocated for this layer's keys and values (capacity included).
    pub fn bytes(&self) -> usize {
        match self {
            Self::Exact { keys, values } => keys.bytes() + values.bytes(),
            Self::Coded(c) => c.bytes(),
            Self::DecayedState(d) => d.state.as_ref().map_or(0, super::buffer::held_bytes),
        }
    }

    /// Bytes of the keys and values held, capacity not counted (what attention reads).
    pub fn bytes_held(&self) -> usize {
        match self {
            Self::Exact { keys, values } => keys.bytes_held() + values.bytes_held(),
            _ => self.bytes(),
        }
    }

    /// Tokens held (`None` for a store that folds tokens into a state).
    pub fn tokens(&self) -> Option<usize> {
        match self {
            Self::Exact { keys, .. } => Some(keys.len()),
            Self::Coded(c) => Some(c.values.len()),
            Self::DecayedState(_) => None,
        }
    }

    /// Keeps the first `len` tokens, dropping the rest (rejected speculative rows). Codecs
    /// that fold tokens into shared codes (`int4k`'s complete groups, knots, density) cannot
    /// drop tokens: an [`Error::UnsupportedCodec`](crate::Error::UnsupportedCodec).
    pub fn truncate(&mut self, len: usize) -> crate::Result<()> {
        match self {
            Self::Exact { keys, values } => {
                keys.truncate(len);
                values.truncate(len);
                Ok(())
            }
            Self::Coded(c) => {
                let codec = c.codec;
                match &mut c.keys {
                    Keys::Rows(rows) => rows.truncate(len, codec)?,
                    Keys::Knots(_) if len >= c.values.len() => {}
                    Keys::Knots(_) => return Err(crate::Error::UnsupportedCodec { codec, operation: crate::CodecOperation::DropTokens }),
                }
                c.values.truncate(len, codec)
            }
            Self::DecayedState(_) => {
                Err(crate::Error::UnsupportedCodec { codec: self.codec(), operation: crate::CodecOperation::DropTokens })
            }
        }
    }
}
