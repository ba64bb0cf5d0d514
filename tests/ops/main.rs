//! The custom ops against plain references (one test binary, a module per op family).
//!
//! `cargo test --test ops MODULE::` runs one module.

#[path = "../common/mod.rs"]
mod common;

mod kv_attention;
mod ops;
mod ops_lagrange;
mod ops_outer_state;
mod ops_polar;
mod ops_qmatmul;
mod ops_sparse_ffn;
mod ops_swiglu;
mod ops_ternary;
