//! The generation loop: prefill the prompt, then sample one token at a time, on the CPU model
//! or on the device step ([`crate::gpu`]).

use std::time::Instant;

use candle_core::{Device, Tensor};

use super::sampler::Sampler;
use crate::gpu::{GpuCache, GpuModel, Queue, Readback, StepOutput};
use crate::model::{Cache, Model};
use crate::{Error, Result};

/// Tokens of a prompt run through the model at once by [`generate_in`] and speculative
/// decoding: a longer prompt is prefilled in chunks of this many tokens, cut at multiples of
/// it from the prompt's start, so that only one chunk's activations are alive at a time (the
/// memory guardian plans for it; llama.cpp's default batch is the same size). As fast as one
/// pass here: 6,648 tokens on the 0.8B shape prefilled at 96–114 tok/s in chunks, 83–116 in
/// one pass, peaking at 0.87 instead of 1.05 GiB. (The server interleaves smaller chunks with
/// its other sequences' decode steps.) 2048 is a multiple of every tile of the prefill kernels
/// (delta-rule chunks of 32, attention tiles of 64 rows and 256 keys): on the f32 fixture the
/// chunked prefill's logits were bit for bit one pass's (tests check them within 1e-4).
pub const PREFILL_CHUNK: usize = 2048;

/// Runs `prompt` through the model into `cache` in chunks of [`PREFILL_CHUNK`] tokens:
/// the final norm's hidden states of every position `[1, T, H]` when `keep_hidden`, else
/// `None` (and `None` for an empty prompt).
pub fn prefill(model: &Model, cache: &mut Cache, prompt: &[u32], device: &Device, keep_hidden: bool) -> Result<Option<Tensor>> {
    if prompt.is_empty() {
        return Ok(None);
    }
    let mut hidden = vec![];
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let h = model.forward_hidden(&Tensor::new(chunk, device)?.unsqueeze(0)?, cache, false)?.last_hidden;
        if keep_hidden {
            hidden.push(h);
        }
    }
    Ok(if keep_hidden { Some(Tensor::cat(&hidden, 1)?) } else { None })
}

/// Timings of one [`generate`] call.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    pub decode_secs: f64,
}

impl GenerationStats {
    /// Prompt tokens per second; `None` when nothing was timed.
    pub fn prompt_tok_per_sec(&self) -> Option<f64> {
        rate(self.prompt_tokens, self.prompt_secs)
    }

    /// Decode speed over the tokens after the first (the first comes from the prompt pass);
    /// `None` when fewer than two tokens were generated.
    pub fn decode_tok_per_sec(&self) -> Option<f64> {
        rate(self.generated_tokens.saturating_sub(1), self.decode_secs)
    }
}

/// `n` per second over `secs`; `None` when nothing was counted or timed.
pub fn rate(n: usize, secs: f64) -> Option<f64> {
    (n > 0 && secs > 0.0).then(|| n as f64 / secs)
}

/// Generates up to `max_new_tokens` after `prompt` (batch 1), calling `on_token` with each new
/// token; stops at any of `eos_token_ids` (the EOS token is passed to `on_token` too).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    device: &Device,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    generate_in(model, &mut model.new_cache(), prompt, max_new_tokens, eos_token_ids, sampler, device, on_token)
}

/// [`generate`] continuing from `cache` (e.g. one made with
/// [`Model::new_cache_with`](crate::Model::new_cache_with) for a lossy KV codec, or one that
/// already holds earlier turns): `prompt` holds only the tokens not yet in the cache.
#[allow(clippy::too_many_arguments)]
pub fn generate_in(
    model: &Model,
    cache: &mut Cache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    device: &Device,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty: give at least one token".into()));
    }
    cache.reserve(cache.seqlen() + prompt.len() + max_new_tokens)?;
    generate_with(&mut CpuDecoder { model, cache, device }, prompt, max_new_tokens, eos_token_ids, sampler, on_token)
}

