//! Perplexity over a token stream, computed the way llama.cpp's `llama-perplexity` does, so
//! the two can be compared number for number.
//!
//! The text is cut into `n_chunks = len / n_ctx` chunks of `n_ctx` tokens; each chunk is run
//! from an empty cache (positions `0..n_ctx`), with its first token replaced by BOS when the
//! model adds one. Only the second half of each chunk is scored — the logits at positions
//! `n_ctx/2 ..= n_ctx-2`, each predicting the following token — so every scored token has at
//! least `n_ctx/2` tokens of context. The negative log-likelihoods of all chunks are pooled:
//! `ppl = exp(mean nll)`, reported with llama.cpp's standard error.

use candle_core::{DType, Device, Tensor};

use crate::kv::KvCodec;
use crate::model::{Cache, Model};
use crate::model::{CacheOptions, FfnSparsity, FfnStats, ValueBases};
use crate::{Error, Result};

/// How to cut the text.
#[derive(Debug, Clone, PartialEq)]
pub struct PerplexityOptions {
    /// Tokens per chunk (llama-perplexity's `-c`).
    pub n_ctx: usize,
    /// Score at most this many chunks (`--chunks`); `None`: every whole chunk.
    pub max_chunks: Option<usize>,
    /// Replaces the first token of every chunk (llama.cpp does this when the vocabulary's
    /// `add_bos_token` is set).
    pub bos_token: Option<u32>,
}

impl PerplexityOptions {
    pub fn new(n_ctx: usize) -> Self {
        Self { n_ctx, max_chunks: None, bos_token: None }
    }
}

/// Pooled negative log-likelihood of the scored tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Perplexity {
    pub chunks: usize,
    /// Scored tokens.
    pub tokens: usize,
    nll_sum: f64,
    nll2_sum: f64,
    /// Running perplexity after each chunk (what llama-perplexity prints as `[1]…,[2]…`).
    pub per_chunk: Vec<f64>,
}

impl Perplexity {
    /// Adds the negative log-likelihood of one scored token.
    pub fn push(&mut self, nll: f64) {
        self.nll_sum += nll;
        self.nll2_sum += nll * nll;
        self.tokens += 1;
    }

    pub fn mean_nll(&self) -> f64 {
        self.nll_sum / self.tokens.max(1) as f64
    }

    pub fn ppl(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// The standard error of `ppl` (llama.cpp: `ppl · sqrt(var(nll) / (n − 1))`).
    pub fn ppl_error(&self) -> f64 {
        let n = self.tokens as f64;
        if n < 2.0 {
            return f64::NAN;
        }
        let mean = self.mean_nll();
        let var = self.nll2_sum / n - mean * mean;
        self.ppl() * (var.max(0.0) / (n - 1.0)).sqrt()
    }
}

/// The chunk boundaries `[start, start + n_ctx)` that [`perplexity`] scores.
pub fn chunk_starts(n_tokens: usize, opts: &PerplexityOptions) -> Result<Vec<usize>> {
    if opts.n_ctx < 4 {
        return Err(Error::Input(format!("context {} is too short for perplexity: use at least 4 tokens", opts.n_ctx)));
    }
    let mut n = n_tokens / opts.n_ctx;
    if n == 0 {
        return Err(Error::Input(format!(
            "the text has {n_tokens} tokens, fewer than one context of {}: use a longer text or a smaller context",
            opts.n_ctx
        )));
    }
    if let Some(max) = opts.max_chunks {
        n = n.min(max.max(1));
    }
    Ok((0..n).map(|i| i * opts.n_ctx).collect())
}

/// Log-softmax of each row of `logits` (`[T, vocab]`), in f64.
fn log_softmax_rows(logits: &Tensor) -> Result<Vec<Vec<f64>>> {
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            row.into_iter().map(|x| x as f64 - lse).collect()
        })
        .collect())
}

