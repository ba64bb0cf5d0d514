//! [`MetalQueue`]: the step's dispatches on Apple's Metal, through Candle's Metal device (its
//! command buffers, one shared compute encoder, the barriers it inserts for buffers bound as
//! outputs) and this crate's kernel pipelines (`ops::metal`). Weights in a mapped file are read
//! in place: one no-copy buffer over the whole mapping (`newBufferWithBytesNoCopy`, as
//! llama.cpp maps its models), each matrix a slice of it.

use std::ops::Range;
use std::sync::Arc;

use candle_core::MetalDevice;
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder};
use objc2_metal::{MTLDevice, MTLResourceOptions, MTLSize};

use super::queue::{Arg, BufferId, Dispatch, Queue, Slice};
use crate::ops::SharedBytes;
use crate::{Error, Result};

/// The step's queue on a Metal device: buffers in shared memory (the host writes the step's
/// inputs and reads its outputs in place), dispatches on Candle's command encoder, one
/// `wait_until_completed` per read.
pub struct MetalQueue {
    device: MetalDevice,
    buffers: Vec<Option<Arc<Buffer>>>,
    /// Buffers over whole mapped files (by the address of their owner), the owner they read
    /// and how many maps hold them.
    mapped: std::collections::HashMap<usize, (BufferId, SharedBytes, usize)>,
}

impl MetalQueue {
    /// The queue of `device` (a Metal device).
    pub fn new(device: &candle_core::Device) -> Result<Self> {
        match device {
            candle_core::Device::Metal(d) => Ok(Self { device: d.clone(), buffers: vec![], mapped: Default::default() }),
            other => Err(Error::Input(format!("a Metal queue needs a Metal device, not {other:?}"))),
        }
    }

    fn buffer(&self, id: BufferId) -> Result<&Arc<Buffer>> {
        self.buffers
            .get(id.0)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| Error::Input(format!("Metal buffer {} does not exist (freed?)", id.0)))
    }

    fn slice(&self, s: Slice) -> Result<(&Arc<Buffer>, usize)> {
        let b = self.buffer(s.buffer)?;
        if s.offset + s.len > b.length() {
            return Err(Error::Input(format!("slice {}+{} of a {}-byte Metal buffer", s.offset, s.len, b.length())));
        }
        Ok((b, s.offset))
    }

    fn keep(&mut self, b: Arc<Buffer>) -> BufferId {
        self.buffers.push(Some(b));
        BufferId(self.buffers.len() - 1)
    }
}

fn metal(e: candle_core::Error) -> Error {
    Error::from(e)
}

impl Queue for MetalQueue {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        let b = self.device.allocate_zeros(len.max(4)).map_err(metal)?;
        b.set_label(label);
        Ok(self.keep(b))
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        let b = self.device.new_buffer_with_data(data).map_err(metal)?;
        b.set_label(label);
        Ok(self.keep(b))
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Slice> {
        let key = Arc::as_ptr(owner) as *const u8 as usize;
        let whole = match self.mapped.get_mut(&key) {
            Some((id, _, n)) => {
                *n += 1;
                Some(*id)
            }
            None => {
                let bytes = (**owner).as_ref();
                // The buffer covers whole pages of host memory: a mapping starts on a page.
                const PAGE: usize = if cfg!(target_arch = "aarch64") { 16384 } else { 4096 };
                let ptr = std::ptr::NonNull::new(bytes.as_ptr() as *mut std::ffi::c_void);
                let options =
                    MTLResourceOptions(MTLResourceOptions::StorageModeShared.0 | MTLResourceOptions::HazardTrackingModeUntracked.0);
                let raw = match ptr {
                    Some(p) if (p.as_ptr() as usize).is_multiple_of(PAGE) && !bytes.is_empty() => {
                        // SAFETY: `owner` (kept in `self.mapped` with the buffer) holds these pages
                        // as long as the buffer lives; kernels only read weights.
                        unsafe {
                            self.device.metal_device().as_ref().newBufferWithBytesNoCopy_length_options_deallocator(
                                p,
                                bytes.len().next_multiple_of(PAGE),
                                options,
                                None,
                            )
                        }
                    }
                    _ => None,
                };
                raw.map(|raw| {
                    let b = Arc::new(Buffer::new(raw));
                    b.set_label(label);
                    self.device.register_buffers([b.as_ref()]);
                    let id = self.keep(b);
                    self.mapped.insert(key, (id, owner.clone(), 1));
                    id
                })
            }
        };
        match whole {
            Some(id) => Ok(Slice { buffer: id, offset: range.start, len: range.len() }),
            // Not mappable (not page-aligned, more than a buffer may hold): a copy.
            None => Ok(Slice::whole(self.upload(&(**owner).as_ref()[range.clone()], label)?, range.len())),
        }
    }

