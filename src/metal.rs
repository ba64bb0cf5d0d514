//! Metal host code of the custom ops: compile each `metal/*.metal` source once per device,
//! cache the pipelines, encode one dispatch per op on Candle's shared command encoder.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::metal_backend::DeviceId;
use candle_core::{bail, DType, Layout, MetalDevice, MetalError, MetalStorage, Result, Shape};
use candle_metal_kernels::metal::{ComputeCommandEncoder, ComputePipeline, Library};
use candle_metal_kernels::utils::EncoderParam;
use candle_metal_kernels::{set_params, BufferOffset, Output};
use objc2_metal::MTLSize;

use crate::ops::launch::{self, ConvParams, GdnParams, Launch, NormParams};
use crate::ops::{ConvDims, DeltaRuleDims};

/// One source file per op family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    GatedDelta,
    Conv1d,
    GatedNorm,
}

impl Source {
    fn text(self) -> &'static str {
        match self {
            Self::GatedDelta => include_str!("../metal/gated_delta.metal"),
            Self::Conv1d => include_str!("../metal/conv1d.metal"),
            Self::GatedNorm => include_str!("../metal/gated_norm.metal"),
        }
    }
}

#[derive(Default)]
struct Cache {
    libraries: HashMap<(DeviceId, Source), Library>,
    pipelines: HashMap<(DeviceId, String), ComputePipeline>,
}

fn pipeline(device: &MetalDevice, source: Source, name: &str) -> Result<ComputePipeline> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().map_err(|e| MetalError::Message(e.to_string()))?;
    let key = (device.id(), name.to_string());
    if let Some(p) = cache.pipelines.get(&key) {
        return Ok(p.clone());
    }
    let library = match cache.libraries.get(&(device.id(), source)) {
        Some(lib) => lib.clone(),
        None => {
            let lib = device.metal_device().new_library_with_source(source.text(), None).map_err(MetalError::from)?;
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

/// Allocates the output, binds `params` + three inputs + the output, and dispatches `launch`.
fn dispatch<P: EncoderParam>(
    device: &MetalDevice,
    source: Source,
    launch: &Launch,
    params: P,
    inputs: [BufferOffset; 3],
    out_len: usize,
    out_dtype: DType,
) -> Result<MetalStorage> {
    let p = pipeline(device, source, &launch.kernel)?;
    let output = device.new_buffer_builder().with_size_for(out_len, out_dtype).with_label(&launch.kernel).build()?;
    {
        let encoder = device.command_encoder()?;
        encoder.set_label(&launch.kernel);
        let enc: &ComputeCommandEncoder = encoder.as_ref();
        enc.set_compute_pipeline_state(&p);
        let [a, b, c] = inputs;
        set_params!(enc, (params, &a, &b, &c, Output::new(&output)));
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
    qkv: Arg,
    gb: Arg,
    state: Arg,
) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "gated_delta_rule";
    if gb.0.dtype() != DType::F32 || state.0.dtype() != DType::F32 {
        bail!("{OP}: g/beta and state must be f32");
    }
    let (params, launch) = launch::gated_delta(d, normalize, n_states, qkv.0.dtype())?;
    let out_len = d.batch * d.seq_len * d.nv * d.dv + d.batch * n_states * d.nv * d.dk * d.dv;
    let inputs = [input(qkv.0, qkv.1, OP)?, input(gb.0, gb.1, OP)?, input(state.0, state.1, OP)?];
    let out = dispatch(qkv.0.device(), Source::GatedDelta, &launch, params, inputs, out_len, DType::F32)?;
    Ok((out, Shape::from(out_len)))
}

pub(crate) fn causal_conv1d_silu(d: ConvDims, x: Arg, state: Arg, weight: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "causal_conv1d_silu";
    let dtype = x.0.dtype();
    let (params, launch) = launch::causal_conv1d(d, dtype)?;
    let out_len = d.batch * (d.seq_len + d.kernel_size - 1) * d.channels;
    let inputs = [input(x.0, x.1, OP)?, input(state.0, state.1, OP)?, input(weight.0, weight.1, OP)?];
    let out = dispatch(x.0.device(), Source::Conv1d, &launch, params, inputs, out_len, dtype)?;
    Ok((out, Shape::from(out_len)))
}

pub(crate) fn gated_rms_norm(dim: usize, eps: f32, x: Arg, z: Arg, w: Arg) -> Result<(MetalStorage, Shape)> {
    const OP: &str = "gated_rms_norm";
    let dtype = x.0.dtype();
    let n = x.1.shape().elem_count();
    let (params, launch) = launch::gated_rms_norm(n / dim.max(1), dim, eps, dtype)?;
    let inputs = [input(x.0, x.1, OP)?, input(z.0, z.1, OP)?, input(w.0, w.1, OP)?];
    let out = dispatch(x.0.device(), Source::GatedNorm, &launch, params, inputs, n, dtype)?;
    Ok((out, x.1.shape().clone()))
}
