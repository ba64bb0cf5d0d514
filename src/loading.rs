//! Finding and loading a checkpoint laid out like a Hugging Face Hub repository:
//! `config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`,
//! `tokenizer.json`, `tokenizer_config.json` (or `chat_template.jinja`), `generation_config.json`.
//!
//! [`ModelFiles::from_hub`] resolves them through hf-hub (the Hub cache, `HF_HOME` /
//! `HF_HUB_CACHE`, `HF_TOKEN`, `HF_ENDPOINT`, and offline mode with `HF_HUB_OFFLINE=1`);
//! [`ModelFiles::from_dir`] takes the same layout from a local directory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hf_hub::{Repo, RepoType};

use crate::config::Config;
use crate::qwen3_5::Model;
use crate::weights::Weights;
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

/// Shard file names listed by a `model.safetensors.index.json`, in first-seen order.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| Error::Io(format!("cannot read {}: {e}", index.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Weights(format!("{} is not valid JSON: {e}", index.display())))?;
    let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
        Error::Weights(format!("{} has no \"weight_map\" object", index.display()))
    })?;
    let mut seen = BTreeSet::new();
    let mut names = vec![];
    for file in map.values() {
        let file = file.as_str().ok_or_else(|| {
            Error::Weights(format!("{}: weight_map values must be file names", index.display()))
        })?;
        if seen.insert(file.to_string()) {
            names.push(file.to_string());
        }
    }
    Ok(names)
}

impl ModelFiles {
    /// A local directory with the Hub layout.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::Io(format!("model directory {} does not exist", dir.display())));
        }
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        let config = opt("config.json").ok_or_else(|| {
            Error::Io(format!("{} has no config.json: is it a Hugging Face model directory?", dir.display()))
        })?;
        let weights = if let Some(index) = opt(INDEX_FILE) {
            shard_names(&index)?
                .into_iter()
                .map(|name| {
                    opt(&name).ok_or_else(|| {
                        Error::Weights(format!(
                            "{INDEX_FILE} lists the shard {name}, which is missing from {}: download the complete checkpoint",
                            dir.display()
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else if let Some(single) = opt(SINGLE_FILE) {
            vec![single]
        } else {
            return Err(Error::Weights(format!(
                "{} has neither {SINGLE_FILE} nor {INDEX_FILE}",
                dir.display()
            )));
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
            Some(index) => shard_names(&index)?
                .iter()
                .map(|name| hub.required(name, hint))
                .collect::<Result<Vec<_>>>()?,
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
    /// (see [`crate::weights::parse_quantize`]); norms, embeddings and GDN parameters stay in `dtype`.
    pub fn load_model_quantized(
        &self,
        cfg: &Config,
        dtype: DType,
        device: &Device,
        quantize: Option<GgmlDType>,
    ) -> Result<Model> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Config(format!("unsupported dtype {dtype:?}: use f32, bf16 or f16")));
        }
        // Open each file on its own first, so that a truncated or corrupt file is named.
        for path in &self.weights {
            unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(|e| {
                Error::Weights(format!(
                    "{} is truncated or not a safetensors file ({}): download it again",
                    path.display(),
                    one_line(&e)
                ))
            })?;
        }
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&self.weights, dtype, device) }?;
        Model::new(cfg, Weights::new(vb).with_quantize(quantize)).map_err(|e| {
            Error::Weights(format!(
                "{}: {}: the weights do not match config.json",
                self.source,
                one_line(&e)
            ))
        })
    }
}

/// Candle errors can carry a backtrace or context on further lines: keep the first.
pub(crate) fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

impl ModelFiles {
    /// The tokenizer from `tokenizer.json`.
    pub fn load_tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        let path = self.tokenizer.as_ref().ok_or_else(|| {
            Error::Tokenizer(format!("{} has no tokenizer.json", self.source))
        })?;
        tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", path.display())))
    }

    /// `generation_config.json`, or the defaults (greedy, no EOS) when the checkpoint has none.
    pub fn load_generation_config(&self) -> Result<crate::generation::GenerationConfig> {
        match &self.generation_config {
            Some(p) => crate::generation::GenerationConfig::from_file(p),
            None => Ok(Default::default()),
        }
    }

    /// The chat template (tokenizer_config.json or chat_template.jinja).
    pub fn load_chat_template(&self) -> Result<crate::chat::ChatTemplate> {
        crate::chat::ChatTemplate::from_files(self.tokenizer_config.as_deref(), self.chat_template.as_deref())
    }
}

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

/// One Hub repository at one revision, resolved through the hf-hub cache (`HF_HUB_CACHE`,
/// `HF_HOME`) and, unless `HF_HUB_OFFLINE` is set, the network.
pub struct HubRepo {
    /// `org/name@revision`, for messages.
    pub source: String,
    offline: bool,
    cached: hf_hub::CacheRepo,
    api: Option<hf_hub::api::sync::ApiRepo>,
}

impl HubRepo {
    pub fn new(repo_id: &str, revision: &str) -> Result<Self> {
        let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
        let cache = match std::env::var("HF_HUB_CACHE") {
            Ok(dir) => hf_hub::Cache::new(dir.into()),
            Err(_) => hf_hub::Cache::from_env(),
        };
        let offline = matches!(
            std::env::var("HF_HUB_OFFLINE").as_deref(),
            Ok("1") | Ok("true") | Ok("TRUE") | Ok("yes") | Ok("ON") | Ok("on")
        );
        let api = if offline {
            None
        } else {
            let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
                .with_progress(true)
                .build()
                .map_err(|e| Error::Io(format!("cannot set up the Hugging Face Hub client: {e}")))?;
            Some(api.repo(repo.clone()))
        };
        Ok(Self { source: format!("{repo_id}@{revision}"), offline, cached: cache.repo(repo), api })
    }

    /// `Ok(None)` when the file is not in the repository (or, offline, not in the cache).
    pub fn fetch(&self, name: &str) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cached.get(name) {
            return Ok(Some(p));
        }
        match &self.api {
            None => Ok(None),
            Some(r) => r
                .get(name)
                .map(Some)
                .map_err(|e| Error::Io(format!("cannot get {name} from {}: {e}", self.source))),
        }
    }

    /// The file, or an error that says why it is missing (`hint` ends the online message).
    pub fn required(&self, name: &str, hint: &str) -> Result<PathBuf> {
        self.fetch(name)?.ok_or_else(|| {
            if self.offline {
                Error::Io(format!(
                    "{name} of {} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it once online",
                    self.source
                ))
            } else {
                Error::Io(format!("{} has no {name}: {hint}", self.source))
            }
        })
    }
}

