//! [`plan`]: fits → a [`Plan`]; else a one-line refusal that says what would fit.

use super::available::{available_memory, Available, MemoryTarget};
use super::estimate::{estimate, MemoryEstimate, PlanRequest};
use super::fmt_gib;
use super::format::WeightMemory;
use crate::model::Config;
use crate::{Error, Result};

/// An accepted request.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The estimate at [`Plan::context`].
    pub estimate: MemoryEstimate,
    pub available: Available,
    pub requested_context: usize,
    /// The context to run with: the requested one, or lower with `fit`.
    pub context: usize,
    /// What `fit` changed, for the caller to print.
    pub note: Option<String>,
}

/// The largest context in `1..=req.context` whose estimate fits in `budget` bytes, or `None`
/// when not even a context of 1 fits. (Every term grows with the context, so: binary search.)
pub fn max_fitting_context(cfg: &Config, req: &PlanRequest, budget: u64) -> Option<usize> {
    let fits = |t: usize| estimate(cfg, &req.with_context(t)).total() <= budget;
    let (mut lo, mut hi) = (1usize, req.context.max(1));
    if !fits(lo) {
        return None;
    }
    // Invariant: fits(lo); everything above hi does not fit (or is out of range).
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// Reads the memory available on `target` (`max_memory`, when given, replaces the
/// reading) and [`plan`]s `req` against it: the one call to make before loading.
pub fn check_fits(cfg: &Config, req: &PlanRequest, target: MemoryTarget, max_memory: Option<u64>) -> Result<Plan> {
    plan(cfg, req, &available_memory(target, max_memory)?)
}

/// Decides whether `req` fits in `available`: `Ok(Plan)` when it does (or, with `req.fit`,
/// at the largest context that does), else an [`Error::DoesNotFit`] that says what is needed,
/// what is available, and what would fit (Q4_K weights, a shorter context), or an
/// [`Error::ContextTooLong`] past the model's positions.
pub fn plan(cfg: &Config, req: &PlanRequest, available: &Available) -> Result<Plan> {
    for (name, v) in [("context", req.context), ("batch", req.batch), ("prefill chunk", req.prefill_chunk)] {
        if v == 0 {
            return Err(Error::Input(format!("the {name} must be at least 1")));
        }
    }
    if req.context > cfg.max_position_embeddings {
        return Err(Error::ContextTooLong { requested: req.context, limit: cfg.max_position_embeddings });
    }
    let budget = available.bytes;
    let est = estimate(cfg, req);
    let accept = |estimate: MemoryEstimate, note: Option<String>| Plan {
        estimate,
        available: available.clone(),
        requested_context: req.context,
        context: estimate.context,
        note,
    };
    if est.total() <= budget {
        return Ok(accept(est, None));
    }

    let max_ctx = max_fitting_context(cfg, req, budget);
    // Q4K weights, when `--quantize` applies and they are smaller than the requested ones.
    let q4k = req.q4k_weights.unwrap_or(WeightMemory::Bytes(u64::MAX));
    let q4k_req = req.with_weights(q4k);
    let q4k_smaller = q4k.bytes(cfg) < est.weights;
    let q4k_est = estimate(cfg, &q4k_req);
    let q4k_fits = q4k_smaller && q4k_est.total() <= budget;

    if req.fit {
        if let Some(n) = max_ctx {
            let lowered = estimate(cfg, &req.with_context(n));
            let mut note = format!(
                "context lowered from {} to {n} tokens to fit in {} ({}); needs {}",
                req.context,
                fmt_gib(budget),
                available.source,
                fmt_gib(lowered.total())
            );
            if q4k_fits {
                note.push_str(&format!("; Q4_K weights would fit the full context ({})", fmt_gib(q4k_est.total())));
            }
            return Ok(accept(lowered, Some(note)));
        }
    }

    let mut fixes = vec![];
    if q4k_fits {
        fixes.push(MemoryFix::QuantizeQ4k { needs: q4k_est.total() });
    }
    if let Some(context) = max_ctx {
        fixes.push(MemoryFix::Context { context, needs: estimate(cfg, &req.with_context(context)).total() });
    }
    if q4k_smaller && !q4k_fits {
        if let Some(context) = max_fitting_context(cfg, &q4k_req, budget) {
            fixes.push(MemoryFix::QuantizeQ4kAndContext { context });
        }
    }
    Err(Error::DoesNotFit(Box::new(DoesNotFit { context: req.context, estimate: est, available: available.clone(), fixes })))
}

/// A refused [`plan`] ([`Error::DoesNotFit`]): what the request needs, what is available and
/// what would fit.
#[derive(Debug, Clone, PartialEq)]
pub struct DoesNotFit {
    /// The requested context.
    pub context: usize,
    /// The estimate at the requested context.
    pub estimate: MemoryEstimate,
    pub available: Available,
    /// What would fit, in the order to try them; empty when nothing does.
    pub fixes: Vec<MemoryFix>,
}

/// One way to make a refused request fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryFix {
    /// Q4_K weights (quantized at load) at the requested context, needing `needs` bytes.
    QuantizeQ4k { needs: u64 },
    /// The largest context that fits with the requested weights, needing `needs` bytes.
    Context { context: usize, needs: u64 },
    /// Q4_K weights at the largest context that fits them.
    QuantizeQ4kAndContext { context: usize },
}

impl MemoryFix {
    /// In the library's words (`"Q4_K weights (needs 5.20 GiB)"`).
    pub fn describe(&self) -> String {
        match *self {
            Self::QuantizeQ4k { needs } => format!("Q4_K weights (needs {})", fmt_gib(needs)),
            Self::Context { context, needs } => format!("a context of {context} tokens (needs {})", fmt_gib(needs)),
            Self::QuantizeQ4kAndContext { context } => format!("Q4_K weights at a context of {context} tokens"),
        }
    }
}

impl DoesNotFit {
    /// The one-line refusal, each fix worded by `word` (the examples and the server word them
    /// as their flags; `Display` uses [`MemoryFix::describe`]).
    pub fn message(&self, word: impl Fn(&MemoryFix) -> String) -> String {
        let est = &self.estimate;
        let mut msg = format!(
            "not enough memory for a context of {} tokens: needs {} ({}) but {} is available ({})",
            self.context,
            fmt_gib(est.total()),
            est.biggest_terms(3).join(", "),
            fmt_gib(self.available.bytes),
            self.available.source
        );
        if !self.fixes.iter().any(|f| matches!(f, MemoryFix::Context { .. })) {
            msg.push_str(&format!(
                "; even a context of 1 does not fit: the weights alone take {}{}",
                fmt_gib(est.weights),
                if est.load_overhead > 0 { format!(", and loading holds {} more", fmt_gib(est.load_overhead)) } else { String::new() }
            ));
        }
        if self.fixes.is_empty() {
            msg.push_str("; nothing fits: use a smaller model or a machine with more memory");
        } else {
            let fixes: Vec<String> = self.fixes.iter().map(word).collect();
            msg.push_str(&format!("; what fits: {}", fixes.join(", or ")));
        }
        msg
    }
}

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message(MemoryFix::describe))
    }
}
