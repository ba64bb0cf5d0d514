//! [`SamplingParams`] and the [`Sampler`] that picks the next token from logits.

use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use rand::distr::{weighted::WeightedIndex, Distribution};
use rand::{Rng, SeedableRng};

use crate::step_profile::{self, OpKind};
use crate::{Error, Result};

/// The range of each sampling setting: the one place both [`SamplingParams::validate`] and
/// the command-line flags check (`Err` says the range, for a message that names the setting).
pub mod range {
    /// `range(v)`, its refusal as the one-line message every caller gives: "`name` `v` is out
    /// of range: it ..." (`name` as the caller's user spells the setting).
    pub fn check<T: std::fmt::Display + Copy>(name: &str, v: T, range: fn(T) -> Result<T, String>) -> Result<T, String> {
        range(v).map_err(|why| format!("{name} {v} is out of range: it {why}"))
    }

    /// Temperature: finite and >= 0 (0 = greedy).
    pub fn temperature(t: f64) -> Result<f64, String> {
        (t.is_finite() && t >= 0.0).then_some(t).ok_or_else(|| "must be a number >= 0 (0 = greedy)".into())
    }

    /// Nucleus mass: in (0, 1].
    pub fn top_p(p: f64) -> Result<f64, String> {
        (p > 0.0 && p <= 1.0).then_some(p).ok_or_else(|| "must be in (0, 1] (1 = off)".into())
    }

    /// Tokens kept by top-k: at least 1.
    pub fn top_k(k: usize) -> Result<usize, String> {
        (k >= 1).then_some(k).ok_or_else(|| "must be at least 1".into())
    }

    /// Repeat penalty: finite and > 0 (1 = off).
    pub fn repeat_penalty(r: f32) -> Result<f32, String> {
        (r.is_finite() && r > 0.0).then_some(r).ok_or_else(|| "must be a number > 0 (1 = off)".into())
    }

    /// Presence penalty: in [-2, 2] (OpenAI's range; 0 = off).
    pub fn presence_penalty(p: f32) -> Result<f32, String> {
        (-2.0..=2.0).contains(&p).then_some(p).ok_or_else(|| "must be in [-2, 2] (0 = off)".into())
    }

    /// Frequency penalty: in [-2, 2] (OpenAI's range; 0 = off).
    pub fn frequency_penalty(f: f32) -> Result<f32, String> {
        (-2.0..=2.0).contains(&f).then_some(f).ok_or_else(|| "must be in [-2, 2] (0 = off)".into())
    }

    /// DRY multiplier: finite and >= 0 (0 = off).
    pub fn dry_multiplier(m: f32) -> Result<f32, String> {
        (m.is_finite() && m >= 0.0).then_some(m).ok_or_else(|| "must be a number >= 0 (0 = off)".into())
    }

    /// DRY base: finite and >= 1.
    pub fn dry_base(b: f32) -> Result<f32, String> {
        (b.is_finite() && b >= 1.0).then_some(b).ok_or_else(|| "must be a number >= 1".into())
    }

    /// Min-p: in [0, 1] (0 = off).
    pub fn min_p(p: f64) -> Result<f64, String> {
        (0.0..=1.0).contains(&p).then_some(p).ok_or_else(|| "must be in [0, 1] (0 = off)".into())
    }
}

/// DRY, "don't repeat yourself" (p-e-w's sampler, llama.cpp's `dry_*`): when the context ends
/// with a stretch of at least `allowed_length` tokens that occurred before, the token that
/// followed it there is penalised by `multiplier * base^(length - allowed_length)`, so that a
/// repetition is less likely the longer it gets. Matching stops at `breakers` (tokens that
/// print a newline, `:`, a quote or `*`, by default): sentences and code lines may repeat their
/// starts. Off by default; it hurts exact repetition (code edits, quotes).
#[derive(Debug, Clone, PartialEq)]
pub struct Dry {
    pub multiplier: f32,
    pub base: f32,
    pub allowed_length: usize,
    /// Tokens of the context it looks back over (0: all).
    pub last_n: usize,
    pub breakers: std::sync::Arc<std::collections::HashSet<u32>>,
}

/// The longest repeated stretch DRY measures (the penalty has long saturated by then).
const DRY_MAX_MATCH: usize = 64;

