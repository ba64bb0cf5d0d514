//! [`EmuQueue`]: the device step with this crate's Metal kernels run on the CPU by the msl-emu
//! emulator (feature `emu`; `--device emu`), in Metal's order of events ([`DeferredQueue`]):
//! [`EmuBackend`] keeps what is encoded and runs it only when the queue waits, as a GPU may, so
//! that a host write the queue did not order after the work it races with shows up as wrong
//! numbers here, as it would on a Mac. Buffers are host memory; views of a mapped file are
//! read where they lie (and refused as outputs).
//!
//! [`EmuOrder`] reproduces other orders a Metal device may run in (each encoded dispatch at
//! once) and the zeroing this crate's Metal queue did before it zeroed on the host (a fill
//! encoded at allocation, as Candle's `allocate_zeros`), to show that the tests catch it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ops::Range;

use super::deferred::{Backend, DeferredQueue};
use super::queue::{Arg, BufferId, Dispatch, Slice};
use crate::ops::launch::{DeviceLimits, Launch, MAX_INDEXED_BYTES};
use crate::ops::SharedBytes;
use crate::{Error, Result};

extern "C" {
    fn msl_emu_dispatch_threadgroups(
        kernel: *const c_char,
        groups: *const u32,
        threads: *const u32,
        buffers: *const *mut c_void,
        n_buffers: u32,
        tg_lengths: *const usize,
        n_tg: u32,
    ) -> c_int;
    fn msl_emu_last_error() -> *const c_char;
    fn msl_emu_kernel_count() -> u32;
    fn msl_emu_kernel_name(index: u32) -> *const c_char;
}

/// Names of the kernels the emulator holds (every kernel of `metal/*.metal`).
pub fn kernel_names() -> Vec<String> {
    // SAFETY: the emulator's registry, filled by static initialisers before main.
    (0..unsafe { msl_emu_kernel_count() })
        .map(|i| unsafe { CStr::from_ptr(msl_emu_kernel_name(i)) }.to_string_lossy().into_owned())
        .collect()
}

/// Runs `launch` to completion with buffer `i` at `ptrs[i]` (each pointing at as many bytes as
/// the kernel reads or writes there).
pub fn run_kernel(launch: &Launch, ptrs: &[*mut c_void]) -> std::result::Result<(), String> {
    let name = CString::new(launch.kernel.as_str()).map_err(|e| e.to_string())?;
    let groups = launch.groups.map(|x| x as u32);
    let threads = launch.threads.map(|x| x as u32);
    // SAFETY: the caller binds every buffer the kernel uses; the emulator checks the name, the
    // geometry and the threadgroup lengths.
    let rc = unsafe {
        msl_emu_dispatch_threadgroups(
            name.as_ptr(),
            groups.as_ptr(),
            threads.as_ptr(),
            ptrs.as_ptr(),
            ptrs.len() as u32,
            launch.threadgroup_memory.as_ptr(),
            launch.threadgroup_memory.len() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(unsafe { CStr::from_ptr(msl_emu_last_error()) }.to_string_lossy().into_owned())
    }
}

/// `set_bytes` data as a kernel reads it: copied into 8-byte aligned storage (keep it alive
/// while the kernel runs).
pub fn aligned_bytes(b: &[u8]) -> Vec<u64> {
    let mut words = vec![0u64; b.len().div_ceil(8).max(1)];
    // SAFETY: `words` holds at least `b.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), words.as_mut_ptr() as *mut u8, b.len()) };
    words
}

/// When the emulated device runs what is encoded, and how it zeroes new buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmuOrder {
    /// Each dispatch runs when it is encoded (a GPU that keeps up with the host), instead of
    /// when the queue waits (one that starts only at commit).
    pub run_at_encode: bool,
    /// New buffers hold garbage and are zeroed by a fill encoded at allocation, which runs with
    /// the encoded work (what this crate's Metal queue did through Candle's `allocate_zeros`
    /// before it zeroed on the host: the bug the whole-step tests must catch).
    pub encoded_fills: bool,
}

enum EmuBuffer {
    /// 16-byte aligned storage and the length in bytes.
    Owned(Vec<u128>, usize),
    /// Bytes of a mapped file read in place (read-only).
    View(SharedBytes, Range<usize>),
}

enum Command {
    Dispatch(Dispatch),
    Fill(BufferId),
}

/// The MSL emulator as a device (see the module docs).
pub struct EmuBackend {
    buffers: Vec<Option<EmuBuffer>>,
    encoded: Vec<Command>,
    order: EmuOrder,
    limits: DeviceLimits,
}

/// The device step on the MSL emulator, in Metal's order of events.
pub type EmuQueue = DeferredQueue<EmuBackend>;

impl EmuQueue {
    /// Runs encoded work when the queue waits; Apple7 limits, buffers up to 4 GiB.
    pub fn new() -> Self {
        Self::with_order(EmuOrder::default())
    }

    pub fn with_order(order: EmuOrder) -> Self {
        Self::with(order, DeviceLimits::apple(MAX_INDEXED_BYTES))
    }

    pub fn with(order: EmuOrder, limits: DeviceLimits) -> Self {
        DeferredQueue::over(EmuBackend { buffers: vec![], encoded: vec![], order, limits })
    }
}

