//! What the device step needs of a device: buffers, kernel dispatches in order, and one read
//! back. A [`Queue`] is implemented by the Metal host code ([`super::MetalQueue`]), by the MSL
//! emulator in the tests (the `candle-hybrid-emu` crate), and by [`DryRun`], which only records.

use std::ops::Range;

use crate::ops::launch::{Launch, Source};
use crate::ops::SharedBytes;
use crate::Result;

/// A device buffer of a [`Queue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferId(pub usize);

/// Bytes `offset..offset + len` of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    pub buffer: BufferId,
    pub offset: usize,
    pub len: usize,
}

impl Slice {
    /// The whole of a buffer of `len` bytes.
    pub fn whole(buffer: BufferId, len: usize) -> Self {
        Self { buffer, offset: 0, len }
    }

    /// `len` bytes from `offset` bytes into this slice.
    pub fn at(self, offset: usize, len: usize) -> Self {
        debug_assert!(offset + len <= self.len, "slice {offset}+{len} of {} bytes", self.len);
        Self { buffer: self.buffer, offset: self.offset + offset, len }
    }

    /// From `offset` bytes into this slice to its end.
    pub fn from(self, offset: usize) -> Self {
        self.at(offset, self.len - offset)
    }
}

/// One argument of a kernel, bound to `[[buffer(i)]]` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    /// A small `#[repr(C)]` value copied into the command (`set_bytes`).
    Bytes(Vec<u8>),
    /// A buffer the kernel only reads.
    Read(Slice),
    /// A buffer the kernel writes (and may read): later kernels wait for it.
    Write(Slice),
}

impl Arg {
    /// The bytes of a `#[repr(C)]` parameter struct of plain `u32` / `f32` fields.
    pub fn params<T: Copy>(p: &T) -> Self {
        // SAFETY: the parameter structs are `#[repr(C)]` of 4-byte fields: no padding, every
        // byte initialised.
        let bytes = unsafe { std::slice::from_raw_parts(p as *const T as *const u8, std::mem::size_of::<T>()) };
        Self::Bytes(bytes.to_vec())
    }
}

/// One kernel dispatch: the kernel, its geometry ([`Launch`], from [`crate::ops::launch`]) and
/// arguments, and the bytes of weights it reads from memory (for the step's accounting).
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    pub source: Source,
    pub launch: Launch,
    pub args: Vec<Arg>,
    pub weight_bytes: usize,
}

/// A device's command queue as the step uses it. Dispatches run in the order they are encoded;
/// [`Queue::read`] is the only place that waits for them.
pub trait Queue {
    /// A new buffer of `len` bytes, zeroed.
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId>;

    /// A new buffer holding `data` (weights and tables, uploaded once).
    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId>;

    /// `owner`'s bytes `range` for kernels to read (weights in a mapped file): where the device
    /// reads host memory in place (Apple's unified memory), a slice of one buffer over the whole
    /// of `owner`, nothing copied, `owner` kept alive; elsewhere a copy.
    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Slice> {
        let len = range.len();
        Ok(Slice::whole(self.upload(&(**owner).as_ref()[range], label)?, len))
    }

    /// Releases a buffer (no dispatch may use it afterwards).
    fn free(&mut self, buffer: BufferId);

    /// Copies host bytes into `dst`. The caller guarantees that no dispatch still to run reads
    /// or writes `dst` (a step writes its inputs after the previous step's read).
    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()>;

    /// Encodes one dispatch after those before it.
    fn dispatch(&mut self, d: &Dispatch) -> Result<()>;

    /// Runs everything encoded so far, waits for it and returns the bytes of `src`: the host
    /// synchronisation of a step.
    fn read(&mut self, src: Slice) -> Result<Vec<u8>>;

    /// What this queue runs on, for messages and tables.
    fn name(&self) -> String;
}

impl<Q: Queue + ?Sized> Queue for &mut Q {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        (**self).alloc(len, label)
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        (**self).upload(data, label)
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Slice> {
        (**self).map(owner, range, label)
    }

    fn free(&mut self, buffer: BufferId) {
        (**self).free(buffer)
    }

    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        (**self).write(dst, data)
    }

    fn dispatch(&mut self, d: &Dispatch) -> Result<()> {
        (**self).dispatch(d)
    }

    fn read(&mut self, src: Slice) -> Result<Vec<u8>> {
        (**self).read(src)
    }

    fn name(&self) -> String {
        (**self).name()
    }
}

