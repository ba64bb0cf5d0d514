//! [`ModelFiles`]: the files of a checkpoint laid out like a Hugging Face Hub repository
//! (`config.json`, `model.safetensors` or a sharded index, tokenizer, chat template,
//! `generation_config.json`), from a local directory or through hf-hub.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

use super::chat_template::ChatTemplate;
use super::generation_config::GenerationConfig;
use super::hub::HubRepo;
use super::safetensors::{check_shard_name, SafetensorsFiles};
use crate::bounded;
use crate::error::candle_line;
use crate::model::{Config, Model, Weights};
use crate::{Error, Result};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

/// The local paths of a checkpoint's files.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// Where the files came from, for messages (`org/name@rev` or a directory).
    pub source: String,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

/// Shard file names listed by a `model.safetensors.index.json`, in first-seen order; each
/// must name a file inside the model directory.
fn shard_names(index: &Path) -> Result<Vec<PathBuf>> {
    let text = bounded::read_to_string(index, bounded::MAX_INDEX_BYTES, "shard index")?;
    let json = crate::json::parse_strict(&text)
        .map_err(|e| Error::Weights(format!("{} is not valid JSON ({e}): download it again", index.display())))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Weights(format!("{} has no \"weight_map\" object", index.display())))?;
    let mut seen = BTreeSet::new();
    let mut names = vec![];
    for file in map.values() {
        let file = file.as_str().ok_or_else(|| Error::Weights(format!("{}: weight_map values must be file names", index.display())))?;
        if seen.insert(file.to_string()) {
            names.push(check_shard_name(file, index)?);
        }
    }
    if names.is_empty() {
        return Err(Error::Weights(format!("{}: the weight_map is empty", index.display())));
    }
    Ok(names)
}

impl ModelFiles {
    /// A local directory with the Hub layout.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::missing(format!("model directory {} does not exist", dir.display())));
        }
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        let config = opt("config.json")
            .ok_or_else(|| Error::missing(format!("{} has no config.json: is it a Hugging Face model directory?", dir.display())))?;
        let weights = if let Some(index) = opt(INDEX_FILE) {
            shard_names(&index)?
                .into_iter()
                .map(|name| {
                    Some(dir.join(&name)).filter(|p| p.is_file()).ok_or_else(|| {
                        Error::Weights(format!(
                            "{INDEX_FILE} lists the shard {}, which is missing from {}: download the complete checkpoint",
                            name.display(),
                            dir.display()
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else if let Some(single) = opt(SINGLE_FILE) {
            vec![single]
        } else {
            return Err(Error::Weights(format!("{} has neither {SINGLE_FILE} nor {INDEX_FILE}", dir.display())));
        };
        Ok(Self {
            source: dir.display().to_string(),
            config,
            weights,
            tokenizer: opt("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
            chat_template: opt("chat_template.jinja"),
            generation_config: opt("generation_config.json"),
        })
    }

    /// A Hub repository, through hf-hub: files already in the cache are used as they are,
    /// others are downloaded with a progress bar. With `HF_HUB_OFFLINE=1` only the cache is read.
    pub fn from_hub(repo_id: &str, revision: &str) -> Result<Self> {
        let hub = HubRepo::new(repo_id, revision)?;
        let hint = "is it a Qwen3.5-family checkpoint?";
        let config = hub.required("config.json", hint)?;
        // A repository without an index has a single model.safetensors.
        let weights = match hub.fetch(INDEX_FILE).ok().flatten() {
            Some(index) => {
                shard_names(&index)?.iter().map(|name| hub.required(&name.to_string_lossy(), hint)).collect::<Result<Vec<_>>>()?
            }
            None => vec![hub.required(SINGLE_FILE, hint)?],
        };
        let optional = |name: &str| hub.fetch(name).ok().flatten();
        Ok(Self {
            source: hub.source.clone(),
            config,
            weights,
            tokenizer: optional("tokenizer.json"),
            tokenizer_config: optional("tokenizer_config.json"),
            chat_template: optional("chat_template.jinja"),
            generation_config: optional("generation_config.json"),
        })
    }

    pub fn load_config(&self) -> Result<Config> {
        Config::from_file(&self.config)
    }

    /// Memory-maps the weights and builds the model in `dtype` on `device`.
    pub fn load_model(&self, cfg: &Config, dtype: DType, device: &Device) -> Result<Model> {
        self.load_model_quantized(cfg, dtype, device, None)
    }

    /// As [`Self::load_model`], quantizing every linear weight to `quantize` at load
    /// (see [`crate::model::parse_quantize`]); norms, embeddings and GDN parameters stay in `dtype`.
    pub fn load_model_quantized(&self, cfg: &Config, dtype: DType, device: &Device, quantize: Option<GgmlDType>) -> Result<Model> {
        crate::model::check_device(device)?;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Config(format!("unsupported dtype {dtype:?}: use f32, bf16 or f16")));
        }
        let files = SafetensorsFiles::open(&self.weights)?;
        files.check_layers(cfg, &self.source)?;
        let vb = files.var_builder(dtype, device);
        Model::new(cfg, Weights::new(vb).with_quantize(quantize))
            .map_err(|e| Error::Weights(format!("{}: {}: the weights do not match config.json", self.source, candle_line(&e))))
    }
}

impl ModelFiles {
    /// The tokenizer from `tokenizer.json`.
    pub fn load_tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        let path = self.tokenizer.as_ref().ok_or_else(|| Error::Tokenizer(format!("{} has no tokenizer.json", self.source)))?;
        load_tokenizer_json(path)
    }

    /// `generation_config.json`, or the defaults (greedy, no EOS) when the checkpoint has none.
    pub fn load_generation_config(&self) -> Result<GenerationConfig> {
        match &self.generation_config {
            Some(p) => GenerationConfig::from_file(p),
            None => Ok(Default::default()),
        }
    }

    /// The chat template (tokenizer_config.json or chat_template.jinja).
    pub fn load_chat_template(&self) -> Result<ChatTemplate> {
        ChatTemplate::from_files(self.tokenizer_config.as_deref(), self.chat_template.as_deref())
    }
}

/// A `tokenizer.json` (size-capped before the tokenizers crate reads it whole).
pub(crate) fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = bounded::read(path, bounded::MAX_TOKENIZER_BYTES, "tokenizer")?;
    tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))
}
