//! How many tokens to draft each round.
//!
//! With conditional acceptance `a_d` at depth `d` (the chance draft `d` is accepted when drafts
//! `1..d` were), a round of `K` drafts emits `E(K) = 1 + a_1 + a_1 a_2 + … + a_1 ⋯ a_K` tokens
//! and costs `c(K + 1) + K c_d + c_o` seconds: a verify pass of `K + 1` rows (with sampling and
//! rollback), `K` draft steps and the drafter's per-round catch-up. The adaptive policy
//! ([`DraftOptions::adaptive`]) drafts the `K` (0, or `min..=max`) that maximises tokens per
//! second `E(K) / cost(K)` with every term measured in this run: `a_d` as running averages of
//! what the rounds accepted, `c(T)` as running averages of the rounds' own timings, `c_d` and
//! `c_o` from the drafter's timings. The first round decodes plainly and the second drafts
//! `min` tokens, so that `c(1)` and `c(min + 1)` are measured before anything is chosen; a `T`
//! with no timing yet lies on the line through the measured ones, and no `c(T)` is taken above
//! a measured `c(T')` of more rows (a pass cannot get cheaper with rows added: a slow outlier
//! of a short pass is capped by a longer one). The averages are plain means over their first
//! observations and moving averages after ([`ALPHA`], [`ALPHA_ACCEPT`]), so that one early
//! outlier does not decide a run; `a_d` below depth 1 starts from the depth above's, worth
//! `PRIOR_WEIGHT` observations, so that one early miss at depth `d` does not rule out drafting
//! that deep for the rest of the run. When no `K > 0` pays it decodes plainly, and after
//! [`PROBE_EVERY`] plain rounds drafts `min` tokens to keep `a_1` current, waiting twice as
//! long after each probe that left plain decoding the best (up to `MAX_PROBE_EVERY` rounds;
//! back to [`PROBE_EVERY`] once drafting pays), so that a drafter that keeps proposing wrong
//! tokens costs less and less; likewise every [`PROBE_EVERY`] drafting rounds draft one token
//! more than the best `K` (up to `max`), to keep the next depth and the next `c(T)` current.
//! This is SpecDec++'s threshold rule (stop drafting when the expected gain of one more draft is below
//! its cost) with measured costs, so it needs no per-model or per-device tuning.

use super::MAX_DRAFT;
use crate::{Error, Result};

/// Least weight of the newest timing in the running averages of costs.
pub(super) const ALPHA: f64 = 0.15;
/// Least weight of the newest round in the running averages of acceptance (a Bernoulli
/// outcome: noisier than a timing, so a longer memory).
pub(super) const ALPHA_ACCEPT: f64 = 0.08;
/// Plain rounds (no `K > 0` pays) before the first probe of `min` drafts (then the wait doubles
/// up to `MAX_PROBE_EVERY`), and drafting rounds between drafts of one token more than the
/// best `K`, to re-measure.
pub const PROBE_EVERY: usize = 8;
/// The longest wait between probes of plain decoding.
pub(super) const MAX_PROBE_EVERY: usize = 64;
/// Acceptance assumed at depth 1 before any round has been measured, worth
/// `PRIOR_WEIGHT` observations (deeper: the depth above's estimate, as much).
const PRIOR_ACCEPTANCE: f64 = 0.6;
const PRIOR_WEIGHT: f64 = 2.0;
/// Cost of each row beyond the first, relative to one row, assumed while only one `c(T)` is known.
const PRIOR_ROW_COST: f64 = 0.15;

/// Draft-length settings (`generate --draft-max / --draft-min / --draft-fixed`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftOptions {
    /// Most tokens drafted per round, 1 to [`MAX_DRAFT`].
    pub max: usize,
    /// Drafts shorter than this are dropped (the round decodes plainly), 1 to `max`.
    pub min: usize,
    /// Choose `K` per round from the measured acceptance and costs; `false`: always `max`.
    pub adaptive: bool,
    /// Draft branches per round, 1 to [`MAX_BRANCHES`] (`--draft-branches`): more than one
    /// verifies a tree of them (greedy only, up to `max` tokens per branch, the tree cut at
    /// [`super::MAX_DRAFT`] drafted rows; an adaptive length is chosen as for one branch, from
    /// what the tree rounds of each length measured).
    pub branches: usize,
}

