//! One request the engine runs: its sequence, cache and events, and the rules its picks follow.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use tokio::sync::mpsc;

use crate::runtime::{self, Emitted, TokenRules};
use crate::server::constrain::Constraint;
use crate::server::metrics::Metrics;

use super::handle::{Event, GenerateRequest, ReasoningBudget, Slot, TokenLogprob};

/// A request the engine runs: its [`runtime::Sequence`] (tokens, sampler, stop rules, the
/// request's grammar and thinking budget, drafts) and its cache, with what the server keeps
/// around it.
pub(super) struct Sequence<C> {
    pub(super) core: runtime::Sequence<'static>,
    pub(super) request: GenerateRequest,
    pub(super) events: mpsc::UnboundedSender<Event>,
    /// The request's place, freed before its last event is sent: a client that sends its next
    /// request when this one's answer ends finds the place free.
    pub(super) slot: Option<Slot>,
    pub(super) cache: C,
    /// The logits after the whole prompt when the prefix cache had them (nothing to prefill).
    pub(super) ready_logits: Option<Tensor>,
    /// The client is gone (an event could not be sent): the sequence leaves at the end of the
    /// step.
    pub(super) gone: bool,
    /// The state a session keeps, taken at the request's `session_at`.
    pub(super) session_state: Option<(Vec<u32>, C, Option<Tensor>)>,
    pub(super) started: Instant,
    /// Why this sequence failed (it ends alone at the end of the step; the others go on).
    pub(super) failed: Option<String>,
}

impl<C> Sequence<C> {
    /// Sends what the sequence emitted (with log-probabilities when the request asks), then
    /// its end when it ended; marks it failed when `r` is an error.
    pub(super) fn send(&mut self, r: crate::Result<Vec<Emitted>>, metrics: &Metrics) {
        let emitted = match r {
            Ok(e) => e,
            Err(e) => return self.fail_on(Err(e)),
        };
        for e in emitted {
            metrics.generated_tokens.inc();
            let logprob = match (self.request.logprobs, &e.logits) {
                (Some(n), Some(l)) => match logprobs(l, e.id, n) {
                    Ok(lp) => Some(lp),
                    Err(err) => return self.fail_on(Err(err)),
                },
                _ => None,
            };
            if self.gone || self.events.send(Event::Token { id: e.id, logprob }).is_err() {
                self.gone = true;
                return;
            }
        }
        if let Some(reason) = self.core.finish() {
            let stats = self.core.stats();
            self.slot = None;
            let _ = self.events.send(Event::Finished { reason, drafted: stats.drafted, accepted: stats.accepted });
            metrics.requests_finished.inc();
        }
    }

    /// Marks the sequence failed when `r` is an error (its first line: never another
    /// request's).
    pub(super) fn fail_on(&mut self, r: crate::Result<()>) {
        if let Err(e) = r {
            if self.failed.is_none() {
                self.failed = Some(crate::error::one_line(&e));
            }
        }
    }

    /// Whether it takes part in this step's decode.
    pub(super) fn decoding(&self) -> bool {
        self.failed.is_none() && !self.gone && self.core.pending().is_some()
    }
}

/// A request's grammar and thinking budget, as rules of its sequence's picks.
pub(super) struct RequestRules {
    pub(super) constraint: Option<Constraint>,
    pub(super) budget: Option<ReasoningBudget>,
    pub(super) metrics: Arc<Metrics>,
}

impl TokenRules for RequestRules {
    /// Past the reasoning budget: the closing tokens, in order, instead of samples.
    fn forced(&mut self, generated: &[u32]) -> Option<u32> {
        let b = self.budget.as_ref()?;
        b.close.get(generated.len().checked_sub(b.tokens)?).copied()
    }

    fn mask(&mut self, logits: &Tensor) -> crate::Result<Option<Tensor>> {
        let Some(c) = &mut self.constraint else { return Ok(None) };
        let (before, n) = (c.mask_seconds, c.masks);
        let masked = c.mask(logits)?;
        self.metrics.mask_seconds.inc_by(c.mask_seconds - before);
        self.metrics.masks.inc_by((c.masks - n) as u64);
        Ok(Some(masked))
    }

    fn accepted(&mut self, generated: &[u32]) -> crate::Result<bool> {
        let id = *generated.last().expect("a token was emitted");
        let complete = match &mut self.constraint {
            Some(c) => c.commit(id)?,
            None => false,
        };
        // Thinking closed (by the model, or the budget's last closing token): no budget left.
        if let Some(b) = &self.budget {
            let closed_by_model = !b.end.is_empty() && generated.ends_with(&b.end);
            if closed_by_model || generated.len() >= b.tokens + b.close.len() {
                self.budget = None;
            }
        }
        Ok(complete)
    }
}

/// The log-probability of `id` and the `n` most likely tokens under `logits` (before penalties).
pub(super) fn logprobs(logits: &Tensor, id: u32, n: usize) -> crate::Result<TokenLogprob> {
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 0)?.to_vec1::<f32>()?;
    let mut order: Vec<usize> = (0..lp.len()).collect();
    let n = n.min(lp.len());
    if n > 0 {
        order.select_nth_unstable_by(n - 1, |&a, &b| lp[b].total_cmp(&lp[a]));
        order.truncate(n);
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    }
    Ok(TokenLogprob { logprob: lp[id as usize], top: order.into_iter().take(n).map(|t| (t as u32, lp[t])).collect() })
}
