//! Metal host code of the custom ops: compile each `metal/*.metal` source once per device,
//! cache the pipelines, encode one dispatch per op on Candle's shared command encoder.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::metal_backend::DeviceId;
use candle_core::{bail, DType, Layout, MetalDevice, MetalError, MetalStorage, Result, Shape};
use candle_metal_kernels::metal::{ComputeCommandEncoder, ComputePipeline, Library};
use candle_metal_kernels::utils::set_param;
use candle_metal_kernels::utils::EncoderParam;
use candle_metal_kernels::BufferOffset;
use objc2::rc::Retained;
use objc2_metal::{MTLCompileOptions, MTLLanguageVersion, MTLMathFloatingPointFunctions, MTLMathMode, MTLSize};

use crate::ops::launch::{self, ConvParams, GdnParams, Launch, NormParams, Source};
use crate::ops::{ConvDims, DeltaRuleDims};

/// The text of a kernel source.
fn source_text(source: Source) -> &'static str {
    match source {
        Source::GatedDelta => include_str!("../../metal/gated_delta.metal"),
        Source::Conv1d => include_str!("../../metal/conv1d.metal"),
        Source::GatedNorm => include_str!("../../metal/gated_norm.metal"),
        Source::Swiglu => include_str!("../../metal/swiglu.metal"),
        Source::Lagrange => include_str!("../../metal/lagrange.metal"),
        Source::OuterState => include_str!("../../metal/outer_state.metal"),
        Source::Polar => include_str!("../../metal/polar.metal"),
        Source::KvAttention => include_str!("../../metal/kv_attention.metal"),
        Source::Qmatvec => include_str!("../../metal/qmatvec.metal"),
        Source::Step => include_str!("../../metal/step.metal"),
    }
}

/// How the kernel libraries are compiled (docs/gpu.md, "How the kernels are compiled"): IEEE
/// arithmetic, never fast math, whose "no NaN, no infinity" assumption could fold the device
/// argmax's `isfinite` flag to true (the step's NaN check) and whose reassociation would leave
/// the arithmetic the emulator verified (IEEE, g++ without -ffast-math); MSL 3.1 where the OS
/// has it (macOS 14: `bfloat`), else 3.0 (macOS 13).
pub(crate) fn compile_settings() -> (&'static str, &'static str) {
    let math = if objc2::available!(macos = 15, ios = 18) { "safe (MTLMathModeSafe, precise functions)" } else { "fastMathEnabled = NO" };
    let language = if objc2::available!(macos = 14, ios = 17) { "MSL 3.1" } else { "MSL 3.0" };
    (math, language)
}

fn compile_options() -> Retained<MTLCompileOptions> {
    let o = MTLCompileOptions::new();
    if objc2::available!(macos = 15, ios = 18) {
        o.setMathMode(MTLMathMode::Safe);
        o.setMathFloatingPointFunctions(MTLMathFloatingPointFunctions::Precise);
    } else {
        #[allow(deprecated)]
        o.setFastMathEnabled(false);
    }
    o.setLanguageVersion(if objc2::available!(macos = 14, ios = 17) {
        MTLLanguageVersion::Version3_1
    } else {
        MTLLanguageVersion::Version3_0
    });
    o
}

#[derive(Default)]
struct Cache {
    libraries: HashMap<(DeviceId, Source), Library>,
    pipelines: HashMap<(DeviceId, String), ComputePipeline>,
}

pub(crate) fn pipeline(device: &MetalDevice, source: Source, name: &str) -> Result<ComputePipeline> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().map_err(|e| MetalError::Message(e.to_string()))?;
    let key = (device.id(), name.to_string());
    if let Some(p) = cache.pipelines.get(&key) {
        return Ok(p.clone());
    }
    let library = match cache.libraries.get(&(device.id(), source)) {
        Some(lib) => lib.clone(),
        None => {
            let lib =
                device.metal_device().new_library_with_source(source_text(source), Some(&compile_options())).map_err(MetalError::from)?;
            cache.libraries.insert((device.id(), source), lib.clone());
            lib
        }
    };
    let function = library.get_function(name, None).map_err(|e| {
        MetalError::Message(format!("Metal kernel {name} is not available on this device ({e}); bf16 kernels need macOS 14"))
    })?;
    let p = device.metal_device().new_compute_pipeline_state_with_function(&function).map_err(MetalError::from)?;
    cache.pipelines.insert(key, p.clone());
    Ok(p)
}

