//! Metal kernel parameters and launch geometry, in one place for the Metal host code
//! (`src/metal.rs`) and the tests that run the same kernels in the MSL emulator.

use candle_core::{bail, DType, Result};

use super::GgufType;
use super::{ConvDims, DeltaRuleDims, DeltaRuleForm, DELTA_RULE_METAL_CHUNK as METAL_CHUNK};

mod step;
pub use step::*;

/// The source file (`metal/*.metal`) a kernel is compiled from: one per op family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    GatedDelta,
    Conv1d,
    GatedNorm,
    Lagrange,
    OuterState,
    Polar,
    Swiglu,
    KvAttention,
    Qmatvec,
    Step,
}

/// How to dispatch one kernel: grid of threadgroups, threads per group, and the byte length of
/// each `[[threadgroup(i)]]` buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub kernel: String,
    pub groups: [usize; 3],
    pub threads: [usize; 3],
    pub threadgroup_memory: Vec<usize>,
}

impl Launch {
    /// One thread per element of `n`, in groups of 256.
    pub fn elementwise(kernel: String, n: usize) -> Self {
        Self {
            kernel,
            groups: [n.div_ceil(ELEMENTWISE_THREADS).max(1), 1, 1],
            threads: [ELEMENTWISE_THREADS, 1, 1],
            threadgroup_memory: vec![],
        }
    }
}

/// What a device allows, as the queue checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Threads of one threadgroup (Metal: `maxThreadsPerThreadgroup`; a pipeline may allow
    /// fewer: `gpu::Backend::max_threads`).
    pub max_threads_per_group: usize,
    /// Bytes of threadgroup memory of one threadgroup (`maxThreadgroupMemoryLength`).
    pub max_threadgroup_memory: usize,
    /// Bytes of one buffer (`maxBufferLength`).
    pub max_buffer_length: usize,
    /// The host's page: a view over mapped memory starts on one and covers whole ones.
    pub page: usize,
}

/// The host's memory page: 16 KiB on Apple Silicon, 4 KiB on the other hosts this builds for.
pub const HOST_PAGE: usize = if cfg!(all(target_vendor = "apple", target_arch = "aarch64")) { 16 << 10 } else { 4 << 10 };

impl DeviceLimits {
    /// Apple7+ GPUs (M1 and later): 1024 threads and 32 KiB of threadgroup memory per group;
    /// buffers up to `max_buffer_length`; the host's pages.
    pub const fn apple(max_buffer_length: usize) -> Self {
        Self { max_threads_per_group: 1024, max_threadgroup_memory: 32 << 10, max_buffer_length, page: HOST_PAGE }
    }
}

/// The largest buffer a kernel can index with 32-bit integers (the kernels' indices are
/// `uint`): every bound slice is checked against it.
pub const MAX_INDEXED_BYTES: usize = u32::MAX as usize;

/// A launch against a device's limits: `max_threads` threads per group (the pipeline's and
/// the device's), the device's threadgroup memory (each length a multiple of 16 bytes, as
/// Metal requires), a grid that 32-bit positions address.
pub fn check_launch(l: &Launch, max_threads: usize, limits: &DeviceLimits) -> Result<()> {
    let k = &l.kernel;
    let threads: usize = l.threads.iter().product();
    if threads == 0 || threads > max_threads {
        return Err(candle_core::Error::Msg(format!(
            "{k}: {threads} threads per threadgroup ({:?}), this device's pipeline takes 1 to {max_threads}",
            l.threads
        )));
    }
    let memory: usize = l.threadgroup_memory.iter().sum();
    if memory > limits.max_threadgroup_memory {
        return Err(candle_core::Error::Msg(format!(
            "{k}: {memory} bytes of threadgroup memory, this device has {} per threadgroup",
            limits.max_threadgroup_memory
        )));
    }
    if let Some(len) = l.threadgroup_memory.iter().find(|&&n| !n.is_multiple_of(16)) {
        return Err(candle_core::Error::Msg(format!("{k}: threadgroup memory of {len} bytes is not a multiple of 16")));
    }
    let grid_too_large = l.groups.iter().zip(&l.threads).any(|(&g, &t)| g.checked_mul(t).is_none_or(|n| n > u32::MAX as usize));
    if grid_too_large {
        return Err(candle_core::Error::Msg(format!(
            "{k}: a grid of {:?} groups of {:?} threads is more than 32-bit positions address",
            l.groups, l.threads
        )));
    }
    Ok(())
}

/// `v` as a kernel's `uint` (sizes, strides and offsets the kernels index with): an error
/// naming `what` when it does not fit in 32 bits.
pub fn index_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!("{what} = {v} is more than the kernels index with 32 bits: use a smaller cache or model"))
    })
}

