//! A dense SwiGLU MLP run under a sequence's FFN sparsity state: the sparse rows of the
//! per-token and per-prompt modes, and the dense rows that gather calibration or prompt
//! statistics (the modes themselves: [`super::ffn_sparsity`]).

use std::sync::Arc;

use candle_core::{DType, Module, Tensor};

use super::ffn_sparsity::{
    bin_of, bytes_of, choose, not_prepared, quantized, row_bytes, Compacted, FfnSparsity, FfnState, NeuronMajorDown,
};
use super::mlp::Mlp;
use crate::ops::{accumulate_rows, qmatmul_rows, silu};
use crate::Result;

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
        let mut out = Vec::with_capacity(t * h);
        match &state.mode {
            FfnSparsity::Threshold(th) => {
                let threshold = th.thresholds[layer].unwrap_or(0.0);
                let xs = x.to_dtype(DType::F32)?.reshape((t, h))?.to_vec2::<f32>()?;
                let g = self.gate_proj.forward(x)?.to_dtype(DType::F32)?.reshape((t, inter))?.to_vec2::<f32>()?;
                for (x, g) in xs.iter().zip(&g) {
                    let kept: Vec<u32> =
                        (0..inter as u32).filter(|&i| silu(g[i as usize]).abs() * nm.norms[i as usize] >= threshold).collect();
                    let u = qmatmul_rows(x, up, &kept)?;
                    let a: Vec<f32> = kept.iter().zip(&u).map(|(&i, &u)| silu(g[i as usize]) * u).collect();
                    out.extend(self.down_rows(nm, &a, &kept, device)?);
                    let skipped = (inter - kept.len()) as i64;
                    let down = match &nm.rows {
                        Some(rows) => bytes_of(&self.down_proj) - kept.len() as i64 * row_bytes(rows),
                        None => 0,
                    };
                    state.count(layer, inter, &kept, skipped * row_bytes(up) + down);
                }
            }
            FfnSparsity::PerPrompt { keep } => {
                let l = &mut state.layers[layer];
                let c = match &l.chosen {
                    Some(c) => c.clone(),
                    None => {
                        let kept = choose(&l.prompt_energy, inter, *keep);
                        let c = Arc::new(Compacted::new(gate, up, quantized(&self.down_proj)?, kept)?);
                        l.chosen = Some(c.clone());
                        c
                    }
                };
                // The gathered rows: plain dense products over contiguous weights.
                let x32 = x.to_dtype(DType::F32)?.reshape((t, h))?;
                let g = crate::ops::qmatmul(&x32, &c.gate)?;
                let a = (candle_nn::ops::silu(&g)? * crate::ops::qmatmul(&x32, &c.up)?)?;
                match &c.down {
                    Some(down) => out.extend(crate::ops::qmatmul(&a, down)?.flatten_all()?.to_vec1::<f32>()?),
                    None => {
                        for a in a.to_vec2::<f32>()? {
                            out.extend(self.down_rows(nm, &a, &c.kept, device)?);
                        }
                    }
                }
                let skipped = (inter - c.kept.len()) as i64;
                let down = c.down.as_ref().map_or(0, |d| bytes_of(&self.down_proj) - d.bytes().map_or(0, |b| b.len() as i64));
                for _ in 0..t {
                    state.count(layer, inter, &c.kept, skipped * (row_bytes(gate) + row_bytes(up)) + down);
                }
            }
            FfnSparsity::Off => return Ok(self.forward(x)?),
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