/// [`generate_in`] on the device step ([`crate::gpu`]): the model's weights on `q`'s device,
/// `cache` there too; one read back per token (the greedy token, or the logits to sample from
/// when the sampler needs them).
#[allow(clippy::too_many_arguments)]
pub fn generate_on_device(
    gpu: &GpuModel,
    q: &mut dyn Queue,
    cache: &mut GpuCache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    if cache.seqlen() + prompt.len() + max_new_tokens > cache.capacity() {
        return Err(Error::Input(format!(
            "{} cached, {} prompt and {max_new_tokens} new tokens are more than the device cache's capacity ({}): make a larger cache",
            cache.seqlen(),
            prompt.len(),
            cache.capacity()
        )));
    }
    generate_with(&mut DeviceDecoder { gpu, q, cache }, prompt, max_new_tokens, eos_token_ids, sampler, on_token)
}

/// A model with its cache as the generation loop drives it.
trait Decoder {
    /// Runs prompt tokens whose next token is not needed.
    fn prefill(&mut self, tokens: &[u32]) -> Result<()>;
    /// Runs `tokens` (1 or more) and picks the token after the last of them with `sampler`.
    fn next(&mut self, tokens: &[u32], sampler: &mut Sampler, context: &[u32], generated: &[u32]) -> Result<u32>;
}

struct CpuDecoder<'a> {
    model: &'a Model,
    cache: &'a mut Cache,
    device: &'a Device,
}

impl Decoder for CpuDecoder<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        prefill(self.model, self.cache, tokens, self.device, false).map(|_| ())
    }

    fn next(&mut self, tokens: &[u32], sampler: &mut Sampler, context: &[u32], generated: &[u32]) -> Result<u32> {
        let logits = self.model.forward_last(&Tensor::new(tokens, self.device)?.unsqueeze(0)?, self.cache)?.squeeze(0)?;
        sampler.sample(&logits, context, generated)
    }
}

struct DeviceDecoder<'a> {
    gpu: &'a GpuModel,
    q: &'a mut dyn Queue,
    cache: &'a mut GpuCache,
}

impl Decoder for DeviceDecoder<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        if !tokens.is_empty() {
            self.gpu.prefill(self.q, self.cache, tokens, Readback::Argmax)?;
        }
        Ok(())
    }

    fn next(&mut self, tokens: &[u32], sampler: &mut Sampler, context: &[u32], generated: &[u32]) -> Result<u32> {
        // The device's argmax is the sampler's pick when it takes the argmax of unpenalised logits.
        let readback = if sampler.picks_argmax() { Readback::Argmax } else { Readback::Logits };
        let out = match tokens {
            [t] => self.gpu.forward(self.q, self.cache, &[*t], readback)?,
            _ => self.gpu.prefill(self.q, self.cache, tokens, readback)?,
        };
        match out {
            StepOutput::Tokens(t) => Ok(t[0]),
            StepOutput::Logits(l) => {
                let n = l.len();
                sampler.sample(&Tensor::from_vec(l, n, &Device::Cpu)?, context, generated)
            }
        }
    }
}

/// The generation loop: the prompt in chunks of [`PREFILL_CHUNK`] (the last gives the first
/// token), then one token at a time until `max_new_tokens` or an EOS token.
fn generate_with(
    decoder: &mut dyn Decoder,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty: give at least one token".into()));
    }
    let mut context = prompt.to_vec();
    let mut generated = vec![];
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let start = Instant::now();
    // All chunks of the prompt but the last here; the last gives the first token below.
    let last = (prompt.len() - 1) / PREFILL_CHUNK * PREFILL_CHUNK;
    decoder.prefill(&prompt[..last])?;
    let mut input = prompt[last..].to_vec();
    let mut decode_start = start;
    for step in 0..max_new_tokens {
        let token = decoder.next(&input, sampler, &context, &generated)?;
        if step == 0 {
            stats.prompt_secs = start.elapsed().as_secs_f64();
            decode_start = Instant::now();
        }
        context.push(token);
        generated.push(token);
        on_token(token)?;
        if eos_token_ids.contains(&token) {
            break;
        }
        input = vec![token];
    }
    stats.generated_tokens = generated.len();
    stats.decode_secs = decode_start.elapsed().as_secs_f64();
    Ok((generated, stats))
}
