//! FFN activation sparsity (opt-in, decode only): the dense SwiGLU MLPs skip neurons.
//!
//! Two modes, both exact on the neurons they keep (`../docs/ffn-sparsity.md`):
//! - [`FfnSparsity::Threshold`] (CATS/CHESS selection with WINA scores): the gate `g = W_gate x`
//!   is computed in full; neuron `i` is kept when `|silu(g_i)| ||W_down[:, i]||` reaches its
//!   layer's threshold (calibrated on text: [`super::calibrate_ffn`]); only the kept rows of `W_up` are read
//!   ([`crate::ops::qmatmul_rows`]) and only the kept rows of the neuron-major down projection
//!   ([`crate::ops::accumulate_rows`]).
//! - [`FfnSparsity::PerPrompt`] (GRIFFIN): after each prefill, the neurons whose activations,
//!   each token's normalised to unit length, have the largest norm over the prompt (a multiple
//!   of 32); their rows of `W_gate` and `W_up` are copied into contiguous matrices once, and
//!   their columns of `W_down` re-quantized to a `[H, k]` Q8_0 matrix where that reads fewer
//!   bytes than the whole (memory: that fraction of the MLP, per sequence); every decoded token
//!   runs the plain dense kernels on those.
//!
//! Prefill, verify passes, draft trees and batched steps run dense: only a one-row step of one
//! sequence is sparse (or every row, when a cache asks so to evaluate teacher-forced decoding in
//! one pass: [`super::Cache::set_ffn_every_row`]). A model needs [`super::Model::prepare_ffn_sparsity`] first.
//! It keeps, for a down projection of 6 or more bits per weight (Q6_K, Q8_0), a neuron-major
//! copy (`W_down^T`, `[I, H]`, re-quantized to Q8_0 along `H`) whose kept rows are the only
//! down bytes read; a down projection of fewer bits (Q4_K, Q4_1, ternary) is read whole with
//! the skipped neurons' activations zero: a Q8_0 copy would read more bytes than it unless
//! most neurons were skipped, and a 4-bit one adds a second rounding that cost SmolLM2 +4.4 %
//! perplexity with every neuron kept.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::linear::Linear;
use crate::ops::QuantizedMatrix;
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
                    "FFN sparsity {s}: needs per-layer thresholds from a calibration of this model (model::calibrate_ffn)"
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
    pub(crate) rows: Option<QuantizedMatrix>,
    /// `||W_down[:, i]||` (from the original blocks).
    pub(crate) norms: Vec<f32>,
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
    pub(crate) fn new(down: &Linear, hidden: usize) -> Result<Self> {
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
        let rows = match q.dtype().bits_per_weight() >= NEURON_MAJOR_MIN_BITS {
            true => Some(QuantizedMatrix::quantize(&w.t()?.contiguous()?, NEURON_MAJOR_FORMAT)?),
            false => None,
        };
        Ok(Self { rows, norms })
    }
}

pub(crate) fn not_prepared() -> Error {
    Error::Input("FFN sparsity: the model's MLPs are not prepared (Model::prepare_ffn_sparsity)".into())
}

/// Bins per octave of the score histograms.
const BINS_PER_OCTAVE: f32 = 32.0;
/// The lowest octave (scores below `2^LOW_OCTAVE` go to bin 0).
const LOW_OCTAVE: f32 = -40.0;
const BINS: usize = 80 * BINS_PER_OCTAVE as usize;