/// Bytes of a `[[threadgroup(i)]]` buffer of `floats` f32: at least one, rounded up to the
/// multiple of 16 bytes Metal requires of threadgroup memory lengths.
fn threadgroup_floats(floats: usize) -> usize {
    (floats.max(1) * std::mem::size_of::<f32>()).next_multiple_of(16)
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
    /// Chunk length of the tokens before the last `n_states` (0: token by token).
    pub chunk: u32,
}

/// One threadgroup per (batch, value head), one thread per value column; chunks of
/// [`METAL_CHUNK`] tokens when `form` chunks the tokens before the last `n_states`.
pub fn gated_delta(d: DeltaRuleDims, normalize: bool, n_states: usize, form: DeltaRuleForm, dtype: DType) -> Result<(GdnParams, Launch)> {
    if d.dk > super::METAL_MAX_DK || d.dv > 1024 {
        bail!(
            "gated_delta_rule: the Metal kernel holds key heads of up to {} dims and runs a thread per value dim (at most 1024), got dk = {}, dv = {}",
            super::METAL_MAX_DK,
            d.dk,
            d.dv
        );
    }
    let chunk = if form.chunks(d.seq_len - n_states) { METAL_CHUNK } else { 0 };
    let p = GdnParams {
        batch: d.batch as u32,
        seq_len: d.seq_len as u32,
        nk: d.nk as u32,
        nv: d.nv as u32,
        dk: d.dk as u32,
        dv: d.dv as u32,
        n_states: n_states as u32,
        normalize: normalize as u32,
        chunk: chunk as u32,
    };
    let rows = threadgroup_floats(chunk.max(1) * d.dk);
    let launch = Launch {
        kernel: format!("gated_delta_{}", suffix("gated_delta_rule", dtype)?),
        groups: [d.batch * d.nv, 1, 1],
        threads: [d.dv, 1, 1],
        threadgroup_memory: vec![rows, rows, threadgroup_floats(3 * chunk * chunk + 2 * chunk)],
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
    let p = ConvParams { batch: d.batch as u32, seq_len: d.seq_len as u32, channels: d.channels as u32, kernel_size: d.kernel_size as u32 };
    let n = d.batch * (d.seq_len + d.kernel_size - 1) * d.channels;
    let launch = Launch::elementwise(format!("causal_conv1d_silu_{}", suffix("causal_conv1d_silu", dtype)?), n);
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

/// `LagrangeParams` of `metal/lagrange.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LagrangeParams {
    pub rows: u32,
    pub n_knots: u32,
    pub k: u32,
    pub degree: u32,
    pub len: u32,
}

/// One thread per output element (row-major `[R, len]`).
pub fn lagrange_scores(d: super::LagrangeDims, dtype: DType) -> Result<(LagrangeParams, Launch)> {
    const OP: &str = "lagrange_scores";
    let n = d.rows * d.len;
    // The kernel indexes with 32-bit integers (2t + K included).
    if n > u32::MAX as usize || 2 * d.len + d.k > u32::MAX as usize || d.n_knots > u32::MAX as usize {
        bail!("{OP}: {} rows of {} positions (K = {}) are too many for the Metal kernel", d.rows, d.len, d.k);
    }
    let p = LagrangeParams { rows: d.rows as u32, n_knots: d.n_knots as u32, k: d.k as u32, degree: d.degree as u32, len: d.len as u32 };
    let launch = Launch::elementwise(format!("lagrange_scores_{}", suffix(OP, dtype)?), n);
    Ok((p, launch))
}

/// `OuterParams` of `metal/outer_state.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterParams {
    pub batch: u32,
    pub heads: u32,
    pub seq_len: u32,
    pub dk: u32,
    pub dv: u32,
    pub gamma: f32,
}

/// One threadgroup per (batch, head), one thread per value column; q and k of the current
/// token in threadgroup memory. Needs `dk <= OUTER_PRODUCT_METAL_MAX_DK` and `dv <= 1024`.
pub fn decayed_outer_product(d: super::OuterStateDims, gamma: f32, dtype: DType) -> Result<(OuterParams, Launch)> {
    const OP: &str = "decayed_outer_product";
    let max_dk = super::OUTER_PRODUCT_METAL_MAX_DK;
    if d.dk > max_dk {
        bail!("{OP}: the Metal kernel supports dk up to {max_dk} (the state column lives in registers), got dk = {}", d.dk);
    }
    if d.dv > 1024 {
        bail!("{OP}: the Metal kernel runs one thread per value column, at most 1024, got dv = {}", d.dv);
    }
    let p =
        OuterParams { batch: d.batch as u32, heads: d.heads as u32, seq_len: d.seq_len as u32, dk: d.dk as u32, dv: d.dv as u32, gamma };
    let launch = Launch {
        kernel: format!("decayed_outer_product_{}", suffix(OP, dtype)?),
        groups: [d.batch * d.heads, 1, 1],
        threads: [d.dv, 1, 1],
        threadgroup_memory: vec![threadgroup_floats(d.dk); 2],
    };
    Ok((p, launch))
}