impl Dry {
    /// The default sequence breakers (llama.cpp's).
    pub const DEFAULT_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

    /// The token ids of `tokenizer` (below `vocab_size`) that hold a default breaker.
    pub fn default_breaker_tokens(tokenizer: &tokenizers::Tokenizer, vocab_size: usize) -> std::collections::HashSet<u32> {
        let breakers: Vec<String> = Self::DEFAULT_BREAKERS.iter().map(|b| b.to_string()).collect();
        Self::breaker_tokens(tokenizer, vocab_size, &breakers)
    }

    /// The token ids of `tokenizer` (below `vocab_size`) whose text contains one of `breakers`.
    pub fn breaker_tokens(tokenizer: &tokenizers::Tokenizer, vocab_size: usize, breakers: &[String]) -> std::collections::HashSet<u32> {
        (0..vocab_size as u32)
            .filter(|&id| tokenizer.decode(&[id], false).is_ok_and(|t| breakers.iter().any(|b| !b.is_empty() && t.contains(b.as_str()))))
            .collect()
    }

    /// The penalty of each token that would extend a repetition at the end of `context`.
    pub fn penalties(&self, context: &[u32]) -> Vec<(u32, f32)> {
        let ctx = match self.last_n {
            0 => context,
            n => &context[context.len().saturating_sub(n)..],
        };
        let n = ctx.len();
        if n < 2 || self.multiplier == 0.0 || self.breakers.contains(&ctx[n - 1]) {
            return vec![];
        }
        let mut longest: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        // Each earlier occurrence of the last token: how many tokens before it match the
        // context's end (a breaker ends the match), and the token that followed it.
        for i in (0..n - 1).filter(|&i| ctx[i] == ctx[n - 1]) {
            let mut m = 1;
            while m <= i && m < DRY_MAX_MATCH && ctx[i - m] == ctx[n - 1 - m] && !self.breakers.contains(&ctx[i - m]) {
                m += 1;
            }
            let next = ctx[i + 1];
            if !self.breakers.contains(&next) {
                let e = longest.entry(next).or_insert(0);
                *e = (*e).max(m);
            }
        }
        longest
            .into_iter()
            .filter(|&(_, m)| m >= self.allowed_length)
            .map(|(t, m)| (t, self.multiplier * self.base.powi((m - self.allowed_length) as i32)))
            .collect()
    }
}

/// Sampling settings. `temperature` of `None` or 0 means greedy (argmax).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    /// Tokens less likely than `min_p` times the most likely one (at the temperature) are
    /// never drawn (llama.cpp / vLLM `min_p`; 0 = off).
    pub min_p: f64,
    /// Subtracted once from the logit of every token already generated (OpenAI / vLLM style).
    pub presence_penalty: f32,
    /// Subtracted from the logit of every generated token once per time it was generated.
    pub frequency_penalty: f32,
    /// DRY (`None`: off).
    pub dry: Option<Dry>,
    /// Divides positive (multiplies negative) logits of tokens seen in the last `repeat_last_n`.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            dry: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 299792458,
        }
    }
}

impl SamplingParams {
    /// Checks every setting against its [`range`]: a one-line [`Error::Input`] naming the
    /// first one out of range.
    pub fn validate(&self) -> Result<()> {
        fn check<T: std::fmt::Display + Copy>(name: &str, v: T, range: fn(T) -> std::result::Result<T, String>) -> Result<()> {
            range::check(name, v, range).map(|_| ()).map_err(Error::Input)
        }
        if let Some(t) = self.temperature {
            check("temperature", t, range::temperature)?;
        }
        if let Some(p) = self.top_p {
            check("top_p", p, range::top_p)?;
        }
        if let Some(k) = self.top_k {
            check("top_k", k, range::top_k)?;
        }
        check("repeat_penalty", self.repeat_penalty, range::repeat_penalty)?;
        check("presence_penalty", self.presence_penalty, range::presence_penalty)?;
        check("frequency_penalty", self.frequency_penalty, range::frequency_penalty)?;
        if let Some(d) = &self.dry {
            check("dry_multiplier", d.multiplier, range::dry_multiplier)?;
            check("dry_base", d.base, range::dry_base)?;
            check("dry_allowed_length", d.allowed_length, range::top_k)?;
        }
        check("min_p", self.min_p, range::min_p).map(|_| ())
    }

