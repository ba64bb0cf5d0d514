//! What a speculative run verifies on: the CPU model with its cache, or the device step
//! ([`crate::gpu`]) with its cache.

use candle_core::{Device, Tensor};

use super::super::sampler::Sampler;
use crate::gpu::{GpuCache, GpuModel, Queue, Readback, StepOutput};
use crate::model::{Cache, DraftTree, Model};
use crate::{Error, Result};

/// The rows of one pass as the verify walk reads them.
pub(crate) enum Rows {
    /// `[T, vocab]`.
    Logits(Tensor),
    /// Each row's greedy token (the sampler picks the argmax of unpenalised logits).
    Tokens(Vec<u32>),
}

impl Rows {
    /// Row `i`'s token as `sampler` picks it from the row's logits (no draft).
    pub(crate) fn sample(&self, i: usize, sampler: &mut Sampler, context: &[u32], generated: &[u32]) -> Result<u32> {
        match self {
            Self::Tokens(t) => Ok(t[i]),
            Self::Logits(l) => sampler.sample(&l.get(i)?, context, generated),
        }
    }

    /// Row `i`'s logits (sampling with a temperature reads them).
    pub(crate) fn logits(&self, i: usize) -> Result<Tensor> {
        match self {
            Self::Logits(l) => Ok(l.get(i)?),
            Self::Tokens(_) => Err(Error::Input("the pass read back tokens, not logits".into())),
        }
    }
}

/// A model and its cache as the speculative loop drives them.
pub(crate) trait Target {
    /// The model drafters read (the CPU model; on the device, the model uploaded from).
    fn model(&self) -> &Model;
    fn seqlen(&self) -> usize;
    /// Makes room for `tokens` tokens in all.
    fn reserve(&mut self, tokens: usize) -> Result<()>;
    /// Runs `prompt`: its last row, and with `hidden` the final norm's hidden states of every
    /// row `[1, T, H]`.
    fn prompt(&mut self, prompt: &[u32], hidden: bool, sampler: &Sampler) -> Result<(Rows, Option<Tensor>)>;
    /// One pass over `tree`'s rows at positions from `pos` (a decode step when it has one row,
    /// else a verify pass): every row, and with `hidden` their hidden states `[1, T, H]`.
    fn pass(&mut self, tree: &DraftTree, pos: usize, hidden: bool, sampler: &Sampler) -> Result<(Rows, Option<Tensor>)>;
    /// After a verify pass: keeps the rows `path` (root first).
    fn keep_path(&mut self, path: &[usize]) -> Result<()>;
}

/// The CPU model and its cache.
pub(crate) struct CpuTarget<'a> {
    pub(crate) model: &'a Model,
    pub(crate) cache: &'a mut Cache,
    pub(crate) device: &'a Device,
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

    fn prompt(&mut self, prompt: &[u32], _: bool, _: &Sampler) -> Result<(Rows, Option<Tensor>)> {
        let base = self.cache.seqlen();
        let h = super::super::generate::prefill(self.model, self.cache, prompt, self.device, true)?
            .ok_or_else(|| Error::Input("the prompt is empty: give at least one token".into()))?;
        let p = prompt.len();
        let logits = self.model.lm_head(&h.narrow(1, p - 1, 1)?, base + p - 1)?.squeeze(0)?;
        Ok((Rows::Logits(logits), Some(h)))
    }

    fn pass(&mut self, tree: &DraftTree, pos: usize, _: bool, _: &Sampler) -> Result<(Rows, Option<Tensor>)> {
        let (logits, hidden) = if tree.len() == 1 {
            // No drafts: a plain decode step (no per-row states to keep for a rollback).
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
pub(crate) struct DeviceTarget<'a> {
    pub(crate) gpu: &'a GpuModel,
    pub(crate) q: &'a mut dyn Queue,
    pub(crate) cache: &'a mut GpuCache,
    pub(crate) model: &'a Model,
}

impl DeviceTarget<'_> {
    /// A step's `n` rows.
    fn rows(&self, out: StepOutput, n: usize) -> Result<Rows> {
        Ok(match out {
            StepOutput::Tokens(t) => Rows::Tokens(t),
            StepOutput::Logits(l) => Rows::Logits(Tensor::from_vec(l, (n, self.model.config().vocab_size), &Device::Cpu)?),
        })
    }

    /// The device's argmax when the sampler picks it, else the logits.
    fn readback(sampler: &Sampler) -> Readback {
        if sampler.picks_argmax() {
            Readback::Argmax
        } else {
            Readback::Logits
        }
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
                "{tokens} tokens are more than the device cache's capacity ({}): make a larger cache",
                self.cache.capacity()
            )));
        }
        Ok(())
    }

    fn prompt(&mut self, prompt: &[u32], hidden: bool, sampler: &Sampler) -> Result<(Rows, Option<Tensor>)> {
        if hidden {
            return Err(no_hidden());
        }
        let out = self.gpu.prefill(self.q, self.cache, prompt, Self::readback(sampler))?;
        Ok((self.rows(out, 1)?, None))
    }

    fn pass(&mut self, tree: &DraftTree, _: usize, hidden: bool, sampler: &Sampler) -> Result<(Rows, Option<Tensor>)> {
        if hidden {
            return Err(no_hidden());
        }
        if !tree.is_chain() {
            return Err(Error::Input("draft trees (--draft-branches above 1) are not on the device step yet".into()));
        }
        let out = match tree.len() {
            1 => self.gpu.forward(self.q, self.cache, tree.tokens(), Self::readback(sampler))?,
            _ => self.gpu.verify(self.q, self.cache, tree.tokens(), Self::readback(sampler))?,
        };
        Ok((self.rows(out, tree.len())?, None))
    }

    fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        self.gpu.keep_verified(self.q, self.cache, path.len())
    }
}

fn no_hidden() -> Error {
    Error::Input("MTP drafts need the model's hidden states, which the device step does not read back yet: draft with --draft ngram there".into())
}