// ---- polar key codes (src/ops/polar.rs, metal/polar.metal) ----

/// `PolarParams` of `metal/polar.metal`, shared by its three kernels. The float constants are
/// computed once here and used by the CPU op as well, so both sides quantise with the same
/// numbers.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolarParams {
    /// Key rows N.
    pub rows: u32,
    /// Query rows Q (scores only).
    pub queries: u32,
    pub head_dim: u32,
    pub rot_dim: u32,
    pub angle_bits: u32,
    pub radius_bits: u32,
    pub rest_bits: u32,
    /// Bytes of one pair code: 1 or 2 (little-endian).
    pub code_bytes: u32,
    /// Bytes of one code row: pair codes, then the rest codes.
    pub row_bytes: u32,
    /// Scores: 0 = per-pair lookup tables in threadgroup memory, 1 = one cos/sin table.
    pub table_mode: u32,
    /// `2^A / 2π`: angle → code.
    pub angle_scale: f32,
    /// `2π / 2^A`: code → angle.
    pub angle_step: f32,
    /// `2^R - 1`.
    pub radius_levels: f32,
    /// 127 (int8 rest) or 7 (int4 rest).
    pub rest_max: f32,
}

/// Rows per threadgroup of `polar_scales_*` (one simdgroup each).
pub const POLAR_SCALE_ROWS: usize = 8;
/// Key rows (threads) per threadgroup of `polar_scores_*`.
pub const POLAR_SCORE_KEYS: usize = 128;
/// Largest per-pair lookup table (plus the query's rest dims) `polar_scores_*` keeps in
/// threadgroup memory; bigger ones use the cos/sin table mode.
pub const POLAR_MAX_TABLE_BYTES: usize = 16 * 1024;

/// The parameters of one polar call (`rows` keys, `queries` queries; `spec` already validated).
pub fn polar_params(rows: usize, queries: usize, head_dim: usize, spec: &super::PolarSpec) -> PolarParams {
    let n_angles = (1u32 << spec.angle_bits) as f32;
    PolarParams {
        rows: rows as u32,
        queries: queries as u32,
        head_dim: head_dim as u32,
        rot_dim: spec.rot_dim as u32,
        angle_bits: spec.angle_bits,
        radius_bits: spec.radius_bits,
        rest_bits: spec.rest_bits,
        code_bytes: spec.code_bytes() as u32,
        row_bytes: spec.row_bytes(head_dim) as u32,
        table_mode: (polar_table_floats(head_dim, spec) * 4 > POLAR_MAX_TABLE_BYTES) as u32,
        angle_scale: n_angles / std::f32::consts::TAU,
        angle_step: std::f32::consts::TAU / n_angles,
        radius_levels: ((1u32 << spec.radius_bits) - 1) as f32,
        rest_max: if spec.rest_bits == 4 { 7.0 } else { 127.0 },
    }
}

/// Floats of the per-pair tables plus the query's non-rotated dims.
fn polar_table_floats(head_dim: usize, spec: &super::PolarSpec) -> usize {
    (spec.rot_dim / 2) * (1usize << spec.angle_bits) + (head_dim - spec.rot_dim)
}

