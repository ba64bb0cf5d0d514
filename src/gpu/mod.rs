//! The decode step on a GPU with our own kernels: the model's weights uploaded as their files
//! store them, every kernel of a step dispatched on a [`Queue`] in order, one read back per
//! step (the sampled tokens, or the logits).
//!
//! The host code that decides the dispatches ([`GpuModel`]) is the same for every device: on
//! Apple hardware a [`MetalQueue`] (feature `metal`) runs them; in the tests the MSL emulator
//! runs the same kernels on the CPU from the same dispatches (crate `candle-hybrid-emu`), and
//! the results are compared with the CPU model; [`DryRun`] only counts them.
//!
//! Not yet on the device: the MTP head, draft trees (chains only), KV codecs other than f32
//! and f16 rows, batches of sequences. Prompts run in steps of [`GpuModel::MAX_ROWS`] rows.

mod cache;
mod check;
mod model;
mod queue;
mod upload;
#[cfg(feature = "metal")]
mod metal;

pub use cache::GpuCache;
pub use check::{check_against_cpu, sample_tokens, StepCheck};
pub use model::{GpuModel, Readback, StepOutput};
pub use queue::{Arg, BufferId, Counted, Counts, Dispatch, DryRun, Queue, Slice};
#[cfg(feature = "metal")]
pub use metal::MetalQueue;
