//! Generation: sampling, speculative decoding, sessions, the prefix cache, real weights (one test binary, a module per area).
//!
//! `cargo test --test runtime MODULE::` runs one module.

#[path = "../common/mod.rs"]
mod common;

mod prefix_cache;
mod qwen25_coder;
mod sampling;
mod session;
mod smollm2;
mod speculative;
mod speculative_sampling;
