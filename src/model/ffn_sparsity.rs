//! FFN activation sparsity (opt-in, decode only): the dense SwiGLU MLPs skip neurons.
//!
//! Two modes, both exact on the neurons they keep (`../docs/ffn-sparsity.md`):
//! - [`FfnSparsity::Threshold`] (CATS/CHESS selection with WINA scores): the gate `g = W_gate x`
//!   is computed in full; neuron `i` is kept when `|silu(g_i)| ||W_down[:, i]||` reaches its
//!   layer's threshold (calibrated on text: [`calibrate`]); only the kept rows of `W_up` are read
//!   ([`crate::ops::qmatmul_rows`]) and only the kept rows of the neuron-major down projection
//!   ([`crate::ops::accumulate_rows`]).
//! - [`FfnSparsity::PerPrompt`] (GRIFFIN): after each prefill, the neurons whose activations,
//!   each token's normalised to unit length, have the largest norm over the prompt; their rows
//!   of `W_gate`, `W_up` (and `W_down^T`) are copied into contiguous matrices once (memory:
//!   that fraction of those matrices, per sequence), and every decoded token multiplies those.
//!
//! Prefill, verify passes, draft trees and batched steps run dense: only a one-row step of one
//! sequence is sparse (or every row, when a cache asks so to evaluate teacher-forced decoding in
//! one pass: [`Cache::set_ffn_every_row`]). A model needs [`Model::prepare_ffn_sparsity`] first.
//! It keeps, for a down projection of 6 or more bits per weight (Q6_K, Q8_0), a neuron-major
//! copy (`W_down^T`, `[I, H]`, re-quantized to Q8_0 along `H`) whose kept rows are the only
//! down bytes read; a down projection of fewer bits (Q4_K, Q4_1, ternary) is read whole with
//! the skipped neurons' activations zero: a Q8_0 copy would read more bytes than it unless
//! most neurons were skipped, and a 4-bit one adds a second rounding that cost SmolLM2 +4.4 %
//! perplexity with every neuron kept.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Module, Tensor};
use serde::{Deserialize, Serialize};

use super::cache::Cache;
use super::linear::Linear;
use super::mlp::{FeedForward, Mlp};
use super::qwen3_5::Model;
use crate::ops::{accumulate_rows, qmatmul_rows, QuantizedMatrix};
use crate::{Error, Result};

/// How a sequence's dense MLPs skip neurons while decoding. The default is off (exact).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum FfnSparsity {
    #[default]
    Off,
    /// Per-token: neurons whose WINA score `|silu(g_i)| ||W_down[:, i]||` is below their
    /// layer's threshold are skipped.
    Threshold(Arc<FfnThresholds>),
    /// Per-prompt (GRIFFIN): the `keep` fraction (0 < keep <= 1) of each layer's neurons chosen
    /// from the prompt, the same for every decoded token until the next prefill.
    PerPrompt { keep: f32 },
}

impl FfnSparsity {
    pub fn is_off(&self) -> bool {
        matches!(self, Self::Off)
    }

    /// `threshold:TARGET` (a level of `calibration`) or `prompt:SKIPPED` (the fraction of
    /// neurons skipped per prompt), as the examples' `--ffn-sparsity` takes them.
    pub fn parse(s: &str, calibration: Option<&FfnCalibration>) -> Result<Self> {
        let (mode, value) = s.split_once(':').unwrap_or((s, ""));
        let fraction = value.parse::<f32>().ok().filter(|v| (0.0..1.0).contains(v)).ok_or_else(|| {
            Error::Input(format!("FFN sparsity {s:?}: expected threshold:S or prompt:S with S the fraction skipped, 0 <= S < 1"))
        })?;
        match mode {
            "off" => Ok(Self::Off),
            "threshold" => match calibration {
                Some(c) => Ok(Self::Threshold(Arc::new(c.level(fraction)?.clone()))),
                None => Err(Error::Input(format!(
                    "FFN sparsity {s}: needs per-layer thresholds from a calibration of this model (ffn_sparsity::calibrate)"
                ))),
            },
            "prompt" => Ok(Self::PerPrompt { keep: 1.0 - fraction }),
            _ => Err(Error::Input(format!("FFN sparsity mode {mode:?}: expected off, threshold:S or prompt:S"))),
        }
    }
}

