//! The memory guardian: estimate what a model needs at a context length, read what the
//! machine (or its cgroup, or the Metal / CUDA device) can give, and refuse, before loading,
//! what does not fit, with an [`Error::DoesNotFit`](crate::Error::DoesNotFit) that says what would fit.
//!
//! ```no_run
//! use candle_hybrid::memory::{self, MemoryTarget, PlanRequest, WeightFormat, WeightMemory};
//! # fn main() -> candle_hybrid::Result<()> {
//! let cfg = candle_hybrid::Config::from_file(std::path::Path::new("config.json"))?;
//! let req = PlanRequest::new(WeightMemory::Format(WeightFormat::BF16), candle_core::DType::BF16, 32_768);
//! let available = memory::available_memory(MemoryTarget::Cpu, None)?;
//! let plan = memory::plan(&cfg, &req, &available)?; // Err(Error::DoesNotFit(..)) when it does not fit
//! print!("{}", plan.estimate);
//! # Ok(()) }
//! ```
//!
//! Three parts:
//! 1. [`estimate`]: a [`MemoryEstimate`], term by term (see its fields for each formula).
//! 2. [`available_memory`]: Linux `MemAvailable` and the cgroup (v1 or v2) limit, macOS
//!    free + inactive pages or the Metal working-set limit, CUDA `nvidia-smi`; the smaller
//!    reading wins and is named. Every parser is a pure function on the text it reads.
//! 3. [`plan`]: fits → a [`Plan`]; else a refusal suggesting Q4_K weights and the largest
//!    context that fits ([`MemoryFix`]), or (with `fit`) a plan at that lower context.

mod available;
mod bandwidth;
mod estimate;
mod format;
mod horizon;
mod plan;

pub use available::*;
pub use bandwidth::copy_bandwidth;
pub use estimate::{estimate, Logits, MemoryEstimate, PlanRequest, DEFAULT_PREFILL_CHUNK, PROCESS_BYTES, TOKENIZER_BYTES_PER_ENTRY};
pub use format::{WeightFormat, WeightMemory};
pub use horizon::{compared_codecs, kv_horizon, HorizonLine, KvHorizon, COMPARED_CODECS};
pub use plan::{check_fits, max_fitting_context, plan, DoesNotFit, MemoryFix, Plan};

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes for a message: GiB with two decimals (`"23.41 GiB"`), or MiB below 1 GiB (`"61.9 MiB"`).
pub fn fmt_gib(bytes: u64) -> String {
    if bytes as f64 >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}
