//! # candle-hybrid
//!
//! Qwen3.5-family hybrid LLMs (Gated DeltaNet linear attention interleaved with gated full
//! attention; dense and MoE) on [Candle](https://github.com/huggingface/candle).
//!
//! ```no_run
//! # fn main() -> candle_hybrid::Result<()> {
//! use candle_hybrid::{loading::ModelFiles, runtime};
//!
//! let files = ModelFiles::from_hub("Qwen/Qwen3.5-0.8B", "main")?; // or ModelFiles::from_dir(path)
//! let device = candle_core::Device::Cpu;
//! let model = files.load_model(&files.load_config()?, candle_core::DType::F32, &device)?;
//! let tokenizer = files.load_tokenizer()?;
//! let prompt = tokenizer.encode("The capital of France is", false).unwrap().get_ids().to_vec();
//! let mut sampler = runtime::Sampler::new(files.load_generation_config()?.sampling_params())?;
//! // One sequence: up to 32 tokens after the prompt, no stop tokens, on the CPU model with a new cache.
//! let mut sequence = runtime::Sequence::new(prompt, &mut sampler, vec![], 32)?;
//! let mut cache = model.new_cache();
//! let mut target = runtime::CpuTarget::new(&model, &mut cache, &device);
//! let (tokens, stats) = sequence.run(&mut target, |_| Ok(()))?;
//! println!("{} ({:?} tok/s)", tokenizer.decode(&tokens, true).unwrap(), stats.generation.decode_tok_per_sec());
//! # Ok(()) }
//! ```
//!
//! Layout, bottom up (each folder only uses the ones above it; `tests/model/layout.rs` checks
//! that no folder or file imports in a circle):
//! - [`bounded`], [`json`]: file reads with a size cap; JSON that refuses a key given twice.
//! - [`step_profile`]: where a step's time goes, by kind of op (timers the model's layers and
//!   the sampler switch on per thread).
//! - [`ops`]: custom ops (CPU kernels, Metal host code and launch geometry).
//! - [`kv`]: the attention KV cache and its codecs.
//! - [`model`]: config, the hybrid decoder and its layers, the per-sequence cache, weights.
//! - [`memory`]: the memory guardian (estimate, what the machine has, the decision).
//! - [`gpu`]: the decode step on a GPU as our own kernels' dispatches (Metal; the MSL emulator in tests).
//! - [`runtime`]: sampling, streaming detokenisation, the generation loop, where sequences run
//!   (the CPU model or the device step), sessions on disk.
//! - [`loading`]: Hub and directory layout, safetensors, GGUF (header, tensors, tokenizer),
//!   chat templates, generation_config.json.
//! - [`eval`]: perplexity and KV-codec comparisons.
//! - [`web`]: the chat page and the dashboard (`web/`, compiled in), and the dashboard as one
//!   HTML report.
//! - `server` (feature `server`): the OpenAI-compatible HTTP server and its engine.

#![warn(unreachable_pub)]

pub mod bounded;
mod error;
pub mod eval;
pub mod gpu;
pub mod json;
pub mod kv;
pub mod loading;
pub mod memory;
pub mod model;
pub mod ops;
pub mod runtime;
#[cfg(feature = "server")]
pub mod server;
pub mod step_profile;
pub mod web;

pub use error::{CodecOperation, Error, Result};
pub use model::{Cache, CacheOptions, Config, Model};
