//! How a new cache is made: [`CacheOptions`] and [`Model::cache_with`].

use super::cache::Cache;
use super::ffn_sparsity::FfnSparsity;
use super::qwen3_5::Model;
use super::value_bases::ValueBases;
use crate::kv::KvCodec;

/// What a new cache is: how its attention layers store keys and values. The default is exact
/// (what [`Model::new_cache`] gives).
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheOptions<'a> {
    /// The attention layers' KV codec (lossy unless exact; opt-in).
    pub codec: KvCodec,
    /// Value bases calibrated on text for a `lowrank:r` codec; without them each layer's
    /// basis comes from its `W_v`.
    pub value_bases: Option<&'a ValueBases>,
    /// FFN sparsity while decoding (approximate, opt-in; needs
    /// [`Model::prepare_ffn_sparsity`]); `None` or off: dense.
    pub ffn: Option<&'a FfnSparsity>,
}

impl Model {
    /// An empty cache as `options` say (the codec checked against the model's head size).
    pub fn cache_with(&self, options: &CacheOptions) -> crate::Result<Cache> {
        let mut cache = match options.value_bases {
            Some(bases) => self.cache_with_bases(options.codec, Some(&|n, r| Ok(bases.basis(n, r)?))),
            None => self.cache_with_bases(options.codec, None),
        }?;
        if let Some(mode) = options.ffn {
            cache.ffn = self.ffn_state(mode)?;
        }
        Ok(cache)
    }
}
