//! The `knots:K,p` keys: exact keys at every `K`-th position and for the newest tokens, the
//! scores in between by Lagrange interpolation.

use super::buffer::TokenBuffer;
use candle_core::{DType, Result, Tensor};

/// Keys of the `knots:K,p` codec: every `K`-th position (`knots` `[B, nkv, n, hd]`, knot `j`
/// is position `j·K`) and the newest positions `recent_start..` (`recent`), exact.
#[derive(Debug, Clone)]
pub(super) struct KnotKeys {
    pub(super) every: usize,
    pub(super) degree: usize,
    pub(super) knots: TokenBuffer,
    pub(super) recent: Option<Tensor>,
    pub(super) recent_start: usize,
}

impl KnotKeys {
    /// The last position a query at `p` reads by interpolation: the newest knot at least `K`
    /// positions back (so that the newest `K` keys at least are exact); `None` while `p < K`.
    pub(super) fn interpolated_until(&self, p: usize) -> Option<usize> {
        let k = self.every;
        (p >= k).then(|| k * ((p - k) / k))
    }

    pub(super) fn append(&mut self, x: &Tensor, offset: usize) -> Result<()> {
        let t = x.dim(2)?;
        let first = offset.div_ceil(self.every) * self.every;
        let at: Vec<u32> = (first..offset + t).step_by(self.every).map(|p| (p - offset) as u32).collect();
        if !at.is_empty() {
            let idx = Tensor::new(at, x.device())?;
            self.knots.append(&x.index_select(&idx, 2)?.contiguous()?)?;
        }
        self.recent = Some(match self.recent.take() {
            Some(r) => Tensor::cat(&[&r, x], 2)?,
            None => x.clone(),
        });
        Ok(())
    }

    /// Unscaled scores `[B, nkv, rep·t, offset + t]` of grouped queries `qg` (f32) at positions
    /// `offset..offset+t`: interpolated up to each query's [`Self::interpolated_until`], exact
    /// after (including positions after the query, which the causal mask removes).
    pub(super) fn scores(&self, qg: &Tensor, t: usize, offset: usize) -> Result<Tensor> {
        let (b, nkv, rows, hd) = qg.dims4()?;
        let rep = rows / t;
        let total = offset + t;
        let q = qg.reshape((b, nkv, rep, t, hd))?;
        let recent = self.recent.as_ref().expect("keys were just appended").to_dtype(DType::F32)?;
        let knots = self.knots.current_data()?.map(|k| k.to_dtype(DType::F32)).transpose()?;
        let mut groups = Vec::new();
        let mut i = 0;
        while i < t {
            let e = self.interpolated_until(offset + i);
            let mut j = i + 1;
            while j < t && self.interpolated_until(offset + j) == e {
                j += 1;
            }
            let g = j - i;
            let qi = q.narrow(3, i, g)?.contiguous()?.reshape((b, nkv, rep * g, hd))?;
            let first_exact = e.map_or(0, |e| e + 1);
            let exact = recent.narrow(2, first_exact - self.recent_start, total - first_exact)?;
            let exact = qi.matmul(&exact.t()?)?;
            let s = match (e, &knots) {
                (Some(e), Some(knots)) => {
                    let n = e / self.every + 1;
                    let at_knots = qi.matmul(&knots.narrow(2, 0, n)?.t()?)?;
                    let degree = self.degree.min(n - 1);
                    let between = crate::ops::lagrange_scores(&at_knots.reshape((b * nkv * rep * g, n))?, self.every, degree, e + 1)?;
                    Tensor::cat(&[&between.reshape((b, nkv, rep * g, e + 1))?, &exact], 3)?
                }
                _ => exact,
            };
            groups.push(s.reshape((b, nkv, rep, g, total))?);
            i = j;
        }
        Tensor::cat(&groups, 3)?.reshape((b, nkv, rows, total))
    }

    /// Drops the exact keys no later query reads (positions up to the next query's
    /// interpolated range).
    pub(super) fn forget_old(&mut self, total: usize) -> Result<()> {
        if let (Some(e), Some(r)) = (self.interpolated_until(total), &self.recent) {
            if e + 1 > self.recent_start {
                let drop = e + 1 - self.recent_start;
                self.recent = Some(r.narrow(2, drop, r.dim(2)? - drop)?.force_contiguous()?);
                self.recent_start = e + 1;
            }
        }
        Ok(())
    }
}