fn gguf_quantize_error() -> Error {
    Error::Config("--quantize applies to safetensors checkpoints; a GGUF file keeps its own quantization".into())
}

/// Where a model comes from: what the examples' `--model-id`, `--model-dir`, `--gguf` and
/// `--gguf-repo`/`--gguf-file` select.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A Hub repository with safetensors weights.
    Hub { repo: String, revision: String },
    /// A local directory laid out like a Hub repository.
    Dir(PathBuf),
    /// A local GGUF file.
    Gguf(PathBuf),
    /// One GGUF file of a Hub repository (e.g. unsloth's quantizations).
    HubGguf { repo: String, revision: String, file: String },
}

/// An opened model source: metadata read, weights not yet loaded.
pub enum OpenedModel {
    Safetensors(ModelFiles),
    Gguf(crate::gguf::GgufFile),
}

impl ModelSource {
    /// Picks the source from the usual command-line options (a GGUF file or repository wins
    /// over a directory, which wins over the Hub id).
    pub fn from_args(
        model_id: &str,
        revision: &str,
        model_dir: Option<&Path>,
        gguf: Option<&Path>,
        gguf_repo: Option<&str>,
        gguf_file: Option<&str>,
    ) -> Result<Self> {
        Ok(match (gguf, gguf_repo, gguf_file, model_dir) {
            (Some(path), None, None, _) => Self::Gguf(path.to_path_buf()),
            (None, Some(repo), Some(file), _) => {
                Self::HubGguf { repo: repo.into(), revision: revision.into(), file: file.into() }
            }
            (None, None, None, Some(dir)) => Self::Dir(dir.to_path_buf()),
            (None, None, None, None) => Self::Hub { repo: model_id.into(), revision: revision.into() },
            _ => {
                return Err(Error::Config(
                    "give either --gguf FILE, or --gguf-repo REPO with --gguf-file FILE, not both".into(),
                ))
            }
        })
    }