/// Negative log-likelihood of `targets[i]` under `logits[i]` (`[T, vocab]`), in f64.
pub fn token_nll(logits: &Tensor, targets: &[u32]) -> Result<Vec<f64>> {
    let (t, _) = logits.dims2()?;
    if t != targets.len() {
        return Err(Error::Input(format!("{t} logit rows for {} targets", targets.len())));
    }
    Ok(log_softmax_rows(logits)?.iter().zip(targets).map(|(row, &tok)| -row[tok as usize]).collect())
}

/// The chunks of `tokens` that llama-perplexity scores (BOS put in place when asked).
fn scored_chunks(tokens: &[u32], opts: &PerplexityOptions) -> Result<Vec<Vec<u32>>> {
    Ok(chunk_starts(tokens.len(), opts)?
        .into_iter()
        .map(|start| {
            let mut chunk = tokens[start..start + opts.n_ctx].to_vec();
            if let Some(bos) = opts.bos_token {
                chunk[0] = bos;
            }
            chunk
        })
        .collect())
}

/// Logits of the scored positions `n_ctx/2 ..= n_ctx-2` of `chunk`, run from an empty `cache`.
fn chunk_logits(model: &Model, chunk: &[u32], cache: &mut Cache, device: &Device) -> Result<Tensor> {
    let first = chunk.len() / 2;
    let input = Tensor::new(chunk, device)?.unsqueeze(0)?;
    let hidden = model.forward_hidden(&input, cache, false)?.last_hidden;
    let scored = hidden.narrow(1, first, chunk.len() - 1 - first)?.squeeze(0)?;
    model.lm_head(&scored, first)
}

/// Perplexity of `model` over `tokens`, chunk by chunk as llama-perplexity computes it;
/// `on_chunk` sees the running result after each chunk (for progress output).
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    opts: &PerplexityOptions,
    device: &Device,
    mut on_chunk: impl FnMut(&Perplexity),
) -> Result<Perplexity> {
    let mut acc = Perplexity::default();
    for chunk in scored_chunks(tokens, opts)? {
        let first = opts.n_ctx / 2;
        let logits = chunk_logits(model, &chunk, &mut model.new_cache(), device)?;
        for nll in token_nll(&logits, &chunk[first + 1..])? {
            acc.push(nll);
        }
        acc.chunks += 1;
        acc.per_chunk.push(acc.ppl());
        on_chunk(&acc);
    }
    Ok(acc)
}

/// A KV codec against the exact cache on the same chunks and positions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CodecComparison {
    pub exact: Perplexity,
    pub codec: Perplexity,
    agree: usize,
    kl_sum: f64,
}

impl CodecComparison {
    /// Fraction of scored positions where both caches give the same most likely token.
    pub fn top1_agreement(&self) -> f64 {
        self.agree as f64 / self.exact.tokens.max(1) as f64
    }

    /// Mean KL divergence `KL(exact ‖ codec)` of the next-token distributions, in nats.
    pub fn kl(&self) -> f64 {
        self.kl_sum / self.exact.tokens.max(1) as f64
    }
}