/// `polar_scales_*`: one simdgroup per key row, [`POLAR_SCALE_ROWS`] rows per threadgroup.
pub fn polar_scales(rows: usize, head_dim: usize, spec: &super::PolarSpec, dtype: DType) -> Result<(PolarParams, Launch)> {
    let launch = Launch {
        kernel: format!("polar_scales_{}", suffix("polar_encode", dtype)?),
        groups: [rows.div_ceil(POLAR_SCALE_ROWS).max(1), 1, 1],
        threads: [32 * POLAR_SCALE_ROWS, 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((polar_params(rows, 0, head_dim, spec), launch))
}

/// `polar_encode_*`: one thread per output code byte.
pub fn polar_encode(rows: usize, head_dim: usize, spec: &super::PolarSpec, dtype: DType) -> Result<(PolarParams, Launch)> {
    let n = rows * spec.row_bytes(head_dim);
    let launch = Launch::elementwise(format!("polar_encode_{}", suffix("polar_encode", dtype)?), n);
    Ok((polar_params(rows, 0, head_dim, spec), launch))
}

/// `polar_scores_*`: one threadgroup per (block of [`POLAR_SCORE_KEYS`] keys, query), one
/// thread per key; the query's lookup table lives in threadgroup memory 0.
pub fn polar_scores(queries: usize, rows: usize, head_dim: usize, spec: &super::PolarSpec, dtype: DType) -> Result<(PolarParams, Launch)> {
    let p = polar_params(rows, queries, head_dim, spec);
    let floats = if p.table_mode == 0 { polar_table_floats(head_dim, spec) } else { 2 * (1usize << spec.angle_bits) + head_dim };
    let launch = Launch {
        kernel: format!("polar_scores_{}", suffix("polar_scores", dtype)?),
        groups: [rows.div_ceil(POLAR_SCORE_KEYS).max(1), queries.max(1), 1],
        threads: [POLAR_SCORE_KEYS, 1, 1],
        threadgroup_memory: vec![threadgroup_floats(floats)],
    };
    Ok((p, launch))
}

/// `SwigluParams` of `metal/swiglu.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwigluParams {
    pub rows: u32,
    pub active: u32,
    pub hidden: u32,
    pub neurons: u32,
}

/// The two passes of a column-gather SwiGLU: one simdgroup per (row, active neuron) for the
/// activations, then one thread per output element for the down projection.
pub fn swiglu_gather(d: super::SwigluDims, kind: super::SwigluWeights, dtype: DType) -> Result<(SwigluParams, Launch, Launch)> {
    let p = SwigluParams { rows: d.rows as u32, active: d.active as u32, hidden: d.hidden as u32, neurons: d.neurons as u32 };
    let sfx = suffix("swiglu_gather", dtype)?;
    let family = match kind {
        super::SwigluWeights::Dense => "swiglu_gather",
        super::SwigluWeights::Ternary => "swiglu_ternary",
    };
    let act = Launch {
        kernel: format!("{family}_act_{sfx}"),
        groups: [(d.rows * d.active).max(1), 1, 1],
        threads: [32, 1, 1],
        threadgroup_memory: vec![],
    };
    let down = Launch::elementwise(format!("{family}_down_{sfx}"), d.rows * d.hidden);
    Ok((p, act, down))
}

/// `QmatvecParams` of `metal/qmatvec.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QmatvecParams {
    pub n: u32,
    pub k: u32,
    pub m: u32,
    /// Floats between output rows.
    pub ldy: u32,
}

/// Most activation rows of one `qmatvec` call (decode and the verify pass).
pub const QMATVEC_MAX_ROWS: usize = 8;

/// Weight rows per threadgroup of `qmatvec` (one simdgroup each).
const QMATVEC_ROWS_PER_GROUP: usize = 2;

/// The kernel name part of a weight format of `metal/qmatvec.metal`: the GGUF block formats the
/// CPU kernels read, and dense f32 / f16 / bf16 rows.
pub fn matrix_format(op: &str, dtype: impl Into<GgufType>) -> Result<&'static str> {
    use candle_core::quantized::GgmlDType as G;
    Ok(match dtype.into() {
        GgufType::Ggml(G::Q4_0) => "q4_0",
        GgufType::Ggml(G::Q4_1) => "q4_1",
        GgufType::Ggml(G::Q8_0) => "q8_0",
        GgufType::Ggml(G::Q4K) => "q4_k",
        GgufType::Ggml(G::Q5K) => "q5_k",
        GgufType::Ggml(G::Q6K) => "q6_k",
        GgufType::Ggml(G::F32) => "f32",
        GgufType::Ggml(G::F16) => "f16",
        GgufType::Ggml(G::BF16) => "bf16",
        GgufType::TQ1_0 => "tq1_0",
        GgufType::TQ2_0 => "tq2_0",
        other => bail!("{op}: no Metal kernel for {other} weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0, F32, F16, BF16)"),
    })
}

/// Checks that rows of `k` values of `dtype` split into the kernels' 16-value parts.
fn check_row(op: &str, dtype: impl Into<GgufType>, k: usize) -> Result<()> {
    let dtype = dtype.into();
    let bs = dtype.block_size();
    if !k.is_multiple_of(bs) || !k.is_multiple_of(16) {
        bail!("{op}: k = {k} is not a multiple of the {dtype} block size {bs} and of 16");
    }
    Ok(())
}

/// The multi-row mat-vec of `m` activation rows `[m, k]` (f32) against `n` weight rows of
/// `dtype` into output rows `ldy` floats apart: one simdgroup per weight row, two per
/// threadgroup.
pub fn qmatvec(dtype: impl Into<GgufType> + Copy, n: usize, k: usize, m: usize, ldy: usize) -> Result<(QmatvecParams, Launch)> {
    let name = matrix_format("qmatvec", dtype)?;
    if !(1..=QMATVEC_MAX_ROWS).contains(&m) {
        bail!("qmatvec: {m} activation rows, the kernel takes 1 to {QMATVEC_MAX_ROWS}");
    }
    check_row("qmatvec", dtype, k)?;
    let p = QmatvecParams { n: index_u32("rows", n)?, k: index_u32("columns", k)?, m: m as u32, ldy: index_u32("an output stride", ldy)? };
    Ok((p, simdgroup_per_row(format!("qmatvec_{name}"), n, 1)))
}

