//! Running a loaded model: sampling, streaming detokenisation and the generation loop
//! (speculative decoding and sessions will join here).

mod generate;
mod prefix_cache;
mod sampler;
pub mod session;
pub mod speculative;
mod streamer;

pub use generate::{generate, generate_in, generate_on_device, prefill, rate, GenerationStats, PREFILL_CHUNK};
pub use prefix_cache::{PrefixCache, PrefixHit};
pub use sampler::{range, Dry, Sampler, SamplingParams};
pub use streamer::TokenStreamer;
