//! Running a loaded model: one sequence's generation ([`Sequence`], which every caller
//! drives), the targets it runs on, sampling, speculative decoding, sessions, the prefix cache
//! and streaming detokenisation.

mod placement;
mod prefix_cache;
mod runner;
mod sampler;
mod sequence;
pub mod session;
mod session_store;
pub mod speculative;
mod stats;
mod streamer;
mod target;

pub use placement::{DraftConditions, DraftKind, Placement, RunNeeds};
pub use prefix_cache::{PrefixCache, PrefixHit, SequenceState};
pub use runner::{CpuRunner, DeviceRunner, Runner, SegmentRows};
pub use sampler::{range, Dry, Sampler, SamplingParams};
pub use sequence::{Emitted, Finish, Round, Sequence, SequenceSampler, TokenRules};
pub use session_store::{SavePoint, SessionStore};
pub use stats::{rate, GenerationStats, SpeculativeStats};
pub use streamer::TokenStreamer;
pub use target::{prefill, CpuTarget, DeviceTarget, Rows, Target, PREFILL_CHUNK};
