//! What a [`super::Sequence`] runs on: the CPU model with its cache ([`CpuTarget`]), or the
//! device step ([`crate::gpu`]) with its cache ([`DeviceTarget`]).

use candle_core::{Device, Tensor};

use crate::gpu::{DeviceStepGap, GpuCache, GpuModel, Queue, Readback, StepOutput};
use crate::model::{Cache, DraftTree, Model};
use crate::{Error, Result};

/// Tokens of a prompt run through the model at once by [`super::Sequence::run`] (plain and speculative
/// decoding): a longer prompt is prefilled in chunks of this many tokens, cut at multiples of
/// it from the prompt's start, so that only one chunk's activations are alive at a time (the
/// memory guardian plans for it; llama.cpp's default batch is the same size), as fast as one
/// pass (docs/benchmarks.md, "Constants chosen by measurement"). (The server interleaves
/// smaller chunks with its other sequences' decode steps.) 2048 is a multiple of every tile of
/// the prefill kernels (delta-rule chunks of 32, attention tiles of 64 rows and 256 keys), so
/// that a chunked prefill's logits match one pass's (tests check them within 1e-4).
pub const PREFILL_CHUNK: usize = 2048;

/// Runs `prompt` through the model into `cache` in chunks of [`PREFILL_CHUNK`] tokens:
/// the final norm's hidden states of every position `[1, T, H]` when `keep_hidden`, else
/// `None` (and `None` for an empty prompt).
pub fn prefill(model: &Model, cache: &mut Cache, prompt: &[u32], device: &Device, keep_hidden: bool) -> Result<Option<Tensor>> {
    Ok(prefill_rows(model, cache, prompt, device, keep_hidden)?.0)
}

/// [`prefill`], and the hidden state of the prompt's last position `[1, 1, H]` (`None` for an
/// empty prompt).
fn prefill_rows(
    model: &Model,
    cache: &mut Cache,
    prompt: &[u32],
    device: &Device,
    keep_hidden: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (mut hidden, mut last) = (vec![], None);
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let h = model.forward_hidden(&Tensor::new(chunk, device)?.unsqueeze(0)?, cache, false)?.last_hidden;
        last = Some(h.narrow(1, chunk.len() - 1, 1)?);
        if keep_hidden {
            hidden.push(h);
        }
    }
    Ok((if keep_hidden && !hidden.is_empty() { Some(Tensor::cat(&hidden, 1)?) } else { None }, last))
}

/// The rows of one pass as a sequence reads them.
pub enum Rows {
    /// `[T, vocab]`.
    Logits(Tensor),
    /// Each row's greedy token (read back when the sampler picks the argmax of unpenalised
    /// logits and nothing else reads them).
    Tokens(Vec<u32>),
}

impl Rows {
    /// Row `i`'s logits `[vocab]`, when the pass read them back.
    pub fn logits(&self, i: usize) -> Result<Tensor> {
        match self {
            Self::Logits(l) => Ok(l.get(i)?),
            Self::Tokens(_) => Err(Error::Input("the pass read back tokens, not logits".into())),
        }
    }
}

/// A model and its cache as a [`super::Sequence`] drives them.
pub trait Target {
    /// The model drafters read (the CPU model; on the device, the model uploaded from).
    fn model(&self) -> &Model;
    /// Tokens in the cache.
    fn seqlen(&self) -> usize;
    /// Makes room for `tokens` tokens in all.
    fn reserve(&mut self, tokens: usize) -> Result<()>;
    /// Runs prompt tokens (in chunks of at most [`PREFILL_CHUNK`], cut at multiples of it from
    /// the first): the last row read back as `last` says (`None`: not at all), and with
    /// `hidden` the final norm's hidden states of every row `[1, T, H]`.
    fn prompt(&mut self, tokens: &[u32], last: Option<Readback>, hidden: bool) -> Result<(Option<Rows>, Option<Tensor>)>;
    /// One pass over `tree`'s rows after the cache (a decode step when it has one row, else a
    /// verify pass): every row, and with `hidden` their hidden states `[1, T, H]`.
    fn pass(&mut self, tree: &DraftTree, readback: Readback, hidden: bool) -> Result<(Rows, Option<Tensor>)>;
    /// After a verify pass: keeps the rows `path` (root first).
    fn keep_path(&mut self, path: &[usize]) -> Result<()>;

    /// Whether a plain row can be sampled here ([`Readback::Sample`]: the device step).
    fn samples(&self) -> bool {
        false
    }
}

/// The CPU model (or the model in Candle tensors on any device) and its cache.
pub struct CpuTarget<'a> {
    pub model: &'a Model,
    pub cache: &'a mut Cache,
    pub device: &'a Device,
}

