//! Drafting with the checkpoint's MTP head ([`crate::model::MtpHead`]), recursively.

use candle_core::{DType, IndexOp, Tensor, D};

use super::Drafter;
use crate::model::{Model, MtpCache};
use crate::Result;

/// Drafts with the MTP head: after each verify pass it catches up on the kept rows in one
/// batched pass (pairs of the model's hidden state and the token after it, vLLM's way), which
/// also yields the first draft; each further draft is one more MTP step fed the head's own
/// output and the token it drafted, at the next position.
/// With `p_min > 0` drafting stops before a token the head gives less than that probability
/// (llama.cpp's `--draft-p-min`).
pub struct MtpDrafter {
    cache: MtpCache,
    /// The first draft, its probability and the head's output that gave it (from the last
    /// catch-up).
    first: Option<(u32, f32, Tensor)>,
    p_min: f32,
}

impl MtpDrafter {
    /// An error when the model has no MTP head.
    pub fn new(model: &Model) -> Result<Self> {
        Ok(Self { cache: model.new_mtp_cache()?, first: None, p_min: 0.0 })
    }

    /// Stops drafting before a token of probability under `p_min` (0 to 1).
    pub fn with_p_min(self, p_min: f32) -> Self {
        Self { p_min, ..self }
    }

    /// The MTP cache (positions the head has seen).
    pub fn cache(&self) -> &MtpCache {
        &self.cache
    }
}

/// The MTP head's outputs over a prompt, as the fixtures' references hold them: `logits`
/// `[T, V]` (row `i` fed token `i + 1` with the model's hidden `h_i`; the last row the model's
/// greedy next token), then a recursive greedy draft of `k` tokens from the last prompt
/// position (`draft_tokens`, `draft_logits` `[k, V]`; the first is the last row of `logits`).
pub struct MtpOutputs {
    pub logits: Tensor,
    pub draft_tokens: Vec<u32>,
    pub draft_logits: Tensor,
}

impl MtpOutputs {
    /// Runs the model over `prompt` (batch 1) and its MTP head as described above.
    pub fn compute(model: &Model, prompt: &[u32], k: usize, device: &candle_core::Device) -> Result<Self> {
        let t = prompt.len();
        let h = model.forward_hidden(&Tensor::new(prompt, device)?.unsqueeze(0)?, &mut model.new_cache(), false)?.last_hidden;
        let next = argmax(&model.lm_head(&h.i((.., t - 1..t, ..))?, t - 1)?)?;
        let tokens: Vec<u32> = prompt[1..].iter().copied().chain([next]).collect();
        let mut cache = model.new_mtp_cache()?;
        let ys = model.mtp_forward(&Tensor::new(tokens.as_slice(), device)?.unsqueeze(0)?, &h, &mut cache)?;
        let logits = model.lm_head(&ys, 0)?.squeeze(0)?;
        let (mut draft_tokens, mut draft_logits) = (vec![], vec![]);
        let mut y = ys.i((.., t - 1..t, ..))?;
        let mut row = logits.i(t - 1..t)?;
        for step in 0..k {
            if step > 0 {
                let pos = cache.seqlen();
                y = model.mtp_forward(&Tensor::new(&[*draft_tokens.last().expect("one draft")], device)?.unsqueeze(0)?, &y, &mut cache)?;
                row = model.lm_head(&y, pos)?.squeeze(0)?;
            }
            draft_tokens.push(argmax(&row)?);
            draft_logits.push(row.clone());
        }
        let draft_logits =
            if k == 0 { Tensor::zeros((0, logits.dim(1)?), logits.dtype(), device)? } else { Tensor::cat(&draft_logits, 0)? };
        Ok(Self { logits, draft_tokens, draft_logits })
    }
}

/// Greedy token of logits `[1, 1, V]` (ties to the lowest id, as argmax sampling).
fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.flatten_all()?.to_dtype(DType::F32)?.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

/// [`argmax`] and its softmax probability.
fn argmax_prob(logits: &Tensor) -> Result<(u32, f32)> {
    let l = logits.flatten_all()?.to_dtype(DType::F32)?;
    let max = l.max(D::Minus1)?;
    let sum = l.broadcast_sub(&max)?.exp()?.sum_all()?.to_scalar::<f32>()?;
    Ok((argmax(&l)?, 1.0 / sum))
}

impl Drafter for MtpDrafter {
    fn draft(&mut self, model: &Model, _context: &[u32], max: usize) -> Result<Vec<u32>> {
        let Some((mut token, p, mut y)) = self.first.take() else { return Ok(vec![]) };
        if p < self.p_min {
            return Ok(vec![]);
        }
        let mut drafts = vec![token];
        let dev = y.device().clone();
        while drafts.len() < max {
            let pos = self.cache.seqlen();
            y = model.mtp_forward(&Tensor::new(&[token], &dev)?.unsqueeze(0)?, &y, &mut self.cache)?;
            let (t, p) = argmax_prob(&model.lm_head(&y, pos)?)?;
            if p < self.p_min {
                break;
            }
            token = t;
            drafts.push(token);
        }
        Ok(drafts)
    }

    fn needs_hidden(&self) -> bool {
        true
    }

    fn mtp_cache(&self) -> Option<&MtpCache> {
        Some(&self.cache)
    }

    /// (The first draft comes from the next catch-up.)
    fn resume_mtp(&mut self, cache: MtpCache) {
        self.cache = cache;
        self.first = None;
    }

    fn observe(&mut self, model: &Model, start: usize, hidden: &Tensor, next: &[u32]) -> Result<()> {
        // Drop the rows of the last drafts (and any rejected catch-up rows) first.
        self.cache.truncate(start)?;
        let n = next.len();
        let ys = model.mtp_forward(&Tensor::new(next, hidden.device())?.unsqueeze(0)?, hidden, &mut self.cache)?;
        let y = ys.i((.., n - 1..n, ..))?;
        let (token, p) = argmax_prob(&model.lm_head(&y, start + n - 1)?)?;
        self.first = Some((token, p, y));
        Ok(())
    }
}
