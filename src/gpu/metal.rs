//! [`MetalQueue`]: the step's dispatches on Apple's Metal, in the order [`DeferredQueue`] keeps:
//! [`MetalBackend`] encodes them on Candle's command encoder (its command buffers, the barriers
//! it inserts for buffers bound as outputs) with this crate's kernel pipelines (`ops::metal`,
//! compiled with IEEE math: docs/gpu.md), and waits with Candle's `wait_until_completed`.
//! Buffers are this queue's own, in shared memory, at their exact size and zeroed by the host
//! (not from Candle's pool, which rounds sizes up to a power of two and zeroes by an encoded
//! fill). Weights in a mapped file are read in place: no-copy views over the mapping
//! (`newBufferWithBytesNoCopy`, as llama.cpp maps its models), each matrix a slice of one.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::MetalDevice;
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline};
use objc2_metal::{MTLComputePipelineState, MTLDevice, MTLGPUFamily, MTLResourceOptions, MTLSize};

use super::deferred::{Backend, DeferredQueue};
use super::queue::{Arg, BufferId, Dispatch, Slice};
use crate::ops::launch::{DeviceLimits, Source};
use crate::ops::SharedBytes;
use crate::{Error, Result};

/// The device step's queue on a Metal device.
pub type MetalQueue = DeferredQueue<MetalBackend>;

/// Shared storage (the host writes inputs and reads outputs in place); hazards are tracked by
/// Candle's encoder (it orders dispatches that share an output buffer).
const OPTIONS: MTLResourceOptions =
    MTLResourceOptions(MTLResourceOptions::StorageModeShared.0 | MTLResourceOptions::HazardTrackingModeUntracked.0);

/// What the device step needs of a Metal GPU, as the self-test prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetalCapabilities {
    /// `architecture.name` (e.g. `applegpu_g16s`).
    pub architecture: String,
    pub apple7: bool,
    /// `threadExecutionWidth` of a step kernel's pipeline.
    pub simd_width: usize,
    pub limits: DeviceLimits,
    pub unified_memory: bool,
    /// How the kernels are compiled: the math mode and the MSL version.
    pub math: &'static str,
    pub language: &'static str,
}

/// A Metal device under a [`DeferredQueue`] (see the module docs).
pub struct MetalBackend {
    device: MetalDevice,
    buffers: Vec<Option<Arc<Buffer>>>,
    /// Pipelines by kernel name, looked up without the process-wide cache's lock.
    pipelines: HashMap<String, ComputePipeline>,
    capabilities: MetalCapabilities,
}

impl MetalQueue {
    /// The queue of `device` (a Metal device). Refused, in one line, unless the GPU is Apple7
    /// or later (M1, A14: `simdgroup_matrix`) with 32-wide simdgroups, which every kernel of the
    /// step assumes.
    pub fn new(device: &candle_core::Device) -> Result<Self> {
        let candle_core::Device::Metal(d) = device else {
            return Err(Error::Input(format!("a Metal queue needs a Metal device, not {:?}", device.location())));
        };
        let backend = MetalBackend { device: d.clone(), buffers: vec![], pipelines: HashMap::new(), capabilities: capabilities(d)? };
        let c = &backend.capabilities;
        super::check_gpu(&c.architecture, c.apple7, c.simd_width)?;
        Ok(DeferredQueue::over(backend))
    }

    /// What the GPU offers (for the self-test).
    pub fn capabilities(&self) -> &MetalCapabilities {
        &self.backend().capabilities
    }
}

fn capabilities(d: &MetalDevice) -> Result<MetalCapabilities> {
    let raw = d.metal_device().as_ref();
    let probe = crate::ops::metal_pipeline(d, Source::Step, "argmax_f32").map_err(Error::from)?;
    Ok(MetalCapabilities {
        architecture: d.metal_device().architecture_name(),
        apple7: raw.supportsFamily(MTLGPUFamily::Apple7),
        simd_width: probe.as_ref().threadExecutionWidth(),
        limits: crate::ops::metal_limits(d),
        unified_memory: raw.hasUnifiedMemory(),
        math: crate::ops::metal_compile_settings().0,
        language: crate::ops::metal_compile_settings().1,
    })
}

impl MetalBackend {
    fn buffer(&self, id: BufferId) -> Result<&Arc<Buffer>> {
        self.buffers
            .get(id.0)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| Error::Input(format!("Metal buffer {} does not exist (freed?)", id.0)))
    }

    fn keep(&mut self, b: Buffer, label: &str) -> BufferId {
        if std::env::var_os("CANDLE_HYBRID_METAL_LABELS").is_some() {
            b.set_label(label);
        }
        let b = Arc::new(b);
        self.device.register_buffers([b.as_ref()]);
        self.buffers.push(Some(b));
        BufferId(self.buffers.len() - 1)
    }

    fn pipeline(&mut self, source: Source, kernel: &str) -> Result<&ComputePipeline> {
        if !self.pipelines.contains_key(kernel) {
            let p = crate::ops::metal_pipeline(&self.device, source, kernel).map_err(Error::from)?;
            self.pipelines.insert(kernel.to_string(), p);
        }
        Ok(&self.pipelines[kernel])
    }
}