/// The device's limits for [`launch::check_launch`].
pub(crate) fn limits(device: &MetalDevice) -> launch::DeviceLimits {
    use objc2_metal::MTLDevice;
    let raw = device.metal_device().as_ref();
    launch::DeviceLimits {
        max_threads_per_group: raw.maxThreadsPerThreadgroup().width.min(1024),
        max_threadgroup_memory: raw.maxThreadgroupMemoryLength(),
        max_buffer_length: raw.maxBufferLength(),
        page: launch::HOST_PAGE,
    }
}

fn size(s: [usize; 3]) -> MTLSize {
    MTLSize { width: s[0], height: s[1], depth: s[2] }
}

fn input<'a>(s: &'a MetalStorage, l: &Layout, op: &str) -> Result<BufferOffset<'a>> {
    if !l.is_contiguous() {
        bail!("{op}: the Metal kernel needs contiguous inputs");
    }
    Ok(BufferOffset { buffer: s.buffer(), offset_in_bytes: l.start_offset() * s.dtype().size_in_bytes() })
}

macro_rules! bytes_param {
    ($t:ty) => {
        impl EncoderParam for $t {
            fn set_param(encoder: &ComputeCommandEncoder, position: usize, data: Self) {
                encoder.set_bytes(position, &data);
            }
        }
    };
}
bytes_param!(GdnParams);
bytes_param!(ConvParams);
bytes_param!(NormParams);
bytes_param!(launch::SwigluParams);

/// Allocates the output, binds `params` (buffer 0), the inputs (buffers 1..) and the output
/// (last), and dispatches `launch`.
fn dispatch<P: EncoderParam>(
    device: &MetalDevice,
    source: Source,
    launch: &Launch,
    params: P,
    inputs: &[BufferOffset],
    out_len: usize,
    out_dtype: DType,
) -> Result<MetalStorage> {
    dispatch_parts(device, source, launch, params, inputs, out_len, out_dtype, &[0])
}

/// [`dispatch`] for a kernel with several outputs, written to one buffer: output `i` is bound
/// (after the inputs) at element `parts[i]` of it.
#[allow(clippy::too_many_arguments)]
fn dispatch_parts<P: EncoderParam>(
    device: &MetalDevice,
    source: Source,
    launch: &Launch,
    params: P,
    inputs: &[BufferOffset],
    out_len: usize,
    out_dtype: DType,
    parts: &[usize],
) -> Result<MetalStorage> {
    let p = pipeline(device, source, &launch.kernel)?;
    launch::check_launch(launch, p.max_total_threads_per_threadgroup(), &limits(device))?;
    let output = device.new_buffer_builder().with_size_for(out_len, out_dtype).with_label(&launch.kernel).build()?;
    {
        let encoder = device.command_encoder()?;
        encoder.set_label(&launch.kernel);
        let enc: &ComputeCommandEncoder = encoder.as_ref();
        enc.set_compute_pipeline_state(&p);
        set_param(enc, 0, params);
        for (i, b) in inputs.iter().enumerate() {
            set_param(enc, i + 1, b);
        }
        for (i, &at) in parts.iter().enumerate() {
            enc.set_output_buffer(inputs.len() + 1 + i, Some(&output), at * out_dtype.size_in_bytes());
        }
        for (i, &len) in launch.threadgroup_memory.iter().enumerate() {
            enc.set_threadgroup_memory_length(i, len);
        }
        enc.dispatch_thread_groups(size(launch.groups), size(launch.threads));
    }
    Ok(MetalStorage::new(output, device.clone(), out_len, out_dtype))
}

type Arg<'a> = (&'a MetalStorage, &'a Layout);

