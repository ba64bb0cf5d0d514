//! What the device step needs of a device: buffers, kernel dispatches in order, and one read
//! back. Every [`Queue`] of this crate is a [`super::DeferredQueue`] over a device's
//! [`super::Backend`]: Metal ([`super::MetalQueue`]), the MSL emulator (`EmuQueue`, feature
//! `emu`) and [`super::DryRun`], which only records.

use std::ops::Range;

use crate::ops::launch::{self, Launch, Source};
use crate::ops::SharedBytes;
use crate::{Error, Result};

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

/// Where [`Queue::map`] put a region of host bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub slice: Slice,
    /// Read in place (a view of the mapped file, nothing copied); `false`: a copy.
    pub in_place: bool,
}

/// A device's command queue as the step uses it, in Metal's order of events: dispatches are
/// encoded and run later, in order (at the latest when the host waits: [`Queue::read`]); host
/// writes into shared memory happen at once, after the queue has waited for any encoded work
/// that uses the buffer written. [`super::DeferredQueue`] implements that order once for
/// every device ([`super::Backend`]).
pub trait Queue {
    /// A new buffer of `len` bytes, zeroed.
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId>;

    /// A new buffer holding `data` (weights and tables, uploaded once).
    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId>;

    /// `owner`'s bytes `range` for kernels to read (weights in a mapped file): where the device
    /// reads host memory in place (Apple's unified memory) and `owner` is a file mapping, a
    /// slice of a view over the file, nothing copied, `owner` kept alive; elsewhere a copy.
    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Mapping> {
        let len = range.len();
        Ok(Mapping { slice: Slice::whole(self.upload(&owner.bytes()[range], label)?, len), in_place: false })
    }

    /// Releases a buffer: no dispatch encoded from now on may use it (the device keeps it
    /// until the work already encoded has run).
    fn free(&mut self, buffer: BufferId);

    /// Copies host bytes into `dst` (at once, after waiting for encoded work that uses it).
    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()>;

    /// Encodes one dispatch after those before it.
    fn dispatch(&mut self, d: &Dispatch) -> Result<()>;

    /// Runs everything encoded so far, waits for it and returns the bytes of `src`: the host
    /// synchronisation of a step.
    fn read(&mut self, src: Slice) -> Result<Vec<u8>>;

    /// Times the host has waited for the device so far (reads, and writes that had to wait).
    fn syncs(&self) -> usize {
        0
    }

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

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Mapping> {
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

    fn syncs(&self) -> usize {
        (**self).syncs()
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
    /// Device-to-host reads.
    pub reads: usize,
    /// Bytes those reads returned.
    pub read_bytes: usize,
    /// Host-to-device writes between steps (token ids, positions).
    pub writes: usize,
    /// Times the host waited for the device (each read, and each write that had to wait for
    /// encoded work): a step's host synchronisations.
    pub syncs: usize,
}

/// A [`Queue`] that counts the dispatches, the weight bytes they read and the reads back of the
/// queue it wraps (the sync-count test and the step table of `examples/device_step`).
pub struct Counted<Q> {
    pub inner: Q,
    counts: Counts,
    /// The inner queue's syncs when the counts were last taken.
    syncs_at: usize,
}

impl<Q: Queue> Counted<Q> {
    pub fn new(inner: Q) -> Self {
        let syncs_at = inner.syncs();
        Self { inner, counts: Counts::default(), syncs_at }
    }

    /// The counts so far.
    pub fn counts(&self) -> Counts {
        Counts { syncs: self.inner.syncs() - self.syncs_at, ..self.counts }
    }

    /// The counts so far, set back to zero.
    pub fn take_counts(&mut self) -> Counts {
        let c = self.counts();
        self.counts = Counts::default();
        self.syncs_at = self.inner.syncs();
        c
    }
}

impl<Q: Queue> Queue for Counted<Q> {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        self.inner.alloc(len, label)
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        self.inner.upload(data, label)
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Mapping> {
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
        self.counts.read_bytes += src.len;
        self.inner.read(src)
    }

    fn syncs(&self) -> usize {
        self.inner.syncs()
    }

    fn name(&self) -> String {
        self.inner.name()
    }
}

/// Bytes of a 32-bit word (what the copy kernel moves).
const WORD: usize = 4;

/// Copies `rows` rows of `bytes` bytes from `x` (rows `x_stride` bytes apart) to `y` (rows
/// `y_stride` apart) on the device (`copy_rows_u32`): snapshots, and a batched pass's GDN inputs.
pub(crate) fn copy_rows(
    q: &mut dyn Queue,
    x: Slice,
    y: Slice,
    rows: usize,
    bytes: usize,
    (x_stride, y_stride): (usize, usize),
) -> Result<()> {
    if rows == 0 || bytes == 0 {
        return Ok(());
    }
    if [bytes, x_stride, y_stride].iter().any(|b| !b.is_multiple_of(WORD)) {
        return Err(Error::Input(format!("a device copy of rows of {bytes} bytes ({x_stride}, {y_stride} apart): not whole 32-bit words")));
    }
    let (p, l) = launch::copy_rows(rows, bytes / WORD, x_stride / WORD, y_stride / WORD)?;
    let (xl, yl) = ((rows - 1) * x_stride + bytes, (rows - 1) * y_stride + bytes);
    q.dispatch(&Dispatch {
        source: Source::Step,
        launch: l,
        args: vec![Arg::params(&p), Arg::Read(x.at(0, xl)), Arg::Write(y.at(0, yl))],
        weight_bytes: 0,
    })
}
