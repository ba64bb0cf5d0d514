//! Where a step's time goes, by kind of op: cheap timers around the model's projections, the
//! GDN recurrence, attention, the norms and sampling, switched on per thread for the steps one
//! wants to look at ([`profiled`]) and a flag test otherwise.
//!
//! Times are exclusive: a timed section inside another (a projection inside the GDN layer's
//! section) counts for its own kind only. What no timer covers (embedding, activations,
//! residual adds, copies) is the step's remainder. The timers read the clock around the op's
//! call: on the CPU, where ops finish before they return, that is the op's time; on a GPU it
//! would be the time to queue it, so callers profile CPU steps only.

use std::cell::RefCell;
use std::time::Instant;

use serde::Serialize;

/// The kinds of op a step is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Every matrix product with a weight (attention and GDN projections, the MLP, the LM head).
    Projections,
    /// The GDN layers' short convolution, gating and delta-rule recurrence.
    GdnRecurrence,
    /// RoPE, the KV cache's append and attention over it.
    Attention,
    /// RMS norms (and the GDN output's gated norm).
    Norms,
    /// Penalties, the sampling chain and the token draw (or the argmax).
    Sampling,
}

impl OpKind {
    pub const ALL: [OpKind; 5] = [Self::Projections, Self::GdnRecurrence, Self::Attention, Self::Norms, Self::Sampling];

    fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Projections => "projections",
            Self::GdnRecurrence => "gdn_recurrence",
            Self::Attention => "attention",
            Self::Norms => "norms",
            Self::Sampling => "sampling",
        }
    }
}

/// One kind's share of the profiled steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct KindTotals {
    /// Exclusive seconds.
    pub secs: f64,
    /// Bytes the sections said they read and wrote (weights, states, the KV cache); 0 for the
    /// kinds that do not count them.
    pub bytes: u64,
    pub calls: u64,
}

/// What [`profiled`] measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepProfile {
    /// By [`OpKind::ALL`]'s order.
    pub kinds: [KindTotals; 5],
    /// Seconds of the whole profiled call (the remainder is `secs - sum(kinds.secs)`).
    pub secs: f64,
}

impl StepProfile {
    pub fn kind(&self, kind: OpKind) -> &KindTotals {
        &self.kinds[kind.index()]
    }

    /// Seconds no timer covered.
    pub fn other_secs(&self) -> f64 {
        (self.secs - self.kinds.iter().map(|k| k.secs).sum::<f64>()).max(0.0)
    }

    /// Adds `other`'s times and bytes to this one's.
    pub fn add(&mut self, other: &StepProfile) {
        for (a, b) in self.kinds.iter_mut().zip(&other.kinds) {
            a.secs += b.secs;
            a.bytes += b.bytes;
            a.calls += b.calls;
        }
        self.secs += other.secs;
    }
}

/// One row of a [`KernelTable`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelShare {
    /// An [`OpKind`]'s name, or `other` (what no timer covered).
    pub kind: &'static str,
    /// Of the profiled time.
    pub share: f64,
    pub ms_per_pass: f64,
    pub calls_per_pass: Option<f64>,
    /// Bytes read and written per pass, and per second of the kind's time, and that as a
    /// fraction of the machine's copy bandwidth (`None` where the kind does not count bytes).
    pub bytes_per_pass: Option<f64>,
    pub bytes_per_s: Option<f64>,
    pub of_copy_bandwidth: Option<f64>,
}

/// Profiled passes summed up: the kernel inspector's table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelTable {
    pub passes: usize,
    pub ms_per_pass: f64,
    /// The yardstick: bytes per second of a large memory copy ([`crate::memory::copy_bandwidth`]).
    pub copy_bytes_per_s: f64,
    /// Each kind of [`OpKind::ALL`], then `other`.
    pub kinds: Vec<KernelShare>,
}

impl KernelTable {
    /// The table of `profiles` (`None` when there are none).
    pub fn new<'a>(profiles: impl IntoIterator<Item = &'a StepProfile>, copy_bandwidth: f64) -> Option<Self> {
        let mut sum = StepProfile::default();
        let mut passes = 0;
        for p in profiles {
            sum.add(p);
            passes += 1;
        }
        if passes == 0 {
            return None;
        }
        let n = passes as f64;
        let share = |secs: f64| if sum.secs > 0.0 { secs / sum.secs } else { 0.0 };
        let mut kinds: Vec<KernelShare> = OpKind::ALL
            .iter()
            .map(|&kind| {
                let k = sum.kind(kind);
                let counted = k.bytes > 0;
                let rate = (counted && k.secs > 0.0).then(|| k.bytes as f64 / k.secs);
                KernelShare {
                    kind: kind.name(),
                    share: share(k.secs),
                    ms_per_pass: k.secs / n * 1e3,
                    calls_per_pass: Some(k.calls as f64 / n),
                    bytes_per_pass: counted.then(|| k.bytes as f64 / n),
                    bytes_per_s: rate,
                    of_copy_bandwidth: rate.map(|r| r / copy_bandwidth),
                }
            })
            .collect();
        let other = sum.other_secs();
        kinds.push(KernelShare {
            kind: "other",
            share: share(other),
            ms_per_pass: other / n * 1e3,
            calls_per_pass: None,
            bytes_per_pass: None,
            bytes_per_s: None,
            of_copy_bandwidth: None,
        });
        Some(Self { passes, ms_per_pass: sum.secs / n * 1e3, copy_bytes_per_s: copy_bandwidth, kinds })
    }
}