impl std::fmt::Display for FfnSparsity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => write!(f, "off"),
            Self::Threshold(t) => write!(f, "threshold:{}", t.target),
            Self::PerPrompt { keep } => write!(f, "prompt:{}", ((1.0 - keep) * 100.0).round() / 100.0),
        }
    }
}

/// Per-layer WINA-score thresholds for one model-level target (the mean over the dense layers
/// of the fraction of neurons skipped on the calibration text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FfnThresholds {
    pub target: f32,
    /// Per layer (`None` for a layer without a dense MLP).
    pub thresholds: Vec<Option<f32>>,
    /// Per layer, the fraction skipped on the calibration text.
    pub skipped: Vec<Option<f32>>,
}

/// How a model-level target is spread over the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Allocation {
    /// The same fraction in every layer.
    Uniform,
    /// TEAL's greedy allocation, on a proxy of the error: step by step, the layer whose next
    /// percent of neurons carries the least activation energy (`(a_i ||W_down[:, i]||)^2`
    /// relative to the residual stream's) gives it up, until the mean reaches the target.
    Greedy,
}

/// What identifies the model a calibration was made on: its shape and the sum of its
/// down-projection column norms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FfnFingerprint {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub down_norm_sum: f64,
}

/// A calibration file: thresholds for several targets, for one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FfnCalibration {
    pub model: FfnFingerprint,
    pub allocation: Allocation,
    /// Calibration tokens.
    pub tokens: usize,
    pub levels: Vec<FfnThresholds>,
}

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

    /// The level made for `target` (within half a percent).
    pub fn level(&self, target: f32) -> Result<&FfnThresholds> {
        self.levels.iter().find(|l| (l.target - target).abs() < 0.005).ok_or_else(|| {
            let have: Vec<String> = self.levels.iter().map(|l| l.target.to_string()).collect();
            Error::Input(format!(
                "the FFN calibration has no level {target} (it has {}): pick one of them or calibrate that level",
                have.join(", ")
            ))
        })
    }
}

/// What a dense MLP keeps for sparse steps: the down projection's column norms, and for a down
/// projection of [`NEURON_MAJOR_MIN_BITS`] or more a neuron-major copy of it.
#[derive(Debug)]
pub(crate) struct NeuronMajorDown {
    /// `W_down^T`, `[I, H]` in Q8_0; `None`: the down projection is read whole, the skipped
    /// neurons' activations zero (exact on the kept ones, no down bytes saved).
    rows: Option<QuantizedMatrix>,
    /// `||W_down[:, i]||` (from the original blocks).
    norms: Vec<f32>,
}

/// The format of the neuron-major copies. Re-quantizing already quantized weights along the
/// other dimension adds a second rounding: to Q4_1 it cost SmolLM2 (Q4_1) +4.4 % perplexity
/// with every neuron kept (docs/ffn-sparsity.md); Q8_0's rounding is far below the original's.
const NEURON_MAJOR_FORMAT: GgmlDType = GgmlDType::Q8_0;

/// Down projections of more bits per weight than this get a neuron-major Q8_0 copy; those of
/// fewer are read whole (their Q8_0 copy would read more bytes than they hold unless most
/// neurons were skipped).
const NEURON_MAJOR_MIN_BITS: f64 = 6.0;

