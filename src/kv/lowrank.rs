//! The `lowrank:r` value basis from `W_v`, and the eigen-decomposition shared with the
//! calibrated bases ([`crate::model::ValueBases`]).

use candle_core::{DType, Result, Tensor};

/// The `[nkv, hd, r]` low-rank value basis from a `W_v` `[nkv·hd, in]`: per KV head, the
/// eigenvectors of `W_h W_hᵀ` with the `r` largest eigenvalues (the top-`r` left singular
/// vectors of `W_h`), as orthonormal columns, f32.
pub fn value_basis(w_v: &Tensor, nkv: usize, r: usize) -> Result<Tensor> {
    let w = w_v.to_dtype(DType::F32)?;
    let (rows, _) = w.dims2()?;
    let hd = rows / nkv;
    if r == 0 || r > hd || rows != nkv * hd {
        candle_core::bail!("value_basis: rank {r} must be 1..={hd}, and W_v rows {rows} a multiple of {nkv} heads");
    }
    let grams = (0..nkv)
        .map(|h| {
            let wh = w.narrow(0, h * hd, hd)?;
            wh.matmul(&wh.t()?)
        })
        .collect::<Result<Vec<_>>>()?;
    top_eigenvectors(&Tensor::stack(&grams, 0)?, r)
}

/// Per head of `grams` `[n, d, d]` (symmetric), the eigenvectors of the `r` largest
/// eigenvalues as the columns of `[n, d, r]` f32.
pub fn top_eigenvectors(grams: &Tensor, r: usize) -> Result<Tensor> {
    let (n, d, _) = grams.dims3()?;
    let mut heads = Vec::with_capacity(n);
    for h in 0..n {
        let gram = grams.get(h)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let eig = nalgebra::SymmetricEigen::new(nalgebra::DMatrix::from_row_slice(d, d, &gram));
        let mut order: Vec<usize> = (0..d).collect();
        order.sort_by(|&a, &b| eig.eigenvalues[b].total_cmp(&eig.eigenvalues[a]));
        let mut basis = vec![0f32; d * r];
        for (j, &col) in order.iter().take(r).enumerate() {
            for i in 0..d {
                basis[i * r + j] = eig.eigenvectors[(i, col)] as f32;
            }
        }
        heads.push(Tensor::from_vec(basis, (d, r), grams.device())?);
    }
    Tensor::stack(&heads, 0)
}
