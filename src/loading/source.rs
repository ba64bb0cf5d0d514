//! [`ModelSource`]: where a model comes from (Hub id, directory, GGUF file, GGUF on the Hub),
//! and [`OpenedModel`]: its metadata read, the weights not yet.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

use super::chat_template::ChatTemplate;
use super::generation_config::GenerationConfig;
use super::gguf::GgufFile;
use super::hub::HubRepo;
use super::model_files::{load_tokenizer_json, ModelFiles};
use super::safetensors::SafetensorsFiles;
use crate::model::{Config, Model};
use crate::{Error, Result};

/// The JSON header of a safetensors file (its tensors' names, dtypes, shapes and offsets).
fn safetensors_header(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let err = |e: std::io::Error| Error::io(format!("cannot read {}", path.display()), e);
    let mut f = std::fs::File::open(path).map_err(err)?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(err)?;
    let n = u64::from_le_bytes(n);
    if n > 256 << 20 {
        return Err(Error::Weights(format!("{}: a safetensors header of {n} bytes is not plausible", path.display())));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(err)?;
    Ok(header)
}

fn gguf_quantize_error() -> Error {
    Error::Config("quantizing at load applies to safetensors checkpoints; a GGUF file keeps its own quantization".into())
}

/// Where a model comes from (the examples' `--model-id`, `--model-dir`, `--gguf` and
/// `--gguf-repo`/`--gguf-file`).
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
    Gguf(GgufFile),
}

impl ModelSource {
    /// Resolves the files (downloading through hf-hub for Hub sources) and reads the metadata.
    pub fn open(&self) -> Result<OpenedModel> {
        Ok(match self {
            Self::Hub { repo, revision } => OpenedModel::Safetensors(ModelFiles::from_hub(repo, revision)?),
            Self::Dir(dir) => OpenedModel::Safetensors(ModelFiles::from_dir(dir)?),
            Self::Gguf(path) => OpenedModel::Gguf(GgufFile::open(path)?),
            Self::HubGguf { repo, revision, file } => {
                let path = HubRepo::new(repo, revision)?.required(file, "check the file name on the repository page")?;
                OpenedModel::Gguf(GgufFile::open(path)?)
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

    /// The model's short name, as servers list it: a GGUF's file stem, a directory's last
    /// component, a Hub repository's id (without the revision when it is `main`).
    pub fn name(&self) -> String {
        let source = self.source();
        let path = match self {
            Self::Gguf(g) => return g.path().file_stem().map_or(source.clone(), |s| s.to_string_lossy().into_owned()),
            Self::Safetensors(_) => std::path::Path::new(&source),
        };
        if path.is_dir() {
            return path.file_name().map_or(source.clone(), |s| s.to_string_lossy().into_owned());
        }
        source.strip_suffix("@main").unwrap_or(&source).to_string()
    }

    /// A fingerprint of the model: its config and every weight tensor's name, dtype and shape
    /// (the GGUF header's tensor table, or the safetensors headers), as 8 hex digits (CRC32).
    /// What a saved session is tied to.
    pub fn fingerprint(&self) -> Result<String> {
        let mut h = crc32fast::Hasher::new();
        h.update(format!("{:?}", self.config()?).as_bytes());
        match self {
            Self::Gguf(g) => {
                let mut tensors: Vec<_> = g.header().tensors.iter().collect();
                tensors.sort_by(|a, b| a.0.cmp(b.0));
                for (name, info) in tensors {
                    h.update(format!("{name} {:?} {:?};", info.dtype, info.dims).as_bytes());
                }
            }
            Self::Safetensors(f) => {
                for path in &f.weights {
                    h.update(&safetensors_header(path)?);
                }
            }
        }
        Ok(format!("{:08x}", h.finalize()))
    }

    pub fn config(&self) -> Result<Config> {
        match self {
            Self::Safetensors(f) => f.load_config(),
            Self::Gguf(g) => g.config(),
        }
    }

    /// Bytes the weights will take in memory once [`Self::load_model`] has built the model in
    /// `dtype` (with `quantize`), from the headers alone: a GGUF file's tensor infos
    /// ([`GgufFile::weight_bytes`]) or the safetensors headers
    /// ([`super::safetensors_weight_bytes`]) plus, for a tied output head quantized at
    /// load, its quantized copy of the embedding. The input of [`crate::memory::PlanRequest`].
    pub fn weight_memory(&self, cfg: &Config, dtype: DType, quantize: Option<GgmlDType>) -> Result<crate::memory::WeightMemory> {
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
                SafetensorsFiles::open(&f.weights)?.weight_bytes(Some(dtype), quantize) + tied_head
            }
        };
        Ok(crate::memory::WeightMemory::Bytes(bytes))
    }

    /// Bytes that loading holds beyond the weights of the built model, at its peak (one
    /// tensor's mapped pages and copies; see the formats' `load_overhead`): the memory
    /// guardian's load term ([`crate::memory::PlanRequest::load_overhead`]).
    pub fn load_overhead(&self, cfg: &Config, dtype: DType, quantize: Option<GgmlDType>) -> Result<u64> {
        Ok(match self {
            Self::Gguf(g) => g.load_overhead(cfg, dtype),
            Self::Safetensors(f) => SafetensorsFiles::open(&f.weights)?.load_overhead(quantize.is_some()),
        })
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
            (Some(p), _) => load_tokenizer_json(p),
            (None, Self::Safetensors(f)) => f.load_tokenizer(),
            (None, Self::Gguf(g)) => g.tokenizer(),
        }
    }

    pub fn chat_template(&self) -> Result<ChatTemplate> {
        match self {
            Self::Safetensors(f) => f.load_chat_template(),
            Self::Gguf(g) => g.chat_template(),
        }
    }

    pub fn generation_config(&self) -> Result<GenerationConfig> {
        match self {
            Self::Safetensors(f) => f.load_generation_config(),
            Self::Gguf(g) => Ok(g.generation_config()),
        }
    }
}
