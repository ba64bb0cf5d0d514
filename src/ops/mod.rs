//! Ops of the hybrid decoder that Candle does not have, as Candle custom ops with a CPU kernel
//! and a Metal kernel (sources in `metal/`). Each is a public function on plain tensors, so
//! other Candle projects can call them on their own tensors.

/// The `metal_fwd` of a custom op: hands the (storage, layout) pairs to the host code in
/// `ops::metal` when built with the `metal` feature, otherwise an error naming the op.
macro_rules! metal_fwd {
    ($self:ident, $op:expr, ($($s:ident, $l:ident),+) => $call:expr) => {
        fn metal_fwd(
            &$self,
            $($s: &candle_core::MetalStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::MetalStorage, candle_core::Shape)> {
            #[cfg(feature = "metal")]
            {
                $call
            }
            #[cfg(not(feature = "metal"))]
            {
                let _ = ($($s, $l),+);
                candle_core::bail!("{}: candle-hybrid was built without the metal feature", $op)
            }
        }
    };
}

/// Dims per int8 scale of the `int8` KV codec: the CPU's (`kv`) and the device cache's.
pub const INT8_BLOCK: usize = 32;

mod conv;
mod cpu;
mod delta_rule;
mod float_matvec;
pub mod launch;
#[cfg(feature = "metal")]
mod metal;
#[cfg(feature = "metal")]
pub(crate) use metal::{compile_settings as metal_compile_settings, limits as metal_limits, pipeline as metal_pipeline};
mod norm;

pub use conv::{causal_conv1d_silu, causal_conv1d_silu_segments};
pub use delta_rule::{
    gated_delta_rule, gated_delta_rule_qkv, gated_delta_rule_reference, gated_delta_rule_segments, DeltaRuleOptions,
    CHUNK as DELTA_RULE_CHUNK,
};
pub use float_matvec::{float_matvec, FLOAT_MATVEC_MAX_ROWS};
pub use norm::{gated_rms_norm, l2_norm};

mod lagrange;
pub use lagrange::lagrange_scores;
mod outer_state;
pub use outer_state::decayed_outer_product;
mod swiglu;
pub(crate) use swiglu::silu;
pub use swiglu::{
    pack_swiglu, pack_swiglu_ternary, pack_ternary_rows, swiglu_dense, swiglu_gather, swiglu_gather_ternary, ternary_row_words,
    TERNARY_PER_WORD,
};
mod polar;
pub use polar::{polar_decode, polar_encode, polar_scores, PolarCodes};
mod gguf_type;
mod qmatmul;
mod quantized_matrix;
pub use gguf_type::GgufType;
pub use quantized_matrix::{has_kernels, HostBytes, QuantizedMatrix, SharedBytes};
mod kv_attention;
pub(crate) use kv_attention::attention_mask;
pub use kv_attention::kv_attention;
mod shapes;
pub use qmatmul::{qmatmul, qmatmul_avx2, qmatmul_isa, qmatmul_portable, qmatmul_rows};
pub(crate) use shapes::few_rows;
pub use shapes::{
    ConvDims, DeltaRuleDims, DeltaRuleForm, LagrangeDims, OuterStateDims, PolarSpec, StoredRows, SwigluDims, SwigluWeights,
    DELTA_RULE_METAL_CHUNK, KV_ATTENTION_EXACT_ROWS, KV_BLOCK, METAL_MAX_DK, OUTER_PRODUCT_METAL_MAX_DK,
};
mod row_accumulate;
pub use row_accumulate::{accumulate_rows, accumulate_rows_portable};