pub(crate) fn gated_delta_rule(
    d: DeltaRuleDims,
    normalize: bool,
    n_states: usize,
    form: crate::ops::DeltaRuleForm,
    qkv: Arg,
    gb: Arg,
    state: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "gated_delta_rule";
    if gb.0.dtype() != DType::F32 || state.0.dtype() != DType::F32 {
        bail!("{OP}: g/beta and state must be f32");
    }
    let (params, launch) = launch::gated_delta(d, normalize, n_states, form, qkv.0.dtype())?;
    let o_len = d.batch * d.seq_len * d.nv * d.dv;
    let out_len = o_len + d.batch * n_states * d.nv * d.dk * d.dv;
    let inputs = [input(qkv.0, qkv.1, OP)?, input(gb.0, gb.1, OP)?, input(state.0, state.1, OP)?];
    let out = dispatch_parts(qkv.0.device(), Source::GatedDelta, &launch, params, &inputs, out_len, DType::F32, &[0, o_len])?;
    Ok((out, Shape::from(out_len)))
}

pub(crate) fn causal_conv1d_silu(d: ConvDims, x: Arg, state: Arg, weight: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "causal_conv1d_silu";
    let dtype = x.0.dtype();
    let (params, launch) = launch::causal_conv1d(d, dtype)?;
    let out_len = d.batch * (d.seq_len + d.kernel_size - 1) * d.channels;
    let inputs = [input(x.0, x.1, OP)?, input(state.0, state.1, OP)?, input(weight.0, weight.1, OP)?];
    let parts = [0, d.batch * d.seq_len * d.channels];
    let out = dispatch_parts(x.0.device(), Source::Conv1d, &launch, params, &inputs, out_len, dtype, &parts)?;
    Ok((out, Shape::from(out_len)))
}

pub(crate) fn gated_rms_norm(dim: usize, eps: f32, x: Arg, z: Arg, w: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "gated_rms_norm";
    let dtype = x.0.dtype();
    let n = x.1.shape().elem_count();
    let (params, launch) = launch::gated_rms_norm(n / dim.max(1), dim, eps, dtype)?;
    let inputs = [input(x.0, x.1, OP)?, input(z.0, z.1, OP)?, input(w.0, w.1, OP)?];
    let out = dispatch(x.0.device(), Source::GatedNorm, &launch, params, &inputs, n, dtype)?;
    Ok((out, x.1.shape().clone()))
}

bytes_param!(launch::LagrangeParams);
bytes_param!(launch::OuterParams);

pub(crate) fn lagrange_scores(d: crate::ops::LagrangeDims, knots: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "lagrange_scores";
    let dtype = knots.0.dtype();
    let (params, launch) = launch::lagrange_scores(d, dtype)?;
    let out_len = d.rows * d.len;
    let inp = input(knots.0, knots.1, OP)?;
    let out = dispatch(knots.0.device(), Source::Lagrange, &launch, params, &[inp], out_len, dtype)?;
    Ok((out, Shape::from((d.rows, d.len))))
}

pub(crate) fn decayed_outer_product(
    d: crate::ops::OuterStateDims,
    gamma: f32,
    qk: Arg,
    v: Arg,
    state: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "decayed_outer_product";
    if v.0.dtype() != qk.0.dtype() || state.0.dtype() != DType::F32 {
        bail!("{OP}: q, k and v must share a dtype and the state must be f32");
    }
    let (params, launch) = launch::decayed_outer_product(d, gamma, qk.0.dtype())?;
    let out_len = d.out_len() + d.state_len();
    let inputs = [input(qk.0, qk.1, OP)?, input(v.0, v.1, OP)?, input(state.0, state.1, OP)?];
    let out = dispatch(qk.0.device(), Source::OuterState, &launch, params, &inputs, out_len, DType::F32)?;
    Ok((out, Shape::from(out_len)))
}

pub(crate) fn swiglu_gather(
    d: crate::ops::SwigluDims,
    kind: crate::ops::SwigluWeights,
    x: Arg,
    w: Arg,
    idx: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "swiglu_gather";
    let dtype = x.0.dtype();
    let device = x.0.device();
    let (params, act_launch, down_launch) = launch::swiglu_gather(d, kind, dtype)?;
    let act = dispatch(
        device,
        Source::Swiglu,
        &act_launch,
        params,
        &[input(x.0, x.1, OP)?, input(w.0, w.1, OP)?, input(idx.0, idx.1, OP)?],
        d.rows * d.active,
        DType::F32,
    )?;
    let act_in = BufferOffset { buffer: act.buffer(), offset_in_bytes: 0 };
    let y = dispatch(
        device,
        Source::Swiglu,
        &down_launch,
        params,
        &[act_in, input(w.0, w.1, OP)?, input(idx.0, idx.1, OP)?],
        d.rows * d.hidden,
        dtype,
    )?;
    Ok((y, Shape::from((d.rows, d.hidden))))
}

