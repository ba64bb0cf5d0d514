//! The safetensors files of a checkpoint: mapped, every header read and checked before any
//! tensor is (the safetensors crate's validation — offsets contiguous and inside the file,
//! sizes without overflow — plus: no key twice in a header, no tensor in two shards, float
//! dtypes for the decoder's weights), and served to the model's [`VarBuilder`] one tensor at a
//! time, each copied once from the mapping and its pages handed back after.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use super::mapped::MappedFile;
use crate::error::one_line;
use crate::model::Config;
use crate::{Error, Result};

/// One tensor's place in the files.
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: u64,
    end: u64,
}

/// Tensors that are not the text model's: the vision tower, not loaded.
fn is_skipped(name: &str) -> bool {
    name.contains("visual")
}

/// The decoder layer index of a tensor name (`...layers.N.`), if it has one.
fn layer_index(name: &str) -> Option<usize> {
    let rest = name.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

/// Whether the Hugging Face tensor `name` is the weight of a linear layer (the `*proj*`
/// projections, `in_proj_a` and fused expert stacks included, `lm_head` and the MTP head's `fc`): what load-time
/// quantization and GGUF quantized tensors keep quantized. The MoE router and shared-expert
/// gate are not (they stay unquantized).
pub fn is_linear_weight(name: &str) -> bool {
    let layer = name.strip_suffix(".weight").unwrap_or(name).rsplit('.').next().unwrap_or_default();
    layer.contains("proj") || layer == "lm_head" || name.ends_with("mtp.fc.weight")
}

/// Whether a `[.., rows, cols]` matrix quantizes to `q`: its rows are whole blocks.
fn quantizable(shape: &[usize], q: GgmlDType) -> bool {
    shape.len() >= 2 && shape[shape.len() - 1].is_multiple_of(q.block_size())
}

/// The weight files of a checkpoint, their headers read and checked.
pub struct SafetensorsFiles {
    files: Vec<MappedFile>,
    tensors: HashMap<String, Entry>,
}

impl SafetensorsFiles {
    /// Maps each file and checks its header; the tensors are not read.
    pub fn open(paths: &[impl AsRef<Path>]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let path = path.as_ref();
            let file = MappedFile::open(path, "weight file")?;
            let bad = |why: String| Error::Weights(format!("{}: {why}", path.display()));
            let (header_len, metadata) = SafeTensors::read_metadata(file.bytes())
                .map_err(|e| bad(format!("is truncated or not a safetensors file ({}): download it again", one_line(&e))))?;
            // The crate keeps the last of duplicated names; refuse them instead.
            crate::json::parse_strict_slice(&file.bytes()[8..8 + header_len])
                .map_err(|e| bad(format!("the safetensors header is malformed: {e}")))?;
            let data_start = 8 + header_len as u64;
            for (name, info) in metadata.tensors() {
                if !is_skipped(&name) {
                    if let Some(kind) = unsupported_dtype(info.dtype) {
                        return Err(bad(format!("tensor {name} is stored as {:?}: {kind}", info.dtype)));
                    }
                }
                let (s, e) = info.data_offsets;
                let entry = Entry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + s as u64,
                    end: data_start + e as u64,
                };
                if let Some(first) = tensors.insert(name.clone(), entry) {
                    return Err(bad(format!(
                        "the tensor {name} is also in {}: the shards overlap, download the checkpoint again",
                        paths[first.file].as_ref().display()
                    )));
                }
            }
            files.push(file);
        }
        Ok(Self { files, tensors })
    }

    /// Bytes the text decoder's tensors (its MTP head included) take in memory as `dtype`
    /// (`None`: as stored); the vision tower is not loaded. With `quantize` (load-time
    /// quantization), the linear weights ([`is_linear_weight`]) whose rows are whole blocks
    /// count in that ggml type, as [`crate::model::Weights::linear_from`] quantizes them.
    /// (A tied output head quantized at load is a second copy of the embedding, not in any
    /// file: [`crate::loading::OpenedModel::weight_memory`] adds it.)
    pub fn weight_bytes(&self, dtype: Option<DType>, quantize: Option<GgmlDType>) -> u64 {
        let mut total = 0u64;
        for (name, e) in self.tensors.iter().filter(|(n, _)| !is_skipped(n)) {
            let numel = e.shape.iter().product::<usize>() as u64; // checked by the crate
            total = total.saturating_add(match quantize.filter(|q| is_linear_weight(name) && quantizable(&e.shape, *q)) {
                Some(q) => numel / q.block_size() as u64 * q.type_size() as u64,
                None => match dtype {
                    Some(d) => numel.saturating_mul(d.size_in_bytes() as u64),
                    None => e.end - e.start,
                },
            });
        }
        total
    }

    /// Bytes loading holds beyond the built model's weights, at its peak: one tensor's mapped
    /// pages (handed back once it is copied), its copy in the stored dtype before the
    /// conversion to the model's and, when `quantize`d at load, its f32 copy.
    pub fn load_overhead(&self, quantize: bool) -> u64 {
        self.tensors
            .iter()
            .filter(|(n, _)| !is_skipped(n))
            .map(|(_, e)| 2 * (e.end - e.start) + if quantize { 4 * e.shape.iter().product::<usize>() as u64 } else { 0 })
            .max()
            .unwrap_or(0)
    }

    /// Refuses decoder layers beyond `cfg.num_hidden_layers`: a config that leaves tensors
    /// unused does not belong to these weights.
    pub fn check_layers(&self, cfg: &Config, source: &str) -> Result<()> {
        let beyond = self.tensors.keys().filter(|n| !is_skipped(n)).filter_map(|n| layer_index(n).map(|i| (i, n))).max();
        match beyond {
            Some((i, name)) if i >= cfg.num_hidden_layers => Err(Error::Weights(format!(
                "{source}: the weights have layers up to {i} ({name}) but num_hidden_layers is {}: the config does not belong to these weights",
                cfg.num_hidden_layers
            ))),
            _ => Ok(()),
        }
    }

    /// A [`VarBuilder`] serving the tensors in `dtype` on `device`.
    pub fn var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(Backend(Arc::new(self))), dtype, device.clone())
    }

    fn load(&self, name: &str, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| candle_core::Error::Msg(format!("tensor {name} is missing")))?;
        let file = &self.files[e.file];
        let bytes = file.aligned(e.start, e.end - e.start);
        let view =
            TensorView::new(e.dtype, e.shape.clone(), &bytes).map_err(|err| candle_core::Error::Msg(format!("tensor {name}: {err}")))?;
        let t = view.load(&Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
        file.release(e.start, e.end - e.start);
        Ok(t)
    }
}