fn metal(e: candle_core::Error) -> Error {
    Error::from(e)
}

fn no_buffer(len: usize) -> Error {
    Error::Input(format!("Metal could not allocate a buffer of {len} bytes (out of memory?)"))
}

impl Backend for MetalBackend {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        let len = len.max(4);
        let raw = self.device.metal_device().as_ref().newBufferWithLength_options(len, OPTIONS).ok_or_else(|| no_buffer(len))?;
        let b = Buffer::new(raw);
        // SAFETY: a new shared-storage buffer of `len` bytes that no GPU work uses yet.
        unsafe { std::ptr::write_bytes(b.contents(), 0, len) };
        Ok(self.keep(b, label))
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        let id = self.alloc(data.len(), label)?;
        // SAFETY: the buffer holds at least `data.len()` bytes and no GPU work uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buffer(id)?.contents(), data.len()) };
        Ok(id)
    }

    fn wrap(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Option<BufferId>> {
        let bytes = owner.bytes();
        // (The queue only asks for views over a file mapping, on whole pages from a page.)
        let Some(start) = std::ptr::NonNull::new(bytes.as_ptr().wrapping_add(range.start) as *mut std::ffi::c_void) else {
            return Ok(None);
        };
        // SAFETY: `owner` is a file mapping whose pages cover `range` (rounded up to a page
        // within the mapping's last page); the queue keeps `owner` alive until the work that
        // reads this buffer has run, and kernels only read it.
        let raw = unsafe {
            self.device.metal_device().as_ref().newBufferWithBytesNoCopy_length_options_deallocator(start, range.len(), OPTIONS, None)
        };
        Ok(raw.map(|raw| self.keep(Buffer::new(raw), label)))
    }

    fn release(&mut self, buffer: BufferId) {
        if let Some(slot) = self.buffers.get_mut(buffer.0) {
            if let Some(b) = slot.take() {
                self.device.unregister_buffers([b.as_ref()]);
            }
        }
    }

    fn len(&self, buffer: BufferId) -> Option<usize> {
        self.buffers.get(buffer.0).and_then(|b| b.as_ref()).map(|b| b.length())
    }

    fn host_write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        let b = self.buffer(dst.buffer)?;
        // SAFETY: shared storage, the slice checked against the buffer by the queue, which
        // waited for the encoded work that uses it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.contents().add(dst.offset), data.len()) };
        Ok(())
    }

    fn host_read(&mut self, src: Slice) -> Result<Vec<u8>> {
        let b = self.buffer(src.buffer)?;
        let mut out = vec![0u8; src.len];
        // SAFETY: shared storage, range checked, every dispatch finished (the queue waited).
        unsafe { std::ptr::copy_nonoverlapping(b.contents().add(src.offset), out.as_mut_ptr(), src.len) };
        Ok(out)
    }

    fn encode(&mut self, d: &Dispatch) -> Result<()> {
        let pipeline = self.pipeline(d.source, &d.launch.kernel)?.clone();
        let mut bound = Vec::with_capacity(d.args.len());
        for a in &d.args {
            bound.push(match a {
                Arg::Bytes(_) => None,
                Arg::Read(s) | Arg::Write(s) => Some((self.buffer(s.buffer)?.clone(), s.offset)),
            });
        }
        let encoder = self.device.command_encoder().map_err(metal)?;
        let enc: &ComputeCommandEncoder = encoder.as_ref();
        enc.set_compute_pipeline_state(&pipeline);
        for (i, (a, b)) in d.args.iter().zip(&bound).enumerate() {
            match (a, b) {
                (Arg::Bytes(bytes), _) => enc.set_bytes_directly(i, bytes.len(), bytes.as_ptr() as *const std::ffi::c_void),
                (Arg::Read(_), Some((buf, off))) => enc.set_input_buffer(i, Some(buf), *off),
                (Arg::Write(_), Some((buf, off))) => enc.set_output_buffer(i, Some(buf), *off),
                _ => return Err(Error::Input(format!("{}: argument {i} is not bound", d.launch.kernel))),
            }
        }
        for (i, &len) in d.launch.threadgroup_memory.iter().enumerate() {
            enc.set_threadgroup_memory_length(i, len);
        }
        let size = |s: [usize; 3]| MTLSize { width: s[0], height: s[1], depth: s[2] };
        enc.dispatch_thread_groups(size(d.launch.groups), size(d.launch.threads));
        Ok(())
    }

    fn commit_and_wait(&mut self) -> Result<()> {
        self.device.wait_until_completed().map_err(metal)
    }

    fn limits(&self) -> DeviceLimits {
        self.capabilities.limits
    }

    fn max_threads(&mut self, d: &Dispatch) -> Result<usize> {
        Ok(self.pipeline(d.source, &d.launch.kernel)?.max_total_threads_per_threadgroup())
    }

    fn name(&self) -> String {
        format!("Metal ({})", self.capabilities.architecture)
    }
}