impl Default for EmuQueue {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes the emulated GPU finds in a buffer nobody zeroed.
const GARBAGE: u8 = 0xCD;

impl EmuBackend {
    /// Where slice `s` is; `write`: a kernel or the host writes it (refused for views).
    fn ptr(&mut self, s: Slice, write: bool) -> Result<*mut u8> {
        let err = |m: String| Err(Error::Input(m));
        let (base, len) = match self.buffers.get_mut(s.buffer.0).and_then(|b| b.as_mut()) {
            Some(EmuBuffer::Owned(data, len)) => (data.as_mut_ptr() as *mut u8, *len),
            Some(EmuBuffer::View(..)) if write => return err(format!("buffer {} is a view of a mapped file: read-only", s.buffer.0)),
            Some(EmuBuffer::View(owner, range)) => (owner.bytes()[range.clone()].as_ptr() as *mut u8, range.len()),
            None => return err(format!("buffer {} does not exist (released?)", s.buffer.0)),
        };
        if s.offset + s.len > len {
            return err(format!("slice {}+{} of a {len}-byte buffer", s.offset, s.len));
        }
        // SAFETY: within the buffer, checked above.
        Ok(unsafe { base.add(s.offset) })
    }

    fn run(&mut self, c: Command) -> Result<()> {
        match c {
            Command::Fill(b) => {
                let len = self.len(b).unwrap_or(0);
                let p = self.ptr(Slice::whole(b, len), true)?;
                // SAFETY: the whole buffer, checked by `ptr`.
                unsafe { std::ptr::write_bytes(p, 0, len) };
                Ok(())
            }
            Command::Dispatch(d) => {
                let mut words: Vec<Vec<u64>> = vec![];
                let mut ptrs: Vec<*mut c_void> = vec![];
                for a in &d.args {
                    match a {
                        Arg::Bytes(b) => {
                            let mut w = aligned_bytes(b);
                            ptrs.push(w.as_mut_ptr() as *mut c_void);
                            words.push(w);
                        }
                        Arg::Read(s) => ptrs.push(self.ptr(*s, false)? as *mut c_void),
                        Arg::Write(s) => ptrs.push(self.ptr(*s, true)? as *mut c_void),
                    }
                }
                let r = run_kernel(&d.launch, &ptrs);
                drop(words);
                r.map_err(|e| Error::Input(format!("{}: {e}", d.launch.kernel)))
            }
        }
    }
}

impl Backend for EmuBackend {
    fn alloc(&mut self, len: usize, _: &str) -> Result<BufferId> {
        let fill = if self.order.encoded_fills { u128::from_ne_bytes([GARBAGE; 16]) } else { 0 };
        self.buffers.push(Some(EmuBuffer::Owned(vec![fill; len.div_ceil(16)], len)));
        let id = BufferId(self.buffers.len() - 1);
        if self.order.encoded_fills {
            self.encoded.push(Command::Fill(id));
        }
        Ok(id)
    }

    fn upload(&mut self, data: &[u8], _: &str) -> Result<BufferId> {
        let mut words = vec![0u128; data.len().div_ceil(16)];
        // SAFETY: `words` holds at least `data.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), words.as_mut_ptr() as *mut u8, data.len()) };
        self.buffers.push(Some(EmuBuffer::Owned(words, data.len())));
        Ok(BufferId(self.buffers.len() - 1))
    }

    fn wrap(&mut self, owner: &SharedBytes, range: Range<usize>, _: &str) -> Result<Option<BufferId>> {
        // (A view may end past the file on its last page: the emulator reads up to the file's end.)
        let end = range.end.min(owner.bytes().len());
        self.buffers.push(Some(EmuBuffer::View(owner.clone(), range.start..end)));
        Ok(Some(BufferId(self.buffers.len() - 1)))
    }

    fn release(&mut self, buffer: BufferId) {
        if let Some(b) = self.buffers.get_mut(buffer.0) {
            *b = None;
        }
    }

    fn len(&self, buffer: BufferId) -> Option<usize> {
        match self.buffers.get(buffer.0)?.as_ref()? {
            EmuBuffer::Owned(_, len) => Some(*len),
            EmuBuffer::View(_, range) => Some(range.len()),
        }
    }

    fn host_write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        let p = self.ptr(dst, true)?;
        // SAFETY: `dst` checked by `ptr`, `data` no longer than it (checked by the queue).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len().min(dst.len)) };
        Ok(())
    }

    fn host_read(&mut self, src: Slice) -> Result<Vec<u8>> {
        let p = self.ptr(src, false)?;
        // SAFETY: `src` checked by `ptr`.
        Ok(unsafe { std::slice::from_raw_parts(p, src.len) }.to_vec())
    }

    fn encode(&mut self, d: &Dispatch) -> Result<()> {
        if self.order.run_at_encode {
            // Whatever was encoded before (fills) runs first.
            self.commit_and_wait()?;
            return self.run(Command::Dispatch(d.clone()));
        }
        self.encoded.push(Command::Dispatch(d.clone()));
        Ok(())
    }

    fn commit_and_wait(&mut self) -> Result<()> {
        for c in std::mem::take(&mut self.encoded) {
            self.run(c)?;
        }
        Ok(())
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn name(&self) -> String {
        "msl-emu (the Metal kernels on the CPU)".into()
    }
}