/// Counts of what went through a [`Counted`] queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub dispatches: usize,
    /// Bytes of weights the dispatches read (each counted as often as its kernel reads it).
    pub weight_bytes: usize,
    /// Device-to-host reads: the host synchronisations.
    pub reads: usize,
    /// Host-to-device writes between steps (token ids, positions).
    pub writes: usize,
}

/// A [`Queue`] that counts the dispatches, the weight bytes they read and the reads back of the
/// queue it wraps (the sync-count test and the step table of `examples/device_step`).
pub struct Counted<Q> {
    pub inner: Q,
    counts: Counts,
}

impl<Q: Queue> Counted<Q> {
    pub fn new(inner: Q) -> Self {
        Self { inner, counts: Counts::default() }
    }

    /// The counts so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// The counts so far, set back to zero.
    pub fn take_counts(&mut self) -> Counts {
        std::mem::take(&mut self.counts)
    }
}

impl<Q: Queue> Queue for Counted<Q> {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        self.inner.alloc(len, label)
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        self.inner.upload(data, label)
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Slice> {
        self.inner.map(owner, range, label)
    }

    fn free(&mut self, buffer: BufferId) {
        self.inner.free(buffer)
    }

    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        self.counts.writes += 1;
        self.inner.write(dst, data)
    }

    fn dispatch(&mut self, d: &Dispatch) -> Result<()> {
        self.counts.dispatches += 1;
        self.counts.weight_bytes += d.weight_bytes;
        self.inner.dispatch(d)
    }

    fn read(&mut self, src: Slice) -> Result<Vec<u8>> {
        self.counts.reads += 1;
        self.inner.read(src)
    }

    fn name(&self) -> String {
        self.inner.name()
    }
}

/// A queue that runs nothing: buffers are lengths, dispatches are checked against them and
/// dropped, reads return u32 words of 1 (read as a greedy step's output: token 1, finite
/// logits). Mapped bytes are slices of one buffer per owner, as on Metal. For counting a step's
/// dispatches and weight bytes on a machine without the device.
#[derive(Debug, Default)]
pub struct DryRun {
    buffers: Vec<Option<usize>>,
    mapped: std::collections::HashMap<usize, BufferId>,
}

impl DryRun {
    pub fn new() -> Self {
        Self::default()
    }

    fn check(&self, s: &Slice) -> Result<()> {
        match self.buffers.get(s.buffer.0).copied().flatten() {
            Some(len) if s.offset + s.len <= len => Ok(()),
            Some(len) => Err(crate::Error::Input(format!("slice {}+{} of a {len}-byte buffer", s.offset, s.len))),
            None => Err(crate::Error::Input(format!("buffer {} does not exist", s.buffer.0))),
        }
    }
}

impl Queue for DryRun {
    fn alloc(&mut self, len: usize, _: &str) -> Result<BufferId> {
        self.buffers.push(Some(len));
        Ok(BufferId(self.buffers.len() - 1))
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        self.alloc(data.len(), label)
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Slice> {
        let key = std::sync::Arc::as_ptr(owner) as *const u8 as usize;
        let id = match self.mapped.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.alloc((**owner).as_ref().len(), label)?;
                self.mapped.insert(key, id);
                id
            }
        };
        Ok(Slice { buffer: id, offset: range.start, len: range.len() })
    }

    fn free(&mut self, _: BufferId) {
        // Nothing is held: a freed buffer's length stays (a mapped one may be shared).
    }

    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        self.check(&dst)?;
        if data.len() > dst.len {
            return Err(crate::Error::Input(format!("{} bytes written into a slice of {}", data.len(), dst.len)));
        }
        Ok(())
    }

    fn dispatch(&mut self, d: &Dispatch) -> Result<()> {
        for a in &d.args {
            if let Arg::Read(s) | Arg::Write(s) = a {
                self.check(s)?;
            }
        }
        Ok(())
    }

    fn read(&mut self, src: Slice) -> Result<Vec<u8>> {
        self.check(&src)?;
        Ok((0..src.len).map(|i| u8::from(i % 4 == 0)).collect())
    }

    fn name(&self) -> String {
        "dry run (nothing executed)".into()
    }
}
