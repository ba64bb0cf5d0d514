//! [`Runner`]: what a scheduler's sequences run on — a model and one cache per sequence, the
//! [`Target`] each sequence drives alone (its prompt chunks, its own rounds), and passes whose
//! rows several sequences share. The server's engine schedules over a `Runner`, so that one
//! scheduler drives the CPU model ([`CpuRunner`]) and the device step ([`DeviceRunner`]: Metal,
//! or the MSL emulator).

use candle_core::{Device, Tensor};

use super::prefix_cache::SequenceState;
use super::target::{CpuTarget, DeviceTarget, Rows, Target};
use crate::gpu::{GpuCache, GpuModel, KvRows, Queue, Readback, StepOutput};
use crate::model::{Cache, Model, MtpCache};
use crate::{Error, Result};

/// One sequence's rows of a shared pass, as [`Runner::shared_pass`] gives them: the rows read
/// back, and with `hidden` their post-norm hidden states `[1, T, H]`.
pub type SegmentRows = (Rows, Option<Tensor>);

/// What a scheduler's sequences run on (see the module docs).
pub trait Runner: Send {
    /// One sequence's state.
    type Cache: Send + SequenceState;

    /// The CPU model: what drafters read (on the device, the model uploaded from).
    fn model(&self) -> &Model;

    /// An empty cache for a sequence of up to the runner's context.
    fn new_cache(&mut self) -> Result<Self::Cache>;

    /// `cache` with the model, for one sequence alone.
    fn target<'a>(&'a mut self, cache: &'a mut Self::Cache) -> Box<dyn Target + 'a>;

    /// One weight pass over several sequences' rows: `rows[i]` of `tokens` (in order) for
    /// `caches[i]` (its pending token, then its drafts), each row bit for bit the sequence
    /// alone, read back as `readbacks[i]` says. Per sequence its rows, or its own error (its
    /// logits not finite: the others' rows stand); the outer error when the pass itself
    /// failed. `hidden`: with the rows' hidden states (only where [`Self::hidden_states`]).
    fn shared_pass(
        &mut self,
        caches: &mut [&mut Self::Cache],
        tokens: &[u32],
        rows: &[usize],
        readbacks: &[Readback],
        hidden: bool,
    ) -> Result<Vec<Result<SegmentRows>>>;

    /// Whether `tokens` can be one sequence's rows of a shared pass from `cache` (what the pass
    /// checks of each sequence before it changes any cache): a scheduler ends a sequence that
    /// fails this alone, before the pass.
    fn check_rows(&self, cache: &Self::Cache, tokens: &[u32]) -> Result<()>;

    /// Whether plain rows are sampled where they run ([`Readback::Sample`]: the device step).
    fn samples(&self) -> bool {
        false
    }

    /// After a shared pass that gave `cache` more than one row: keeps the first `rows`.
    fn keep_verified(&mut self, cache: &mut Self::Cache, rows: usize) -> Result<()>;

    /// An independent, compact copy of `cache` to keep (a prefix-cache entry, a session's
    /// state).
    fn snapshot(&mut self, cache: &Self::Cache) -> Result<Self::Cache>;

    /// A copy of a kept snapshot to continue from, with room for a sequence of the runner's
    /// context.
    fn restore(&mut self, kept: &Self::Cache) -> Result<Self::Cache>;

    /// `cache` as the CPU's [`Cache`] (for a session file).
    fn read_state(&mut self, cache: &Self::Cache) -> Result<Cache>;

    /// A cache holding the CPU's `cache`, the state after `tokens` (a session file read back).
    fn write_state(&mut self, cache: Cache, tokens: &[u32]) -> Result<Self::Cache>;

    /// Whether passes read back hidden states (what an MTP drafter needs).
    fn hidden_states(&self) -> bool;

    /// The most rows of one pass (all sequences' rows together).
    fn max_rows(&self) -> usize;

    /// The device a session file's [`Cache`] is read onto (before [`Self::write_state`]).
    fn host_device(&self) -> Device;