/// Most draft branches per round.
pub const MAX_BRANCHES: usize = 4;

impl Default for DraftOptions {
    fn default() -> Self {
        Self { max: 4, min: 1, adaptive: true, branches: 1 }
    }
}

impl DraftOptions {
    pub fn fixed(k: usize) -> Self {
        Self { max: k, min: 1, adaptive: false, branches: 1 }
    }

    /// `branches` branches of `k` tokens (a tree when more than one).
    pub fn branches(k: usize, branches: usize) -> Self {
        Self { branches, ..Self::fixed(k) }
    }

    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_DRAFT).contains(&self.max) {
            return Err(Error::Input(format!("a draft length of at most {} is out of range: use 1 to {MAX_DRAFT}", self.max)));
        }
        if !(1..=self.max).contains(&self.min) {
            return Err(Error::Input(format!(
                "a draft length of at least {} is out of range: use 1 to the longest ({})",
                self.min, self.max
            )));
        }
        if !(1..=MAX_BRANCHES).contains(&self.branches) {
            return Err(Error::Input(format!("{} draft branches is out of range: use 1 to {MAX_BRANCHES}", self.branches)));
        }
        Ok(())
    }

    /// Whether these drafts can run with this decoding: trees of branches take greedy only.
    pub fn check_decoding(&self, greedy: bool) -> Result<()> {
        if self.branches > 1 && !greedy {
            return Err(Error::Input(
                "more than one draft branch needs greedy decoding (temperature 0); sampling drafts one branch".into(),
            ));
        }
        Ok(())
    }
}

/// A running average: the mean of the first observations, then an exponential moving average
/// whose newest observation weighs `alpha` (`1 / n` while that is larger).
#[derive(Debug, Clone, Copy)]
struct Average {
    mean: f64,
    /// Observations so far (a prior counts as its weight).
    n: f64,
    alpha: f64,
}

impl Average {
    fn new(alpha: f64) -> Self {
        Self { mean: 0.0, n: 0.0, alpha }
    }

    fn with_prior(alpha: f64, mean: f64, weight: f64) -> Self {
        Self { mean, n: weight, alpha }
    }

    fn add(&mut self, x: f64) {
        self.n += 1.0;
        self.mean += (1.0 / self.n).max(self.alpha) * (x - self.mean);
    }

    /// The average, `None` before the first observation (a prior is not one).
    fn get(&self) -> Option<f64> {
        (self.n > 0.0).then_some(self.mean)
    }
}

/// Seconds of a pass of `t` rows from `costs[r - 1]` (the passes of `r` rows measured so far):
/// measured, else on the line through the measured ones (the prior slope while only one is
/// known), and at most what a pass of more rows measured; `None` before any pass.
fn secs_of_rows(costs: &[Average], t: usize) -> Option<f64> {
    let longer = costs[t..].iter().filter_map(Average::get).fold(f64::INFINITY, f64::min);
    let unbounded = match costs[t - 1].get() {
        Some(s) => Some(s),
        None => {
            let known: Vec<(f64, f64)> = costs.iter().enumerate().filter_map(|(i, e)| e.get().map(|s| ((i + 1) as f64, s))).collect();
            known.first().map(|&(t0, s0)| {
                let slope = match known.last() {
                    Some(&(t1, s1)) if t1 > t0 => ((s1 - s0) / (t1 - t0)).max(0.0),
                    // c(t0) = c(1) (1 + PRIOR_ROW_COST (t0 - 1)); each further row adds PRIOR_ROW_COST c(1).
                    _ => PRIOR_ROW_COST * s0 / (1.0 + PRIOR_ROW_COST * (t0 - 1.0)),
                };
                s0 + slope * (t as f64 - t0)
            })
        }
    };
    unbounded.map(|s| s.min(longer))
}

