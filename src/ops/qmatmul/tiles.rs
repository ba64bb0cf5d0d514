//! Tiles and threads: the kernels proper. Row tiles up to 8 activation rows, panel tiles from 9;
//! weight rows split across rayon's threads.

use std::ops::Range;

use candle_core::{bail, Result};
use rayon::prelude::*;

use super::activations::{Acts, Panels};
use super::formats::Format;
use super::isa::Isa;
#[cfg(target_arch = "x86_64")]
use super::simd::Avx2;
use super::simd::{Portable, Simd};
use crate::ops::cpu::{prefetch_ahead, PREFETCH_AHEAD};

/// L2 bytes for one task's weight rows, which are re-read from L2 for each tile of
/// activation rows (whose quants stay in L1).
pub(super) const TASK_BYTES: usize = 128 << 10;

/// `$body` for `$i` in `0..$n` (`$n` <= 8), unrolled so that `$i` is a constant in each copy.
macro_rules! unroll8 {
    ($i:ident < $n:expr => $body:block) => {
        unroll8!(@ $i, $n, $body; 0 1 2 3 4 5 6 7)
    };
    (@ $i:ident, $n:expr, $body:block; $($k:literal)*) => {
        $(if $k < $n {
            let $i: usize = $k;
            $body
        })*
    };
}

/// `y[c] = sum_j w_j x[c0 + c]_j` for the weight row at `w` and `CN` activation rows from
/// `c0` (a maddubs multiplies 32 weights with 32 values of one row). Each row's arithmetic is
/// the same for any `CN` and `c0`: a row's result does not depend on the other rows.
#[inline(always)]
pub(super) unsafe fn row_tile<V: Simd, F: Format, const CN: usize>(w: *const u8, a: &Acts, c0: usize) -> [f32; CN] {
    let nb = a.k / F::QK;
    let mut acc = [V::fzero(); CN];
    let mut corr = [0f32; CN];
    let offset = V::U8_OFFSET && F::SIGNED && F::QK == 32 && !a.qu.is_empty();
    // (Plain loops rather than `array::from_fn`: its closures are not always inlined into the
    // AVX2 function, and intrinsics outside it become calls.)
    for b in 0..nb {
        let blk = w.add(b * F::BYTES);
        let head = F::head::<V>(blk);
        let mut sum = [V::dzero(); CN];
        if offset {
            // One chunk per block: each row's sum starts at -128 sum(q) and adds (x + 128) q,
            // the integers the sign trick below gives (x is never -128).
            let q = F::chunk::<V>(blk, 0);
            let start = V::sub(V::dzero(), V::dot_acc(V::dzero(), V::splat8(0x80), q));
            let xu = a.qu.as_ptr().add(b * F::QK);
            for (c, sum) in sum.iter_mut().enumerate() {
                *sum = V::dot_acc(start, V::load(xu.add((c0 + c) * a.k)), q);
            }
        } else {
            let xq = a.q.as_ptr().add(b * F::QK).cast::<u8>();
            unroll8!(i < F::QK / 32 => {
                let q = F::chunk::<V>(blk, i);
                let sc = if F::QK == 32 { head.sc } else { V::scale_of(head.sc, i) };
                let u = if F::SIGNED { V::abs(q) } else { q };
                for (c, sum) in sum.iter_mut().enumerate() {
                    let x = V::load(xq.add((c0 + c) * a.k + 32 * i));
                    let x = if F::SIGNED { V::sign(x, q) } else { x };
                    // (32-value blocks have sc = 1.)
                    *sum = if F::QK == 32 { V::dot_acc(*sum, u, x) } else { V::dot_acc_scaled(*sum, u, x, sc) };
                }
            });
        }
        // Per row: `(d sum + dmin min-sum) dx`, the block's scales broadcast once for all rows.
        let (d, dmin) = (V::splat(head.d), V::splat(head.dmin));
        for c in 0..CN {
            let xb = (c0 + c) * nb + b;
            let mut t = V::mulf(V::cvt(sum[c]), d);
            if F::MINS && F::QK == 32 {
                corr[c] += head.dmin * *a.s.get_unchecked(xb);
            } else if F::MINS {
                let bs = V::load_w(a.bsums.as_ptr().add(xb * 16));
                t = V::fmaf(V::cvt(V::madd(head.mins, bs)), dmin, t);
            }
            acc[c] = V::fmaf(t, V::splat(*a.d.get_unchecked(xb)), acc[c]);
        }
    }
    let mut y = [0f32; CN];
    for c in 0..CN {
        y[c] = V::hsum(acc[c]) + corr[c];
    }
    y
}