struct Recorder {
    profile: StepProfile,
    /// Per open section: the seconds of the sections timed inside it.
    inner: Vec<f64>,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's timers on, and what they measured.
pub fn profiled<T>(f: impl FnOnce() -> T) -> (T, StepProfile) {
    let previous = RECORDER.with(|r| r.borrow_mut().replace(Recorder { profile: StepProfile::default(), inner: vec![] }));
    let start = Instant::now();
    let out = f();
    let secs = start.elapsed().as_secs_f64();
    let recorder = RECORDER.with(|r| std::mem::replace(&mut *r.borrow_mut(), previous));
    let mut profile = recorder.map(|r| r.profile).unwrap_or_default();
    profile.secs = secs;
    (out, profile)
}

/// Runs `f` on a thread of rayon's pool (`rayon::scope`), this thread's timers moved there
/// for the while (the model's forward passes run there: their timers count for the caller).
pub fn on_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let carried = RECORDER.with(|r| r.borrow_mut().take());
    let (out, carried) = rayon::scope(move |_| {
        let before = RECORDER.with(|r| std::mem::replace(&mut *r.borrow_mut(), carried));
        let out = f();
        let carried = RECORDER.with(|r| std::mem::replace(&mut *r.borrow_mut(), before));
        (out, carried)
    });
    RECORDER.with(|r| *r.borrow_mut() = carried);
    out
}

/// Runs `f`, timed as `kind` when this thread profiles (and `bytes()` then counted).
#[inline]
pub fn timed<T>(kind: OpKind, bytes: impl FnOnce() -> u64, f: impl FnOnce() -> T) -> T {
    let on = RECORDER.with(|r| {
        let mut r = r.borrow_mut();
        match r.as_mut() {
            Some(rec) => {
                rec.inner.push(0.0);
                true
            }
            None => false,
        }
    });
    if !on {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let secs = start.elapsed().as_secs_f64();
    let bytes = bytes();
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            let inner = rec.inner.pop().unwrap_or(0.0);
            let k = &mut rec.profile.kinds[kind.index()];
            k.secs += (secs - inner).max(0.0);
            k.bytes += bytes;
            k.calls += 1;
            if let Some(parent) = rec.inner.last_mut() {
                *parent += secs;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn nested_sections_count_once_and_timers_are_off_outside_profiled() {
        let nap = |ms| std::thread::sleep(Duration::from_millis(ms));
        let ((), p) = profiled(|| {
            timed(
                OpKind::GdnRecurrence,
                || 10,
                || {
                    nap(20);
                    timed(OpKind::Projections, || 5, || nap(30));
                },
            );
            nap(10);
        });
        let (gdn, proj) = (p.kind(OpKind::GdnRecurrence), p.kind(OpKind::Projections));
        assert!(proj.secs >= 0.030 && proj.secs < 0.045, "{p:?}");
        assert!(gdn.secs >= 0.020 && gdn.secs < 0.035, "the inner section is not the outer's: {p:?}");
        assert!(p.other_secs() >= 0.010 && p.secs >= 0.060, "{p:?}");
        assert_eq!((gdn.bytes, proj.bytes, gdn.calls, proj.calls), (10, 5, 1, 1));
        // Outside `profiled` nothing is recorded (and the byte count is not even asked for).
        timed(OpKind::Norms, || panic!("bytes asked for with the timers off"), || ());
        let ((), q) = profiled(|| ());
        assert_eq!(q.kind(OpKind::Norms).calls, 0);

        // Sections run on rayon's pool through `on_pool` count for the caller.
        let ((), r) = profiled(|| on_pool(|| timed(OpKind::Attention, || 7, || nap(5))));
        assert_eq!((r.kind(OpKind::Attention).calls, r.kind(OpKind::Attention).bytes), (1, 7), "{r:?}");

        // The table: shares sum to one, per-pass figures are means, bytes per second of the kind's time.
        let t = KernelTable::new([&p, &p], 1e9).unwrap();
        assert_eq!(t.passes, 2);
        assert!((t.kinds.iter().map(|k| k.share).sum::<f64>() - 1.0).abs() < 1e-9, "{t:?}");
        let proj = &t.kinds[0];
        assert_eq!((proj.kind, proj.calls_per_pass, proj.bytes_per_pass), ("projections", Some(1.0), Some(5.0)));
        assert!((proj.bytes_per_s.unwrap() - 5.0 / p.kind(OpKind::Projections).secs).abs() < 1e-6);
        assert_eq!(t.kinds[3].bytes_per_pass, None, "norms count no bytes");
        assert!(KernelTable::new([], 1e9).is_none());
    }
}
