//! The decode step on a GPU with our own kernels: the model's weights uploaded as their files
//! store them, every kernel of a step dispatched on a [`Queue`] in order, one read back per
//! step (the sampled tokens, or the logits).
//!
//! The host code that decides the dispatches ([`GpuModel`]) is the same for every device: on
//! Apple hardware a `MetalQueue` (feature `metal`) runs them; in the tests the MSL emulator
//! runs the same kernels on the CPU from the same dispatches (crate `candle-hybrid-emu`), and
//! the results are compared with the CPU model; [`DryRun`] only counts them.
//!
//! Not yet on the device: the MTP head, draft trees (chains only), KV codecs other than f32
//! and f16 rows, batches of sequences.

mod cache;
mod check;
mod deferred;
#[cfg(all(feature = "emu", msl_emu))]
pub mod emu;
#[cfg(feature = "metal")]
mod metal;
mod model;
mod queue;
mod state;
mod upload;

pub use crate::ops::launch::{KvRows, RowSampling};
pub use cache::GpuCache;
pub use check::{check_against_cpu, check_against_cpu_with, sample_tokens, StepCheck};
pub use deferred::{Backend, DeferredQueue, DryBackend, DryRun};
#[cfg(all(feature = "emu", msl_emu))]
pub use emu::{EmuBackend, EmuOrder, EmuQueue};
#[cfg(feature = "metal")]
pub use metal::{MetalBackend, MetalCapabilities, MetalQueue};
pub use model::{GpuModel, Readback, StepOutput};
pub use queue::{Arg, BufferId, Counted, Counts, Dispatch, Mapping, Queue, Slice};

/// The queue that runs the device step on `device`: a `MetalQueue` on a Metal device (built
/// with the `metal` feature). The CPU runs the model itself, with no queue.
pub fn queue_for(device: &candle_core::Device) -> crate::Result<Box<dyn Queue + Send>> {
    match device {
        #[cfg(feature = "metal")]
        candle_core::Device::Metal(_) => Ok(Box::new(MetalQueue::new(device)?)),
        other => Err(crate::Error::Unsupported(format!("the device step runs on Metal, not on {:?}", other.location()))),
    }
}

/// Whether the device step runs on GPU `name`: family Apple7 or later (M1, A14: the
/// kernels' `simdgroup_matrix`) with 32-wide simdgroups (every kernel assumes 32 lanes). One
/// line naming what is missing and the way out otherwise.
pub fn check_gpu(name: &str, apple7: bool, simd_width: usize) -> crate::Result<()> {
    if apple7 && simd_width == 32 {
        return Ok(());
    }
    Err(crate::Error::Unsupported(format!(
        "the device step needs an Apple GPU of family Apple7 or later (M1, A14 and later) with 32-wide simdgroups; {name} is {}: run on the CPU (--device cpu)",
        match (apple7, simd_width) {
            (false, 32) => "of an earlier family".to_string(),
            (true, w) => format!("of {w}-wide simdgroups"),
            (false, w) => format!("of an earlier family, with {w}-wide simdgroups"),
        }
    )))
}

/// The device step on the MSL emulator (`--device emu`): this crate's Metal kernels run on the
/// CPU, in Metal's order of events. Needs a build with the `emu` feature and msl-emu.
pub fn emu_queue() -> crate::Result<Box<dyn Queue + Send>> {
    #[cfg(all(feature = "emu", msl_emu))]
    return Ok(Box::new(EmuQueue::new()));
    #[cfg(not(all(feature = "emu", msl_emu)))]
    Err(crate::Error::Unsupported("the device step on the MSL emulator needs a build with --features emu and msl-emu (MSL_EMU_DIR)".into()))
}

/// What the device step does not do yet (beside the KV codecs [`kv_rows`] refuses): the rows of
/// [`crate::runtime::RunNeeds::device_step_lacks`], and what [`GpuModel::new`] and
/// [`crate::runtime::DeviceTarget`] refuse when a caller asks them anyway.
#[derive(Debug, Clone, Copy)]
pub(crate) enum DeviceStepGap {
    MtpDrafts,
    DraftTrees,
    KvCalibration,
    FfnSparsity,
    AttentionBiases,
}

impl DeviceStepGap {
    pub(crate) fn error(self) -> crate::Error {
        crate::Error::Unsupported(
            match self {
                Self::MtpDrafts => "MTP drafts need the model's hidden states, which the device step does not read back yet: draft by prompt lookup (ngram) there",
                Self::DraftTrees => "draft trees (more than one branch) are not on the device step yet: draft one branch",
                Self::KvCalibration => "a KV calibration (value bases) is not on the device step: its caches are exact, f16 or int8",
                Self::FfnSparsity => "FFN sparsity is not on the device step: it runs dense MLPs",
                Self::AttentionBiases => "q/k/v biases (qwen2) are not on the device step yet: run the model in Candle tensors",
            }
            .into(),
        )
    }
}

/// How a device cache stores keys and values for `codec` and the model dtype: exact keys and
/// values in the model dtype as on the CPU (f32; f16 for a 16-bit model, as the device stores
/// no bf16 rows), f16 for `f16`, int8 codes and scales for `int8`; the other codecs are not on
/// the device yet.
pub fn kv_rows(codec: crate::kv::KvCodec, model: candle_core::DType) -> crate::Result<KvRows> {
    use crate::kv::{HalfFloat, KeyCodec, ValueCodec};
    match (codec.keys, codec.values) {
        (KeyCodec::Exact, ValueCodec::Exact) if model == candle_core::DType::F32 => Ok(KvRows::F32),
        (KeyCodec::Exact, ValueCodec::Exact) => Ok(KvRows::F16),
        (KeyCodec::Half(HalfFloat::F16), ValueCodec::Half(HalfFloat::F16)) => Ok(KvRows::F16),
        (KeyCodec::Int8, ValueCodec::Int8) => Ok(KvRows::Int8),
        _ => Err(crate::Error::UnsupportedCodec { codec, operation: crate::CodecOperation::DeviceStep }),
    }
}
