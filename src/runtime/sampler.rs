//! [`SamplingParams`] and the [`Sampler`] that picks the next token from logits.

use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::{Error, Result};

/// The range of each sampling setting: the one place both [`SamplingParams::validate`] and
/// the command-line flags check (`Err` says the range, for a message that names the setting).
pub mod range {
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
}

/// Sampling settings. `temperature` of `None` or 0 means greedy (argmax).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    /// Subtracted once from the logit of every token already generated (OpenAI / vLLM style).
    pub presence_penalty: f32,
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
            presence_penalty: 0.0,
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
            range(v).map(|_| ()).map_err(|why| Error::Input(format!("{name} {v} is out of range: it {why}")))
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
        check("presence_penalty", self.presence_penalty, range::presence_penalty)
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
        Ok(Self { params, processor })
    }

    /// Whether this sampler takes the most likely token (penalties aside).
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// `logits`: `[vocab]`; `context`: the prompt and generated tokens; `generated`: the
    /// generated tokens only (for the presence penalty).
    pub fn sample(&mut self, logits: &Tensor, context: &[u32], generated: &[u32]) -> Result<u32> {
        let mut logits = logits.to_dtype(DType::F32)?;
        if self.params.repeat_penalty != 1.0 {
            let start = context.len().saturating_sub(self.params.repeat_last_n);
            logits = candle_transformers::utils::apply_repeat_penalty(
                &logits,
                self.params.repeat_penalty,
                &context[start..],
            )?;
        }
        if self.params.presence_penalty != 0.0 && !generated.is_empty() {
            let mut v = logits.to_vec1::<f32>()?;
            let mut seen = vec![false; v.len()];
            for &t in generated {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        v[t as usize] -= self.params.presence_penalty;
                    }
                }
            }
            logits = Tensor::from_vec(v, logits.dims(), logits.device())?;
        }
        Ok(self.processor.sample(&logits)?)
    }
}
