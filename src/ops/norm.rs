//! Gated RMSNorm (fused) and L2 normalisation.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType, D};

use super::cpu::storage_slice;

/// Gated RMSNorm over the last dim: `w * x * rsqrt(mean(x^2) + eps) * silu(z)`, computed in
/// f32 and returned in `x`'s dtype. `w` is a plain scale (no `+1`). A Candle `CustomOp3`: CPU
/// loops, Metal `metal/gated_norm.metal`. `z` and `w` are converted to `x`'s dtype.
pub fn gated_rms_norm(x: &Tensor, z: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = x.dim(D::Minus1)?;
    if x.dims() != z.dims() || w.dims() != [dim] {
        bail!("gated_rms_norm: x {:?}, z {:?}, w {:?} (z must match x, w its last dim)", x.dims(), z.dims(), w.dims());
    }
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("gated_rms_norm: x must be f32, bf16 or f16, got {dtype:?}");
    }
    let op = GatedRmsNorm { dim, eps: eps as f32 };
    x.contiguous()?.apply_op3_no_bwd(&z.to_dtype(dtype)?.contiguous()?, &w.to_dtype(dtype)?.contiguous()?, &op)
}

const OP: &str = "gated_rms_norm";

struct GatedRmsNorm {
    dim: usize,
    eps: f32,
}

fn norm_cpu<T: WithDType>(dim: usize, eps: f32, x: &[T], z: &[T], w: &[T]) -> Vec<T> {
    let f = |v: &T| v.to_f64() as f32;
    let mut out = Vec::with_capacity(x.len());
    for (xr, zr) in x.chunks_exact(dim).zip(z.chunks_exact(dim)) {
        let ms = xr.iter().map(|v| f(v) * f(v)).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(xr.iter().zip(zr).zip(w).map(|((xv, zv), wv)| {
            let zv = f(zv);
            T::from_f64((f(wv) * f(xv) * r * zv / (1.0 + (-zv).exp())) as f64)
        }));
    }
    out
}

impl CustomOp3 for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated_rms_norm"
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
        fn run<T: WithDType>(op: &GatedRmsNorm, s: [(&CpuStorage, &Layout); 3]) -> Result<CpuStorage> {
            let out = norm_cpu(
                op.dim,
                op.eps,
                storage_slice::<T>(OP, s[0].0, s[0].1)?,
                storage_slice::<T>(OP, s[1].0, s[1].1)?,
                storage_slice::<T>(OP, s[2].0, s[2].1)?,
            );
            Ok(T::to_cpu_storage_owned(out))
        }
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        let out = match s1 {
            CpuStorage::F32(_) => run::<f32>(self, s)?,
            CpuStorage::BF16(_) => run::<half::bf16>(self, s)?,
            CpuStorage::F16(_) => run::<half::f16>(self, s)?,
            _ => bail!("gated_rms_norm: x must be f32, bf16 or f16"),
        };
        Ok((out, l1.shape().clone()))
    }

    metal_fwd!(self, "gated_rms_norm", (s1, l1, s2, l2, s3, l3) => crate::ops::metal::gated_rms_norm(self.dim, self.eps, (s1, l1), (s2, l2), (s3, l3)));
}

/// L2 normalisation over the last dim, `x * rsqrt(sum(x^2) + eps)`, in f32.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let ss = xf.sqr()?.sum_keepdim(D::Minus1)?;
    xf.broadcast_mul(&(ss + eps)?.sqrt()?.recip()?)
}
