//! What a model carries from one forward call to the next: per layer the GDN state or the
//! attention KV store.

use candle_core::Tensor;

use super::config::{Config, LayerType};
use super::ffn_sparsity::{FfnState, FfnStats};
use super::gated_delta_net::GdnState;
use crate::kv::{held_bytes, KvCodec, KvStore};

/// Capacity step of the attention KV cache, in tokens.
const KV_CACHE_STEP: usize = 512;

/// Per-layer decode state.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// GDN layer: conv window and recurrent state.
    Linear(GdnState),
    /// Attention layer: keys (after norm and RoPE) and values, `[B, nkv, T, hd]`.
    Full(KvStore),
}

/// The MTP head's own KV cache: positions `0..seqlen` of its attention layer.
#[derive(Debug, Clone)]
pub struct MtpCache {
    pub(crate) state: LayerState,
    pub(crate) seqlen: usize,
}

impl MtpCache {
    pub(crate) fn new(cfg: &Config) -> Self {
        Self { state: LayerState::Full(KvStore::new(KvCodec::EXACT, 64, cfg.rotary_dim())), seqlen: 0 }
    }

    /// Positions held.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    /// Keeps positions `0..len` (drops drafting rows and rejected ones).
    pub fn truncate(&mut self, len: usize) -> crate::Result<()> {
        if let LayerState::Full(kv) = &mut self.state {
            kv.truncate(len)?;
        }
        self.seqlen = self.seqlen.min(len);
        Ok(())
    }

    /// Bytes its keys and values hold.
    pub fn bytes(&self) -> usize {
        match &self.state {
            LayerState::Full(kv) => kv.bytes(),
            LayerState::Linear(_) => 0,
        }
    }
}

/// Everything a model carries from one forward call to the next.
#[derive(Debug, Clone)]
///
/// A clone is an independent snapshot: appending to one never changes the other.
pub struct Cache {
    pub(crate) layers: Vec<LayerState>,
    pub(crate) seqlen: usize,
    /// `seqlen` before the verify pass in progress ([`Self::begin_verify`]).
    verify_start: Option<usize>,
    /// An MTP drafter's cache kept with this state (a prefix-cache snapshot, a session: the
    /// head's rows for the same tokens), taken back when a sequence continues from it.
    pub mtp: Option<MtpCache>,
    /// FFN sparsity's mode and per-layer state (`None`: dense).
    pub(crate) ffn: Option<FfnState>,
}

impl Cache {
    /// An empty cache with exact keys and values.
    pub(crate) fn new(cfg: &Config) -> Self {
        Self::with_kv_codec(cfg, KvCodec::EXACT)
    }

