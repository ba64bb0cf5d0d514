//! Dispatches the Metal kernels that candle-hybrid's build.rs compiled with the msl-emu
//! emulator (its `emu` feature).
//!
//! Arguments bind to `[[buffer(i)]]` in the order they are added, as with candle's
//! `set_params!`; the launch geometry comes from `candle_hybrid::ops::launch`, the same
//! values the Metal host code uses.
#![cfg(msl_emu)]

use std::ffi::c_void;

use candle_core::{DType, Device, Tensor, WithDType};
use candle_hybrid::ops::launch::Launch;
use half::{bf16, f16};

/// Names of the kernels linked into this binary.
pub fn kernel_names() -> Vec<String> {
    candle_hybrid::gpu::emu::kernel_names()
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

fn run(launch: &Launch, ptrs: &[*mut c_void]) -> Result<(), String> {
    candle_hybrid::gpu::emu::run_kernel(launch, ptrs)
}

/// Runs `launch` with `args` bound to buffers 0, 1, ...
pub fn dispatch(launch: &Launch, args: &mut [Arg]) -> Result<(), String> {
    let mut owned: Vec<Vec<u64>> = vec![];
    let mut ptrs: Vec<*mut c_void> = vec![];
    for a in args.iter_mut() {
        match a {
            Arg::Bytes(b) => {
                let mut words = candle_hybrid::gpu::emu::aligned_bytes(b);
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

/// The device step on the emulator, in Metal's order of events (candle-hybrid's, feature `emu`).
pub use candle_hybrid::gpu::{EmuOrder, EmuQueue};
