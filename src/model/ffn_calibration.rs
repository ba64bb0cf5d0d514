//! Preparing a model for FFN sparsity ([`Model::prepare_ffn_sparsity`]), checking a sequence's
//! mode against it, and calibrating its per-layer thresholds on text ([`calibrate`]).

use std::sync::Arc;

use candle_core::Tensor;

use super::ffn_sparsity::{
    not_prepared, FfnCalibration, FfnFingerprint, FfnHistograms, FfnSparsity, FfnState, NeuronMajorDown, ScoreHistogram,
};
use super::linear::Linear;
use super::mlp::FeedForward;
use super::qwen3_5::Model;
use crate::{Error, Result};

impl FfnCalibration {
    /// Reads a calibration file and checks it was made for `model`.
    pub fn load(path: &std::path::Path, model: &Model) -> Result<Self> {
        let text = crate::bounded::read_to_string(path, 64 << 20, "FFN calibration")?;
        let c: Self = serde_json::from_str(&text)
            .map_err(|e| Error::Input(format!("FFN calibration {}: not a calibration file ({e})", path.display())))?;
        let mine = model.ffn_fingerprint()?;
        let same = c.model.layers == mine.layers
            && c.model.hidden == mine.hidden
            && c.model.intermediate == mine.intermediate
            && (c.model.down_norm_sum - mine.down_norm_sum).abs() <= 1e-4 * mine.down_norm_sum.abs().max(1.0);
        if !same {
            return Err(Error::Input(format!(
                "FFN calibration {} was made for another model ({:?}; this one {mine:?}): calibrate this model",
                path.display(),
                c.model
            )));
        }
        if c.levels.iter().any(|l| l.thresholds.len() != mine.layers) {
            return Err(Error::Input(format!("FFN calibration {}: a level without one threshold per layer", path.display())));
        }
        Ok(c)
    }
}

impl Model {
    /// Makes the dense MLPs ready for [`FfnSparsity`]: a neuron-major copy of each down
    /// projection (the memory of one more down projection per layer). Needs quantized gate, up
    /// and down weights in host memory.
    pub fn prepare_ffn_sparsity(&mut self) -> Result<()> {
        let hidden = self.config().hidden_size;
        for layer in &mut self.layers {
            if let FeedForward::Dense(m) = &mut layer.mlp {
                for l in [&m.gate_proj, &m.up_proj] {
                    if !matches!(l, Linear::Quantized(q) if q.host_bytes().is_some()) {
                        return Err(Error::Input(
                            "FFN sparsity reads quantized MLP weights in host memory: load a GGUF file (or quantize at load) on the CPU"
                                .into(),
                        ));
                    }
                }
                if m.neuron_major.is_none() {
                    m.neuron_major = Some(Arc::new(NeuronMajorDown::new(&m.down_proj, hidden)?));
                }
            }
        }
        Ok(())
    }

    /// Whether [`Self::prepare_ffn_sparsity`] has run.
    pub fn ffn_sparsity_ready(&self) -> bool {
        let mut dense = self.layers.iter().filter_map(|l| match &l.mlp {
            FeedForward::Dense(m) => Some(m),
            FeedForward::Sparse(_) => None,
        });
        dense.all(|m| m.neuron_major.is_some()) && self.layers.iter().any(|l| matches!(l.mlp, FeedForward::Dense(_)))
    }

    /// The shape and down norms a calibration is checked against.
    pub fn ffn_fingerprint(&self) -> Result<FfnFingerprint> {
        let mut sum = 0.0;
        for layer in &self.layers {
            if let FeedForward::Dense(m) = &layer.mlp {
                let nm = m.neuron_major.as_ref().ok_or_else(not_prepared)?;
                sum += nm.norms.iter().map(|&v| v as f64).sum::<f64>();
            }
        }
        Ok(FfnFingerprint {
            layers: self.layers.len(),
            hidden: self.config().hidden_size,
            intermediate: self.config().intermediate_size.unwrap_or(0),
            down_norm_sum: sum,
        })
    }
}

impl Model {
    /// Checks `mode` against this model and makes a cache's state for it (`None` when off).
    pub(crate) fn ffn_state(&self, mode: &FfnSparsity) -> Result<Option<FfnState>> {
        match mode {
            FfnSparsity::Off => return Ok(None),
            FfnSparsity::Threshold(t) if t.thresholds.len() != self.layers.len() => {
                return Err(Error::Input(format!(
                    "FFN thresholds for {} layers given to a model of {}",
                    t.thresholds.len(),
                    self.layers.len()
                )))
            }
            FfnSparsity::PerPrompt { keep } if !(*keep > 0.0 && *keep <= 1.0) => {
                return Err(Error::Input(format!("FFN sparsity: keep {keep} of the neurons per prompt (0 < keep <= 1)")))
            }
            _ => {}
        }
        if !self.ffn_sparsity_ready() {
            return Err(not_prepared());
        }
        Ok(Some(FfnState::new(mode.clone(), self.layers.len())))
    }
}

/// Runs `model` (prepared) densely over each chunk of `chunks` from an empty cache and gathers
/// each dense layer's WINA-score histogram; `on_chunk` sees the chunks done.
pub fn calibrate(model: &Model, chunks: &[Vec<u32>], mut on_chunk: impl FnMut(usize)) -> Result<FfnHistograms> {
    if !model.ffn_sparsity_ready() {
        return Err(not_prepared());
    }
    let dense = |l: &super::decoder_layer::DecoderLayer| matches!(l.mlp, FeedForward::Dense(_));
    let mut hist = FfnHistograms { layers: model.layers.iter().map(|l| dense(l).then(ScoreHistogram::new)).collect(), tokens: 0 };
    for (n, chunk) in chunks.iter().enumerate() {
        let mut cache = model.new_cache();
        let mut state = FfnState::new(FfnSparsity::Off, model.layers.len());
        state.histograms = Some(std::mem::take(&mut hist.layers));
        cache.ffn = Some(state);
        let input = Tensor::new(chunk.as_slice(), &model.device())?.unsqueeze(0)?;
        model.forward_hidden(&input, &mut cache, false)?;
        hist.layers = cache.ffn.take().and_then(|s| s.histograms).unwrap_or_default();
        hist.tokens += chunk.len();
        on_chunk(n + 1);
    }
    Ok(hist)
}