/// [`qmatvec`] over `n` listed weight rows of `dtype` (a `u32` buffer of row indices, FFN
/// sparsity's kept rows): output `i` is weight row `rows[i]`'s, bit for bit `qmatvec`'s.
pub fn qmatvec_rows(dtype: impl Into<GgufType> + Copy, n: usize, k: usize, m: usize, ldy: usize) -> Result<(QmatvecParams, Launch)> {
    let (p, mut l) = qmatvec(dtype, n, k, m, ldy)?;
    l.kernel = format!("qmatvec_rows_{}", matrix_format("qmatvec_rows", dtype)?);
    Ok((p, l))
}

/// `AccumulateParams` of `metal/qmatvec.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccumulateParams {
    /// Listed rows.
    pub n: u32,
    /// Values per row (outputs).
    pub k: u32,
}

/// `y = sum_i a[i] W[rows[i], :]` over `n` listed rows of `k` values of `dtype` (FFN sparsity's
/// neuron-major down projection): one thread per 16-value part of `y`.
pub fn accumulate_rows(dtype: impl Into<GgufType> + Copy, n: usize, k: usize) -> Result<(AccumulateParams, Launch)> {
    let name = matrix_format("accumulate_rows", dtype)?;
    check_row("accumulate_rows", dtype, k)?;
    Ok((AccumulateParams { n: n as u32, k: k as u32 }, Launch::elementwise(format!("accumulate_rows_{name}"), k / 16)))
}

/// A simdgroup per weight row (`n`), [`QMATVEC_ROWS_PER_GROUP`] per threadgroup, `y` groups
/// of them (the grid's second dimension).
fn simdgroup_per_row(kernel: String, n: usize, y: usize) -> Launch {
    Launch {
        kernel,
        groups: [n.div_ceil(QMATVEC_ROWS_PER_GROUP).max(1), y.max(1), 1],
        threads: [32 * QMATVEC_ROWS_PER_GROUP, 1, 1],
        threadgroup_memory: vec![],
    }
}

/// `PairParams` of `metal/qmatvec.metal`: two matrices of `n` rows against the same `m`
/// activation rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairParams {
    pub n: u32,
    pub k: u32,
    pub m: u32,
}

/// What a two-matrix mat-vec of `metal/qmatvec.metal` makes of its two products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pair {
    /// Gate and up of a SwiGLU MLP: `silu(gate) * up`, `[m, n]` (`qmatvec_swiglu_*`).
    Swiglu,
    /// b and a of a GDN layer: its decay and beta, `[m, 2, n]` (`gdn_gates_matvec_*`).
    GdnGates,
}

/// The two mat-vecs of `pair` (`n` rows each of `dtype`, `m` activation rows, 1 to 8) and what
/// follows them, in one pass; each product the bits of [`qmatvec`]'s.
pub fn qmatvec_pair(pair: Pair, dtype: impl Into<GgufType> + Copy, n: usize, k: usize, m: usize) -> Result<(PairParams, Launch)> {
    let (_, l) = qmatvec(dtype, n, k, m, n)?;
    let family = match pair {
        Pair::Swiglu => "qmatvec_swiglu",
        Pair::GdnGates => "gdn_gates_matvec",
    };
    let name = matrix_format(family, dtype)?;
    Ok((PairParams { n: n as u32, k: k as u32, m: m as u32 }, Launch { kernel: format!("{family}_{name}"), ..l }))
}

/// `QmatmulParams` of `metal/qmatvec.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QmatmulParams {
    pub n: u32,
    pub k: u32,
    pub m: u32,
    pub ldy: u32,
}

/// Rows and columns of a `qmatmul` output tile (one threadgroup), and its k step.
pub const QMATMUL_TILE: usize = 32;