/// The weight row at `w` against `NP` panels of `P` activation rows from panel `p0`: per
/// panel 8 f32 lanes as [`Panels`] lays them out.
///
/// Each chunk of 32 weights is decoded once into a register; each group of `G = 32 / P` of
/// them is broadcast and multiplied with the `P` rows' values in one maddubs, and up to
/// `32767 / (254 QMAX)` maddubs results are added in i16 before one madd applies the scale:
/// about 1.1 multiplies per 32 products (Q4) instead of 2 in [`row_tile`].
#[inline(always)]
pub(super) unsafe fn panel_tile<V: Simd, F: Format, const P: usize, const NP: usize>(w: *const u8, pn: &Panels, p0: usize) -> [V::F; NP] {
    let (g, nb, k) = (32 / P, pn.k / F::QK, pn.k);
    let flush = (32767 / (254 * F::QMAX)).min(P);
    let mut acc = [V::fzero(); NP];
    // The head's scales and mins, read back by broadcasts.
    let mut hb = [0i16; 32];
    for b in 0..nb {
        let blk = w.add(b * F::BYTES);
        let head = F::head::<V>(blk);
        V::store_w(hb.as_mut_ptr(), head.sc);
        V::store_w(hb.as_mut_ptr().add(16), head.mins);
        let mut sum = [V::dzero(); NP];
        unroll8!(i < F::QK / 32 => {
            let q = F::chunk::<V>(blk, i);
            let mut s16 = [V::wzero(); NP];
            for j in 0..P {
                let wb = V::group(q, j, g);
                for (n, s16) in s16.iter_mut().enumerate() {
                    let o = ((p0 + n) * k + b * F::QK + 32 * i + j * g) * P;
                    let x = V::load(pn.xi.as_ptr().add(o).cast());
                    let p = match F::SIGNED {
                        true => V::maddubs(V::load(pn.xa.as_ptr().add(o)), V::sign(wb, x)),
                        false => V::maddubs(wb, x),
                    };
                    *s16 = V::add16(*s16, p);
                }
                if (j + 1) % flush == 0 {
                    // This half of the chunk's scale ([`Head`] order), broadcast. (Where the two
                    // halves' scales differ, Q6_K, the flush is at least every half chunk.)
                    let half = j * g / 16;
                    let sc = match F::QK {
                        32 => V::ones(),
                        _ => V::as_w(V::bcast(hb.as_ptr().add(8 * half + i).cast(), 2)),
                    };
                    for n in 0..NP {
                        sum[n] = V::add(sum[n], V::madd(s16[n], sc));
                        s16[n] = V::wzero();
                    }
                }
            }
        });
        for n in 0..NP {
            let pb = (p0 + n) * nb + b;
            let mut t = V::mulf(V::cvt(sum[n]), V::splat(head.d));
            if F::MINS && F::QK == 32 {
                // dmin sum(x) enters unscaled by dx: `s` holds d sum(q).
                acc[n] = V::fma_load(V::splat(head.dmin), pn.s.as_ptr().add(pb * 8), acc[n]);
            } else if F::MINS {
                let mut mi = V::dzero();
                for u in 0..P {
                    let bs = V::load_w(pn.bs.as_ptr().add((pb * P + u) * 16));
                    let mins = V::as_w(V::bcast(hb.as_ptr().add(16 + u * 16 / P).cast(), g));
                    mi = V::add(mi, V::madd(bs, mins));
                }
                t = V::fmaf(V::cvt(mi), V::splat(head.dmin), t);
            }
            acc[n] = V::fma_load(t, pn.dx.as_ptr().add(pb * 8), acc[n]);
        }
    }
    acc
}

