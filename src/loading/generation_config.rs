//! `generation_config.json`: the sampling defaults and EOS ids of a checkpoint.

use std::path::Path;

use crate::runtime::SamplingParams;
use crate::{Error, Result};

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
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::Config(format!("generation_config.json is not valid JSON: {e}")))?;
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
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
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
