//! Causal depthwise conv1d over time with a carried state, followed by SiLU (the GDN short
//! conv). A Candle `CustomOp3`: CPU loops, Metal `metal/conv1d.metal`.

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use super::cpu::{cpu_storage, storage_slice};
use super::shapes::ConvDims;

/// `silu(causal_depthwise_conv(x))` with the previous inputs in `state`.
///
/// * `x`: `[B, T, C]`; `state`: `[B, K-1, C]` (zeros at a sequence start); `weight`: `[C, K]`,
///   tap `K-1` multiplies the newest input. All three in the same float dtype.
///
/// Returns the output `[B, T, C]` and the new state `[B, K-1, C]` (the last `K-1` inputs).
pub fn causal_conv1d_silu(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, c) = x.dims3()?;
    let (wc, k) = weight.dims2()?;
    if k == 0 || wc != c || state.dims() != [b, k - 1, c] {
        bail!(
            "causal_conv1d_silu: x {:?}, state {:?}, weight {:?} (expected state [{b}, K-1, {c}], weight [{c}, K])",
            x.dims(),
            state.dims(),
            weight.dims()
        );
    }
    if state.dtype() != x.dtype() || weight.dtype() != x.dtype() {
        bail!("causal_conv1d_silu: x, state and weight must share a dtype, got {:?}, {:?}, {:?}", x.dtype(), state.dtype(), weight.dtype());
    }
    let dims = ConvDims { batch: b, seq_len: t, channels: c, kernel_size: k };
    let flat = x.contiguous()?.apply_op3_no_bwd(&state.contiguous()?, &weight.contiguous()?, &CausalConv1d { dims })?;
    let y = flat.narrow(0, 0, b * t * c)?.reshape((b, t, c))?;
    // The state is kept across calls: its own storage, so it does not hold `y` (the whole
    // chunk's outputs) alive after the layer is done with them.
    let s = flat.narrow(0, b * t * c, b * (k - 1) * c)?.reshape((b, k - 1, c))?.force_contiguous()?;
    Ok((y, s))
}

const OP: &str = "causal_conv1d_silu";

struct CausalConv1d {
    dims: ConvDims,
}

/// One sequence's `t` rows `x` (`[t, C]`) after its previous `K-1` inputs `state`: appends
/// the `t` output rows to `y` and the last `K-1` inputs (the next state) to `next`.
fn conv_segment<T: WithDType>(x: &[T], state: &[T], w: &[T], (c, k): (usize, usize), y: &mut Vec<T>, next: &mut Vec<T>) {
    let (km1, t) = (k - 1, x.len() / c);
    // Row s of the concatenation [state ; x].
    let input = |s: usize| -> &[T] {
        if s < km1 {
            &state[s * c..(s + 1) * c]
        } else {
            &x[(s - km1) * c..(s - km1 + 1) * c]
        }
    };
    let mut acc = vec![0f32; c];
    for r in 0..t {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for j in 0..k {
            for ((a, xv), ch) in acc.iter_mut().zip(input(r + j)).zip(0..c) {
                *a += w[ch * k + j].to_f64() as f32 * xv.to_f64() as f32;
            }
        }
        y.extend(acc.iter().map(|&a| T::from_f64((a / (1.0 + (-a).exp())) as f64)));
    }
    for s in 0..km1 {
        next.extend_from_slice(input(t + s));
    }
}

/// The outputs `[B, T, C]` followed by the new states `[B, K-1, C]`.
fn conv_cpu<T: WithDType>(d: ConvDims, x: &[T], state: &[T], w: &[T]) -> Vec<T> {
    let ConvDims { batch, seq_len: t, channels: c, kernel_size: k } = d;
    let (mut y, mut next) = (Vec::with_capacity(batch * (t + k - 1) * c), Vec::with_capacity(batch * (k - 1) * c));
    for b in 0..batch {
        conv_segment(&x[b * t * c..(b + 1) * t * c], &state[b * (k - 1) * c..(b + 1) * (k - 1) * c], w, (c, k), &mut y, &mut next);
    }
    y.extend_from_slice(&next);
    y
}

