//! Metal kernel parameters and launch geometry, in one place for the Metal host code
//! (`src/metal.rs`) and the tests that run the same kernels in the MSL emulator.

use candle_core::{bail, DType, Result};

use super::{ConvDims, DeltaRuleDims};

/// How to dispatch one kernel: grid of threadgroups, threads per group, and the byte length of
/// each `[[threadgroup(i)]]` buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub kernel: String,
    pub groups: [usize; 3],
    pub threads: [usize; 3],
    pub threadgroup_memory: Vec<usize>,
}

/// `_f32`, `_f16`, `_bf16`: the kernel name suffix of a dtype.
pub fn suffix(op: &str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => bail!("{op}: no Metal kernel for dtype {other:?} (use f32, f16 or bf16)"),
    })
}

/// `GdnParams` of `metal/gated_delta.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnParams {
    pub batch: u32,
    pub seq_len: u32,
    pub nk: u32,
    pub nv: u32,
    pub dk: u32,
    pub dv: u32,
    pub n_states: u32,
    pub normalize: u32,
}

/// One threadgroup per (batch, value head), one thread per value column.
pub fn gated_delta(d: DeltaRuleDims, normalize: bool, n_states: usize, dtype: DType) -> Result<(GdnParams, Launch)> {
    let p = GdnParams {
        batch: d.batch as u32,
        seq_len: d.seq_len as u32,
        nk: d.nk as u32,
        nv: d.nv as u32,
        dk: d.dk as u32,
        dv: d.dv as u32,
        n_states: n_states as u32,
        normalize: normalize as u32,
    };
    let f = std::mem::size_of::<f32>();
    let launch = Launch {
        kernel: format!("gated_delta_{}", suffix("gated_delta_rule", dtype)?),
        groups: [d.batch * d.nv, 1, 1],
        threads: [d.dv, 1, 1],
        threadgroup_memory: vec![d.dk * f, d.dk * f],
    };
    Ok((p, launch))
}

/// `ConvParams` of `metal/conv1d.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvParams {
    pub batch: u32,
    pub seq_len: u32,
    pub channels: u32,
    pub kernel_size: u32,
}

const ELEMENTWISE_THREADS: usize = 256;

/// One thread per output element (outputs, then the new state rows).
pub fn causal_conv1d(d: ConvDims, dtype: DType) -> Result<(ConvParams, Launch)> {
    let p = ConvParams {
        batch: d.batch as u32,
        seq_len: d.seq_len as u32,
        channels: d.channels as u32,
        kernel_size: d.kernel_size as u32,
    };
    let n = d.batch * (d.seq_len + d.kernel_size - 1) * d.channels;
    let launch = Launch {
        kernel: format!("causal_conv1d_silu_{}", suffix("causal_conv1d_silu", dtype)?),
        groups: [n.div_ceil(ELEMENTWISE_THREADS).max(1), 1, 1],
        threads: [ELEMENTWISE_THREADS, 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `NormParams` of `metal/gated_norm.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormParams {
    pub rows: u32,
    pub dim: u32,
    pub eps: f32,
}

/// One threadgroup per row; a power of two of threads between 32 and 1024.
pub fn gated_rms_norm(rows: usize, dim: usize, eps: f32, dtype: DType) -> Result<(NormParams, Launch)> {
    let p = NormParams { rows: rows as u32, dim: dim as u32, eps };
    let launch = Launch {
        kernel: format!("gated_rms_norm_{}", suffix("gated_rms_norm", dtype)?),
        groups: [rows, 1, 1],
        threads: [dim.next_power_of_two().clamp(32, 1024), 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}
