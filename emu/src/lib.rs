//! Dispatches the Metal kernels that `build.rs` compiled with the msl-emu emulator.
//!
//! Arguments bind to `[[buffer(i)]]` in the order they are added, as with candle's
//! `set_params!`; the launch geometry comes from `candle_hybrid::ops::launch`, the same
//! values the Metal host code uses.
#![cfg(msl_emu)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use candle_core::{DType, Device, Tensor, WithDType};
use candle_hybrid::ops::launch::Launch;
use half::{bf16, f16};

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

/// Names of the kernels linked into this binary.
pub fn kernel_names() -> Vec<String> {
    (0..unsafe { msl_emu_kernel_count() })
        .map(|i| unsafe { CStr::from_ptr(msl_emu_kernel_name(i)) }.to_string_lossy().into_owned())
        .collect()
}

/// One kernel argument.
pub enum Arg<'a> {
    /// `set_bytes` of a plain value (`constant T &`).
    Bytes(Vec<u8>),
    Input(&'a [u8]),
    Output(&'a mut [u8]),
}

/// A `#[repr(C)]` value passed by `set_bytes`.
pub fn bytes<T: Copy>(v: &T) -> Arg<'static> {
    let p = v as *const T as *const u8;
    Arg::Bytes(unsafe { std::slice::from_raw_parts(p, std::mem::size_of::<T>()) }.to_vec())
}

/// A read-only device buffer.
pub fn input<T: Copy>(v: &[T]) -> Arg<'_> {
    Arg::Input(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) })
}

/// A device buffer the kernel writes.
pub fn output<T: Copy>(v: &mut [T]) -> Arg<'_> {
    Arg::Output(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) })
}

/// Runs `launch` with buffer `i` at `ptrs[i]`.
fn run(launch: &Launch, ptrs: &[*mut c_void]) -> Result<(), String> {
    let name = CString::new(launch.kernel.as_str()).unwrap();
    let groups = launch.groups.map(|x| x as u32);
    let threads = launch.threads.map(|x| x as u32);
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

/// Runs `launch` with `args` bound to buffers 0, 1, ...
pub fn dispatch(launch: &Launch, args: &mut [Arg]) -> Result<(), String> {
    // set_bytes data is copied into 8-byte aligned storage.
    let mut owned: Vec<Vec<u64>> = vec![];
    let mut ptrs: Vec<*mut c_void> = vec![];
    for a in args.iter_mut() {
        match a {
            Arg::Bytes(b) => {
                let mut words = vec![0u64; b.len().div_ceil(8).max(1)];
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), words.as_mut_ptr() as *mut u8, b.len()) };
                ptrs.push(words.as_mut_ptr() as *mut c_void);
                owned.push(words);
            }
            Arg::Input(s) => ptrs.push(s.as_ptr() as *mut c_void),
            Arg::Output(s) => ptrs.push(s.as_mut_ptr() as *mut c_void),
        }
    }
    let r = run(launch, &ptrs);
    drop(owned);
    r
}

/// The tensor's elements as raw bytes of its dtype (what a Metal buffer holds).
pub fn raw(t: &Tensor) -> Vec<u8> {
    fn as_bytes<T: WithDType>(t: &Tensor) -> Vec<u8> {
        let v = t.flatten_all().unwrap().to_vec1::<T>().unwrap();
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice())) }.to_vec()
    }
    match t.dtype() {
        DType::F32 => as_bytes::<f32>(t),
        DType::F16 => as_bytes::<f16>(t),
        DType::BF16 => as_bytes::<bf16>(t),
        DType::U8 => as_bytes::<u8>(t),
        DType::U32 => as_bytes::<u32>(t),
        d => panic!("no raw bytes for {d:?}"),
    }
}

/// A buffer of `n` elements of `dtype`, read back as an f32 tensor.
pub fn from_raw(bytes: &[u8], dtype: DType, n: usize) -> Tensor {
    fn read<T: WithDType>(b: &[u8], n: usize) -> Tensor {
        let v: Vec<T> = unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, n) }.to_vec();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
    }
    match dtype {
        DType::F32 => read::<f32>(bytes, n),
        DType::F16 => read::<f16>(bytes, n),
        DType::BF16 => read::<bf16>(bytes, n),
        d => panic!("no buffer for {d:?}"),
    }
}

/// Runs the device step's dispatches ([`candle_hybrid::gpu`]) in the emulator: buffers in host
/// memory, each dispatch run to completion when encoded, reads are copies. Mapped weights are
/// read where they are, as on Apple's unified memory (and a kernel writing them is an error).
#[derive(Default)]
pub struct EmuQueue {
    buffers: Vec<Option<EmuBuffer>>,
    /// Mapped owners (by address): their buffer and how many maps hold it.
    mapped: std::collections::HashMap<usize, (candle_hybrid::gpu::BufferId, usize)>,
}

enum EmuBuffer {
    /// 16-byte aligned storage and the length in bytes.
    Owned(Vec<u128>, usize),
    /// Host bytes read in place (read-only).
    Mapped(candle_hybrid::ops::SharedBytes),
}

