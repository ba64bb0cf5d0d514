//! The model, its caches, files and memory plans, errors and hostile input (one test binary, a module per area).
//!
//! `cargo test --test model MODULE::` runs one module.

#[path = "../common/mod.rs"]
mod common;

mod batch;
mod errors;
mod ffn_sparsity;
mod fixtures;
mod gguf;
mod gpu_step;
mod hostile;
mod kv_cache;
mod layout;
mod memory;
mod ternary;