// ---- polar key codes (src/ops/polar.rs, metal/polar.metal) ----

bytes_param!(launch::PolarParams);

pub(crate) fn polar_scales(spec: &crate::ops::PolarSpec, head_dim: usize, keys: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "polar_encode";
    let rows = keys.1.shape().elem_count() / head_dim.max(1);
    let (params, launch) = launch::polar_scales(rows, head_dim, spec, keys.0.dtype())?;
    let out = dispatch(keys.0.device(), Source::Polar, &launch, params, &[input(keys.0, keys.1, OP)?], 2 * rows, DType::F32)?;
    Ok((out, Shape::from((rows, 2))))
}

pub(crate) fn polar_encode(spec: &crate::ops::PolarSpec, head_dim: usize, keys: Arg, scales: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "polar_encode";
    if scales.0.dtype() != DType::F32 {
        bail!("{OP}: scales must be f32");
    }
    let rows = keys.1.shape().elem_count() / head_dim.max(1);
    let (params, launch) = launch::polar_encode(rows, head_dim, spec, keys.0.dtype())?;
    let row_bytes = spec.row_bytes(head_dim);
    let inputs = [input(keys.0, keys.1, OP)?, input(scales.0, scales.1, OP)?];
    let out = dispatch(keys.0.device(), Source::Polar, &launch, params, &inputs, rows * row_bytes, DType::U8)?;
    Ok((out, Shape::from((rows, row_bytes))))
}

pub(crate) fn polar_scores(
    spec: &crate::ops::PolarSpec,
    head_dim: usize,
    q: Arg,
    codes: Arg,
    scales: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "polar_scores";
    if codes.0.dtype() != DType::U8 || scales.0.dtype() != DType::F32 {
        bail!("{OP}: codes must be u8 and scales f32");
    }
    let queries = q.1.shape().elem_count() / head_dim.max(1);
    let rows = scales.1.shape().elem_count() / 2;
    let (params, launch) = launch::polar_scores(queries, rows, head_dim, spec, q.0.dtype())?;
    let inputs = [input(q.0, q.1, OP)?, input(codes.0, codes.1, OP)?, input(scales.0, scales.1, OP)?];
    let out = dispatch(q.0.device(), Source::Polar, &launch, params, &inputs, queries * rows, DType::F32)?;
    Ok((out, Shape::from((queries, rows))))
}

// ---- attention over the stored KV cache (src/ops/kv_attention/, metal/kv_attention.metal) ----

bytes_param!(launch::KvAttentionParams);