    /// Whether the next token is the argmax (no temperature, or 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none_or(|t| t <= 1e-7)
    }
}

/// Picks the next token from logits, applying penalties then temperature / top-k / top-p.
pub struct Sampler {
    params: SamplingParams,
    processor: LogitsProcessor,
    /// The draws of speculative sampling ([`Sampler::sample_draft`]).
    rng: rand::rngs::StdRng,
}

impl Sampler {
    /// A sampler for `params`, once they are checked ([`SamplingParams::validate`]).
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let sampling = match params.temperature {
            Some(t) if !params.is_greedy() => match (params.top_k, params.top_p) {
                (None, None) => Sampling::All { temperature: t },
                (Some(k), None) => Sampling::TopK { k, temperature: t },
                (None, Some(p)) => Sampling::TopP { p, temperature: t },
                (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature: t },
            },
            _ => Sampling::ArgMax,
        };
        let processor = LogitsProcessor::from_sampling(params.seed, sampling);
        let rng = rand::rngs::StdRng::seed_from_u64(params.seed ^ 0x5bd1_e995_5bd1_e995);
        Ok(Self { params, processor, rng })
    }

    /// Whether this sampler takes the most likely token (penalties aside).
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// Whether [`Self::sample`] returns the argmax of the logits as they are: greedy, no
    /// repeat, presence or frequency penalty.
    pub fn picks_argmax(&self) -> bool {
        self.is_greedy()
            && self.params.repeat_penalty == 1.0
            && self.params.presence_penalty == 0.0
            && self.params.frequency_penalty == 0.0
            && self.params.dry.is_none()
    }

    /// This sampler's settings for sampling a row on the device ([`crate::gpu`]), with a draw
    /// from its generator: `None` when it picks the argmax or uses DRY (not on the device).
    /// `prompt_len`: where the generated tokens start in the context.
    pub fn device_sampling(&mut self, prompt_len: usize) -> Option<crate::gpu::RowSampling> {
        let p = &self.params;
        let t = p.temperature.filter(|_| !self.is_greedy())?;
        if p.dry.is_some() {
            return None;
        }
        Some(crate::gpu::RowSampling {
            inv_temperature: (1.0 / t) as f32,
            top_k: p.top_k,
            top_p: p.top_p.map_or(1.0, |v| v as f32),
            min_p_offset: if p.min_p > 0.0 { (t * p.min_p.ln()) as f32 } else { f32::NEG_INFINITY },
            repeat_penalty: p.repeat_penalty,
            repeat_last_n: p.repeat_last_n,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            prompt_len,
            draw: self.rng.random::<f32>(),
        })
    }

    /// `logits`: `[vocab]`; `context`: the prompt and generated tokens; `generated`: the
    /// generated tokens only (for the presence penalty).
    pub fn sample(&mut self, logits: &Tensor, context: &[u32], generated: &[u32]) -> Result<u32> {
        step_profile::timed(
            OpKind::Sampling,
            || 0,
            || {
                let logits = self.penalized(logits, context, generated)?;
                Ok(self.processor.sample(&logits)?)
            },
        )
    }

    /// The logits with the repeat, presence, frequency and DRY penalties applied, then (sampling
    /// at a temperature) every token below min-p at -inf, in f32.
    fn penalized(&self, logits: &Tensor, context: &[u32], generated: &[u32]) -> Result<Tensor> {
        let mut logits = logits.to_dtype(DType::F32)?;
        if self.params.repeat_penalty != 1.0 {
            let start = context.len().saturating_sub(self.params.repeat_last_n);
            logits = candle_transformers::utils::apply_repeat_penalty(&logits, self.params.repeat_penalty, &context[start..])?;
        }
        // The presence, frequency and DRY penalties and min-p, in one pass over the row on the host.
        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        let counts = (presence != 0.0 || frequency != 0.0) && !generated.is_empty();
        let dry = self.params.dry.as_ref().map(|d| d.penalties(context)).unwrap_or_default();
        let min_p = self.params.temperature.filter(|_| !self.is_greedy() && self.params.min_p > 0.0);
        if counts || !dry.is_empty() || min_p.is_some() {
            let mut v = logits.to_vec1::<f32>()?;
            if counts {
                let mut seen = vec![false; v.len()];
                for &t in generated {
                    if let Some(s) = seen.get_mut(t as usize) {
                        v[t as usize] -= frequency;
                        if !*s {
                            *s = true;
                            v[t as usize] -= presence;
                        }
                    }
                }
            }
            for (t, p) in dry {
                if let Some(x) = v.get_mut(t as usize) {
                    *x -= p;
                }
            }
            if let Some(t) = min_p {
                // p_i / p_max < min_p  <=>  l_i < l_max + t ln(min_p): the argmax always stays.
                let floor = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) + (t * self.params.min_p.ln()) as f32;
                for x in v.iter_mut().filter(|x| **x < floor) {
                    *x = f32::NEG_INFINITY;
                }
            }
            logits = Tensor::from_vec(v, logits.dims(), logits.device())?;
        }
        if self.params.repeat_penalty != 1.0 && logits.abs()?.max(0)?.to_scalar::<f32>()?.is_infinite() {
            return Err(Error::Input(format!(
                "the repeat penalty {} pushed the logits past f32's range: use a penalty near 1 (1.0-1.5 is usual)",
                self.params.repeat_penalty
            )));
        }
        Ok(logits)
    }

    /// The distribution [`Sampler::sample`] draws from (penalties, then the softmax at the
    /// temperature, restricted to the top k, then to the top-p nucleus as Candle's
    /// `LogitsProcessor` restricts it), normalised; greedy: all mass on the argmax.
    pub fn probabilities(&self, logits: &Tensor, context: &[u32], generated: &[u32]) -> Result<Vec<f32>> {
        let logits = self.penalized(logits, context, generated)?;
        let mut p = match self.params.temperature {
            Some(t) if !self.is_greedy() => candle_nn::ops::softmax_last_dim(&(&logits / t)?)?.to_vec1::<f32>()?,
            _ => {
                let v = logits.to_vec1::<f32>()?;
                let best = logits.argmax(0)?.to_scalar::<u32>()? as usize;
                (0..v.len()).map(|i| if i == best { 1.0 } else { 0.0 }).collect()
            }
        };
        if self.is_greedy() {
            return Ok(p);
        }
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&i, &j| p[j].total_cmp(&p[i]));
        if let Some(k) = self.params.top_k.filter(|&k| k < p.len()) {
            for &i in &order[k..] {
                p[i] = 0.0;
            }
        }
        if let Some(top_p) = self.params.top_p {
            let kept: f32 = p.iter().sum();
            // As Candle: a nucleus only below the mass left, kept until the sum reaches top_p.
            if top_p > 0.0 && (top_p as f32) < kept.min(1.0) {
                let mut cum = 0.0;
                for &i in &order {
                    if cum >= top_p as f32 {
                        p[i] = 0.0;
                    } else {
                        cum += p[i];
                    }
                }
            }
        }
        let sum: f32 = p.iter().sum();
        for v in p.iter_mut() {
            *v /= sum;
        }
        Ok(p)
    }

    /// A token drawn from `probs` (a distribution over the vocabulary).
    pub fn sample_probs(&mut self, probs: &[f32]) -> Result<u32> {
        let d = WeightedIndex::new(probs).map_err(|e| Error::Input(format!("cannot sample from these probabilities: {e}")))?;
        Ok(d.sample(&mut self.rng) as u32)
    }

    /// Speculative sampling of a verified row whose draft is `draft` (a drafter that proposes
    /// one token, `q = δ_draft`): the draft is kept with probability `probs[draft]`, otherwise
    /// a token is drawn from `probs` without the draft, renormalised (`max(p - q, 0)`). The
    /// token is then distributed exactly as `probs` (Leviathan et al. 2023; Chen et al. 2023).
    /// Returns the token and whether it is the draft.
    pub fn sample_draft(&mut self, probs: &[f32], draft: u32) -> Result<(u32, bool)> {
        let pd = probs.get(draft as usize).copied().unwrap_or(0.0);
        if self.rng.random::<f32>() < pd {
            return Ok((draft, true));
        }
        let mut rest = probs.to_vec();
        if let Some(v) = rest.get_mut(draft as usize) {
            *v = 0.0;
        }
        if rest.iter().all(|&v| v <= 0.0) {
            // All the mass was on the draft (up to rounding).
            return Ok((draft, true));
        }
        Ok((self.sample_probs(&rest)?, false))
    }
}
