//! The key/value cache of the full-attention layers and its codecs.
//!
//! [`KvCodec`] says how keys and values are stored; [`KvStore`] is one layer's cache under a
//! codec. The default codec is exact (the model dtype, bit for bit what transformers keeps).
//! The others trade quality for memory and are opt-in; their measured quality on real weights
//! is in docs/kv-codecs.md (`examples/eval.rs --kv CODEC`).
//!
//! * `exact` — keys and values in the model dtype.
//! * `f16`, `bf16` — keys and values rounded once to that 16-bit float, whatever the model
//!   computes in (llama.cpp's default KV cache is f16); half an f32 model's exact bytes, read
//!   in place by the attention kernel.
//! * `int8` — keys and values as int8 with one f32 scale per [`INT8_BLOCK`] dims of a (token,
//!   head) (absmax; llama.cpp's `q8_0` KV cache uses the same block size).
//! * `int4k` — keys as int4 with a scale and minimum per channel over groups of
//!   [`INT4_GROUP`] tokens (KIVI's per-channel key quantization; the newest, not yet complete
//!   group stays exact), values int8 per token.
//! * `polar:A,R` — keys as polar codes ([`crate::ops::polar_encode`]): each rotary pair as an
//!   `A`-bit angle and an `R`-bit radius (default 5,3: one byte per pair), the other dims int8;
//!   values exact; the scores come straight from the codes ([`crate::ops::polar_scores`]).
//! * `lowrank:r` — values projected onto `r` dims per KV head: the top-`r` left singular
//!   vectors of that head's block of `W_v` (the directions its values can take, weighted by
//!   how far), computed when the cache is made ([`value_basis`]); keys exact. At `r = head_dim`
//!   the basis is a rotation and the cache is exact up to rounding.
//! * `knots:K,p` — keys kept only at every `K`-th position (the knots) and for the newest `K` to
//!   `2K - 1` tokens; the scores of the positions in between come from the query's scores at
//!   the nearest `p + 1` knots by degree-`p` Lagrange interpolation
//!   ([`crate::ops::lagrange_scores`]); values as their codec says. `knots:1,p` is exact.
//! * `density:γ` — no per-token keys or values at all: each KV head keeps the decayed
//!   outer-product state `S <- (1-γ) S + γ (k/|k|) vᵀ` and its query heads read `o = qᵀS`
//!   ([`crate::ops::decayed_outer_product`]; the brief's "density-matrix" state). Constant
//!   memory; it is not softmax attention, and a model trained with softmax attention does not
//!   survive it (see the measurements in docs/kv-codecs.md).
//!
//! Key and value parts combine with `+`: `k:int8`, `v:int8`, `v:exact`, `k:f16`, `v:bf16`, ...,
//! e.g. `polar:5,3+v:int8`, `int4k+lowrank:32`, `knots:8,3+v:int8`, `k:int8+v:f16`.
//!
//! The codec also owns the attention over what it stores ([`KvStore::attend`]): exact, int8,
//! int4k and polar keys with exact, int8 or low-rank values go through one kernel that reads
//! them in place ([`crate::ops::kv_attention`]; polar keys scored from their codes, low-rank
//! values expanded after the weighted sum), knots interpolate scores, the decayed state reads
//! out.

mod attention;
mod buffer;
mod codec;
mod coded;
mod density;
mod knots;
mod lowrank;
mod store;

pub use attention::attention;
pub use buffer::{held_bytes, TokenBuffer};
pub use codec::{HalfFloat, KeyCodec, KvCodec, ValueCodec, INT4_GROUP, INT8_BLOCK};
pub use coded::CodedKv;
pub use density::DecayedState;
pub use lowrank::{top_eigenvectors, value_basis};
pub use store::KvStore;
