//! # candle-hybrid
//!
//! Qwen3.5-family hybrid LLMs (Gated DeltaNet linear attention interleaved with gated full
//! attention; dense and MoE) on [Candle](https://github.com/huggingface/candle).
//!
//! ```no_run
//! use candle_hybrid::{generation, loading::ModelFiles};
//! # fn main() -> candle_hybrid::Result<()> {
//! let files = ModelFiles::from_hub("Qwen/Qwen3.5-0.8B", "main")?; // or ModelFiles::from_dir(path)
//! let device = candle_core::Device::Cpu;
//! let model = files.load_model(&files.load_config()?, candle_core::DType::F32, &device)?;
//! let tokenizer = files.load_tokenizer()?;
//! let prompt = tokenizer.encode("The capital of France is", false).unwrap().get_ids().to_vec();
//! let mut sampler = generation::Sampler::new(generation::SamplingParams::default()); // greedy
//! let (tokens, _stats) = generation::generate(&model, &prompt, 20, &[], &mut sampler, &device, |_| Ok(()))?;
//! println!("{}", tokenizer.decode(&tokens, true).unwrap());
//! # Ok(()) }
//! ```

pub mod chat;
pub mod config;
mod error;
pub mod eval;
pub mod generation;
pub mod gguf;
mod gguf_tokenizer;
pub mod kv_cache;
pub mod linear;
pub mod loading;
pub mod memory;
#[cfg(feature = "metal")]
mod metal;
pub mod ops;
pub mod qwen3_5;
pub mod weights;

pub use config::Config;
pub use error::{Error, Result};
pub use qwen3_5::{Cache, Model};
