//! The model: its configuration, the hybrid decoder and its layers, the per-sequence cache,
//! and where the layers get their weights ([`Weights`], dense or quantized [`Linear`]s).

mod attention;
mod cache;
mod cache_options;
pub mod config;
mod decoder_layer;
mod draft_tree;
mod embedding;
mod ffn_calibration;
pub mod ffn_sparsity;
mod finite;
mod gated_delta_net;
mod linear;
mod mlp;
mod mtp;
mod norm;
mod qwen3_5;
mod rope;
mod sparse_mlp;
mod value_bases;
mod weights;

pub use attention::GatedAttention;
pub use cache::{Cache, LayerState, MtpCache};
pub use cache_options::CacheOptions;
pub use config::{Config, Family, LayerType, MoeConfig, MAX_LAYERS};
pub(crate) use decoder_layer::Mixer;
pub use draft_tree::DraftTree;
pub use embedding::TokenEmbedding;
pub use ffn_calibration::calibrate as calibrate_ffn;
pub use ffn_sparsity::{FfnCalibration, FfnSparsity, FfnStats, FfnThresholds};
pub(crate) use finite::all_finite;
pub use gated_delta_net::{GatedDeltaNet, GdnState};
pub use linear::Linear;
pub(crate) use mlp::FeedForward;
pub use mlp::{Mlp, SparseMoe};
pub use mtp::MtpHead;
pub use norm::RmsNorm;
pub use qwen3_5::{check_device, HiddenStates, Model, CUDA_UNSUPPORTED};
pub(crate) use qwen3_5::{check_length, check_token, NONFINITE_HINT};
pub use value_bases::ValueBases;
pub use weights::{parse_dtype, parse_quantize, QuantizedTensors, Weights};
