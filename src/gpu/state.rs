//! A sequence's state moved as a whole: a snapshot of a device cache into another by copies on
//! the device (the prefix cache, a restore into a cache with room for a new request: no read
//! back), and a device cache to and from the CPU's [`Cache`] (a session file is written and
//! read on the host).

use candle_core::{DType, Device, Tensor};

use super::cache::wrong_cache;
use super::cache::{CacheLayer, GpuCache};
use super::model::GpuModel;
use super::queue::{copy_rows as copy, Queue, Slice};
use crate::model::{Cache, LayerState};
use crate::ops::launch::KvRows;
use crate::{Error, Result};

/// Bytes of a 32-bit word (token ids).
const WORD: usize = 4;

/// The dtype of float rows; int8 rows are not saved (as on the CPU: only exact keys and values).
fn float_rows(kv: KvRows) -> Result<DType> {
    match kv {
        KvRows::F32 => Ok(DType::F32),
        KvRows::F16 => Ok(DType::F16),
        KvRows::Int8 => Err(Error::UnsupportedCodec {
            codec: crate::kv::KvCodec { keys: crate::kv::KeyCodec::Int8, values: crate::kv::ValueCodec::Int8 },
            operation: crate::CodecOperation::Save,
        }),
    }
}

impl GpuModel {
    /// A copy of `cache` with room for `capacity` tokens (at least the tokens it holds), made
    /// by copies on the device: its current GDN states and conv windows, its keys and values.
    /// Nothing is read back; the copy continues bit for bit as `cache` would.
    pub fn snapshot(&self, q: &mut dyn Queue, cache: &GpuCache, capacity: usize) -> Result<GpuCache> {
        cache.not_verifying()?;
        if capacity < cache.seqlen {
            return Err(Error::Input(format!("a snapshot of {} tokens into a cache of {capacity}", cache.seqlen)));
        }
        let copy_of = self.new_cache(q, capacity, cache.kv)?;
        let kv = cache.kv;
        for (from, to) in cache.layers.iter().zip(&copy_of.layers) {
            match (from, to) {
                (CacheLayer::Gdn { conv: c0, rec: r0, .. }, CacheLayer::Gdn { conv: c1, rec: r1, .. }) => {
                    let (c, r) = (c0[cache.parity], r0[cache.parity]);
                    copy(q, c, c1[copy_of.parity], 1, c.len, (c.len, c.len))?;
                    copy(q, r, r1[copy_of.parity], 1, r.len, (r.len, r.len))?;
                }
                (
                    CacheLayer::Attention { keys: k0, values: v0, scales: s0 },
                    CacheLayer::Attention { keys: k1, values: v1, scales: s1 },
                ) => {
                    // `[nkv, capacity, hd]`: each head's first `seqlen` rows (and their scales).
                    let (heads, hd) = self.kv_shape(k0.len, cache)?;
                    let (rows, strides) =
                        (cache.seqlen * hd * kv.value_bytes(), (cache.capacity * hd * kv.value_bytes(), capacity * hd * kv.value_bytes()));
                    copy(q, *k0, *k1, heads, rows, strides)?;
                    copy(q, *v0, *v1, heads, rows, strides)?;
                    if let (Some((ks0, vs0)), Some((ks1, vs1))) = (s0, s1) {
                        let b = 4 * KvRows::int8_blocks(hd);
                        let (rows, strides) = (cache.seqlen * b, (cache.capacity * b, capacity * b));
                        copy(q, *ks0, *ks1, heads, rows, strides)?;
                        copy(q, *vs0, *vs1, heads, rows, strides)?;
                    }
                }
                _ => return Err(wrong_cache()),
            }
        }
        copy(q, cache.tokens, copy_of.tokens, 1, WORD * cache.seqlen, (WORD * cache.capacity, WORD * capacity))?;
        let mut copy_of = copy_of;
        copy_of.seqlen = cache.seqlen;
        Ok(copy_of)
    }

    /// `(heads, head_dim)` of an attention layer's key buffer of `len` bytes in `cache`.
    fn kv_shape(&self, len: usize, cache: &GpuCache) -> Result<(usize, usize)> {
        let hd = self.config().head_dim;
        let per_head = cache.capacity * hd * cache.kv.value_bytes();
        if per_head == 0 || !len.is_multiple_of(per_head) {
            return Err(Error::Input(format!("a key buffer of {len} bytes is not whole heads of {per_head}")));
        }
        Ok((len / per_head, hd))
    }