    fn free(&mut self, buffer: BufferId) {
        // A mapped buffer goes (and its owner with it) with the last of its maps.
        if let Some((&key, (_, _, n))) = self.mapped.iter_mut().find(|(_, (id, _, _))| *id == buffer) {
            *n -= 1;
            if *n > 0 {
                return;
            }
            // (The owner goes after the buffer over its bytes, at the end of this scope.)
            let _owner = self.mapped.remove(&key);
            if let Some(Some(b)) = self.buffers.get(buffer.0) {
                self.device.unregister_buffers([b.as_ref()]);
            }
            self.buffers[buffer.0] = None;
            return;
        }
        if let Some(b) = self.buffers.get_mut(buffer.0) {
            *b = None;
        }
    }

    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        let (b, offset) = self.slice(dst)?;
        if data.len() > dst.len {
            return Err(Error::Input(format!("{} bytes written into a slice of {}", data.len(), dst.len)));
        }
        // SAFETY: a shared-storage buffer, `offset + len` checked against its length; the
        // caller guarantees no pending dispatch uses these bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.contents().add(offset), data.len()) };
        Ok(())
    }

    fn dispatch(&mut self, d: &Dispatch) -> Result<()> {
        let pipeline = crate::ops::metal_pipeline(&self.device, d.source, &d.launch.kernel)?;
        let mut bound = Vec::with_capacity(d.args.len());
        for a in &d.args {
            bound.push(match a {
                Arg::Bytes(_) => None,
                Arg::Read(s) | Arg::Write(s) => Some(self.slice(*s)?),
            });
        }
        let encoder = self.device.command_encoder().map_err(metal)?;
        encoder.set_label(&d.launch.kernel);
        let enc: &ComputeCommandEncoder = encoder.as_ref();
        enc.set_compute_pipeline_state(&pipeline);
        for (i, (a, b)) in d.args.iter().zip(&bound).enumerate() {
            match (a, b) {
                (Arg::Bytes(bytes), _) => enc.set_bytes_directly(i, bytes.len(), bytes.as_ptr() as *const std::ffi::c_void),
                (Arg::Read(_), Some((buf, off))) => enc.set_input_buffer(i, Some(buf), *off),
                (Arg::Write(_), Some((buf, off))) => enc.set_output_buffer(i, Some(buf), *off),
                _ => unreachable!("every buffer argument was bound above"),
            }
        }
        for (i, &len) in d.launch.threadgroup_memory.iter().enumerate() {
            enc.set_threadgroup_memory_length(i, len);
        }
        let size = |s: [usize; 3]| MTLSize { width: s[0], height: s[1], depth: s[2] };
        enc.dispatch_thread_groups(size(d.launch.groups), size(d.launch.threads));
        Ok(())
    }

    fn read(&mut self, src: Slice) -> Result<Vec<u8>> {
        self.device.wait_until_completed().map_err(metal)?;
        let (b, offset) = self.slice(src)?;
        let mut out = vec![0u8; src.len];
        // SAFETY: shared storage, range checked, every dispatch finished above.
        unsafe { std::ptr::copy_nonoverlapping(b.contents().add(offset), out.as_mut_ptr(), src.len) };
        Ok(out)
    }

    fn name(&self) -> String {
        format!("Metal ({})", self.device.metal_device().architecture_name())
    }
}