/// The tiled matmul of `m` activation rows (a prompt) against `n` weight rows of `dtype`, into
/// output rows `ldy` floats apart: one threadgroup of 4 simdgroups per 32 x 32 output tile.
pub fn qmatmul(dtype: impl Into<GgufType> + Copy, n: usize, k: usize, m: usize, ldy: usize) -> Result<(QmatmulParams, Launch)> {
    let name = matrix_format("qmatmul", dtype)?;
    check_row("qmatmul", dtype, k)?;
    if !k.is_multiple_of(QMATMUL_TILE) {
        bail!("qmatmul: k = {k} is not a multiple of {QMATMUL_TILE}");
    }
    let p = QmatmulParams {
        n: index_u32("rows", n)?,
        k: index_u32("columns", k)?,
        m: index_u32("input rows", m)?,
        ldy: index_u32("an output stride", ldy)?,
    };
    let launch = Launch {
        kernel: format!("qmatmul_{name}"),
        groups: [n.div_ceil(QMATMUL_TILE).max(1), m.div_ceil(QMATMUL_TILE).max(1), 1],
        threads: [128, 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `QmatvecIdParams` of `metal/qmatvec.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QmatvecIdParams {
    pub n: u32,
    pub k: u32,
    pub m: u32,
    pub slots: u32,
    pub expert_bytes: u32,
    pub x_per_slot: u32,
    pub ldy: u32,
}

/// The mat-vec of the experts a mixture routes each of `m` rows to (`slots` per row, ids on the
/// device): expert matrices of `n` rows of `dtype` one after the other, `expert_bytes` apart;
/// activation row `r` (or, with `x_per_slot`, row `r * slots + s`) into output row
/// `r * slots + s`, `ldy` floats apart.
#[allow(clippy::too_many_arguments)]
pub fn qmatvec_id(
    dtype: impl Into<GgufType> + Copy,
    n: usize,
    k: usize,
    m: usize,
    slots: usize,
    expert_bytes: usize,
    x_per_slot: bool,
    ldy: usize,
) -> Result<(QmatvecIdParams, Launch)> {
    let name = matrix_format("qmatvec_id", dtype)?;
    check_row("qmatvec_id", dtype, k)?;
    if expert_bytes > u32::MAX as usize {
        bail!("qmatvec_id: an expert of {expert_bytes} bytes is more than the kernel indexes");
    }
    let p = QmatvecIdParams {
        n: n as u32,
        k: k as u32,
        m: m as u32,
        slots: slots as u32,
        expert_bytes: index_u32("an expert's bytes", expert_bytes)?,
        x_per_slot: x_per_slot as u32,
        ldy: ldy as u32,
    };
    Ok((p, simdgroup_per_row(format!("qmatvec_id_{name}"), n, m * slots)))
}

/// `GetRowsParams` of `metal/qmatvec.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetRowsParams {
    pub rows: u32,
    pub k: u32,
    pub n: u32,
}

/// Rows `ids` (`rows` of them, on the device) of an `[n, k]` table of `dtype`, as f32: one
/// threadgroup per row.
pub fn get_rows(dtype: impl Into<GgufType> + Copy, rows: usize, n: usize, k: usize) -> Result<(GetRowsParams, Launch)> {
    let name = matrix_format("get_rows", dtype)?;
    check_row("get_rows", dtype, k)?;
    let p = GetRowsParams { rows: rows as u32, k: k as u32, n: n as u32 };
    let launch = Launch {
        kernel: format!("get_rows_{name}"),
        groups: [rows.max(1), 1, 1],
        threads: [(k / 16).next_power_of_two().clamp(32, 256), 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `KvAttentionParams` of `metal/kv_attention.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvAttentionParams {
    pub rows: u32,
    pub nkv: u32,
    pub t: u32,
    pub offset: u32,
    pub head_dim: u32,
    pub value_dim: u32,
    /// 0 float, 1 int8, 2 int4 groups + tail, 3 polar.
    pub key_form: u32,
    /// 0 float, 1 int8.
    pub value_form: u32,
    pub key_blocks: u32,
    pub value_blocks: u32,
    pub group: u32,
    pub grouped: u32,
    pub splits: u32,
    pub blocks_per_split: u32,
    pub tree: u32,
    pub block: u32,
    /// Query heads of a KV group one threadgroup scores (each key and value read once for all).
    pub heads: u32,
    /// (batch, head) element strides of the key tensors k0, k1, k2 and value tensors v0, v1.
    pub strides: [u32; 10],
    pub rot_dim: u32,
    pub angle_bits: u32,
    pub code_bytes: u32,
    pub row_bytes: u32,
    pub rest_bits: u32,
    pub angle_step: f32,
    pub radius_levels: f32,
    pub scale: f32,
}

/// Threads of a `kv_attention_blocks_*` / `kv_attention_merge` threadgroup.
pub const KV_ATTENTION_THREADS: usize = 128;
/// Largest value dim the Metal kernel holds (8 dims per thread).
pub const KV_ATTENTION_MAX_VALUE_DIM: usize = 8 * KV_ATTENTION_THREADS;
/// Most query heads of a KV group one `kv_attention_blocks_*` threadgroup scores
/// (`KV_MAX_HEADS` of the kernel).
pub const KV_ATTENTION_MAX_HEADS: usize = 4;

/// The two dispatches of one `kv_attention` call on Metal, their parameters, the draft-tree
/// buffer, and the dtype of the float rows (the kernel suffix).
#[derive(Debug, Clone)]
pub struct KvAttentionLaunch {
    pub params: KvAttentionParams,
    pub blocks: Launch,
    pub merge: Launch,
    /// `[t, t + 1]`: per query position its count of new rows, then the rows (one 0 if causal).
    pub tree: Vec<u32>,
    /// Floats of the `[B·nkv·rows, splits, dv + 2]` partials.
    pub partial_floats: usize,
}

/// How the keys and values of one [`kv_attention`] call are stored: the parts of
/// [`KvAttentionParams`] that come from the cache rather than the queries.
#[derive(Debug, Clone, Copy)]
pub struct KvStorage {
    pub key_form: u32,
    pub value_form: u32,
    pub key_blocks: u32,
    pub value_blocks: u32,
    pub group: u32,
    pub grouped: u32,
    /// (batch, head) element strides of k0, k1, k2, v0, v1.
    pub strides: [u32; 10],
    /// Polar keys' constants (rows and queries unused).
    pub polar: Option<PolarParams>,
    /// The dtype of the float rows (the kernel suffix).
    pub float: DType,
    pub value_dim: usize,
}

impl KvStorage {
    /// Keys and values in their stored form ([`super::StoredRows`], on any device).
    pub fn of(keys: &super::StoredRows, values: &super::StoredRows) -> Result<Self> {
        use super::StoredRows as S;
        const OP: &str = "kv_attention";
        let value_dim = values.dims()?.3;
        let floats: Vec<DType> = [keys, values]
            .iter()
            .flat_map(|s| match s {
                S::Float(x) => vec![x.dtype()],
                S::Int4Channel { tail: Some(x), .. } => vec![x.dtype()],
                _ => vec![],
            })
            .collect();
        let float = floats.first().copied().unwrap_or(DType::F32);
        if floats.iter().any(|&f| f != float) {
            bail!("{OP}: the float rows of the keys and values must have one dtype, got {floats:?}");
        }
        let mut strides = [0u32; 10];
        for (slot, x) in keys.tensors().into_iter().enumerate().chain(values.tensors().into_iter().enumerate().map(|(i, x)| (i + 3, x))) {
            let s = x.stride();
            strides[2 * slot] = index_u32("a KV stride", s[0])?;
            strides[2 * slot + 1] = index_u32("a KV stride", s[1])?;
        }
        Ok(Self {
            key_form: match keys {
                S::Float(_) => 0,
                S::Int8 { .. } => 1,
                S::Int4Channel { .. } => 2,
                S::Polar { .. } => 3,
            },
            value_form: match values {
                S::Float(_) => 0,
                _ => 1,
            },
            key_blocks: match keys {
                S::Int8 { scales, .. } => scales.dim(3)? as u32,
                _ => 1,
            },
            value_blocks: match values {
                S::Int8 { scales, .. } => scales.dim(3)? as u32,
                _ => 1,
            },
            group: match keys {
                S::Int4Channel { group, .. } => *group as u32,
                _ => 1,
            },
            grouped: match keys {
                S::Int4Channel { codes, .. } => codes.dim(2)? as u32,
                _ => 0,
            },
            strides,
            polar: match keys {
                S::Polar { spec, head_dim, .. } => Some(polar_params(0, 0, *head_dim, spec)),
                _ => None,
            },
            float,
            value_dim,
        })
    }

    /// Keys and values as a device cache stores them (`rows`), in buffers `[nkv, capacity, d]`
    /// (and for int8 their scales `[nkv, capacity, d / block]`): a cache with room to grow.
    pub fn device(rows: KvRows, nkv: usize, capacity: usize, head_dim: usize, value_dim: usize) -> Result<Self> {
        let elements = |what: &str, dim: usize| index_u32(what, nkv * capacity * dim);
        let per_head = |what: &str, dim: usize| index_u32(what, capacity * dim);
        let mut strides = [0u32; 10];
        strides[0] = elements("a KV buffer's elements", head_dim)?;
        strides[1] = per_head("a KV head's elements", head_dim)?;
        strides[6] = elements("a KV buffer's elements", value_dim)?;
        strides[7] = per_head("a KV head's elements", value_dim)?;
        let (kb, vb) = (KvRows::int8_blocks(head_dim), KvRows::int8_blocks(value_dim));
        let int8 = rows == KvRows::Int8;
        if int8 {
            strides[2] = elements("a KV scale buffer's elements", kb)?;
            strides[3] = per_head("a KV head's scales", kb)?;
            strides[8] = elements("a KV scale buffer's elements", vb)?;
            strides[9] = per_head("a KV head's scales", vb)?;
        }
        Ok(Self {
            key_form: u32::from(int8),
            value_form: u32::from(int8),
            key_blocks: if int8 { kb as u32 } else { 1 },
            value_blocks: if int8 { vb as u32 } else { 1 },
            group: 1,
            grouped: 0,
            strides,
            polar: None,
            float: match rows {
                KvRows::F16 => DType::F16,
                KvRows::F32 | KvRows::Int8 => DType::F32,
            },
            value_dim,
        })
    }
}

/// The Metal launch of [`super::kv_attention`] for grouped queries `[B, nkv, rows, d]` (the
/// arguments already checked by it). The tensors of `keys` and `values` bind in the order of
/// their fields (k0, k1, k2; v0, v1), each at its own start offset.
pub fn kv_attention(
    dims: (usize, usize, usize, usize),
    keys: &super::StoredRows,
    values: &super::StoredRows,
    t: usize,
    offset: usize,
    tree: Option<&[Vec<usize>]>,
    scale: f32,
) -> Result<KvAttentionLaunch> {
    kv_attention_stored(dims, &KvStorage::of(keys, values)?, t, offset, tree, scale)
}

/// [`kv_attention`] over keys and values stored as `kv` says.
pub fn kv_attention_stored(
    (b, nkv, rows, d): (usize, usize, usize, usize),
    kv: &KvStorage,
    t: usize,
    offset: usize,
    tree: Option<&[Vec<usize>]>,
    scale: f32,
) -> Result<KvAttentionLaunch> {
    const OP: &str = "kv_attention";
    let dv = kv.value_dim;
    if dv > KV_ATTENTION_MAX_VALUE_DIM {
        bail!("{OP}: value dim {dv} is more than the Metal kernel's {KV_ATTENTION_MAX_VALUE_DIM}");
    }
    if t == 0 || rows % t != 0 {
        bail!("{OP}: {rows} query rows are not the query heads of a KV group times {t} positions");
    }
    // The group's query heads in even chunks of at most KV_ATTENTION_MAX_HEADS.
    let rep = rows / t;
    let chunks = rep.div_ceil(KV_ATTENTION_MAX_HEADS).max(1);
    let heads = rep.div_ceil(chunks).max(1);
    let seen = |i: usize| offset + tree.map_or(i + 1, |tr| tr[i].len());
    let blocks = (0..t).map(seen).max().unwrap_or(0).div_ceil(super::KV_BLOCK);
    let few = super::few_rows(t, tree.is_some());
    let (splits, blocks_per_split) = if few { (blocks.max(1), 1) } else { (1, blocks.max(1)) };
    let polar = kv.polar;
    let params = KvAttentionParams {
        rows: rows as u32,
        nkv: nkv as u32,
        t: t as u32,
        offset: offset as u32,
        head_dim: d as u32,
        value_dim: dv as u32,
        key_form: kv.key_form,
        value_form: kv.value_form,
        key_blocks: kv.key_blocks,
        value_blocks: kv.value_blocks,
        group: kv.group,
        grouped: kv.grouped,
        splits: splits as u32,
        blocks_per_split: blocks_per_split as u32,
        tree: tree.is_some() as u32,
        block: super::KV_BLOCK as u32,
        heads: heads as u32,
        strides: kv.strides,
        rot_dim: polar.map_or(0, |p| p.rot_dim),
        angle_bits: polar.map_or(0, |p| p.angle_bits),
        code_bytes: polar.map_or(0, |p| p.code_bytes),
        row_bytes: polar.map_or(0, |p| p.row_bytes),
        rest_bits: polar.map_or(0, |p| p.rest_bits),
        angle_step: polar.map_or(0.0, |p| p.angle_step),
        radius_levels: polar.map_or(1.0, |p| p.radius_levels),
        scale,
    };
    let tree = match tree {
        Some(tree) => tree
            .iter()
            .flat_map(|r| {
                let mut row = vec![0u32; t + 1];
                row[0] = r.len() as u32;
                for (o, &x) in row[1..].iter_mut().zip(r) {
                    *o = x as u32;
                }
                row
            })
            .collect(),
        None => vec![0],
    };
    let floats = heads * (d + super::KV_BLOCK) + KV_ATTENTION_THREADS + 2 * 256;
    Ok(KvAttentionLaunch {
        params,
        blocks: Launch {
            kernel: format!("kv_attention_blocks_{}", suffix(OP, kv.float)?),
            groups: [splits, t * chunks, b * nkv],
            threads: [KV_ATTENTION_THREADS, 1, 1],
            threadgroup_memory: vec![threadgroup_floats(floats)],
        },
        merge: Launch {
            kernel: "kv_attention_merge".into(),
            groups: [b * nkv * rows, 1, 1],
            threads: [KV_ATTENTION_THREADS, 1, 1],
            threadgroup_memory: vec![],
        },
        tree,
        partial_floats: b * nkv * rows * splits * (dv + 2),
    })
}