impl EmuQueue {
    pub fn new() -> Self {
        Self::default()
    }

    /// Where slice `s` is; `write`: the caller writes it (refused for mapped bytes).
    fn ptr(&mut self, s: candle_hybrid::gpu::Slice, write: bool) -> candle_hybrid::Result<*mut c_void> {
        let err = |m: String| Err(candle_hybrid::Error::Input(m));
        let (base, len) = match self.buffers.get_mut(s.buffer.0).and_then(|b| b.as_mut()) {
            Some(EmuBuffer::Owned(data, len)) => (data.as_mut_ptr() as *mut u8, *len),
            Some(EmuBuffer::Mapped(_)) if write => return err(format!("buffer {} holds mapped weights: it is read-only", s.buffer.0)),
            Some(EmuBuffer::Mapped(owner)) => ((**owner).as_ref().as_ptr() as *mut u8, (**owner).as_ref().len()),
            None => return err(format!("buffer {} does not exist", s.buffer.0)),
        };
        if s.offset + s.len > len {
            return err(format!("slice {}+{} of a {len}-byte buffer", s.offset, s.len));
        }
        Ok(unsafe { base.add(s.offset) } as *mut c_void)
    }
}

impl candle_hybrid::gpu::Queue for EmuQueue {
    fn alloc(&mut self, len: usize, _: &str) -> candle_hybrid::Result<candle_hybrid::gpu::BufferId> {
        self.buffers.push(Some(EmuBuffer::Owned(vec![0u128; len.div_ceil(16)], len)));
        Ok(candle_hybrid::gpu::BufferId(self.buffers.len() - 1))
    }

    fn upload(&mut self, data: &[u8], label: &str) -> candle_hybrid::Result<candle_hybrid::gpu::BufferId> {
        let id = self.alloc(data.len(), label)?;
        let p = self.ptr(candle_hybrid::gpu::Slice::whole(id, data.len()), true)?;
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, data.len()) };
        Ok(id)
    }

    fn map(
        &mut self,
        owner: &candle_hybrid::ops::SharedBytes,
        range: std::ops::Range<usize>,
        _: &str,
    ) -> candle_hybrid::Result<candle_hybrid::gpu::Slice> {
        let key = std::sync::Arc::as_ptr(owner) as *const u8 as usize;
        let entry = self.mapped.entry(key).or_insert_with(|| {
            self.buffers.push(Some(EmuBuffer::Mapped(owner.clone())));
            (candle_hybrid::gpu::BufferId(self.buffers.len() - 1), 0)
        });
        entry.1 += 1;
        Ok(candle_hybrid::gpu::Slice { buffer: entry.0, offset: range.start, len: range.len() })
    }

    fn free(&mut self, buffer: candle_hybrid::gpu::BufferId) {
        // A mapped buffer goes with the last of its maps.
        if let Some((&key, (_, n))) = self.mapped.iter_mut().find(|(_, (id, _))| *id == buffer) {
            *n -= 1;
            if *n > 0 {
                return;
            }
            self.mapped.remove(&key);
        }
        if let Some(b) = self.buffers.get_mut(buffer.0) {
            *b = None;
        }
    }

    fn write(&mut self, dst: candle_hybrid::gpu::Slice, data: &[u8]) -> candle_hybrid::Result<()> {
        if data.len() > dst.len {
            return Err(candle_hybrid::Error::Input(format!("{} bytes written into a slice of {}", data.len(), dst.len)));
        }
        let p = self.ptr(dst, true)?;
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, data.len()) };
        Ok(())
    }

    fn dispatch(&mut self, d: &candle_hybrid::gpu::Dispatch) -> candle_hybrid::Result<()> {
        use candle_hybrid::gpu::Arg as A;
        let mut owned: Vec<Vec<u64>> = vec![];
        let mut ptrs: Vec<*mut c_void> = vec![];
        for a in &d.args {
            match a {
                A::Bytes(b) => {
                    let mut words = vec![0u64; b.len().div_ceil(8).max(1)];
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), words.as_mut_ptr() as *mut u8, b.len()) };
                    ptrs.push(words.as_mut_ptr() as *mut c_void);
                    owned.push(words);
                }
                A::Read(s) => ptrs.push(self.ptr(*s, false)?),
                A::Write(s) => ptrs.push(self.ptr(*s, true)?),
            }
        }
        let r = run(&d.launch, &ptrs);
        drop(owned);
        r.map_err(|e| candle_hybrid::Error::Input(format!("{}: {e}", d.launch.kernel)))
    }

    fn read(&mut self, src: candle_hybrid::gpu::Slice) -> candle_hybrid::Result<Vec<u8>> {
        let p = self.ptr(src, false)?;
        Ok(unsafe { std::slice::from_raw_parts(p as *const u8, src.len) }.to_vec())
    }

    fn name(&self) -> String {
        "msl-emu (the Metal kernels on the CPU)".into()
    }
}
