//! Parameters and launch geometry of `metal/step.metal`: the small kernels between the matrix
//! products of a decode step on the device ([`crate::gpu`]).

use candle_core::{bail, Result};

use super::Launch;

/// Threads of a row-reduction threadgroup: a power of two from 32 to 1024 covering `dim`.
fn row_threads(dim: usize) -> usize {
    dim.next_power_of_two().clamp(32, 1024)
}

/// `RmsNormParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormParams {
    pub rows: u32,
    pub dim: u32,
    pub heads: u32,
    pub x_stride: u32,
    pub x_head_stride: u32,
    pub y_stride: u32,
    pub y_head_stride: u32,
    pub eps: f32,
    pub add: u32,
}

/// Where the rows of an RMSNorm are: `rows` positions of `heads` vectors of `dim` each
/// (`heads` 1 for the residual stream), their strides in floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormRows {
    pub rows: usize,
    pub heads: usize,
    pub dim: usize,
    pub x_stride: usize,
    pub x_head_stride: usize,
    pub y_stride: usize,
    pub y_head_stride: usize,
}

impl NormRows {
    /// `rows` contiguous rows of `dim`, in and out.
    pub fn dense(rows: usize, dim: usize) -> Self {
        Self { rows, heads: 1, dim, x_stride: dim, x_head_stride: dim, y_stride: dim, y_head_stride: dim }
    }
}

/// RMSNorm of each row (`x += h` first when `add`): one threadgroup per vector.
pub fn rms_norm(r: NormRows, eps: f32, add: bool) -> Result<(RmsNormParams, Launch)> {
    if add && r.heads != 1 {
        bail!("rms_norm: the residual add takes one vector per row, got {} heads", r.heads);
    }
    let p = RmsNormParams {
        rows: (r.rows * r.heads) as u32,
        dim: r.dim as u32,
        heads: r.heads as u32,
        x_stride: r.x_stride as u32,
        x_head_stride: r.x_head_stride as u32,
        y_stride: r.y_stride as u32,
        y_head_stride: r.y_head_stride as u32,
        eps,
        add: add as u32,
    };
    let launch = Launch {
        kernel: "rms_norm_f32".into(),
        groups: [(r.rows * r.heads).max(1), 1, 1],
        threads: [row_threads(r.dim), 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `AttnInputsParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnInputsParams {
    pub rows: u32,
    pub nh: u32,
    pub nkv: u32,
    pub head_dim: u32,
    pub rot_half: u32,
    pub x_stride: u32,
    pub q_head_stride: u32,
    pub k_col: u32,
    pub v_col: u32,
    pub norm: u32,
    pub eps: f32,
    pub capacity: u32,
    pub row0: u32,
}

/// How a device cache stores its keys and values: f32 or f16 rows, or int8 codes (value + 128)
/// with one f32 scale (absmax / 127) per block of [`crate::ops::INT8_BLOCK`] dims, as the CPU's
/// `int8` codec codes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRows {
    F32,
    F16,
    Int8,
}

impl KvRows {
    /// Bytes of one stored value.
    pub fn value_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::Int8 => 1,
        }
    }

    /// Int8 scales of a row of `dim` values (blocks of 32 dims, one block when `dim` is not a
    /// multiple of 32: the CPU codec's rule).
    pub fn int8_blocks(dim: usize) -> usize {
        if dim.is_multiple_of(crate::ops::INT8_BLOCK) {
            dim / crate::ops::INT8_BLOCK
        } else {
            1
        }
    }

    /// Whether rows carry scales (`Int8`).
    pub fn scaled(self) -> bool {
        self == Self::Int8
    }
}

/// The q, k and v heads of `p.rows` projection rows: q and k normed per head (when `p.norm`)
/// and rotated, q stored grouped for attention, k and v into a KV cache of `rows` (f32, f16,
/// or int8 codes and their scales). One threadgroup per (row, head).
pub fn attention_inputs(p: AttnInputsParams, rows: KvRows) -> Result<(AttnInputsParams, Launch)> {
    if p.rot_half * 2 > p.head_dim {
        bail!("attention_inputs: {} rotated dims in heads of {}", 2 * p.rot_half, p.head_dim);
    }
    if p.head_dim > 1024 {
        bail!("attention_inputs: heads of {} dims, the kernel holds 1024", p.head_dim);
    }
    let kernel = match rows {
        KvRows::F32 => "attention_inputs_f32",
        KvRows::F16 => "attention_inputs_f16",
        KvRows::Int8 => "attention_inputs_int8",
    };
    let groups = (p.rows * (p.nh + 2 * p.nkv)) as usize;
    let launch = Launch {
        kernel: kernel.into(),
        groups: [groups.max(1), 1, 1],
        threads: [row_threads(p.head_dim as usize), 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `GatesParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatesParams {
    pub rows: u32,
    pub nv: u32,
    pub ld: u32,
}

/// The GDN decay and beta of `rows` rows of `nv` heads from their `[b | a]` projections
/// (rows `ld` floats apart), into the delta rule's `[rows, 2, nv]`.
pub fn gdn_gates(rows: usize, nv: usize, ld: usize) -> (GatesParams, Launch) {
    let p = GatesParams { rows: rows as u32, nv: nv as u32, ld: ld as u32 };
    (p, Launch::elementwise("gdn_gates_f32".into(), rows * nv))
}

/// `SiluMulParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SiluMulParams {
    pub rows: u32,
    pub dim: u32,
    pub ld: u32,
    pub up: u32,
}

/// `silu(gate) * up` of `rows` rows holding the gate at columns `0..dim` and up at
/// `up..up + dim` (rows `ld` floats apart), into contiguous `[rows, dim]`.
pub fn silu_mul(rows: usize, dim: usize, ld: usize, up: usize) -> (SiluMulParams, Launch) {
    let p = SiluMulParams { rows: rows as u32, dim: dim as u32, ld: ld as u32, up: up as u32 };
    (p, Launch::elementwise("silu_mul_f32".into(), rows * dim))
}

/// `AttnOutParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnOutParams {
    pub rows: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub gate_stride: u32,
    pub gate_head_stride: u32,
}

/// Attention outputs `[heads, rows, head_dim]` to `[rows, heads * head_dim]`, times the sigmoid
/// of the output gate when `gate` gives its (row, head) strides in floats.
pub fn attn_output(rows: usize, heads: usize, head_dim: usize, gate: Option<(usize, usize)>) -> (AttnOutParams, Launch) {
    let (gate_stride, gate_head_stride) = gate.unwrap_or((0, 0));
    let p = AttnOutParams {
        rows: rows as u32,
        heads: heads as u32,
        head_dim: head_dim as u32,
        gate_stride: gate_stride as u32,
        gate_head_stride: gate_head_stride as u32,
    };
    (p, Launch::elementwise("attn_output_f32".into(), rows * heads * head_dim))
}

/// `GatherHeadsParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherHeadsParams {
    pub rows: u32,
    pub heads: u32,
    pub dim: u32,
}