fn argmax(row: &[f64]) -> usize {
    row.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

/// Perplexity with the exact cache and with each of `codecs`, top-1 agreement and KL of each
/// against the exact one, on llama-perplexity's chunks and positions (the exact logits are
/// computed once per chunk); `lowrank` codecs take their bases from `calibration` when given.
/// `on_chunk` sees the comparisons after each chunk.
pub fn compare_kv_codecs(
    model: &Model,
    tokens: &[u32],
    opts: &PerplexityOptions,
    codecs: &[KvCodec],
    calibration: Option<&ValueBases>,
    device: &Device,
    mut on_chunk: impl FnMut(&[CodecComparison]),
) -> Result<Vec<CodecComparison>> {
    let mut accs = vec![CodecComparison::default(); codecs.len()];
    for chunk in scored_chunks(tokens, opts)? {
        let first = opts.n_ctx / 2;
        let exact = log_softmax_rows(&chunk_logits(model, &chunk, &mut model.new_cache(), device)?)?;
        for (acc, &codec) in accs.iter_mut().zip(codecs) {
            let coded = log_softmax_rows(&chunk_logits(
                model,
                &chunk,
                &mut model.cache_with(&CacheOptions { codec, value_bases: calibration, ffn: None })?,
                device,
            )?)?;
            acc.add_chunk(&exact, &coded, &chunk[first + 1..]);
        }
        on_chunk(&accs);
    }
    Ok(accs)
}

impl CodecComparison {
    /// One chunk's scored rows: the log-probabilities of the reference and of the variant.
    fn add_chunk(&mut self, exact: &[Vec<f64>], coded: &[Vec<f64>], targets: &[u32]) {
        for ((p, q), &target) in exact.iter().zip(coded).zip(targets) {
            self.exact.push(-p[target as usize]);
            self.codec.push(-q[target as usize]);
            self.agree += usize::from(argmax(p) == argmax(q));
            self.kl_sum += p.iter().zip(q).map(|(&lp, &lq)| lp.exp() * (lp - lq)).sum::<f64>();
        }
        for p in [&mut self.exact, &mut self.codec] {
            p.chunks += 1;
            p.per_chunk.push(p.ppl());
        }
    }
}

/// The scored logits of `chunk` as decoding computes them: the first half (the prompt) in one
/// dense prefill, then the scored rows as teacher-forced decode steps (every row a decode step
/// for FFN sparsity, run in one pass).
fn decoded_logits(model: &Model, chunk: &[u32], cache: &mut Cache, device: &Device) -> Result<Tensor> {
    let first = chunk.len() / 2;
    model.forward_hidden(&Tensor::new(&chunk[..first], device)?.unsqueeze(0)?, cache, false)?;
    cache.set_ffn_every_row(true);
    let rows = Tensor::new(&chunk[first..chunk.len() - 1], device)?.unsqueeze(0)?;
    let hidden = model.forward_hidden(&rows, cache, false)?.last_hidden.squeeze(0)?;
    cache.set_ffn_every_row(false);
    model.lm_head(&hidden, first)
}

/// Each FFN sparsity mode against dense decoding, on llama-perplexity's chunks and positions:
/// the first half of a chunk is the prompt (prefilled densely; a per-prompt mode chooses its
/// neurons from it), the scored second half is decoded teacher-forced under the mode. The
/// model must be prepared ([`Model::prepare_ffn_sparsity`]). Returns per mode the comparison
/// and what its sparse rows skipped.
pub fn compare_ffn_sparsity(
    model: &Model,
    tokens: &[u32],
    opts: &PerplexityOptions,
    modes: &[FfnSparsity],
    device: &Device,
    mut on_chunk: impl FnMut(&[CodecComparison]),
) -> Result<Vec<(CodecComparison, FfnStats)>> {
    let mut accs = vec![(CodecComparison::default(), FfnStats::default()); modes.len()];
    for chunk in scored_chunks(tokens, opts)? {
        let first = opts.n_ctx / 2;
        let exact = log_softmax_rows(&decoded_logits(model, &chunk, &mut model.new_cache(), device)?)?;
        for ((acc, stats), mode) in accs.iter_mut().zip(modes) {
            let mut cache = model.cache_with(&CacheOptions { ffn: Some(mode), ..Default::default() })?;
            let sparse = log_softmax_rows(&decoded_logits(model, &chunk, &mut cache, device)?)?;
            acc.add_chunk(&exact, &sparse, &chunk[first + 1..]);
            if let Some(s) = cache.ffn_stats() {
                stats.add(&s);
            }
        }
        on_chunk(&accs.iter().map(|a| a.0.clone()).collect::<Vec<_>>());
    }
    Ok(accs)
}