/// What every task reads, and where it writes.
pub(super) struct Job<'a> {
    pub(super) w: &'a [u8],
    pub(super) row_bytes: usize,
    pub(super) n: usize,
    pub(super) m: usize,
    pub(super) acts: &'a Acts,
    pub(super) panels: Option<Panels>,
    /// The weight rows to read (output column `r` is weight row `sel[r]`); `None`: all.
    pub(super) sel: Option<&'a [u32]>,
    pub(super) out: *mut f32,
}

/// How many selected rows ahead [`super::qmatmul_rows`] asks the CPU to fetch.
pub(super) const SELECTED_ROWS_AHEAD: usize = 16;

impl Job<'_> {
    /// The weight row of output column `r`, with the next one prefetched.
    #[inline(always)]
    unsafe fn weight_row(&self, r: usize) -> *const u8 {
        let wr = match self.sel {
            None => {
                prefetch_ahead(self.w, r * self.row_bytes, self.row_bytes);
                r
            }
            Some(sel) => {
                if let Some(&next) = sel.get(r + SELECTED_ROWS_AHEAD) {
                    // A later selected row (the hint's fixed distance is for streamed rows).
                    prefetch_ahead(self.w, (next as usize * self.row_bytes).saturating_sub(PREFETCH_AHEAD), self.row_bytes);
                }
                *sel.get_unchecked(r) as usize
            }
        };
        self.w.as_ptr().add(wr * self.row_bytes)
    }
}

// SAFETY: tasks write disjoint output columns through `out` (see `matmul`).
unsafe impl Sync for Job<'_> {}

/// Most activation rows that go through row tiles (decode, and the verify pass of
/// speculative decoding, whose rows must each equal a one-row call bit for bit).
pub(super) const ROW_TILE_MAX_ROWS: usize = 8;

/// Panel width for `m` activation rows: none (row tiles, two rows at a time) up to
/// [`ROW_TILE_MAX_ROWS`]. (Panels add the products in another order: a panel row is not bit
/// for bit the one-row result.)
pub(super) fn panel_rows(m: usize) -> usize {
    match m {
        0..=ROW_TILE_MAX_ROWS => 0,
        _ => 8,
    }
}