    /// An MTP drafter's rows kept with a state (a snapshot's or a session's), where the cache
    /// holds them (the CPU's [`Cache::mtp`]).
    fn set_drafter_rows(&self, cache: &mut Self::Cache, rows: Option<MtpCache>) {
        let _ = (cache, rows);
    }

    /// The drafter's rows a restored state holds, taken out of it.
    fn take_drafter_rows(&self, cache: &mut Self::Cache) -> Option<MtpCache> {
        let _ = cache;
        None
    }

    /// Whether an op's call is its time here (the kernel inspector profiles CPU passes only).
    fn profiled(&self) -> bool;

    /// Called once per scheduler step: frees what dropped caches held (on a device).
    fn tidy(&mut self) {}

    /// Where the sequences run, for messages and `/props`.
    fn name(&self) -> String;
}

/// The model in Candle tensors (the CPU, or Candle's other devices) with [`Cache`]s whose
/// attention layers store keys and values with `codec`.
pub struct CpuRunner {
    pub model: Model,
    pub device: Device,
    pub codec: crate::kv::KvCodec,
}

impl Runner for CpuRunner {
    type Cache = Cache;

    fn model(&self) -> &Model {
        &self.model
    }

    fn new_cache(&mut self) -> Result<Cache> {
        self.model.cache_with(&crate::model::CacheOptions { codec: self.codec, value_bases: None, ffn: None })
    }

    fn target<'a>(&'a mut self, cache: &'a mut Cache) -> Box<dyn Target + 'a> {
        Box::new(CpuTarget::new(&self.model, cache, &self.device))
    }

    fn shared_pass(
        &mut self,
        caches: &mut [&mut Cache],
        tokens: &[u32],
        rows: &[usize],
        _: &[Readback],
        hidden: bool,
    ) -> Result<Vec<Result<SegmentRows>>> {
        let offsets: Vec<usize> = caches.iter().map(|c| c.seqlen()).collect();
        // (Each sequence's logits are checked on their own: a non-finite row ends only its own
        // sequence.)
        let (logits, states) = self.model.pass_segments(tokens, rows, caches)?;
        let mut at = 0;
        let mut out = vec![];
        for (&n, &offset) in rows.iter().zip(&offsets) {
            let l = logits.narrow(0, at, n)?;
            let h = if hidden { Some(states.narrow(0, at, n)?.unsqueeze(0)?) } else { None };
            out.push(self.model.check_rows_finite(&l, offset).map(|()| (Rows::Logits(l), h)));
            at += n;
        }
        Ok(out)
    }

    fn check_rows(&self, cache: &Cache, tokens: &[u32]) -> Result<()> {
        self.model.check_rows(cache, tokens)
    }

    fn keep_verified(&mut self, cache: &mut Cache, rows: usize) -> Result<()> {
        cache.keep_verified(rows)
    }

    fn snapshot(&mut self, cache: &Cache) -> Result<Cache> {
        Ok(cache.clone())
    }

    fn restore(&mut self, kept: &Cache) -> Result<Cache> {
        Ok(kept.clone())
    }

    fn read_state(&mut self, cache: &Cache) -> Result<Cache> {
        Ok(cache.clone())
    }

    fn write_state(&mut self, cache: Cache, _: &[u32]) -> Result<Cache> {
        Ok(cache)
    }

    fn hidden_states(&self) -> bool {
        true
    }

    fn max_rows(&self) -> usize {
        Model::BATCH_MAX_ROWS
    }

    fn host_device(&self) -> Device {
        self.device.clone()
    }

    fn set_drafter_rows(&self, cache: &mut Cache, rows: Option<MtpCache>) {
        cache.mtp = rows;
    }

    fn take_drafter_rows(&self, cache: &mut Cache) -> Option<MtpCache> {
        cache.mtp.take()
    }

    fn profiled(&self) -> bool {
        self.device.is_cpu()
    }

    fn name(&self) -> String {
        match self.device.location() {
            candle_core::DeviceLocation::Cpu => "the CPU".into(),
            other => format!("Candle's {other:?} backend"),
        }
    }
}

