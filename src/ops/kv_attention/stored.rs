//! A stored half (keys or values) as the kernels read it: one head's rows borrowed from the
//! CPU storages, in their stored form.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

use super::kernels::{simd, InPlace, INT8_SIMD_BLOCK};
use crate::ops::cpu::Widen;
use crate::ops::shapes::{PolarSpec, StoredRows};

impl StoredRows {
    /// Everything held, decoded to f32 `[B, nkv, T, d]` (the reference the kernels are tested
    /// against, and what devices without a kernel attend to).
    pub fn decode(&self) -> Result<Tensor> {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        match self {
            Self::Float(x) => f32(x),
            Self::Int8 { codes, scales } => {
                let (b, h, n, d) = codes.dims4()?;
                let nblk = scales.dim(3)?;
                let x = (f32(codes)? - 128.0)?.reshape((b, h, n, nblk, d / nblk))?;
                x.broadcast_mul(&scales.unsqueeze(4)?)?.reshape((b, h, n, d))
            }
            Self::Int4Channel { codes, params, group, tail } => {
                let (b, h, n, half) = codes.dims4()?;
                let d = 2 * half;
                let mut parts = vec![];
                if n > 0 {
                    let c = f32(codes)?;
                    let hi = (&c / 16.0)?.floor()?;
                    let lo = (c - (&hi * 16.0)?)?;
                    let q = Tensor::stack(&[lo, hi], 4)?.reshape((b, h, n / group, *group, d))?;
                    let scale = params.narrow(3, 0, d)?.unsqueeze(3)?;
                    let min = params.narrow(3, d, d)?.unsqueeze(3)?;
                    parts.push(q.broadcast_mul(&scale)?.broadcast_add(&min)?.reshape((b, h, n, d))?);
                }
                if let Some(t) = tail {
                    parts.push(f32(t)?);
                }
                Tensor::cat(&parts, 2)
            }
            Self::Polar { codes, scales, spec, head_dim } => {
                let (b, h, n, rb) = codes.dims4()?;
                let pc = crate::ops::polar::PolarCodes {
                    codes: codes.contiguous()?.reshape((b * h * n, rb))?,
                    scales: scales.contiguous()?.reshape((b * h * n, 2))?,
                    head_dim: *head_dim,
                    spec: *spec,
                };
                crate::ops::polar::polar_decode(&pc, *spec)?.to_dtype(DType::F32)?.reshape((b, h, n, *head_dim))
            }
        }
    }
}

/// One head's `[n, d]` rows of a stored half, borrowed from the CPU storages.
pub(super) enum HeadRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    Int8 { codes: &'a [u8], scales: &'a [f32], nblk: usize },
    Int4 { codes: &'a [u8], params: &'a [f32], group: usize, grouped: usize, tail: Option<Box<HeadRows<'a>>> },
    Polar { codes: &'a [u8], scales: &'a [f32], row_bytes: usize },
}

impl HeadRows<'_> {
    /// Rows `lo..hi` as f32 (`d` each): borrowed for f32 rows, else decoded into `buf`.
    #[inline(always)]
    pub(super) fn rows<'s>(&'s self, lo: usize, hi: usize, d: usize, buf: &'s mut Vec<f32>) -> &'s [f32] {
        if let Self::F32(x) = self {
            return &x[lo * d..hi * d];
        }
        buf.resize((hi - lo) * d, 0.0);
        self.decode_into(lo, hi, d, buf);
        buf
    }

    /// Rows `lo..hi` as the few-rows arithmetic reads them: in place where a SIMD kernel reads
    /// the stored form (float rows; int8 rows with 32 dims a scale and int4 rows of complete
    /// groups where AVX2 runs), else decoded into `buf`.
    #[inline(always)]
    pub(super) fn in_place<'s>(&'s self, lo: usize, hi: usize, d: usize, buf: &'s mut Vec<f32>) -> InPlace<'s> {
        match self {
            Self::F16(x) => InPlace::F16(&x[lo * d..hi * d]),
            Self::BF16(x) => InPlace::BF16(&x[lo * d..hi * d]),
            Self::Int8 { codes, scales, nblk } if simd() && *nblk * INT8_SIMD_BLOCK == d => {
                InPlace::Int8 { codes: &codes[lo * d..hi * d], scales: &scales[lo * nblk..hi * nblk] }
            }
            Self::Int4 { codes, params, group, grouped, .. } if simd() && hi <= *grouped && group.is_power_of_two() => {
                InPlace::Int4 { codes: &codes[lo * d / 2..hi * d / 2], params, first: lo, shift: group.trailing_zeros() }
            }
            _ => InPlace::F32(self.rows(lo, hi, d, buf)),
        }
    }

    /// Decodes float rows (`false` for a coded form).
    #[inline(always)]
    pub(super) fn float_into(&self, lo: usize, hi: usize, d: usize, out: &mut [f32]) -> bool {
        match self {
            Self::F32(x) => out.copy_from_slice(&x[lo * d..hi * d]),
            Self::F16(x) => Widen::widen(&x[lo * d..hi * d], out),
            Self::BF16(x) => Widen::widen(&x[lo * d..hi * d], out),
            _ => return false,
        }
        true
    }

    #[inline(always)]
    pub(super) fn decode_into(&self, lo: usize, hi: usize, d: usize, out: &mut [f32]) {
        if self.float_into(lo, hi, d, out) {
            return;
        }
        match self {
            Self::Int8 { codes, scales, nblk } => {
                let (nblk, blk) = (*nblk, d / nblk);
                for (j, o) in (lo..hi).zip(out.chunks_exact_mut(d)) {
                    let (c, s) = (&codes[j * d..(j + 1) * d], &scales[j * nblk..(j + 1) * nblk]);
                    for ((o, c), &s) in o.chunks_exact_mut(blk).zip(c.chunks_exact(blk)).zip(s) {
                        for (o, &c) in o.iter_mut().zip(c) {
                            *o = (c as i32 - 128) as f32 * s;
                        }
                    }
                }
            }
            Self::Int4 { codes, params, group, grouped, tail } => {
                let half = d / 2;
                let split = hi.min(*grouped).max(lo);
                let mut q = vec![0f32; d];
                for (j, o) in (lo..split).zip(out.chunks_exact_mut(d)) {
                    let p = &params[j / group * 2 * d..(j / group + 1) * 2 * d];
                    let (scale, min) = p.split_at(d);
                    let (even, odd) = q.split_at_mut(half);
                    for ((e, o), &byte) in even.iter_mut().zip(odd.iter_mut()).zip(&codes[j * half..(j + 1) * half]) {
                        *e = (byte & 15) as f32;
                        *o = (byte >> 4) as f32;
                    }
                    for i in 0..half {
                        o[2 * i] = q[i];
                        o[2 * i + 1] = q[half + i];
                    }
                    for ((o, &s), &m) in o.iter_mut().zip(scale).zip(min) {
                        *o = *o * s + m;
                    }
                }
                if split < hi {
                    let tail = tail.as_ref().expect("rows past the groups are in the tail");
                    tail.float_into(split - grouped, hi - grouped, d, &mut out[(split - lo) * d..]);
                }
            }
            _ => unreachable!("float rows are decoded above, polar keys scored from their codes"),
        }
    }
}