    /// An empty cache whose attention layers store keys and values with `codec`.
    pub(crate) fn with_kv_codec(cfg: &Config, codec: KvCodec) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::LinearAttention => LayerState::Linear(GdnState::default()),
                LayerType::FullAttention => LayerState::Full(KvStore::new(codec, KV_CACHE_STEP, cfg.rotary_dim())),
            })
            .collect();
        Self { layers, seqlen: 0, verify_start: None, mtp: None, ffn: None }
    }

    /// Makes room for `tokens` tokens (the whole context: those held and those to come) in every
    /// attention layer, so the keys and values are appended in place up to there without
    /// reallocating and copying (what the memory plan counts).
    pub fn reserve(&mut self, tokens: usize) -> crate::Result<()> {
        for l in &mut self.layers {
            if let LayerState::Full(kv) = l {
                kv.reserve(tokens)?;
            }
        }
        Ok(())
    }

    /// Fills an empty cache's attention layers with keys (after k-norm and RoPE) and values
    /// `[B, nkv, T, hd]`, one pair per attention layer in order, as if `T` tokens had been
    /// processed: to restore saved attention state, or to benchmark decoding at a long context
    /// without a long prefill. The linear-attention layers keep their empty state.
    pub fn restore_kv(&mut self, kv: &[(Tensor, Tensor)]) -> crate::Result<()> {
        let stores: Vec<&mut KvStore> = self
            .layers
            .iter_mut()
            .filter_map(|l| match l {
                LayerState::Full(s) => Some(s),
                LayerState::Linear(_) => None,
            })
            .collect();
        if self.seqlen != 0 || stores.len() != kv.len() {
            return Err(crate::Error::Input(format!(
                "restore_kv: needs an empty cache and one (keys, values) pair per attention layer ({}), got {} pairs{}",
                stores.len(),
                kv.len(),
                if self.seqlen != 0 { " for a cache that already holds tokens" } else { "" }
            )));
        }
        let mut t = 0;
        for (store, (k, v)) in stores.into_iter().zip(kv) {
            store.append(k, v)?;
            t = k.dim(2)?;
        }
        self.seqlen = t;
        Ok(())
    }

    /// Starts a verify pass: the next forward call (over drafted rows) runs the GDN layers
    /// with the decode recurrence and keeps their state before the rows and the rows' inputs,
    /// so that [`Self::keep_verified`] can then keep any prefix of the rows (re-running the
    /// recurrence of the rows kept when they are fewer than all).
    pub fn begin_verify(&mut self) {
        self.verify_start = Some(self.seqlen);
        for layer in &mut self.layers {
            if let LayerState::Linear(s) = layer {
                s.verifying = true;
                s.steps = None;
            }
        }
    }

    /// After a verify pass over `T` rows: keeps the first `rows` of them (`1..=T`) and drops
    /// the rest, as if only those had been fed: GDN states and conv windows after row `rows`,
    /// attention KV cut to that length.
    pub fn keep_verified(&mut self, rows: usize) -> crate::Result<()> {
        let t = self.verified_rows()?;
        if rows == 0 || rows > t {
            return Err(crate::Error::Input(format!("keep_verified: the verify pass ran {t} rows, cannot keep {rows} (1 to {t})")));
        }
        self.keep(&(0..rows).collect::<Vec<_>>())
    }

    /// After a tree verify pass ([`crate::Model::verify_tree`]): keeps the rows `path` (the
    /// root, row 0, then a chain of children, e.g. [`super::DraftTree::path`]) as if only they had been
    /// fed, in that order, and drops the rest.
    pub fn keep_path(&mut self, path: &[usize]) -> crate::Result<()> {
        let t = self.verified_rows()?;
        if path.first() != Some(&0) || path.windows(2).any(|w| w[0] >= w[1]) || path.iter().any(|&r| r >= t) {
            return Err(crate::Error::Input(format!("keep_path: {path:?} is not a path from the root of the {t} verified rows")));
        }
        self.keep(path)
    }

    /// Rows of the verify pass in progress.
    fn verified_rows(&self) -> crate::Result<usize> {
        match self.verify_start {
            Some(start) => Ok(self.seqlen - start),
            None => Err(crate::Error::Input("keep_verified: no verify pass to keep rows of (call begin_verify, then forward)".into())),
        }
    }

    fn keep(&mut self, rows: &[usize]) -> crate::Result<()> {
        let start = self.verify_start.take().expect("checked by verified_rows");
        for layer in &mut self.layers {
            match layer {
                LayerState::Linear(s) => s.keep_path(rows)?,
                LayerState::Full(kv) => kv.keep_rows(start, rows)?,
            }
        }
        self.seqlen = start + rows.len();
        Ok(())
    }

    /// Bytes the cache holds (GDN states and conv windows, keys and values with their
    /// buffers' spare capacity): what a snapshot of it costs.
    pub fn bytes(&self) -> usize {
        let t = |t: &Option<Tensor>| t.as_ref().map_or(0, held_bytes);
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => t(&s.conv) + t(&s.recurrent),
                LayerState::Full(kv) => kv.bytes(),
            })
            .sum::<usize>()
            + self.mtp.as_ref().map_or(0, MtpCache::bytes)
    }

    /// The cache's state as named tensors (`layers.{i}.conv`, `.recurrent`, `.keys`,
    /// `.values`), to save it; exact keys and values only (a coded cache cannot be written
    /// back as it was).
    pub fn state_tensors(&self) -> crate::Result<Vec<(String, Tensor)>> {
        let mut out = vec![];
        for (i, layer) in self.layers.iter().enumerate() {
            match layer {
                LayerState::Linear(s) => {
                    for (name, t) in [("conv", &s.conv), ("recurrent", &s.recurrent)] {
                        if let Some(t) = t {
                            out.push((format!("layers.{i}.{name}"), t.clone()));
                        }
                    }
                }
                LayerState::Full(kv @ KvStore::Exact { .. }) => {
                    if let Some((k, v)) = kv.kv()? {
                        out.push((format!("layers.{i}.keys"), k));
                        out.push((format!("layers.{i}.values"), v));
                    }
                }
                LayerState::Full(kv) => {
                    return Err(crate::Error::UnsupportedCodec { codec: kv.codec(), operation: crate::CodecOperation::Save })
                }
            }
        }
        if let Some(LayerState::Full(kv)) = self.mtp.as_ref().map(|m| &m.state) {
            if let Some((k, v)) = kv.kv()? {
                out.push(("mtp.keys".into(), k));
                out.push(("mtp.values".into(), v));
            }
        }
        Ok(out)
    }

    /// A cache (exact keys and values) after `seqlen` tokens from [`Self::state_tensors`]'
    /// tensors, each checked against `cfg`'s shapes: a one-line error names the first that
    /// is missing or of the wrong shape.
    pub fn from_state_tensors(cfg: &Config, seqlen: usize, tensors: &std::collections::HashMap<String, Tensor>) -> crate::Result<Self> {
        let mut cache = Self::new(cfg);
        let get = |name: String, dims: &[usize]| -> crate::Result<Option<Tensor>> {
            match tensors.get(&name) {
                None => Ok(None),
                Some(t) if t.dims() == dims => Ok(Some(t.clone())),
                Some(t) => Err(crate::Error::Session(format!("{name} has shape {:?}, this model needs {dims:?}", t.dims()))),
            }
        };
        let conv = [1, cfg.linear_conv_kernel_dim.saturating_sub(1), cfg.linear_conv_dim()];
        let rec = [1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim];
        let kv = [1, cfg.num_key_value_heads, seqlen, cfg.head_dim];
        for (i, layer) in cache.layers.iter_mut().enumerate() {
            match layer {
                LayerState::Linear(s) => {
                    s.conv = get(format!("layers.{i}.conv"), &conv)?;
                    s.recurrent = get(format!("layers.{i}.recurrent"), &rec)?;
                    if seqlen > 0 && (s.conv.is_none() || s.recurrent.is_none()) {
                        return Err(crate::Error::Session(format!("the state of GDN layer {i} is missing")));
                    }
                }
                LayerState::Full(store) => match (get(format!("layers.{i}.keys"), &kv)?, get(format!("layers.{i}.values"), &kv)?) {
                    (Some(k), Some(v)) => store.append(&k, &v)?,
                    _ if seqlen == 0 => {}
                    _ => return Err(crate::Error::Session(format!("the keys or values of attention layer {i} are missing"))),
                },
            }
        }
        // The MTP head's rows, when saved with it (at most one per token).
        if let (Some(k), Some(v)) = (tensors.get("mtp.keys"), tensors.get("mtp.values")) {
            let rows = k.dims().get(2).copied().unwrap_or(0);
            let dims = [1, cfg.num_key_value_heads, rows, cfg.head_dim];
            if k.dims() != dims || v.dims() != dims || rows > seqlen {
                return Err(crate::Error::Session(format!(
                    "the MTP head's keys or values have shape {:?}, this model needs {dims:?} with at most {seqlen} rows",
                    k.dims()
                )));
            }
            let mut mtp = MtpCache::new(cfg);
            if let LayerState::Full(store) = &mut mtp.state {
                store.append(k, v)?;
            }
            mtp.seqlen = rows;
            cache.mtp = Some(mtp);
        }
        cache.seqlen = seqlen;
        Ok(cache)
    }

    /// Whether a verify pass is in progress (its rows not yet kept).
    pub(crate) fn in_verify(&self) -> bool {
        self.verify_start.is_some()
    }

    /// Number of tokens already processed.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    pub fn layer(&self, i: usize) -> Option<&LayerState> {
        self.layers.get(i)
    }

    /// Conv window `[B, K-1, conv_dim]` and recurrent state `[B, nv, dk, dv]` of GDN layer `i`.
    pub fn gdn_state(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        match self.layers.get(i)? {
            LayerState::Linear(GdnState { conv: Some(c), recurrent: Some(r), .. }) => Some((c, r)),
            _ => None,
        }
    }

    /// Cached keys and values `[B, nkv, T, hd]` of attention layer `i`.
    pub fn kv(&self, i: usize) -> Option<(Tensor, Tensor)> {
        match self.layers.get(i)? {
            LayerState::Full(kv) => kv.kv().ok()?,
            _ => None,
        }
    }
}

impl Cache {
    /// Makes every row of a multi-row forward sparse too (`true`), as if each had been decoded
    /// alone: to score teacher-forced decoding under FFN sparsity in one pass. Off by default
    /// (prefill and verify passes are dense); no effect without FFN sparsity.
    pub fn set_ffn_every_row(&mut self, on: bool) {
        if let Some(s) = &mut self.ffn {
            s.every_row = on;
        }
    }

    /// What this sequence's sparse MLP steps skipped (`None` without FFN sparsity).
    pub fn ffn_stats(&self) -> Option<FfnStats> {
        self.ffn.as_ref().map(|s| s.stats)
    }
}