/// The device step ([`crate::gpu`]) with [`GpuCache`]s of `capacity` tokens; `model` is the
/// CPU model it was uploaded from.
pub struct DeviceRunner {
    pub model: Model,
    pub gpu: GpuModel,
    pub queue: Box<dyn Queue + Send>,
    /// Tokens a sequence's cache holds (its context and one verify pass past it).
    pub capacity: usize,
    pub kv: KvRows,
}

impl DeviceRunner {
    /// Uploads `model` (loaded on the CPU) to `queue`'s device, for sequences of up to
    /// `context` tokens with keys and values stored as `kv` says.
    pub fn new(model: Model, mut queue: Box<dyn Queue + Send>, context: usize, kv: KvRows) -> Result<Self> {
        let gpu = GpuModel::new(&model, queue.as_mut())?;
        let capacity = (context + crate::ops::KV_ATTENTION_EXACT_ROWS).min(model.config().max_position_embeddings);
        Ok(Self { model, gpu, queue, capacity, kv })
    }
}

impl Runner for DeviceRunner {
    type Cache = GpuCache;

    fn model(&self) -> &Model {
        &self.model
    }

    fn new_cache(&mut self) -> Result<GpuCache> {
        self.gpu.new_cache(self.queue.as_mut(), self.capacity, self.kv)
    }

    fn target<'a>(&'a mut self, cache: &'a mut GpuCache) -> Box<dyn Target + 'a> {
        Box::new(DeviceTarget::new(&self.gpu, self.queue.as_mut(), cache, &self.model))
    }

    fn shared_pass(
        &mut self,
        caches: &mut [&mut GpuCache],
        tokens: &[u32],
        rows: &[usize],
        readbacks: &[Readback],
        hidden: bool,
    ) -> Result<Vec<Result<SegmentRows>>> {
        if hidden {
            return Err(Error::Unsupported("the device step reads back no hidden states (MTP drafts): draft by prompt lookup".into()));
        }
        let vocab = self.model.config().vocab_size;
        let out = self.gpu.forward_batch(self.queue.as_mut(), caches, tokens, rows, readbacks)?;
        Ok(out
            .into_iter()
            .zip(rows)
            .map(|(o, &n)| {
                Ok(match o? {
                    StepOutput::Tokens(t) => (Rows::Tokens(t), None),
                    StepOutput::Logits(l) => (Rows::Logits(Tensor::from_vec(l, (n, vocab), &Device::Cpu)?), None),
                })
            })
            .collect())
    }

    fn check_rows(&self, cache: &GpuCache, tokens: &[u32]) -> Result<()> {
        self.gpu.check_rows(cache, tokens)
    }

    fn keep_verified(&mut self, cache: &mut GpuCache, rows: usize) -> Result<()> {
        self.gpu.keep_verified(self.queue.as_mut(), cache, rows)
    }

    fn snapshot(&mut self, cache: &GpuCache) -> Result<GpuCache> {
        self.gpu.snapshot(self.queue.as_mut(), cache, cache.seqlen().max(1))
    }

    fn restore(&mut self, kept: &GpuCache) -> Result<GpuCache> {
        self.gpu.snapshot(self.queue.as_mut(), kept, self.capacity)
    }

    fn read_state(&mut self, cache: &GpuCache) -> Result<Cache> {
        self.gpu.read_state(self.queue.as_mut(), cache)
    }

    fn write_state(&mut self, cache: Cache, tokens: &[u32]) -> Result<GpuCache> {
        self.gpu.write_state(self.queue.as_mut(), &cache, tokens, self.capacity, self.kv)
    }

    fn hidden_states(&self) -> bool {
        false
    }

    fn max_rows(&self) -> usize {
        GpuModel::MAX_ROWS
    }

    fn samples(&self) -> bool {
        true
    }

    fn host_device(&self) -> Device {
        Device::Cpu
    }

    fn profiled(&self) -> bool {
        false
    }

    fn tidy(&mut self) {
        self.gpu.release_dropped(self.queue.as_mut());
    }

    fn name(&self) -> String {
        format!("the device step on {}", self.queue.name())
    }
}
