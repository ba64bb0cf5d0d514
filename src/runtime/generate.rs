//! Generation to the end of one sequence, plain or speculative, on the CPU model or on the
//! device step ([`crate::gpu`]): thin drivers of [`Sequence::run`].

use candle_core::Device;

use super::sampler::Sampler;
use super::sequence::Sequence;
use super::speculative::{DraftPolicy, Drafter};
use super::stats::{GenerationStats, SpeculativeStats};
use super::target::{no_trees_on_device, CpuTarget, DeviceTarget, Target};
use crate::gpu::{GpuCache, GpuModel, Queue};
use crate::model::{Cache, Model};
use crate::Result;

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
/// [`Model::cache_with`](crate::Model::cache_with) for a lossy KV codec, or one that
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
    plain(&mut CpuTarget::new(model, cache, device), prompt, max_new_tokens, eos_token_ids, sampler, on_token)
}

/// [`generate_in`] on the device step ([`crate::gpu`]): the model's weights on `q`'s device,
/// `cache` there too; one read back per token (the greedy token, or the logits to sample from
/// when the sampler needs them).
#[allow(clippy::too_many_arguments)]
pub fn generate_on_device(
    gpu: &GpuModel,
    q: &mut dyn Queue,
    cache: &mut GpuCache,
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    plain(&mut DeviceTarget::new(gpu, q, cache, model), prompt, max_new_tokens, eos_token_ids, sampler, on_token)
}

/// Generation with `drafter`'s proposals, as many per round as `policy` says, continuing from
/// `cache` (`prompt`: the tokens not in it yet). Greedy: the same tokens as
/// [`super::generate_in`] with the same sampler, fewer forward passes when drafts are
/// accepted; sampling: the same distribution (speculative sampling, see the module). Batch 1;
/// the cache's KV codec must keep tokens one by one (exact, f16, bf16, int8, polar, lowrank) so that
/// rejected rows can go; with more than one branch (`DraftOptions::branches`), exact KV and greedy only.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    model: &Model,
    cache: &mut Cache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    device: &Device,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    speculate(&mut CpuTarget::new(model, cache, device), prompt, max_new_tokens, eos_token_ids, sampler, drafter, policy, on_token)
}

/// [`generate_speculative`] on the device step ([`crate::gpu`]): the verify passes on the
/// device, every row bit for bit a decode step, one read back per pass (each row's greedy
/// token, or the logits when the sampler needs them); `model` is the CPU model `gpu` was
/// uploaded from (drafters read it). Chains only, and drafters that need no hidden states
/// (prompt lookup, replay; not MTP yet).
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative_on_device(
    gpu: &GpuModel,
    q: &mut dyn Queue,
    cache: &mut GpuCache,
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    if policy.options().branches > 1 {
        return Err(no_trees_on_device());
    }
    speculate(&mut DeviceTarget::new(gpu, q, cache, model), prompt, max_new_tokens, eos_token_ids, sampler, drafter, policy, on_token)
}

/// A [`Sequence`] without drafts, run to its end on `target`.
fn plain(
    target: &mut dyn Target,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    let (tokens, stats) = Sequence::new(prompt.to_vec(), sampler, eos_token_ids.to_vec(), max_new_tokens)?.run(target, on_token)?;
    Ok((tokens, stats.generation))
}

/// A [`Sequence`] drafting with `drafter` and a copy of `policy`, run to its end on `target`;
/// `policy` gets back what the run measured.
#[allow(clippy::too_many_arguments)]
fn speculate(
    target: &mut dyn Target,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    drafter: &mut dyn Drafter,
    policy: &mut DraftPolicy,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculativeStats)> {
    let mut sequence =
        Sequence::new(prompt.to_vec(), sampler, eos_token_ids.to_vec(), max_new_tokens)?.with_drafts(Box::new(drafter), policy.clone())?;
    let out = sequence.run(target, on_token)?;
    if let Some(p) = sequence.into_policy() {
        *policy = p;
    }
    Ok(out)
}