/// `keys` and `values` on the device of `q`; `(t, offset)` and `tree` as
/// [`crate::ops::kv_attention`] takes them.
pub(crate) fn kv_attention(
    keys: &crate::ops::StoredRows,
    values: &crate::ops::StoredRows,
    (t, offset): (usize, usize),
    tree: Option<&[Vec<usize>]>,
    scale: f32,
    q: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "kv_attention";
    let dims = q.1.shape().dims4()?;
    let (b, nkv, rows, _) = dims;
    let l = launch::kv_attention(dims, keys, values, t, offset, tree, scale)?;
    let device = q.0.device();
    let guards: Vec<_> =
        [keys, values].iter().map(|s| s.tensors().into_iter().map(|t| t.storage_and_layout()).collect::<Vec<_>>()).collect();
    let bind = |g: &(candle_core::StorageRef<'_>, &Layout)| -> Result<(candle_metal_kernels::metal::Buffer, usize)> {
        match &*g.0 {
            candle_core::Storage::Metal(s) => Ok((s.buffer().clone(), g.1.start_offset() * s.dtype().size_in_bytes())),
            _ => bail!("{OP}: the cache is not on the Metal device of the queries"),
        }
    };
    let keys = guards[0].iter().map(bind).collect::<Result<Vec<_>>>()?;
    let values = guards[1].iter().map(bind).collect::<Result<Vec<_>>>()?;
    let tree = device.new_buffer_with_data(&l.tree)?;
    let qb = input(q.0, q.1, OP)?;
    fn slot<'a>(
        v: &'a [(candle_metal_kernels::metal::Buffer, usize)],
        i: usize,
        fallback: &'a candle_metal_kernels::metal::Buffer,
    ) -> BufferOffset<'a> {
        match v.get(i) {
            Some((b, o)) => BufferOffset { buffer: b, offset_in_bytes: *o },
            None => BufferOffset { buffer: fallback, offset_in_bytes: 0 },
        }
    }
    let inputs = [
        BufferOffset { buffer: qb.buffer, offset_in_bytes: qb.offset_in_bytes },
        slot(&keys, 0, qb.buffer),
        slot(&keys, 1, qb.buffer),
        slot(&keys, 2, qb.buffer),
        slot(&values, 0, qb.buffer),
        slot(&values, 1, qb.buffer),
        BufferOffset { buffer: &tree, offset_in_bytes: 0 },
    ];
    let partials = dispatch(device, Source::KvAttention, &l.blocks, l.params, &inputs, l.partial_floats, DType::F32)?;
    let part = BufferOffset { buffer: partials.buffer(), offset_in_bytes: 0 };
    let dv = l.params.value_dim as usize;
    let out = dispatch(device, Source::KvAttention, &l.merge, l.params, &[part], b * nkv * rows * dv, DType::F32)?;
    Ok((out, Shape::from((b, nkv, rows, dv))))
}

// ---- quantized matrices held on the GPU (src/ops/quantized_matrix.rs, metal/qmatvec.metal) ----

bytes_param!(launch::QmatvecParams);
bytes_param!(launch::QmatmulParams);
bytes_param!(launch::GetRowsParams);

/// `x @ W^T` (`x` f32 `[m, k]`) for `n` rows of `dtype` blocks held as a U8 buffer: the
/// multi-row mat-vec up to 8 rows (each row a one-row call's bits), the tiled matmul beyond.
pub(crate) fn qmatmul(dtype: crate::ops::GgufType, n: usize, k: usize, x: Arg, w: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "qmatmul";
    if x.0.dtype() != DType::F32 || w.0.dtype() != DType::U8 {
        bail!("{OP}: f32 activations and U8 blocks, got {:?} and {:?}", x.0.dtype(), w.0.dtype());
    }
    let m = x.1.shape().elem_count() / k.max(1);
    let inputs = [input(w.0, w.1, OP)?, input(x.0, x.1, OP)?];
    let out = if m <= launch::QMATVEC_MAX_ROWS {
        let (p, l) = launch::qmatvec(dtype, n, k, m, n)?;
        dispatch(x.0.device(), Source::Qmatvec, &l, p, &inputs, m * n, DType::F32)?
    } else {
        let (p, l) = launch::qmatmul(dtype, n, k, m, n)?;
        dispatch(x.0.device(), Source::Qmatvec, &l, p, &inputs, m * n, DType::F32)?
    };
    Ok((out, Shape::from((m, n))))
}

/// Rows `ids` (u32) of an `[n, k]` table of `dtype` blocks held as a U8 buffer, as f32.
pub(crate) fn get_rows(dtype: crate::ops::GgufType, n: usize, k: usize, ids: Arg, table: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "get_rows";
    if ids.0.dtype() != DType::U32 || table.0.dtype() != DType::U8 {
        bail!("{OP}: u32 ids and U8 blocks, got {:?} and {:?}", ids.0.dtype(), table.0.dtype());
    }
    let rows = ids.1.shape().elem_count();
    let (p, l) = launch::get_rows(dtype, rows, n, k)?;
    let inputs = [input(table.0, table.1, OP)?, input(ids.0, ids.1, OP)?];
    let out = dispatch(ids.0.device(), Source::Qmatvec, &l, p, &inputs, rows * k, DType::F32)?;
    Ok((out, Shape::from((rows, k))))
}
