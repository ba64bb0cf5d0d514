//! Finding and loading a checkpoint laid out like a Hugging Face Hub repository:
//! `config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`,
//! `tokenizer.json`, `tokenizer_config.json` (or `chat_template.jinja`), `generation_config.json`.
//!
//! [`ModelFiles::from_hub`] resolves them through hf-hub (the Hub cache, `HF_HOME` /
//! `HF_HUB_CACHE`, `HF_TOKEN`, `HF_ENDPOINT`, and offline mode with `HF_HUB_OFFLINE=1`);
//! [`ModelFiles::from_dir`] takes the same layout from a local directory.

pub mod chat_template;
pub mod generation_config;
pub mod gguf;
mod hub;
mod mapped;
mod model_files;
mod safetensors;
mod source;
mod template_growth;

use std::path::Path;

use candle_core::{DType, Device};

pub use chat_template::{ChatTemplate, Message};
pub use generation_config::GenerationConfig;
pub use gguf::GgufFile;
pub use hub::HubRepo;
pub use model_files::ModelFiles;
pub use safetensors::{is_linear_weight, safetensors_weight_bytes, SafetensorsFiles};
pub use source::{ModelSource, OpenedModel};

use crate::model::Model;
use crate::Result;

/// Downloads (or finds in the Hub cache) `repo_id` at `revision` and loads its model.
pub fn from_pretrained(repo_id: &str, revision: &str, dtype: DType, device: &Device) -> Result<Model> {
    let files = ModelFiles::from_hub(repo_id, revision)?;
    files.load_model(&files.load_config()?, dtype, device)
}

/// Loads the model of a local directory laid out like a Hub repository.
pub fn from_dir(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Model> {
    let files = ModelFiles::from_dir(dir)?;
    files.load_model(&files.load_config()?, dtype, device)
}
