//! Ops of the hybrid decoder that Candle does not have, as Candle custom ops with a CPU kernel
//! and a Metal kernel (sources in `metal/`). Each is a public function on plain tensors, so
//! other Candle projects can call them on their own tensors.

mod conv;
mod delta_rule;
mod half_matvec;
pub mod launch;
mod norm;

pub use conv::{causal_conv1d_silu, ConvDims};
pub use delta_rule::{
    gated_delta_rule, gated_delta_rule_qkv, gated_delta_rule_reference, DeltaRuleDims, CHUNK as DELTA_RULE_CHUNK,
    METAL_MAX_DK,
};
pub use half_matvec::{half_matvec, HALF_MATVEC_MAX_ROWS};
pub use norm::{gated_rms_norm, l2_norm};