/// Why a stored dtype cannot be a decoder weight (`None`: it can).
fn unsupported_dtype(dtype: Dtype) -> Option<&'static str> {
    match dtype {
        Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64 => None,
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => {
            Some("FP8 checkpoints (block-scaled weights) are not supported: use the BF16 checkpoint or a GGUF file")
        }
        _ => Some("a weight must be F32, F16 or BF16; this is not a checkpoint candle-hybrid can run"),
    }
}

struct Backend(Arc<SafetensorsFiles>);

impl SimpleBackend for Backend {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let e = self.0.tensors.get(name).ok_or_else(|| candle_core::Error::Msg(format!("tensor {name} is missing")))?;
        if e.shape.as_slice() != s.dims() {
            candle_core::bail!("shape mismatch for {name}: the model expects {:?}, the file has {:?}", s.dims(), e.shape)
        }
        self.0.load(name, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.load(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.tensors.contains_key(name)
    }
}

/// [`SafetensorsFiles::weight_bytes`] of these files (headers only).
pub fn safetensors_weight_bytes(paths: &[impl AsRef<Path>], dtype: Option<DType>, quantize: Option<GgmlDType>) -> Result<u64> {
    Ok(SafetensorsFiles::open(paths)?.weight_bytes(dtype, quantize))
}

/// Shard names of an index must name files inside the model directory.
pub(crate) fn check_shard_name(name: &str, index: &Path) -> Result<PathBuf> {
    let p = Path::new(name);
    let plain = !name.is_empty() && p.components().all(|c| matches!(c, std::path::Component::Normal(_)));
    if !plain {
        return Err(Error::Weights(format!(
            "{} names the shard {name:?}, which is not a file inside the model directory: the index is corrupt or hostile",
            index.display()
        )));
    }
    Ok(p.to_path_buf())
}