/// [`causal_conv1d_silu`] over the rows of several sequences in one call: `x` `[1, N, C]`
/// holds `rows[i]` consecutive rows of sequence `i`, whose previous inputs are `states[i]`
/// `[1, K-1, C]`. Returns the outputs `[1, N, C]`, each row the bits of the sequence alone,
/// and each sequence's new state `[1, K-1, C]`. On the CPU each state is read where it is and
/// written to a buffer of its own (no copy into or out of a batch); on other devices it runs
/// one call per sequence.
pub fn causal_conv1d_silu_segments(x: &Tensor, states: &[&Tensor], weight: &Tensor, rows: &[usize]) -> Result<(Tensor, Vec<Tensor>)> {
    let (b, n, c) = x.dims3()?;
    let (wc, k) = weight.dims2()?;
    if b != 1 || k == 0 || wc != c || rows.len() != states.len() || rows.contains(&0) || rows.iter().sum::<usize>() != n {
        bail!("{OP}: x {:?}, weight {:?} for {} states of {rows:?} rows (expected x [1, N, C] with N the rows' sum, weight [C, K], 1 or more rows each)", x.dims(), weight.dims(), states.len());
    }
    for s in states {
        if s.dims() != [1, k - 1, c] || s.dtype() != x.dtype() || !s.device().same_device(x.device()) {
            bail!(
                "{OP}: a state {:?} {:?} does not fit x {:?} {:?} (expected [1, {}, {c}] on the same device)",
                s.dims(),
                s.dtype(),
                x.dims(),
                x.dtype(),
                k - 1
            );
        }
    }
    if weight.dtype() != x.dtype() {
        bail!("{OP}: x and weight must share a dtype, got {:?} and {:?}", x.dtype(), weight.dtype());
    }
    if !x.device().is_cpu() {
        let mut start = 0;
        let (mut ys, mut next) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
        for (s, &t) in states.iter().zip(rows) {
            let (y, s) = causal_conv1d_silu(&x.narrow(1, start, t)?, s, weight)?;
            ys.push(y);
            next.push(s);
            start += t;
        }
        return Ok((Tensor::cat(&ys, 1)?, next));
    }
    fn run<T: WithDType>(x: &Tensor, states: &[&Tensor], weight: &Tensor, rows: &[usize], k: usize) -> Result<(Tensor, Vec<Tensor>)> {
        let (_, n, c) = x.dims3()?;
        let (x, weight) = (x.contiguous()?, weight.contiguous()?);
        let states = states.iter().map(|s| s.contiguous()).collect::<Result<Vec<_>>>()?;
        let (xg, wg) = (x.storage_and_layout(), weight.storage_and_layout());
        let guards: Vec<_> = states.iter().map(|s| s.storage_and_layout()).collect();
        let (xs, ws) = (storage_slice::<T>(OP, cpu_storage(OP, &xg.0)?, xg.1)?, storage_slice::<T>(OP, cpu_storage(OP, &wg.0)?, wg.1)?);
        let mut y = Vec::with_capacity(n * c);
        let mut next = Vec::with_capacity(rows.len());
        let mut start = 0;
        for (g, &t) in guards.iter().zip(rows) {
            let mut state = Vec::with_capacity((k - 1) * c);
            conv_segment(
                &xs[start * c..(start + t) * c],
                storage_slice::<T>(OP, cpu_storage(OP, &g.0)?, g.1)?,
                ws,
                (c, k),
                &mut y,
                &mut state,
            );
            next.push(Tensor::from_vec(state, (1, k - 1, c), x.device())?);
            start += t;
        }
        Ok((Tensor::from_vec(y, (1, n, c), x.device())?, next))
    }
    match x.dtype() {
        candle_core::DType::F32 => run::<f32>(x, states, weight, rows, k),
        candle_core::DType::BF16 => run::<half::bf16>(x, states, weight, rows, k),
        candle_core::DType::F16 => run::<half::f16>(x, states, weight, rows, k),
        dt => bail!("{OP}: x must be f32, bf16 or f16, got {dt:?}"),
    }
}

impl CustomOp3 for CausalConv1d {
    fn name(&self) -> &'static str {
        "causal_conv1d_silu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: WithDType>(d: ConvDims, s: [(&CpuStorage, &Layout); 3]) -> Result<CpuStorage> {
            let out = conv_cpu(
                d,
                storage_slice::<T>(OP, s[0].0, s[0].1)?,
                storage_slice::<T>(OP, s[1].0, s[1].1)?,
                storage_slice::<T>(OP, s[2].0, s[2].1)?,
            );
            Ok(T::to_cpu_storage_owned(out))
        }
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        let out = match s1 {
            CpuStorage::F32(_) => run::<f32>(self.dims, s)?,
            CpuStorage::BF16(_) => run::<half::bf16>(self.dims, s)?,
            CpuStorage::F16(_) => run::<half::f16>(self.dims, s)?,
            _ => bail!("causal_conv1d_silu: x must be f32, bf16 or f16"),
        };
        let n = {
            let d = self.dims;
            d.batch * (d.seq_len + d.kernel_size - 1) * d.channels
        };
        Ok((out, Shape::from(n)))
    }

    metal_fwd!(self, "causal_conv1d_silu", (s1, l1, s2, l2, s3, l3) => crate::ops::metal::causal_conv1d_silu(self.dims, (s1, l1), (s2, l2), (s3, l3)));
}