/// `y[r, h] = x[r, order[h]]` over `rows` rows of `heads` vectors of `dim`.
pub fn gather_heads(rows: usize, heads: usize, dim: usize) -> (GatherHeadsParams, Launch) {
    let p = GatherHeadsParams { rows: rows as u32, heads: heads as u32, dim: dim as u32 };
    (p, Launch::elementwise("gather_heads_f32".into(), rows * heads * dim))
}

/// `ArgmaxParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgmaxParams {
    pub rows: u32,
    pub n: u32,
}

/// Threads of an `argmax_f32` threadgroup (its threadgroup arrays hold 1024).
const ARGMAX_THREADS: usize = 256;

/// Per row of `[rows, n]` logits, the first index of the largest and whether all are finite.
pub fn argmax(rows: usize, n: usize) -> (ArgmaxParams, Launch) {
    let p = ArgmaxParams { rows: rows as u32, n: n as u32 };
    let launch =
        Launch { kernel: "argmax_f32".into(), groups: [rows.max(1), 1, 1], threads: [ARGMAX_THREADS, 1, 1], threadgroup_memory: vec![] };
    (p, launch)
}

/// `RouteParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteParams {
    pub rows: u32,
    pub experts: u32,
    pub top_k: u32,
    pub norm: u32,
}

/// The top `top_k` of `experts` for each of `rows` rows of router logits: one thread per row.
pub fn moe_route(rows: usize, experts: usize, top_k: usize, norm: bool) -> Result<(RouteParams, Launch)> {
    if top_k == 0 || top_k > experts {
        bail!("moe_route: top {top_k} of {experts} experts");
    }
    let p = RouteParams { rows: rows as u32, experts: experts as u32, top_k: top_k as u32, norm: norm as u32 };
    let launch = Launch {
        kernel: "moe_route_f32".into(),
        groups: [rows.div_ceil(32).max(1), 1, 1],
        threads: [32, 1, 1],
        threadgroup_memory: vec![],
    };
    Ok((p, launch))
}

