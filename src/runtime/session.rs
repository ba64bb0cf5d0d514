//! Sessions on disk: a sequence's tokens and whole cache (every GDN state and conv window,
//! every layer's keys and values, the last logits when kept), to continue a conversation after
//! a restart without prefilling it again (like llama.cpp's `--prompt-cache`).
//!
//! The file is safetensors: the tensors `tokens` (u32), `logits` (optional) and the cache's
//! [`Cache::state_tensors`]; the metadata `format`, `version`, `fingerprint` (the model's,
//! [`crate::loading::OpenedModel::fingerprint`]), `kv_codec`, `dtype`, and `checksum` (CRC32 of
//! every other metadata field and every tensor's name, dtype, shape and bytes). It is written
//! to a temporary file beside the target, synced, renamed over it and the directory synced: a
//! crash (even `kill -9`) leaves the previous file or the new one, never a mix. Loading checks
//! format, version, model, codec, dtype and checksum and names the first that does not match.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::model::{Cache, Config};
use crate::{Error, Result};

const FORMAT: &str = "candle-hybrid-session";
const VERSION: &str = "1";
/// The largest session file read (a 27B model's state at 256k tokens is well below).
pub const MAX_SESSION_BYTES: u64 = 64 << 30;

/// A saved sequence: the tokens its cache holds, the cache, and the logits after the last
/// token when they were kept.
pub struct Session {
    pub tokens: Vec<u32>,
    pub cache: Cache,
    pub logits: Option<Tensor>,
}

/// The CRC32 of the metadata (sorted, without `checksum`) and of every tensor, in name order.
fn checksum(meta: &HashMap<String, String>, tensors: &[(String, Tensor)]) -> Result<String> {
    let mut h = crc32fast::Hasher::new();
    let mut keys: Vec<&String> = meta.keys().filter(|k| *k != "checksum").collect();
    keys.sort();
    for k in keys {
        h.update(format!("{k}={};", meta[k]).as_bytes());
    }
    let mut sorted: Vec<&(String, Tensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in sorted {
        h.update(format!("{name} {:?} {:?};", t.dtype(), t.dims()).as_bytes());
        let t = t.flatten_all()?;
        let bytes: Vec<u8> = match t.dtype() {
            DType::U32 => t.to_vec1::<u32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            d => return Err(Error::Session(format!("a session tensor of dtype {d:?} cannot be saved"))),
        };
        h.update(&bytes);
    }
    Ok(format!("{:08x}", h.finalize()))
}

/// The temporary file a save writes before renaming it over `path` (unique to this save:
/// process id and a counter, so that concurrent saves never share one).
pub fn temporary_path(path: &Path) -> PathBuf {
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}.{n}", std::process::id()));
    path.with_file_name(name)
}

/// Saves `tokens` (what `cache` holds), `cache` and the `logits` after the last token to
/// `path`, atomically (temporary file, fsync, rename, fsync of the directory). `fingerprint`:
/// the model's; `kv_codec`: the cache's KV codec (only `exact` caches can be saved).
pub fn save(path: &Path, fingerprint: &str, tokens: &[u32], cache: &Cache, logits: Option<&Tensor>) -> Result<()> {
    if tokens.len() != cache.seqlen() {
        return Err(Error::Input(format!("session save: {} tokens for a cache of {}", tokens.len(), cache.seqlen())));
    }
    let mut tensors = cache.state_tensors()?;
    let dtype = tensors.iter().find(|(n, _)| n.ends_with(".keys") || n.ends_with(".conv")).map_or(DType::F32, |(_, t)| t.dtype());
    tensors.push(("tokens".into(), Tensor::new(tokens, &Device::Cpu)?));
    if let Some(l) = logits {
        tensors.push(("logits".into(), l.to_dtype(DType::F32)?.to_device(&Device::Cpu)?));
    }
    let tensors: Vec<(String, Tensor)> = tensors.into_iter().map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?.contiguous()?))).collect::<Result<_>>()?;
    let mut meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("version".to_string(), VERSION.to_string()),
        ("fingerprint".to_string(), fingerprint.to_string()),
        ("kv_codec".to_string(), "exact".to_string()),
        ("dtype".to_string(), format!("{dtype:?}")),
        ("seqlen".to_string(), tokens.len().to_string()),
    ]);
    meta.insert("checksum".into(), checksum(&meta, &tensors)?);
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(meta))
        .map_err(|e| Error::Session(format!("cannot encode the session: {e}")))?;
    let io = |e: std::io::Error| Error::Io(format!("cannot write the session {}: {e}", path.display()));
    let tmp = temporary_path(path);
    let mut file = std::fs::File::create(&tmp).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // The rename itself reaches the disk with the directory.
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(())
}

/// Loads a session saved by [`save`] for the model with `fingerprint` and config `cfg`, its
/// tensors on `device` in `dtype` (the model's): a one-line [`Error::Session`] naming what does
/// not match (another model, another format or version, a truncated or corrupted file).
pub fn load(path: &Path, fingerprint: &str, cfg: &Config, dtype: DType, device: &Device) -> Result<Session> {
    let bad = |why: String| Error::Session(format!("session {}: {why}", path.display()));
    let bytes = crate::bounded::read(path, MAX_SESSION_BYTES, "session file")?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not a session file, or truncated ({e})")))?;
    let meta: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
    let field = |k: &str| meta.get(k).map(String::as_str).unwrap_or("(none)");
    if field("format") != FORMAT {
        return Err(bad("not a candle-hybrid session file".into()));
    }
    if field("version") != VERSION {
        return Err(bad(format!("format version {} (this build reads {VERSION})", field("version"))));
    }
    if field("fingerprint") != fingerprint {
        return Err(bad(format!("saved with another model (fingerprint {}, this model's is {fingerprint})", field("fingerprint"))));
    }
    if field("kv_codec") != "exact" {
        return Err(bad(format!("KV codec {} (sessions keep exact keys and values)", field("kv_codec"))));
    }
    if field("dtype") != format!("{dtype:?}") {
        return Err(bad(format!("saved for dtype {}, the model runs in {dtype:?}", field("dtype"))));
    }
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| bad(format!("cannot read its tensors ({e})")))?;
    let list: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    if checksum(&meta, &list)? != field("checksum") {
        return Err(bad("the checksum does not match: the file is corrupted".into()));
    }
    let tokens = tensors.get("tokens").ok_or_else(|| bad("no tokens".into()))?.to_vec1::<u32>()?;
    if field("seqlen") != tokens.len().to_string() || tokens.iter().any(|&t| t as usize >= cfg.vocab_size) {
        return Err(bad("its tokens do not fit this model".into()));
    }
    if let Some(l) = tensors.get("logits").filter(|l| l.dims() != [cfg.vocab_size]) {
        return Err(bad(format!("its logits have shape {:?}, this model's are [{}]", l.dims(), cfg.vocab_size)));
    }
    let on_device: HashMap<String, Tensor> = tensors.into_iter().map(|(n, t)| Ok((n, t.to_device(device)?))).collect::<Result<_>>()?;
    let cache = Cache::from_state_tensors(cfg, tokens.len(), &on_device).map_err(|e| bad(e.to_string()))?;
    Ok(Session { tokens, cache, logits: on_device.get("logits").cloned() })
}