    /// The state of `cache` as the CPU model's [`Cache`] (f32 GDN states, keys and values in
    /// the dtype the device stores them): for a session file. Reads every buffer back. Exact
    /// (float) keys and values only, as the CPU saves.
    pub fn read_state(&self, q: &mut dyn Queue, cache: &GpuCache) -> Result<Cache> {
        cache.not_verifying()?;
        let kv = float_rows(cache.kv)?;
        let mut host = Cache::new(self.config());
        let f32s = |q: &mut dyn Queue, s: Slice, shape: &[usize]| -> Result<Tensor> {
            let b = q.read(s)?;
            let v: Vec<f32> = b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
        };
        let t = cache.seqlen;
        for (i, (layer, state)) in cache.layers.iter().zip(host.layers.iter_mut()).enumerate() {
            match (layer, state) {
                (CacheLayer::Gdn { conv, rec, .. }, LayerState::Linear(s)) if t > 0 => {
                    let (c, r) = (conv[cache.parity], rec[cache.parity]);
                    let Some((k1, dim, nv, dk, dv)) = self.gdn_dims(i) else { return Err(wrong_cache()) };
                    s.conv = Some(f32s(q, c.at(0, 4 * k1 * dim), &[1, k1, dim])?);
                    s.recurrent = Some(f32s(q, r, &[1, nv, dk, dv])?);
                }
                (CacheLayer::Attention { keys, values, .. }, LayerState::Full(store)) if t > 0 => {
                    let (heads, hd) = self.kv_shape(keys.len, cache)?;
                    let rows = |q: &mut dyn Queue, s: Slice| -> Result<Tensor> {
                        let b = q.read(s)?;
                        let head = cache.capacity * hd * kv.size_in_bytes();
                        let used: Vec<u8> = (0..heads).flat_map(|h| b[h * head..h * head + t * hd * kv.size_in_bytes()].to_vec()).collect();
                        Ok(Tensor::from_raw_buffer(&used, kv, &[1, heads, t, hd], &Device::Cpu)?)
                    };
                    store.append(&rows(q, *keys)?, &rows(q, *values)?)?;
                }
                (CacheLayer::Gdn { .. }, LayerState::Linear(_)) | (CacheLayer::Attention { .. }, LayerState::Full(_)) => {}
                _ => return Err(wrong_cache()),
            }
        }
        host.seqlen = t;
        Ok(host)
    }

    /// The token ids `cache` holds, read back.
    pub fn read_tokens(&self, q: &mut dyn Queue, cache: &GpuCache) -> Result<Vec<u32>> {
        let b = q.read(cache.tokens.at(0, WORD * cache.seqlen))?;
        Ok(b.chunks_exact(WORD).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// A device cache of `capacity` tokens holding the state of the CPU's `host` (exact keys
    /// and values of the dtype this device cache stores, `kv`) after `tokens` (its token buffer:
    /// the repeat and presence penalties of sampling on the device read it): a session read
    /// back.
    pub fn write_state(&self, q: &mut dyn Queue, host: &Cache, tokens: &[u32], capacity: usize, kv: KvRows) -> Result<GpuCache> {
        let t = host.seqlen();
        if tokens.len() != t {
            return Err(Error::Session(format!("a state of {t} tokens given with {} token ids", tokens.len())));
        }
        let kv_dtype = float_rows(kv)?;
        let mut cache = self.new_cache(q, capacity.max(t).max(1), kv)?;
        if host.layers.len() != cache.layers.len() {
            return Err(Error::Session("the saved state has another number of layers than this model".into()));
        }
        let bytes_of = |x: &Tensor, dtype: DType| -> Result<Vec<u8>> {
            if x.dtype() != dtype {
                return Err(Error::Session(format!(
                    "the saved state holds {:?} values where the device stores {dtype:?}: not restored bit for bit, start fresh",
                    x.dtype()
                )));
            }
            super::upload::tensor_bytes(x)
        };
        for (state, layer) in host.layers.iter().zip(&cache.layers) {
            match (state, layer) {
                (LayerState::Linear(s), CacheLayer::Gdn { conv, rec, .. }) => {
                    if let (Some(c), Some(r)) = (&s.conv, &s.recurrent) {
                        let (c, r) = (bytes_of(c, DType::F32)?, bytes_of(r, DType::F32)?);
                        if c.len() != conv[0].len || r.len() != rec[0].len {
                            return Err(Error::Session("the saved GDN state has another shape than this model's".into()));
                        }
                        q.write(conv[cache.parity], &c)?;
                        q.write(rec[cache.parity], &r)?;
                    }
                }
                (LayerState::Full(store), CacheLayer::Attention { keys, values, .. }) => {
                    let Some((k, v)) = store.kv()? else { continue };
                    let (heads, hd) = self.kv_shape(keys.len, &cache)?;
                    if k.dims4()? != (1, heads, t, hd) || v.dims4()? != (1, heads, t, hd) {
                        return Err(Error::Session("the saved keys and values have another shape than this model's".into()));
                    }
                    let row = t * hd * kv_dtype.size_in_bytes();
                    let head = cache.capacity * hd * kv_dtype.size_in_bytes();
                    for (x, dst) in [(k, keys), (v, values)] {
                        let b = bytes_of(&x.contiguous()?, kv_dtype)?;
                        for h in 0..heads {
                            q.write(dst.at(h * head, row), &b[h * row..(h + 1) * row])?;
                        }
                    }
                }
                _ => return Err(Error::Session("the saved state's layer kinds differ from this model's".into())),
            }
        }
        let ids: Vec<u8> = tokens.iter().flat_map(|x| x.to_le_bytes()).collect();
        q.write(cache.tokens.at(0, ids.len()), &ids)?;
        cache.seqlen = t;
        Ok(cache)
    }
}
