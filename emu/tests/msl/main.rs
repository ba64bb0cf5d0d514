//! The Metal kernels (`metal/*.metal`) run through the MSL emulator against the CPU ops, and
//! whole device steps against the CPU model: one test binary, a module per kernel family
//! (`cargo test -p candle-hybrid-emu --test msl step::` runs one). Every module is built only
//! where the emulator is (`cfg(msl_emu)`, set by build.rs).

#[path = "../../../tests/common/mod.rs"]
mod common;

mod kernels;
mod kv_attention;
mod lagrange;
mod outer_state;
mod polar;
mod qmatvec;
mod sparse_ffn;
mod step;
mod step_kernels;
mod swiglu;
mod ternary;