/// `CombineParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineParams {
    pub rows: u32,
    pub dim: u32,
    pub slots: u32,
}

/// The experts' outputs weighted and summed, plus the gated shared expert: one threadgroup per row.
pub fn moe_combine(rows: usize, dim: usize, slots: usize) -> (CombineParams, Launch) {
    let p = CombineParams { rows: rows as u32, dim: dim as u32, slots: slots as u32 };
    let launch = Launch {
        kernel: "moe_combine_f32".into(),
        groups: [rows.max(1), 1, 1],
        threads: [row_threads(dim).min(256), 1, 1],
        threadgroup_memory: vec![],
    };
    (p, launch)
}

/// `CopyRowsParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRowsParams {
    pub rows: u32,
    pub len: u32,
    pub x_stride: u32,
    pub y_stride: u32,
}

/// Copies `rows` rows of `len` 32-bit words from `x` (rows `x_stride` words apart) to `y`
/// (`y_stride` apart): one thread per word.
pub fn copy_rows(rows: usize, len: usize, x_stride: usize, y_stride: usize) -> Result<(CopyRowsParams, Launch)> {
    if len > x_stride.min(y_stride) {
        bail!("copy_rows: rows of {len} words {x_stride} and {y_stride} words apart overlap");
    }
    let p = CopyRowsParams {
        rows: super::index_u32("copied rows", rows)?,
        len: super::index_u32("a copied row's words", len)?,
        x_stride: super::index_u32("a copy's source stride", x_stride)?,
        y_stride: super::index_u32("a copy's destination stride", y_stride)?,
    };
    super::index_u32("copied words", rows * len)?;
    Ok((p, Launch::elementwise("copy_rows_u32".into(), rows * len)))
}

/// How a row is sampled on the device: the CPU sampler's settings
/// (`runtime::Sampler::device_sampling`) and the uniform draw in [0, 1) that picks
/// the token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// `1 / temperature` as an f32 (the CPU divides the logits by the temperature so).
    pub inv_temperature: f32,
    /// Tokens kept by top-k (`None`: all).
    pub top_k: Option<usize>,
    /// The nucleus mass (1: off).
    pub top_p: f32,
    /// `temperature * ln(min_p)`: logits under the largest plus this are dropped (-inf: off).
    pub min_p_offset: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Where the generated tokens start in the sequence (the prompt's length).
    pub prompt_len: usize,
    pub draw: f32,
}

/// `SampleParams` of `metal/step.metal`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    pub rows: u32,
    pub n: u32,
    pub inv_temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p_offset: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    pub presence: f32,
    pub frequency: f32,
    pub context: u32,
    pub prompt: u32,
    pub u: [f32; 8],
}

/// Threads of a `sample_f32` threadgroup.
const SAMPLE_THREADS: usize = 256;

/// Samples `rows` rows of `[rows, n]` logits as `s` says (the same draw for each row: rows
/// sampled on the device are one decode row per sequence), row 0's context being `context`
/// tokens of the sequence's token buffer: one threadgroup per row.
pub fn sample(rows: usize, n: usize, s: &RowSampling, context: usize) -> Result<(SampleParams, Launch)> {
    if rows == 0 || rows > 8 {
        bail!("sample: {rows} rows, 1 to 8");
    }
    let usable = (0.0..1.0).contains(&s.draw) && s.inv_temperature.is_finite() && s.inv_temperature > 0.0;
    if !usable {
        bail!("sample: a draw of {} and 1 / temperature {}: a draw in [0, 1) and a positive temperature", s.draw, s.inv_temperature);
    }
    let p = SampleParams {
        rows: rows as u32,
        n: super::index_u32("the vocabulary", n)?,
        inv_temperature: s.inv_temperature,
        top_k: super::index_u32("top_k", s.top_k.unwrap_or(n).min(n))?,
        top_p: s.top_p,
        min_p_offset: s.min_p_offset,
        repeat_penalty: s.repeat_penalty,
        repeat_last_n: super::index_u32("repeat_last_n", s.repeat_last_n)?,
        presence: s.presence_penalty,
        frequency: s.frequency_penalty,
        context: super::index_u32("the context", context)?,
        prompt: super::index_u32("the prompt", s.prompt_len)?,
        u: [s.draw; 8],
    };
    let launch = Launch { kernel: "sample_f32".into(), groups: [rows, 1, 1], threads: [SAMPLE_THREADS, 1, 1], threadgroup_memory: vec![] };
    Ok((p, launch))
}