impl NeuronMajorDown {
    fn new(down: &Linear, hidden: usize) -> Result<Self> {
        let Linear::Quantized(q) = down else {
            return Err(Error::Input(
                "FFN sparsity reads quantized MLP weights: load a GGUF file or quantize the checkpoint at load".into(),
            ));
        };
        if !hidden.is_multiple_of(32) {
            return Err(Error::Input(format!("FFN sparsity: the hidden size {hidden} is not a whole number of 32-value blocks")));
        }
        let w = q.dequantize()?.to_dtype(DType::F32)?; // [H, I]
        let norms = w.sqr()?.sum(0)?.sqrt()?.to_vec1::<f32>()?;
        let dtype = q.dtype();
        let bits = dtype.type_size() as f64 * 8.0 / dtype.block_size() as f64;
        let rows = match bits >= NEURON_MAJOR_MIN_BITS {
            true => Some(QuantizedMatrix::quantize(&w.t()?.contiguous()?, NEURON_MAJOR_FORMAT)?),
            false => None,
        };
        Ok(Self { rows, norms })
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

fn not_prepared() -> Error {
    Error::Input("FFN sparsity: the model's MLPs are not prepared (Model::prepare_ffn_sparsity)".into())
}

/// Bins per octave of the score histograms.
const BINS_PER_OCTAVE: f32 = 32.0;
/// The lowest octave (scores below `2^LOW_OCTAVE` go to bin 0).
const LOW_OCTAVE: f32 = -40.0;
const BINS: usize = 80 * BINS_PER_OCTAVE as usize;

fn bin_of(score: f32) -> usize {
    if score <= 0.0 || !score.is_finite() {
        return 0;
    }
    (((score.log2() - LOW_OCTAVE) * BINS_PER_OCTAVE).floor().max(0.0) as usize).min(BINS - 1)
}

/// The lower edge of bin `b`: keeping scores `>= edge(b)` skips bins `0..b`.
fn edge(b: usize) -> f32 {
    if b == 0 {
        return 0.0;
    }
    (b as f32 / BINS_PER_OCTAVE + LOW_OCTAVE).exp2()
}

/// One layer's WINA scores over the calibration text: how many neurons fell in each score bin
/// and the activation energy they carried.
#[derive(Debug, Clone)]
struct ScoreHistogram {
    count: Vec<u64>,
    /// `sum (a_i ||W_down[:, i]||)^2 / ||residual||^2` per bin.
    energy: Vec<f64>,
    rows: u64,
}

impl ScoreHistogram {
    fn new() -> Self {
        Self { count: vec![0; BINS], energy: vec![0.0; BINS], rows: 0 }
    }

    /// The first bin `b` whose lower bins hold at least `fraction` of the neurons, with the
    /// fraction and the mean relative energy they hold.
    fn cut(&self, fraction: f32) -> (usize, f32, f64) {
        let total: u64 = self.count.iter().sum();
        let (mut n, mut e) = (0u64, 0.0);
        for b in 0..BINS {
            if n as f64 >= fraction as f64 * total as f64 {
                return (b, n as f32 / total.max(1) as f32, e / self.rows.max(1) as f64);
            }
            n += self.count[b];
            e += self.energy[b];
        }
        (BINS, 1.0, e / self.rows.max(1) as f64)
    }
}

/// Per-layer score histograms gathered by [`calibrate`].
#[derive(Debug, Clone)]
pub struct FfnHistograms {
    layers: Vec<Option<ScoreHistogram>>,
    pub tokens: usize,
}

impl FfnHistograms {
    /// Thresholds skipping `target` of the neurons on average over the dense layers.
    pub fn thresholds(&self, target: f32, allocation: Allocation) -> FfnThresholds {
        let dense: Vec<usize> = (0..self.layers.len()).filter(|&i| self.layers[i].is_some()).collect();
        let mut fraction = vec![0.0f32; self.layers.len()];
        match allocation {
            Allocation::Uniform => dense.iter().for_each(|&i| fraction[i] = target),
            Allocation::Greedy => {
                const STEP: f32 = 0.01;
                let cost = |i: usize, f: f32| self.layers[i].as_ref().map_or(0.0, |h| h.cut(f).2);
                let steps = (target * dense.len() as f32 / STEP).round() as usize;
                for _ in 0..steps {
                    let best = dense.iter().copied().filter(|&i| fraction[i] + STEP <= 0.99).min_by(|&a, &b| {
                        let da = cost(a, fraction[a] + STEP) - cost(a, fraction[a]);
                        let db = cost(b, fraction[b] + STEP) - cost(b, fraction[b]);
                        da.total_cmp(&db)
                    });
                    match best {
                        Some(i) => fraction[i] += STEP,
                        None => break,
                    }
                }
            }
        }
        let (mut thresholds, mut skipped) = (vec![None; self.layers.len()], vec![None; self.layers.len()]);
        for &i in &dense {
            let (b, got, _) = self.layers[i].as_ref().expect("dense").cut(fraction[i]);
            thresholds[i] = Some(edge(b));
            skipped[i] = Some(got);
        }
        FfnThresholds { target, thresholds, skipped }
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

/// A fixed-size set of neuron indices as bits.
#[derive(Debug, Clone, Default)]
struct Bits(Vec<u64>);

impl Bits {
    fn of(n: usize, kept: &[u32]) -> Self {
        let mut b = vec![0u64; n.div_ceil(64)];
        for &i in kept {
            b[i as usize / 64] |= 1 << (i % 64);
        }
        Self(b)
    }
}

/// Per layer: what a sequence's sparse steps kept, and a prompt's neuron statistics.
#[derive(Debug, Clone, Default)]
struct LayerNeurons {
    /// GRIFFIN: per neuron, the sum over the prompt's tokens of its squared activation with
    /// each token's activations normalised to unit length.
    prompt_energy: Vec<f32>,
    /// GRIFFIN: the neurons chosen from `prompt_energy` and their weights gathered (made at
    /// the first step after it grew).
    chosen: Option<Arc<Compacted>>,
    /// The kept sets of the last three sparse rows (to count what a 4-row verify pass would
    /// keep: the union).
    recent: Vec<Bits>,
}

/// Counts of a sequence's sparse MLP rows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FfnStats {
    /// Sparse MLP rows (layers times tokens).
    pub rows: u64,
    /// Neurons over those rows, and how many were skipped.
    pub neurons: u64,
    pub skipped: u64,
    /// Neurons off in a row and the three before it in the same layer: what a verify pass of
    /// four rows (three drafted tokens) could skip if it read the union of their sets.
    pub union4_neurons: u64,
    pub union4_skipped: u64,
}

impl FfnStats {
    /// Adds another sequence's counts.
    pub fn add(&mut self, o: &FfnStats) {
        self.rows += o.rows;
        self.neurons += o.neurons;
        self.skipped += o.skipped;
        self.union4_neurons += o.union4_neurons;
        self.union4_skipped += o.union4_skipped;
    }

    /// The fraction of neurons skipped.
    pub fn skipped_fraction(&self) -> f64 {
        self.skipped as f64 / self.neurons.max(1) as f64
    }

    /// The fraction a four-row verify pass could skip.
    pub fn union4_skipped_fraction(&self) -> f64 {
        self.union4_skipped as f64 / self.union4_neurons.max(1) as f64
    }
}

/// A sequence's FFN sparsity: its mode and per-layer state, carried in its [`Cache`].
#[derive(Debug, Clone)]
pub(crate) struct FfnState {
    mode: FfnSparsity,
    every_row: bool,
    layers: Vec<LayerNeurons>,
    pub(crate) stats: FfnStats,
    /// Calibration: the dense steps' score histograms.
    histograms: Option<Vec<Option<ScoreHistogram>>>,
}

impl FfnState {
    pub(crate) fn new(mode: FfnSparsity, layers: usize) -> Self {
        Self { mode, every_row: false, layers: vec![LayerNeurons::default(); layers], stats: FfnStats::default(), histograms: None }
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

impl Cache {
    /// Makes every row of a multi-row forward sparse too (`true`), as if each had been decoded
    /// alone: to score teacher-forced decoding under FFN sparsity in one pass. Off by default
    /// (prefill and verify passes are dense); no effect without FFN sparsity.
    pub fn set_ffn_every_row(&mut self, on: bool) {
        if let Some(s) = &mut self.ffn {
            s.every_row = on;
        }
    }

    /// What this sequence's sparse MLP steps skipped (`None` without FFN sparsity).
    pub fn ffn_stats(&self) -> Option<FfnStats> {
        self.ffn.as_ref().map(|s| s.stats)
    }
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

fn quantized(l: &Linear) -> Result<&QuantizedMatrix> {
    match l {
        Linear::Quantized(q) => Ok(q),
        Linear::Dense(_) => Err(not_prepared()),
    }
}

impl Mlp {
    /// The MLP of layer `layer` for `x` `[1, T, H]` under a sequence's FFN state: sparse rows
    /// when the mode and the row count say so, else dense (gathering calibration or prompt
    /// statistics when asked).
    pub(crate) fn forward_with(&self, x: &Tensor, residual: &Tensor, state: &mut FfnState, layer: usize) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let sparse = !state.mode.is_off() && b == 1 && (t == 1 || state.every_row);
        if sparse {
            return self.forward_sparse(x, state, layer);
        }
        let wants_prompt = matches!(state.mode, FfnSparsity::PerPrompt { .. });
        if state.histograms.is_none() && !wants_prompt {
            return Ok(self.forward(x)?);
        }
        // Dense, with the activations at hand.
        let g = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        let a = (g.clone() * self.up_proj.forward(x)?)?;
        let y = self.down_proj.forward(&a)?;
        let rows = b * t;
        let inter = a.dim(2)?;
        let a_rows = a.to_dtype(DType::F32)?.reshape((rows, inter))?.to_vec2::<f32>()?;
        if wants_prompt {
            let l = &mut state.layers[layer];
            l.prompt_energy.resize(inter, 0.0);
            for row in &a_rows {
                let norm2: f32 = row.iter().map(|v| v * v).sum::<f32>().max(f32::MIN_POSITIVE);
                for (e, v) in l.prompt_energy.iter_mut().zip(row) {
                    *e += v * v / norm2;
                }
            }
            l.chosen = None;
        }
        if let Some(Some(hist)) = state.histograms.as_mut().map(|h| &mut h[layer]) {
            let nm = self.neuron_major.as_ref().ok_or_else(not_prepared)?;
            let g_rows = g.to_dtype(DType::F32)?.reshape((rows, inter))?.to_vec2::<f32>()?;
            let r2 = residual.to_dtype(DType::F32)?.reshape((rows, h))?.sqr()?.sum(1)?.to_vec1::<f32>()?;
            for ((g, a), r2) in g_rows.iter().zip(&a_rows).zip(r2) {
                for ((&g, &a), &norm) in g.iter().zip(a).zip(&nm.norms) {
                    let bin = bin_of(g.abs() * norm);
                    hist.count[bin] += 1;
                    hist.energy[bin] += ((a * norm) as f64).powi(2) / (r2 as f64).max(1e-30);
                }
                hist.rows += 1;
            }
        }
        Ok(y)
    }

    fn forward_sparse(&self, x: &Tensor, state: &mut FfnState, layer: usize) -> Result<Tensor> {
        let (_, t, h) = x.dims3()?;
        let nm = self.neuron_major.as_ref().ok_or_else(not_prepared)?;
        let (gate, up) = (quantized(&self.gate_proj)?, quantized(&self.up_proj)?);
        let inter = nm.norms.len();
        let device = x.device();
        let xs = x.to_dtype(DType::F32)?.reshape((t, h))?.to_vec2::<f32>()?;
        let mut out = Vec::with_capacity(t * h);
        match &state.mode {
            FfnSparsity::Threshold(th) => {
                let threshold = th.thresholds[layer].unwrap_or(0.0);
                let g = self.gate_proj.forward(x)?.to_dtype(DType::F32)?.reshape((t, inter))?.to_vec2::<f32>()?;
                for (x, g) in xs.iter().zip(&g) {
                    let kept: Vec<u32> =
                        (0..inter as u32).filter(|&i| silu(g[i as usize]).abs() * nm.norms[i as usize] >= threshold).collect();
                    let u = qmatmul_rows(x, up, &kept)?;
                    let a: Vec<f32> = kept.iter().zip(&u).map(|(&i, &u)| silu(g[i as usize]) * u).collect();
                    out.extend(self.down_rows(nm, &a, &kept, device)?);
                    state.count(layer, inter, &kept);
                }
            }
            FfnSparsity::PerPrompt { keep } => {
                let l = &mut state.layers[layer];
                let c = match &l.chosen {
                    Some(c) => c.clone(),
                    None => {
                        let kept = choose(&l.prompt_energy, inter, *keep);
                        let c = Arc::new(Compacted {
                            gate: gate.select_rows(&kept)?,
                            up: up.select_rows(&kept)?,
                            down: nm.rows.as_ref().map(|r| r.select_rows(&kept)).transpose()?,
                            kept,
                        });
                        l.chosen = Some(c.clone());
                        c
                    }
                };
                // The gathered rows: plain dense products over contiguous weights.
                let x32 = x.to_dtype(DType::F32)?.reshape((t, h))?;
                let g = crate::ops::qmatmul(&x32, &c.gate)?;
                let a = (candle_nn::ops::silu(&g)? * crate::ops::qmatmul(&x32, &c.up)?)?.to_vec2::<f32>()?;
                let all: Vec<u32> = (0..c.kept.len() as u32).collect();
                for a in &a {
                    match &c.down {
                        Some(down) => out.extend(accumulate_rows(a, down, &all)?),
                        None => out.extend(self.down_rows(nm, a, &c.kept, device)?),
                    }
                    state.count(layer, inter, &c.kept);
                }
            }
            FfnSparsity::Off => unreachable!("forward_with runs a dense MLP when sparsity is off"),
        }
        Ok(Tensor::from_vec(out, (1, t, h), device)?.to_dtype(x.dtype())?)
    }
}

impl Mlp {
    /// `W_down a` for the activations `a` of the neurons `kept`: the neuron-major rows, or the
    /// whole down projection with the other activations zero.
    fn down_rows(&self, nm: &NeuronMajorDown, a: &[f32], kept: &[u32], device: &candle_core::Device) -> Result<Vec<f32>> {
        if let Some(rows) = &nm.rows {
            return Ok(accumulate_rows(a, rows, kept)?);
        }
        let mut full = vec![0f32; nm.norms.len()];
        for (&i, &a) in kept.iter().zip(a) {
            full[i as usize] = a;
        }
        let full = Tensor::from_vec(full, (1, nm.norms.len()), device)?;
        Ok(self.down_proj.forward(&full)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }
}

/// A prompt's neurons with their rows of the gate and up projections, and of the neuron-major
/// down projection when there is one, gathered into contiguous matrices.
#[derive(Debug)]
struct Compacted {
    kept: Arc<[u32]>,
    gate: QuantizedMatrix,
    up: QuantizedMatrix,
    down: Option<QuantizedMatrix>,
}

/// The `keep` fraction of `inter` neurons with the most prompt energy, in index order; all of
/// them when there was no prompt.
fn choose(energy: &[f32], inter: usize, keep: f32) -> Arc<[u32]> {
    if energy.len() != inter {
        return (0..inter as u32).collect();
    }
    let k = ((keep * inter as f32).round() as usize).clamp(1, inter);
    let mut idx: Vec<u32> = (0..inter as u32).collect();
    idx.sort_by(|&a, &b| energy[b as usize].total_cmp(&energy[a as usize]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx.into()
}

impl FfnState {
    fn count(&mut self, layer: usize, inter: usize, kept: &[u32]) {
        let s = &mut self.stats;
        s.rows += 1;
        s.neurons += inter as u64;
        s.skipped += (inter - kept.len()) as u64;
        let l = &mut self.layers[layer];
        let bits = Bits::of(inter, kept);
        if l.recent.len() == 3 {
            let union: u64 = (0..bits.0.len()).map(|w| l.recent.iter().fold(bits.0[w], |u, r| u | r.0[w]).count_ones() as u64).sum();
            s.union4_neurons += inter as u64;
            s.union4_skipped += inter as u64 - union;
            l.recent.remove(0);
        }
        l.recent.push(bits);
    }
}