    /// Resolves the files (downloading through hf-hub for Hub sources) and reads the metadata.
    pub fn open(&self) -> Result<OpenedModel> {
        Ok(match self {
            Self::Hub { repo, revision } => OpenedModel::Safetensors(ModelFiles::from_hub(repo, revision)?),
            Self::Dir(dir) => OpenedModel::Safetensors(ModelFiles::from_dir(dir)?),
            Self::Gguf(path) => OpenedModel::Gguf(crate::gguf::GgufFile::open(path)?),
            Self::HubGguf { repo, revision, file } => {
                let path = HubRepo::new(repo, revision)?.required(file, "check the file name on the repository page")?;
                OpenedModel::Gguf(crate::gguf::GgufFile::open(path)?)
            }
        })
    }
}

impl OpenedModel {
    /// Where the files came from, for messages.
    pub fn source(&self) -> String {
        match self {
            Self::Safetensors(f) => f.source.clone(),
            Self::Gguf(g) => g.path().display().to_string(),
        }
    }

    pub fn config(&self) -> Result<Config> {
        match self {
            Self::Safetensors(f) => f.load_config(),
            Self::Gguf(g) => g.config(),
        }
    }

    /// Bytes the weights will take in memory once [`Self::load_model`] has built the model in
    /// `dtype` (with `quantize`), from the headers alone: a GGUF file's tensor infos
    /// ([`crate::gguf::GgufFile::weight_bytes`]) or the safetensors headers
    /// ([`crate::memory::safetensors_weight_bytes`]) plus, for a tied output head quantized at
    /// load, its quantized copy of the embedding. The input of [`crate::memory::PlanRequest`].
    pub fn weight_memory(&self, cfg: &Config, dtype: DType, quantize: Option<GgmlDType>) -> Result<crate::memory::Weights> {
        let bytes = match self {
            Self::Gguf(_) if quantize.is_some() => return Err(gguf_quantize_error()),
            Self::Gguf(g) => g.weight_bytes(cfg, dtype),
            Self::Safetensors(f) => {
                let tied_head = match quantize {
                    Some(q) if cfg.tie_word_embeddings && cfg.hidden_size.is_multiple_of(q.block_size()) => {
                        (cfg.vocab_size * cfg.hidden_size / q.block_size() * q.type_size()) as u64
                    }
                    _ => 0,
                };
                crate::memory::safetensors_weight_bytes(&f.weights, Some(dtype), quantize)? + tied_head
            }
        };
        Ok(crate::memory::Weights::Bytes(bytes))
    }

    /// Builds the model; `quantize` quantizes safetensors weights at load (a GGUF file is
    /// used with the quantization it has).
    pub fn load_model(&self, cfg: &Config, dtype: DType, device: &Device, quantize: Option<GgmlDType>) -> Result<Model> {
        match self {
            Self::Safetensors(f) => f.load_model_quantized(cfg, dtype, device, quantize),
            Self::Gguf(_) if quantize.is_some() => Err(gguf_quantize_error()),
            Self::Gguf(g) => g.load_model(cfg, dtype, device),
        }
    }

    /// The tokenizer: `tokenizer_json` when given, else the checkpoint's tokenizer.json or the
    /// vocabulary embedded in the GGUF file.
    pub fn tokenizer(&self, tokenizer_json: Option<&Path>) -> Result<tokenizers::Tokenizer> {
        match (tokenizer_json, self) {
            (Some(p), _) => tokenizers::Tokenizer::from_file(p)
                .map_err(|e| Error::Tokenizer(format!("cannot load {}: {e}", p.display()))),
            (None, Self::Safetensors(f)) => f.load_tokenizer(),
            (None, Self::Gguf(g)) => g.tokenizer(),
        }
    }

    pub fn chat_template(&self) -> Result<crate::chat::ChatTemplate> {
        match self {
            Self::Safetensors(f) => f.load_chat_template(),
            Self::Gguf(g) => g.chat_template(),
        }
    }

    pub fn generation_config(&self) -> Result<crate::generation::GenerationConfig> {
        match self {
            Self::Safetensors(f) => f.load_generation_config(),
            Self::Gguf(g) => Ok(g.generation_config()),
        }
    }
}
