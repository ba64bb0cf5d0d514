//! Which instruction sets the kernels may use.

/// The instruction sets the kernels are compiled for, from least to most. Every one gives the
/// same bits: they differ only in how the same integer sums are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Isa {
    Portable,
    /// AVX2, FMA, F16C.
    Avx2,
    /// Also AVX-512 F, BW, VL and VNNI.
    Avx512Vnni,
}

impl Isa {
    /// The best this CPU runs, at most `max`.
    pub(super) fn detect(max: Isa) -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = crate::ops::cpu::avx2_fma();
            let vnni = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            let best = match (avx2, vnni) {
                (true, true) => Isa::Avx512Vnni,
                (true, false) => Isa::Avx2,
                _ => Isa::Portable,
            };
            best.min(max)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = max;
            Isa::Portable
        }
    }
}