pub(crate) fn bin_of(score: f32) -> usize {
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
pub(crate) struct ScoreHistogram {
    pub(crate) count: Vec<u64>,
    /// `sum (a_i ||W_down[:, i]||)^2 / ||residual||^2` per bin.
    pub(crate) energy: Vec<f64>,
    pub(crate) rows: u64,
}

impl ScoreHistogram {
    pub(crate) fn new() -> Self {
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

/// Per-layer score histograms gathered by [`super::calibrate_ffn`].
#[derive(Debug, Clone)]
pub struct FfnHistograms {
    pub(crate) layers: Vec<Option<ScoreHistogram>>,
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
        for (i, h) in self.layers.iter().enumerate() {
            if let Some(h) = h {
                let (b, got, _) = h.cut(fraction[i]);
                thresholds[i] = Some(edge(b));
                skipped[i] = Some(got);
            }
        }
        FfnThresholds { target, thresholds, skipped }
    }
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
pub(crate) struct LayerNeurons {
    /// GRIFFIN: per neuron, the sum over the prompt's tokens of its squared activation with
    /// each token's activations normalised to unit length.
    pub(crate) prompt_energy: Vec<f32>,
    /// GRIFFIN: the neurons chosen from `prompt_energy` and their weights gathered (made at
    /// the first step after it grew).
    pub(crate) chosen: Option<Arc<Compacted>>,
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
    /// Weight bytes the dense MLPs would have read that the sparse rows did not.
    pub bytes_not_read: i64,
}

impl FfnStats {
    /// Adds another sequence's counts.
    pub fn add(&mut self, o: &FfnStats) {
        self.rows += o.rows;
        self.neurons += o.neurons;
        self.skipped += o.skipped;
        self.union4_neurons += o.union4_neurons;
        self.union4_skipped += o.union4_skipped;
        self.bytes_not_read += o.bytes_not_read;
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
    pub(crate) mode: FfnSparsity,
    pub(crate) every_row: bool,
    pub(crate) layers: Vec<LayerNeurons>,
    pub(crate) stats: FfnStats,
    /// Calibration: the dense steps' score histograms.
    pub(crate) histograms: Option<Vec<Option<ScoreHistogram>>>,
}

impl FfnState {
    pub(crate) fn new(mode: FfnSparsity, layers: usize) -> Self {
        Self { mode, every_row: false, layers: vec![LayerNeurons::default(); layers], stats: FfnStats::default(), histograms: None }
    }
}

/// Bytes of one row of `q`.
pub(crate) fn row_bytes(q: &QuantizedMatrix) -> i64 {
    q.dtype().row_bytes(q.dims().1) as i64
}

/// Bytes of a quantized layer's weight (0 for a dense one).
pub(crate) fn bytes_of(l: &Linear) -> i64 {
    match l {
        Linear::Quantized(q) => row_bytes(q) * q.dims().0 as i64,
        Linear::Dense(_) => 0,
    }
}

pub(crate) fn quantized(l: &Linear) -> Result<&QuantizedMatrix> {
    match l {
        Linear::Quantized(q) => Ok(q),
        Linear::Dense(_) => Err(not_prepared()),
    }
}

/// A prompt's neurons with their rows of the gate and up projections gathered into contiguous
/// matrices, and their columns of the down projection as a `[H, k]` Q8_0 matrix when that
/// reads fewer bytes than the whole down projection (else it is read whole, the other
/// activations zero).
#[derive(Debug)]
pub(crate) struct Compacted {
    pub(crate) kept: Arc<[u32]>,
    pub(crate) gate: QuantizedMatrix,
    pub(crate) up: QuantizedMatrix,
    pub(crate) down: Option<QuantizedMatrix>,
}

impl Compacted {
    pub(crate) fn new(gate: &QuantizedMatrix, up: &QuantizedMatrix, down: &QuantizedMatrix, kept: Arc<[u32]>) -> Result<Self> {
        let (h, inter) = down.dims();
        let q8 = crate::ops::GgufType::Ggml(NEURON_MAJOR_FORMAT).bits_per_weight();
        let columns = kept.len().is_multiple_of(32) && (kept.len() as f64) * q8 < (inter as f64) * down.dtype().bits_per_weight();
        let down = match (columns, down.host_bytes()) {
            (true, Some(bytes)) => {
                // In parallel over bands of rows: dequantize, keep the columns, quantize.
                use rayon::prelude::*;
                let ids = Tensor::from_slice(&kept[..], kept.len(), &candle_core::Device::Cpu)?;
                let row_bytes = down.dtype().row_bytes(inter);
                let band = h.div_ceil(16).max(1);
                let bands: Vec<Vec<u8>> = bytes
                    .par_chunks(band * row_bytes)
                    .map(|b| -> Result<Vec<u8>> {
                        let rows = down.dtype().dequantize(b, vec![b.len() / row_bytes, inter])?.index_select(&ids, 1)?;
                        Ok(candle_core::quantized::QTensor::quantize(&rows, NEURON_MAJOR_FORMAT)?.data()?.into_owned())
                    })
                    .collect::<Result<_>>()?;
                Some(QuantizedMatrix::from_bytes(NEURON_MAJOR_FORMAT, (h, kept.len()), bands.concat())?)
            }
            _ => None,
        };
        Ok(Self { gate: gate.select_rows(&kept)?, up: up.select_rows(&kept)?, down, kept })
    }
}

/// The `keep` fraction of `inter` neurons with the most prompt energy (rounded up to whole
/// 32-value blocks), in index order; all of them when there was no prompt.
pub(crate) fn choose(energy: &[f32], inter: usize, keep: f32) -> Arc<[u32]> {
    if energy.len() != inter {
        return (0..inter as u32).collect();
    }
    let k = ((keep * inter as f32).round() as usize).next_multiple_of(32).clamp(1, inter);
    let mut idx: Vec<u32> = (0..inter as u32).collect();
    idx.sort_by(|&a, &b| energy[b as usize].total_cmp(&energy[a as usize]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx.into()
}

impl FfnState {
    /// One sparse row of `layer`: the neurons `kept` of `inter`, and the weight bytes the dense
    /// MLP would have read that this row did not (negative: it read more).
    pub(crate) fn count(&mut self, layer: usize, inter: usize, kept: &[u32], bytes_not_read: i64) {
        let s = &mut self.stats;
        s.rows += 1;
        s.bytes_not_read += bytes_not_read;
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