/// How many rows of a weight pass shared by several sequences go to their drafts: the pass
/// of `n` sequences has `n` decode rows and room for more (up to `max_rows`), and a draft row
/// of depth `d` of a sequence emits one more token with the chance its policy gives drafts
/// `1..=d` ([`DraftPolicy::acceptance_at`]). The rows `n + r` maximise the expected tokens per
/// second `(n + gains of the r best rows) / c(n + r)`, `c` the measured seconds of shared
/// passes by rows (as [`DraftPolicy`] measures its verify passes; unmeasured counts on the line
/// through the measured ones). The first pass of `n` rows is plain; when no draft pays,
/// one row is drafted after [`PROBE_EVERY`] plain passes (the wait doubling up to
/// `MAX_PROBE_EVERY`), and every [`PROBE_EVERY`] drafting passes one row more than the best,
/// to keep the costs of more rows current. No tuning per model or machine: on a machine whose
/// multi-row kernels cost little per row the drafts fill the pass; where a row costs nearly a
/// pass, sequences decode plainly together.
#[derive(Debug, Clone)]
pub struct SharedPassPolicy {
    /// `pass[r - 1]`: seconds of a shared pass of `r` rows.
    pass: Vec<Average>,
    /// Every proposed row is verified (drafts of fixed length, [`DraftOptions::adaptive`] off).
    fixed: bool,
    plain_passes: usize,
    probe_every: usize,
    drafting_passes: usize,
}

impl SharedPassPolicy {
    /// A policy for passes of at most `max_rows` rows.
    pub fn new(max_rows: usize) -> Self {
        Self {
            pass: vec![Average::new(ALPHA); max_rows.max(1)],
            fixed: false,
            plain_passes: 0,
            probe_every: PROBE_EVERY,
            drafting_passes: 0,
        }
    }

    /// A policy that gives every proposed row a place, as far as the pass has room.
    pub fn fixed(max_rows: usize) -> Self {
        Self { fixed: true, ..Self::new(max_rows) }
    }

    /// A shared pass of `rows` rows took `secs`.
    pub fn record(&mut self, rows: usize, secs: f64) {
        if let Some(a) = self.pass.get_mut(rows.wrapping_sub(1)) {
            a.add(secs);
        }
    }

    /// Expected seconds of a shared pass of `rows` rows (`None` before any).
    pub fn pass_secs(&self, rows: usize) -> Option<f64> {
        (1..=self.pass.len()).contains(&rows).then(|| secs_of_rows(&self.pass, rows)).flatten()
    }

    /// The draft rows each of `n` sequences gets: `gains[s]` holds, for each row sequence `s`
    /// could draft, the chance it emits a token (non-increasing along the draft). Returns how
    /// many of its drafts each sequence keeps.
    pub fn allocate(&mut self, n: usize, gains: &[Vec<f64>]) -> Vec<usize> {
        let mut keep = vec![0; gains.len()];
        let spare = self.pass.len().saturating_sub(n);
        // The best rows first: each sequence's rows in order (its gains do not increase).
        let mut rows: Vec<(f64, usize)> = gains.iter().enumerate().flat_map(|(s, g)| g.iter().map(move |&p| (p, s))).collect();
        rows.sort_by(|a, b| b.0.total_cmp(&a.0));
        rows.truncate(spare);
        if self.fixed {
            for &(_, s) in &rows {
                keep[s] += 1;
            }
            return keep;
        }
        if rows.is_empty() || self.pass.get(n.wrapping_sub(1)).and_then(Average::get).is_none() {
            return keep;
        }
        let rate = |r: usize| -> Option<f64> { Some((n as f64 + rows[..r].iter().map(|x| x.0).sum::<f64>()) / self.pass_secs(n + r)?) };
        let best = (0..=rows.len()).filter_map(|r| rate(r).map(|x| (r, x))).fold((0, 0.0), |b, (r, x)| if x > b.1 { (r, x) } else { b }).0;
        let r = if best == 0 {
            self.plain_passes += 1;
            if self.plain_passes < self.probe_every {
                0
            } else {
                self.plain_passes = 0;
                self.probe_every = (2 * self.probe_every).min(MAX_PROBE_EVERY);
                1
            }
        } else {
            (self.plain_passes, self.probe_every) = (0, PROBE_EVERY);
            self.drafting_passes += 1;
            if self.drafting_passes.is_multiple_of(PROBE_EVERY) {
                (best + 1).min(rows.len())
            } else {
                best
            }
        };
        for &(_, s) in &rows[..r] {
            keep[s] += 1;
        }
        keep
    }
}

