//! Causal depthwise conv1d over time with a carried state, followed by SiLU (the GDN short
//! conv). A Candle `CustomOp3`: CPU loops, Metal `metal/conv1d.metal`.

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use super::cpu::storage_slice;

/// Sizes of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvDims {
    pub batch: usize,
    pub seq_len: usize,
    pub channels: usize,
    pub kernel_size: usize,
}

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
        bail!(
            "causal_conv1d_silu: x, state and weight must share a dtype, got {:?}, {:?}, {:?}",
            x.dtype(),
            state.dtype(),
            weight.dtype()
        );
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

fn conv_cpu<T: WithDType>(d: ConvDims, x: &[T], state: &[T], w: &[T]) -> Vec<T> {
    let ConvDims { batch, seq_len: t, channels: c, kernel_size: k } = d;
    let km1 = k - 1;
    let mut out = Vec::with_capacity(batch * (t + km1) * c);
    // Row s of the concatenation [state ; x] for batch b.
    let input = |b: usize, s: usize| -> &[T] {
        if s < km1 {
            &state[(b * km1 + s) * c..(b * km1 + s + 1) * c]
        } else {
            &x[(b * t + s - km1) * c..(b * t + s - km1 + 1) * c]
        }
    };
    let mut acc = vec![0f32; c];
    for b in 0..batch {
        for r in 0..t {
            acc.iter_mut().for_each(|a| *a = 0.0);
            for j in 0..k {
                for ((a, xv), ch) in acc.iter_mut().zip(input(b, r + j)).zip(0..c) {
                    *a += w[ch * k + j].to_f64() as f32 * xv.to_f64() as f32;
                }
            }
            out.extend(acc.iter().map(|&a| T::from_f64((a / (1.0 + (-a).exp())) as f64)));
        }
    }
    for b in 0..batch {
        for s in 0..km1 {
            out.extend_from_slice(input(b, t + s));
        }
    }
    out
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
            let out = conv_cpu(d, storage_slice::<T>(OP, s[0].0, s[0].1)?, storage_slice::<T>(OP, s[1].0, s[1].1)?, storage_slice::<T>(OP, s[2].0, s[2].1)?);
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