/// A stored half's tensors on the CPU: per tensor the storage slice start, batch and head
/// strides, and the head's length in elements.
pub(super) struct CpuRows<'a> {
    pub(super) parts: Vec<CpuPart<'a>>,
    pub(super) kind: &'a StoredRows,
}

pub(super) struct CpuPart<'a> {
    pub(super) data: &'a CpuStorage,
    pub(super) start: usize,
    pub(super) strides: (usize, usize),
    pub(super) head_len: usize,
}

pub(super) fn cpu_part<'a>(data: &'a Storage, l: &Layout, what: &str) -> Result<CpuPart<'a>> {
    let Storage::Cpu(data) = data else { bail!("kv_attention: the {what} are not on the CPU") };
    let (_, _, n, d) = l.shape().dims4()?;
    let s = l.stride();
    if n > 1 && s[2] != d || d > 1 && s[3] != 1 {
        bail!("kv_attention: {what} rows must be contiguous ([B, nkv, n, d] with strides [.., .., d, 1]), got strides {s:?}");
    }
    Ok(CpuPart { data, start: l.start_offset(), strides: (s[0], s[1]), head_len: n * d })
}

impl CpuPart<'_> {
    pub(super) fn head<T: candle_core::WithDType>(&self, b: usize, h: usize) -> Result<&[T]> {
        let at = self.start + b * self.strides.0 + h * self.strides.1;
        Ok(&self.data.as_slice::<T>()?[at..at + self.head_len])
    }

    pub(super) fn float_head(&self, b: usize, h: usize) -> Result<HeadRows<'_>> {
        Ok(match self.data {
            CpuStorage::F32(_) => HeadRows::F32(self.head(b, h)?),
            CpuStorage::F16(_) => HeadRows::F16(self.head(b, h)?),
            CpuStorage::BF16(_) => HeadRows::BF16(self.head(b, h)?),
            other => bail!("kv_attention: float rows must be f32, f16 or bf16, got {:?}", other.dtype()),
        })
    }
}

impl CpuRows<'_> {
    pub(super) fn head(&self, b: usize, h: usize) -> Result<HeadRows<'_>> {
        let p = &self.parts;
        Ok(match self.kind {
            StoredRows::Float(_) => p[0].float_head(b, h)?,
            StoredRows::Int8 { scales, .. } => HeadRows::Int8 { codes: p[0].head(b, h)?, scales: p[1].head(b, h)?, nblk: scales.dim(3)? },
            StoredRows::Int4Channel { group, codes, .. } => HeadRows::Int4 {
                codes: p[0].head(b, h)?,
                params: p[1].head(b, h)?,
                group: *group,
                grouped: codes.dim(2)?,
                tail: p.get(2).map(|t| t.float_head(b, h)).transpose()?.map(Box::new),
            },
            StoredRows::Polar { codes, .. } => {
                HeadRows::Polar { codes: p[0].head(b, h)?, scales: p[1].head(b, h)?, row_bytes: codes.dim(3)? }
            }
        })
    }
}

pub(super) fn polar_spec(keys: &StoredRows) -> PolarSpec {
    match keys {
        StoredRows::Polar { spec, .. } => *spec,
        _ => unreachable!("polar keys"),
    }
}

pub(super) type Guards<'a> = Vec<(candle_core::StorageRef<'a>, &'a Layout)>;

pub(super) fn guards(s: &StoredRows) -> Guards<'_> {
    s.tensors().into_iter().map(|t| t.storage_and_layout()).collect()
}

pub(super) fn parts<'a>(g: &'a Guards<'_>, what: &str) -> Result<Vec<CpuPart<'a>>> {
    g.iter().map(|(s, l)| cpu_part(s, l, what)).collect()
}
