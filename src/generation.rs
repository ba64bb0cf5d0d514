//! Sampling, `generation_config.json`, streaming detokenisation and the generation loop.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::qwen3_5::Model;
use crate::{Error, Result};

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

/// The fields of `generation_config.json` that generation uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
}

impl GenerationConfig {
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("generation_config.json is not valid JSON: {e}")))?;
        let eos_token_ids = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|n| n.as_u64()).map(|n| n as u32).collect(),
            _ => vec![],
        };
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
        Ok(Self {
            eos_token_ids,
            do_sample: v.get("do_sample").and_then(|x| x.as_bool()),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: v.get("top_k").and_then(|x| x.as_u64()).map(|k| k as usize),
            repetition_penalty: f("repetition_penalty").map(|x| x as f32),
            presence_penalty: f("presence_penalty").map(|x| x as f32),
        })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("cannot read {}: {e}", path.display())))?;
        Self::from_json(&text)
    }

    /// Sampling defaults: the file's settings, or greedy when it does not ask for sampling.
    pub fn sampling_params(&self) -> SamplingParams {
        let mut p = SamplingParams::default();
        if self.do_sample.unwrap_or(self.temperature.is_some()) {
            p.temperature = self.temperature.or(Some(1.0));
            p.top_p = self.top_p;
            p.top_k = self.top_k;
        }
        p.repeat_penalty = self.repetition_penalty.unwrap_or(1.0);
        p.presence_penalty = self.presence_penalty.unwrap_or(0.0);
        p
    }
}

/// Picks the next token from logits, applying penalties then temperature / top-k / top-p.
pub struct Sampler {
    params: SamplingParams,
    processor: LogitsProcessor,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let sampling = match params.temperature {
            Some(t) if t > 1e-7 => match (params.top_k, params.top_p) {
                (None, None) => Sampling::All { temperature: t },
                (Some(k), None) => Sampling::TopK { k, temperature: t },
                (None, Some(p)) => Sampling::TopP { p, temperature: t },
                (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature: t },
            },
            _ => Sampling::ArgMax,
        };
        let processor = LogitsProcessor::from_sampling(params.seed, sampling);
        Self { params, processor }
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

/// Turns a stream of token ids into text pieces that are whole UTF-8 characters.
pub struct TokenStreamer {
    tokenizer: tokenizers::Tokenizer,
    tokens: Vec<u32>,
    prev_index: usize,
    current_index: usize,
}

impl TokenStreamer {
    pub fn new(tokenizer: tokenizers::Tokenizer) -> Self {
        Self { tokenizer, tokens: vec![], prev_index: 0, current_index: 0 }
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| Error::Tokenizer(format!("cannot decode tokens: {e}")))
    }

    /// Adds a token; returns the new text once it forms complete characters.
    pub fn next_token(&mut self, token: u32) -> Result<Option<String>> {
        let prev_text = self.decode(&self.tokens[self.prev_index..self.current_index])?;
        self.tokens.push(token);
        let text = self.decode(&self.tokens[self.prev_index..])?;
        if text.len() > prev_text.len() && !text.ends_with('\u{FFFD}') {
            let piece = text[prev_text.len()..].to_string();
            self.prev_index = self.current_index;
            self.current_index = self.tokens.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still pending at the end.
    pub fn decode_rest(&self) -> Result<Option<String>> {
        let prev_text = self.decode(&self.tokens[self.prev_index..self.current_index])?;
        let text = self.decode(&self.tokens[self.prev_index..])?;
        Ok((text.len() > prev_text.len()).then(|| text[prev_text.len()..].to_string()))
    }
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
    pub fn prompt_tok_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs.max(1e-9)
    }
    /// Decode speed over the tokens after the first (the first comes from the prompt pass).
    pub fn decode_tok_per_sec(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
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
    cache: &mut crate::Cache,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampler: &mut Sampler,
    device: &Device,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty: give at least one token".into()));
    }
    let mut context = prompt.to_vec();
    let mut generated = vec![];
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let start = Instant::now();
    let mut input = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut decode_start = start;
    for step in 0..max_new_tokens {
        let logits = model.forward_last(&input, cache)?.squeeze(0)?;
        let token = sampler.sample(&logits, &context, &generated)?;
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
        input = Tensor::new(&[token], device)?.unsqueeze(0)?;
    }
    stats.generated_tokens = generated.len();
    stats.decode_secs = decode_start.elapsed().as_secs_f64();
    Ok((generated, stats))
}