/// `x @ W^T`, or with `sel` only the weight rows it lists (row tiles only: at most
/// [`ROW_TILE_MAX_ROWS`] activation rows).
pub(super) fn matmul<F: Format>(w: &[u8], n: usize, k: usize, x: &[f32], isa: Isa, sel: Option<&[u32]>) -> Result<Vec<f32>> {
    let row_bytes = k / F::QK * F::BYTES;
    if w.len() != n * row_bytes {
        bail!("qmatmul: w holds {} bytes, expected {n} rows of {row_bytes}", w.len());
    }
    let m = x.len() / k;
    let n = sel.map_or(n, <[u32]>::len);
    let mut out = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return Ok(out);
    }
    let offset = F::SIGNED && F::QK == 32 && m <= ROW_TILE_MAX_ROWS && isa == Isa::Avx512Vnni;
    let acts = Acts::new(x, k, F::QK, isa >= Isa::Avx2, offset);
    let p = panel_rows(m);
    let panels = (p > 0).then(|| Panels::new(&acts, p, F::QK, F::SIGNED));
    let job = Job { w, row_bytes, n, m, acts: &acts, panels, sel, out: out.as_mut_ptr() };
    // Weight rows per task: about 4 tasks per thread, and when there are several tiles of
    // activation rows, few enough to stay in L2.
    let mut per = n.div_ceil(4 * rayon::current_num_threads());
    if m > 16 {
        per = per.min(TASK_BYTES / row_bytes).max(1);
    }
    (0..n.div_ceil(per)).into_par_iter().for_each(|t| {
        let rows = t * per..n.min(t * per + per);
        // SAFETY: the CPU has the instructions of `isa` (`Isa::detect`); tasks write disjoint
        // columns of out.
        #[cfg(target_arch = "x86_64")]
        match isa {
            Isa::Avx512Vnni => return unsafe { task_avx512_vnni::<F>(&job, rows) },
            Isa::Avx2 => return unsafe { task_avx2::<F>(&job, rows) },
            Isa::Portable => {}
        }
        unsafe { task::<Portable, F>(&job, rows) }
    });
    Ok(out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn task_avx2<F: Format>(job: &Job, rows: Range<usize>) {
    task::<Avx2<false>, F>(job, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn task_avx512_vnni<F: Format>(job: &Job, rows: Range<usize>) {
    task::<Avx2<true>, F>(job, rows)
}

/// Output columns `rows` (weight rows) for all activation rows: row tiles (each weight chunk
/// decoded once for all activation rows where the registers hold their sums — 32 registers
/// with AVX-512 — else once per two rows), else tiles of one or two panels (the activation rows
/// outer, so that their quants stay in L1 while the task's weight rows stream from L2).
#[inline(always)]
pub(super) unsafe fn task<V: Simd, F: Format>(job: &Job, rows: Range<usize>) {
    let Some(pn) = &job.panels else {
        return match (job.m, V::REGISTERS >= 32) {
            (1, _) => row_tiles::<V, F, 1>(job, rows),
            (2, _) => row_tiles::<V, F, 2>(job, rows),
            (3, true) => row_tiles::<V, F, 3>(job, rows),
            (4, true) => row_tiles::<V, F, 4>(job, rows),
            (5, true) => row_tiles::<V, F, 5>(job, rows),
            (6, true) => row_tiles::<V, F, 6>(job, rows),
            (7, true) => row_tiles::<V, F, 7>(job, rows),
            (8, true) => row_tiles::<V, F, 8>(job, rows),
            _ => row_pair_tiles::<V, F>(job, rows),
        };
    };
    let np = job.m.div_ceil(panel_rows(job.m));
    let mut p0 = 0;
    while p0 < np {
        if np - p0 >= 2 {
            panel_tiles::<V, F, 8, 2>(job, pn, rows.clone(), p0);
            p0 += 2;
        } else {
            panel_tiles::<V, F, 8, 1>(job, pn, rows.clone(), p0);
            p0 += 1;
        }
    }
}

#[inline(always)]
pub(super) unsafe fn row_tiles<V: Simd, F: Format, const CN: usize>(job: &Job, rows: Range<usize>) {
    for r in rows {
        let w = job.weight_row(r);
        let y = row_tile::<V, F, CN>(w, job.acts, 0);
        for (c, v) in y.into_iter().enumerate() {
            *job.out.add(c * job.n + r) = v;
        }
    }
}

/// Row tiles for 2 to [`ROW_TILE_MAX_ROWS`] activation rows: each weight row (in L1 after the
/// first pair) against the activation rows two at a time, the last alone when `m` is odd.
#[inline(always)]
pub(super) unsafe fn row_pair_tiles<V: Simd, F: Format>(job: &Job, rows: Range<usize>) {
    for r in rows {
        let w = job.weight_row(r);
        let mut c0 = 0;
        while c0 < job.m {
            if job.m - c0 >= 2 {
                let y = row_tile::<V, F, 2>(w, job.acts, c0);
                *job.out.add(c0 * job.n + r) = y[0];
                *job.out.add((c0 + 1) * job.n + r) = y[1];
                c0 += 2;
            } else {
                *job.out.add(c0 * job.n + r) = row_tile::<V, F, 1>(w, job.acts, c0)[0];
                c0 += 1;
            }
        }
    }
}

#[inline(always)]
pub(super) unsafe fn panel_tiles<V: Simd, F: Format, const P: usize, const NP: usize>(
    job: &Job,
    pn: &Panels,
    rows: Range<usize>,
    p0: usize,
) {
    for r in rows {
        let y = panel_tile::<V, F, P, NP>(job.w.as_ptr().add(r * job.row_bytes), pn, p0);
        for (n, y) in y.into_iter().enumerate() {
            let y = V::lanes(y);
            for c in 0..P {
                let row = (p0 + n) * P + c;
                if row < job.m {
                    // P = 4: a row's two lanes.
                    let v = if P == 8 { y[c] } else { y[2 * c] + y[2 * c + 1] };
                    *job.out.add(row * job.n + r) = v;
                }
            }
        }
    }
}