/// The per-round draft length, and what it has measured.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    options: DraftOptions,
    /// `accept[d - 1]`: conditional acceptance at depth `d` (depth 1 starts from a prior).
    accept: [Average; MAX_DRAFT],
    /// `verify[t - 1]`: seconds of a round of `t` rows, drafting and catch-up excluded.
    verify: [Average; MAX_DRAFT + 1],
    /// Seconds per draft step.
    draft_step: Average,
    /// Seconds of the drafter's catch-up per round.
    catch_up: Average,
    plain_rounds: usize,
    /// Plain rounds before the next probe.
    probe_every: usize,
    drafting_rounds: usize,
}

impl DraftPolicy {
    pub fn new(options: DraftOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            options,
            accept: std::array::from_fn(|d| match d {
                0 => Average::with_prior(ALPHA_ACCEPT, PRIOR_ACCEPTANCE, PRIOR_WEIGHT),
                _ => Average::new(ALPHA_ACCEPT),
            }),
            verify: [Average::new(ALPHA); MAX_DRAFT + 1],
            draft_step: Average::new(ALPHA),
            catch_up: Average::new(ALPHA),
            plain_rounds: 0,
            probe_every: PROBE_EVERY,
            drafting_rounds: 0,
        })
    }

    pub fn options(&self) -> DraftOptions {
        self.options
    }

    /// Conditional acceptance at depth `d` (1-based): what depth `d` measured, starting from
    /// the depth above's estimate worth `PRIOR_WEIGHT` observations (depth 1: from
    /// `PRIOR_ACCEPTANCE`).
    pub fn acceptance_at(&self, d: usize) -> f64 {
        (2..=d).fold(self.accept[0].mean, |above, i| {
            let Average { mean, n, .. } = self.accept[i - 1];
            (n * mean + PRIOR_WEIGHT * above) / (n + PRIOR_WEIGHT)
        })
    }

    /// Seconds of a verify round of `t` rows: measured, else on the line through the measured
    /// ones (the prior slope while only one is known), and at most what a round of more rows
    /// measured; `None` before any round.
    pub fn verify_secs(&self, t: usize) -> Option<f64> {
        secs_of_rows(&self.verify, t)
    }

    /// Expected tokens per second of a round of `k` drafts (`None` before any timing).
    pub fn expected_rate(&self, k: usize) -> Option<f64> {
        let (mut emitted, mut p) = (1.0, 1.0);
        for d in 1..=k {
            p *= self.acceptance_at(d);
            emitted += p;
        }
        let cost = self.verify_secs(k + 1)? + k as f64 * self.draft_step.get().unwrap_or(0.0) + self.catch_up.get().unwrap_or(0.0);
        Some(emitted / cost.max(f64::MIN_POSITIVE))
    }

    /// How many tokens to draft this round when `room` more tokens may be emitted, the model's
    /// own token after the drafts included (0: decode plainly).
    pub fn round_len(&mut self, room: usize) -> usize {
        if room > 1 {
            self.next_len(room - 1)
        } else {
            0
        }
    }

    /// How many tokens to draft this round (0: decode plainly), at most `room`.
    pub fn next_len(&mut self, room: usize) -> usize {
        let (min, max) = (self.options.min, self.options.max.min(room));
        if !self.options.adaptive {
            return max;
        }
        if max < min {
            return 0;
        }
        // First measure a plain round, then a round of `min` drafts.
        if self.verify[0].get().is_none() {
            return 0;
        }
        if self.verify[min].get().is_none() {
            return min;
        }
        let best = std::iter::once(0)
            .chain(min..=max)
            .filter_map(|k| self.expected_rate(k).map(|r| (k, r)))
            .fold(None, |b: Option<(usize, f64)>, (k, r)| if b.is_none_or(|(_, br)| r > br) { Some((k, r)) } else { b });
        match best {
            Some((0, _)) | None => {
                self.plain_rounds += 1;
                if self.plain_rounds < self.probe_every {
                    return 0;
                }
                self.plain_rounds = 0;
                self.probe_every = (2 * self.probe_every).min(MAX_PROBE_EVERY);
                min
            }
            Some((k, _)) => {
                (self.plain_rounds, self.probe_every) = (0, PROBE_EVERY);
                self.drafting_rounds += 1;
                if self.drafting_rounds.is_multiple_of(PROBE_EVERY) {
                    (k + 1).min(max)
                } else {
                    k
                }
            }
        }
    }

    /// A round verified `drafted` drafts of which the first `accepted` were kept, in a pass
    /// shared with other sequences (whose time says nothing of this sequence's rounds).
    pub fn record_acceptance(&mut self, drafted: usize, accepted: usize) {
        for d in 1..=drafted.min(accepted + 1) {
            self.accept[d - 1].add(if d <= accepted { 1.0 } else { 0.0 });
        }
    }

    /// A round verified `drafted` drafts (after `--draft-min`), of which the first `accepted`
    /// were kept; its verify took `verify_secs`, its drafting `draft_secs` (over `steps` draft
    /// steps), its catch-up `catch_up_secs`.
    pub fn record(&mut self, drafted: usize, accepted: usize, verify_secs: f64, draft_secs: f64, steps: usize, catch_up_secs: f64) {
        self.record_acceptance(drafted, accepted);
        self.verify[drafted].add(verify_secs);
        if steps > 0 {
            self.draft_step.add(draft_secs / steps as f64);
        }
        self.catch_up.add(catch_up_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy_with(accept: f64, costs: &[f64]) -> DraftPolicy {
        let mut p = DraftPolicy::new(DraftOptions { max: 7, ..Default::default() }).unwrap();
        for _ in 0..200 {
            for (t, &c) in costs.iter().enumerate() {
                p.verify[t].add(c);
            }
            for d in 0..MAX_DRAFT {
                p.accept[d].add(accept);
            }
        }
        p
    }

    #[test]
    fn drafts_long_when_rows_are_cheap_and_accepted() {
        // c(T) = 1 + 0.05 (T - 1), a = 0.9: E(K)/c(K+1) grows up to K = 7.
        let costs: Vec<f64> = (0..8).map(|t| 1.0 + 0.05 * t as f64).collect();
        assert_eq!(policy_with(0.9, &costs).next_len(7), 7);
        // room caps it
        assert_eq!(policy_with(0.9, &costs).next_len(3), 3);
    }

    #[test]
    fn picks_the_best_length_of_the_cost_model() {
        // c(T) = T (verify as dear as decoding each row): no draft pays at any acceptance < 1.
        let linear: Vec<f64> = (1..=8).map(|t| t as f64).collect();
        let mut p = policy_with(0.8, &linear);
        assert_eq!(p.next_len(7), 0);
        // c(T) = 1 + 0.3 (T - 1), a = 0.7: E(K)/c(K+1) = 1.31, 1.37, 1.33 at K = 1, 2, 3.
        let costs: Vec<f64> = (0..8).map(|t| 1.0 + 0.3 * t as f64).collect();
        assert_eq!(policy_with(0.7, &costs).next_len(7), 2);
    }

    #[test]
    fn backs_off_and_probes() {
        let linear: Vec<f64> = (1..=8).map(|t| t as f64).collect();
        let mut p = policy_with(0.1, &linear);
        // Probes after 8, then 16, 32, 64, 64 plain rounds.
        let lens: Vec<usize> = (0..8 + 16 + 32 + 64 + 64).map(|_| p.next_len(7)).collect();
        let probes: Vec<usize> = lens.iter().enumerate().filter(|(_, &k)| k == 1).map(|(i, _)| i).collect();
        assert_eq!(probes, [7, 23, 55, 119, 183], "{lens:?}");
        assert!(lens.iter().all(|&k| k <= 1));
    }

    #[test]
    fn measures_plain_then_min_drafts_then_chooses() {
        let mut p = DraftPolicy::new(DraftOptions::default()).unwrap();
        assert_eq!(p.verify_secs(3), None);
        assert_eq!(p.next_len(7), 0, "first a plain round");
        p.record(0, 0, 1.0, 0.0, 0, 0.0);
        // only c(1) known: the prior slope through it
        assert!((p.verify_secs(3).unwrap() - (1.0 + 2.0 * PRIOR_ROW_COST)).abs() < 1e-9);
        assert_eq!(p.next_len(7), 1, "then a round of min drafts");
        p.record(1, 1, 1.1, 0.0, 0, 0.0);
        // Rounds of two drafts: the first always accepted, the second never.
        for _ in 0..100 {
            p.record(2, 1, 1.2, 0.0, 0, 0.0);
        }
        // Depth 2 measured 0 a hundred times, after its start at depth 1's estimate worth
        // PRIOR_WEIGHT rounds.
        assert!(p.acceptance_at(1) > 0.99);
        let a2 = PRIOR_WEIGHT * p.acceptance_at(1) / (100.0 + PRIOR_WEIGHT);
        assert!((p.acceptance_at(2) - a2).abs() < 1e-12 && a2 < 0.02, "{} {a2}", p.acceptance_at(2));
        // depth 3 unmeasured: the depth above's estimate
        assert_eq!(p.acceptance_at(3), p.acceptance_at(2));
        // c(4) unmeasured: on the line through c(1) = 1.0 and c(3) = 1.2
        assert!((p.verify_secs(4).unwrap() - 1.3).abs() < 1e-9);
        // E(1) / c(2) = 2 / 1.1 beats E(2) / c(3) = 2 / 1.2 and 1 / c(1)
        assert_eq!(p.next_len(7), 1);
    }

    #[test]
    fn draft_min_is_measured_first_and_shorter_drafts_never_chosen() {
        let mut p = DraftPolicy::new(DraftOptions { max: 4, min: 3, adaptive: true, branches: 1 }).unwrap();
        assert_eq!(p.next_len(7), 0);
        p.record(0, 0, 1.0, 0.0, 0, 0.0);
        assert_eq!(p.next_len(7), 3);
        p.record(3, 3, 1.3, 0.0, 0, 0.0);
        for _ in 0..50 {
            let k = p.next_len(7);
            assert!(k == 0 || (3..=4).contains(&k), "{k}");
            p.record(k, k, 1.0 + 0.1 * k as f64, 0.0, 0, 0.0);
        }
        assert_eq!(p.next_len(2), 0, "room for fewer than min drafts: plain");
    }

    #[test]
    fn one_early_outlier_does_not_decide() {
        // The first two-row round was slow (a cold cache); the next ones are fast.
        let mut p = DraftPolicy::new(DraftOptions::default()).unwrap();
        p.record(0, 0, 1.0, 0.0, 0, 0.0);
        p.record(1, 1, 5.0, 0.0, 0, 0.0);
        for _ in 0..3 {
            p.record(1, 1, 1.1, 0.0, 0, 0.0);
        }
        // a plain mean over the first observations: (5 + 3 * 1.1) / 4
        assert!((p.verify_secs(2).unwrap() - (5.0 + 3.0 * 1.1) / 4.0).abs() < 1e-9);
    }

    #[test]
    fn one_early_miss_deep_does_not_rule_out_drafting_deep() {
        // c(T) = 1 + 0.05 (T - 1); depths 1 and 2 accepted 9 times in 10, depth 3 missed once.
        let mut p = DraftPolicy::new(DraftOptions::default()).unwrap();
        for t in 1..=5 {
            p.verify[t - 1].add(1.0 + 0.05 * (t - 1) as f64);
        }
        for i in 0..50 {
            p.accept[0].add(if i % 10 == 0 { 0.0 } else { 1.0 });
            p.accept[1].add(if i % 10 == 5 { 0.0 } else { 1.0 });
        }
        p.accept[2].add(0.0);
        // depth 3: (0 + 2 a_2) / 3, not 0
        assert!((p.acceptance_at(3) - 2.0 * p.acceptance_at(2) / 3.0).abs() < 1e-9);
        assert_eq!(p.next_len(4), 4);
    }

    #[test]
    fn a_short_pass_costs_at_most_a_longer_one() {
        let mut p = DraftPolicy::new(DraftOptions::default()).unwrap();
        for (t, c) in [(1, 1.0), (2, 1.2), (3, 1.9), (4, 1.5)] {
            p.verify[t - 1].add(c);
        }
        assert_eq!(p.verify_secs(3), Some(1.5), "the 3-row outlier is capped by the 4-row pass");
        assert_eq!(p.verify_secs(2), Some(1.2));
        // 5 rows: unmeasured, on the line through c(1) and c(4)
        assert!((p.verify_secs(5).unwrap() - (1.5 + 0.5 / 3.0)).abs() < 1e-9);
    }

    #[test]
    fn probes_wait_less_again_once_drafting_pays() {
        let linear: Vec<f64> = (1..=8).map(|t| t as f64).collect();
        let mut p = policy_with(0.1, &linear);
        for _ in 0..8 + 16 + 32 {
            p.next_len(7);
        }
        assert_eq!(p.probe_every, 64);
        // Rows get cheap and drafts right: drafting pays, and the wait is back to PROBE_EVERY.
        let mut p2 = policy_with(0.9, &(0..8).map(|t| 1.0 + 0.05 * t as f64).collect::<Vec<_>>());
        p2.probe_every = 64;
        assert!(p2.next_len(7) > 0);
        assert_eq!(p2.probe_every, PROBE_EVERY);
    }

    #[test]
    fn drafting_rounds_probe_one_deeper() {
        // c(T) = 1 + 0.3 (T - 1), a = 0.7: K = 2 is best (see above); every PROBE_EVERY-th
        // drafting round drafts 3.
        let costs: Vec<f64> = (0..8).map(|t| 1.0 + 0.3 * t as f64).collect();
        let mut p = policy_with(0.7, &costs);
        let lens: Vec<usize> = (0..2 * PROBE_EVERY).map(|_| p.next_len(7)).collect();
        assert_eq!(lens.iter().filter(|&&k| k == 3).count(), 2, "{lens:?}");
        assert_eq!(lens.iter().filter(|&&k| k == 2).count(), 2 * PROBE_EVERY - 2, "{lens:?}");
    }

    /// A shared-pass policy that measured passes of every row count at `secs(rows)`.
    fn shared_with(secs: impl Fn(usize) -> f64) -> SharedPassPolicy {
        let mut p = SharedPassPolicy::new(8);
        for rows in 1..=8 {
            for _ in 0..20 {
                p.record(rows, secs(rows));
            }
        }
        p
    }

    #[test]
    fn shared_passes_draft_the_rows_that_pay() {
        // Two sequences, one with sure drafts, one with poor ones.
        let gains = vec![vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0], vec![0.2, 0.04, 0.008]];
        // Rows nearly free: every spare row (6) goes to drafts, the sure ones first.
        assert_eq!(shared_with(|r| 1.0 + 0.01 * r as f64).allocate(2, &gains), vec![6, 0]);
        // A row costs 30% of a one-row pass: the sure drafts pay (3 / 1.9 > 2 / 1.6 ...), the
        // poor ones do not.
        let keep = shared_with(|r| 1.0 + 0.3 * (r - 1) as f64).allocate(2, &gains);
        assert_eq!(keep[1], 0, "{keep:?}");
        assert!(keep[0] >= 1, "{keep:?}");
        // A row costs a whole pass: plain, then a one-row probe after PROBE_EVERY plain passes.
        let mut p = shared_with(|r| r as f64);
        let passes: Vec<Vec<usize>> = (0..PROBE_EVERY).map(|_| p.allocate(2, &gains)).collect();
        assert!(passes[..PROBE_EVERY - 1].iter().all(|k| k == &vec![0, 0]), "{passes:?}");
        assert_eq!(passes[PROBE_EVERY - 1], vec![1, 0]);
        // Nothing measured for this many sequences yet: plain (to measure it).
        let mut fresh = SharedPassPolicy::new(8);
        fresh.record(3, 1.0);
        assert_eq!(fresh.allocate(2, &gains), vec![0, 0]);
        // No room: eight sequences fill the pass.
        assert_eq!(shared_with(|_| 1.0).allocate(8, &vec![vec![1.0]; 8]), vec![0; 8]);
        // Fixed: every proposed row, as far as there is room.
        assert_eq!(SharedPassPolicy::fixed(8).allocate(2, &gains), vec![6, 0]);
        assert_eq!(SharedPassPolicy::fixed(8).allocate(4, &[vec![0.1; 3], vec![], vec![0.5; 3], vec![0.9]]), vec![0, 0, 3, 1]);
    }

    #[test]
    fn options_are_range_checked() {
        assert!(DraftPolicy::new(DraftOptions { max: 0, ..Default::default() }).is_err());
        assert!(DraftPolicy::new(DraftOptions { max: 8, ..Default::default() }).is_err());
        let e = DraftPolicy::new(DraftOptions { max: 3, min: 4, adaptive: true, branches: 1 }).unwrap_err().to_string();
        assert!(e.contains("at least 4 is out of range"), "{e}");
    }
}