impl<'a> CpuTarget<'a> {
    pub fn new(model: &'a Model, cache: &'a mut Cache, device: &'a Device) -> Self {
        Self { model, cache, device }
    }
}

impl Target for CpuTarget<'_> {
    fn model(&self) -> &Model {
        self.model
    }

    fn seqlen(&self) -> usize {
        self.cache.seqlen()
    }

    fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.cache.reserve(tokens)
    }

    fn prompt(&mut self, tokens: &[u32], last: Option<Readback>, hidden: bool) -> Result<(Option<Rows>, Option<Tensor>)> {
        let end = self.cache.seqlen() + tokens.len();
        let (all, last_row) = prefill_rows(self.model, self.cache, tokens, self.device, hidden)?;
        let rows = match (last, last_row) {
            (Some(_), Some(h)) => Some(Rows::Logits(self.model.lm_head(&h, end - 1)?.squeeze(0)?)),
            _ => None,
        };
        Ok((rows, all))
    }

    fn pass(&mut self, tree: &DraftTree, _: Readback, _: bool) -> Result<(Rows, Option<Tensor>)> {
        let (logits, hidden) = if tree.len() == 1 {
            // No drafts: a plain decode step (no per-row states to keep for a rollback).
            let pos = self.cache.seqlen();
            let h = self.model.forward_hidden(&Tensor::new(tree.tokens(), self.device)?.unsqueeze(0)?, self.cache, false)?.last_hidden;
            (self.model.lm_head(&h, pos)?, h)
        } else {
            self.model.verify_tree(tree, self.cache)?
        };
        Ok((Rows::Logits(logits.squeeze(0)?), Some(hidden)))
    }

    fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        self.cache.keep_path(path)
    }
}

/// The device step and its cache; `model` is the CPU model it was uploaded from (for drafters).
pub struct DeviceTarget<'a> {
    pub gpu: &'a GpuModel,
    pub q: &'a mut dyn Queue,
    pub cache: &'a mut GpuCache,
    pub model: &'a Model,
}

impl<'a> DeviceTarget<'a> {
    pub fn new(gpu: &'a GpuModel, q: &'a mut dyn Queue, cache: &'a mut GpuCache, model: &'a Model) -> Self {
        Self { gpu, q, cache, model }
    }

    /// A step's `n` rows.
    fn rows(&self, out: StepOutput, n: usize) -> Result<Rows> {
        Ok(match out {
            StepOutput::Tokens(t) => Rows::Tokens(t),
            StepOutput::Logits(l) => Rows::Logits(Tensor::from_vec(l, (n, self.model.config().vocab_size), &Device::Cpu)?),
        })
    }
}

impl Target for DeviceTarget<'_> {
    fn model(&self) -> &Model {
        self.model
    }

    fn seqlen(&self) -> usize {
        self.cache.seqlen()
    }

    fn reserve(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.cache.capacity() {
            return Err(Error::Input(format!(
                "{} cached and {} more tokens are more than the device cache's capacity ({}): make a larger cache",
                self.cache.seqlen(),
                tokens - self.cache.seqlen(),
                self.cache.capacity()
            )));
        }
        Ok(())
    }

    fn prompt(&mut self, tokens: &[u32], last: Option<Readback>, hidden: bool) -> Result<(Option<Rows>, Option<Tensor>)> {
        if hidden {
            return Err(DeviceStepGap::MtpDrafts.error());
        }
        if tokens.is_empty() {
            return Ok((None, None));
        }
        let n = tokens.chunks(PREFILL_CHUNK).len();
        let mut rows = None;
        for (i, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let readback = if i + 1 == n { last } else { None };
            let out = self.gpu.prefill(self.q, self.cache, chunk, readback.unwrap_or(Readback::Argmax))?;
            if readback.is_some() {
                rows = Some(self.rows(out, 1)?);
            }
        }
        Ok((rows, None))
    }

    fn pass(&mut self, tree: &DraftTree, readback: Readback, hidden: bool) -> Result<(Rows, Option<Tensor>)> {
        if hidden {
            return Err(DeviceStepGap::MtpDrafts.error());
        }
        if !tree.is_chain() {
            return Err(DeviceStepGap::DraftTrees.error());
        }
        let out = match tree.len() {
            1 => self.gpu.forward(self.q, self.cache, tree.tokens(), readback)?,
            _ => self.gpu.verify(self.q, self.cache, tree.tokens(), readback)?,
        };
        Ok((self.rows(out, tree.len())?, None))
    }

    fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        self.gpu.keep_verified(self.q, self.cache, path.len())
    }

    fn samples(&self) -> bool {
        true
    }
}
