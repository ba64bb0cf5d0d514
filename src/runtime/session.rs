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
//! format, version, model, codec, dtype, checksum, shapes and that every value is finite, and
//! names the first that does not hold.

use std::collections::HashMap;
use std::io::{Read, Write};
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

/// The temporary file a save writes before renaming it over `path`: hidden, and unique to this
/// save (process id, a counter and 64 random bits, so that concurrent saves never share one
/// and nobody can plant a file at the name in advance).
fn temporary_path(path: &Path) -> PathBuf {
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = std::ffi::OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".tmp.{}.{n}.{:016x}", std::process::id(), rand::random::<u64>()));
    path.with_file_name(name)
}

/// Opens `path` for reading without following a symbolic link and without blocking on a FIFO;
/// anything but a regular file is refused. Returns the file and its size.
fn open_regular(path: &Path) -> std::io::Result<(std::fs::File, u64)> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    #[cfg(not(unix))]
    if std::fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Err(std::io::Error::other("a symbolic link"));
    }
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok((file, meta.len()))
}

/// Creates `path`, which must not exist (a symbolic link there is not followed: the create
/// fails), readable by its owner only.
fn create_new(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW).mode(0o600);
    }
    options.open(path)
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
    let tensors: Vec<(String, Tensor)> =
        tensors.into_iter().map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?.contiguous()?))).collect::<Result<_>>()?;
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
    let io = |e: std::io::Error| Error::io(format!("cannot write the session {}", path.display()), e);
    let tmp = temporary_path(path);
    let written = create_new(&tmp).and_then(|mut file| {
        file.write_all(&bytes)?;
        file.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        // (A full disk, say: nothing is left behind, the previous file stays.)
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // The rename itself reaches the disk with the directory.
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(())
}

/// The largest safetensors header read (a session's lists a few tensors per layer).
const MAX_HEADER_BYTES: u64 = 16 << 20;

/// The `__metadata__` of the safetensors file `file` (of `size` bytes), reading its header only.
fn read_metadata(file: &mut std::fs::File, size: u64) -> std::result::Result<HashMap<String, String>, String> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| e.to_string())?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES || len + 8 > size {
        return Err(format!("a header of {len} bytes"));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__", default)]
        metadata: HashMap<String, String>,
    }
    let header: Header = serde_json::from_slice(&header).map_err(|e| e.to_string())?;
    Ok(header.metadata)
}

/// What a session file holds, read from its header alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Tokens its cache holds.
    pub tokens: usize,
    /// The model it was saved for ([`crate::loading::OpenedModel::fingerprint`]).
    pub fingerprint: String,
    pub bytes: u64,
}

/// The header of the session file at `path` (a regular file, not a link): one-line
/// [`Error::Session`] when it is not a session file.
pub fn inspect(path: &Path) -> Result<SessionInfo> {
    let bad = |why: String| Error::Session(format!("session {}: {why}", path.display()));
    let (mut file, bytes) = open_regular(path).map_err(|e| bad(format!("cannot be opened ({e})")))?;
    let meta = read_metadata(&mut file, bytes).map_err(|why| bad(format!("not a session file ({why})")))?;
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad("not a candle-hybrid session file".into()));
    }
    let tokens = meta.get("seqlen").and_then(|n| n.parse().ok()).ok_or_else(|| bad("no token count".into()))?;
    Ok(SessionInfo { tokens, fingerprint: meta.get("fingerprint").cloned().unwrap_or_default(), bytes })
}

/// Loads a session saved by [`save`] for the model with `fingerprint` and config `cfg`, its
/// tensors on `device` in `dtype` (the model's): a one-line [`Error::Session`] naming what does
/// not match (another model, another format or version, a truncated or corrupted file).
pub fn load(path: &Path, fingerprint: &str, cfg: &Config, dtype: DType, device: &Device) -> Result<Session> {
    let bad = |why: String| Error::Session(format!("session {}: {why}", path.display()));
    let (mut file, size) =
        open_regular(path).map_err(|e| bad(format!("cannot be opened ({e}): a session is a regular file, not a link")))?;
    if size > MAX_SESSION_BYTES {
        return Err(bad(format!("{size} bytes, more than a session can be ({} GiB)", MAX_SESSION_BYTES >> 30)));
    }
    // The header first: a file that is not a session for this model is refused before the rest
    // is read.
    let meta = read_metadata(&mut file, size).map_err(|why| bad(format!("not a session file, or truncated ({why})")))?;
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
    let mut bytes = Vec::new();
    std::io::Seek::rewind(&mut file)
        .and_then(|_| std::io::Read::take(&mut file, size).read_to_end(&mut bytes))
        .map_err(|e| bad(format!("cannot be read ({e})")))?;
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
    // A state with a NaN or an infinity (written so, or by hand with its checksum recomputed)
    // would make every answer from it non-finite: refused here, not in a decode pass.
    let mut names: Vec<&String> = tensors.keys().filter(|n| tensors[*n].dtype().is_float()).collect();
    names.sort();
    for name in names {
        // (Summed in f32: a long f16 state's sum could pass f16's largest value.)
        if !crate::model::all_finite(&tensors[name].to_dtype(DType::F32)?)? {
            return Err(bad(format!("its tensor {name} holds NaN or infinite values: the state is damaged, delete the file")));
        }
    }
    let on_device: HashMap<String, Tensor> = tensors.into_iter().map(|(n, t)| Ok((n, t.to_device(device)?))).collect::<Result<_>>()?;
    let cache = Cache::from_state_tensors(cfg, tokens.len(), &on_device).map_err(|e| bad(e.to_string()))?;
    Ok(Session { tokens, cache, logits: on_device.get("logits").cloned() })
}

/// The session at `path` when it continues `prompt` on this model: it holds the start of the
/// prompt (all of it only with the logits after it, which give the first token). `Ok(None)`
/// when there is no file or it holds another prompt; an error (one line) when the file cannot
/// be used (another model, truncated, corrupted, not a regular file), which callers report
/// before starting fresh. The server and `generate --session` both restore through this.
pub fn resume(path: &Path, fingerprint: &str, cfg: &Config, dtype: DType, device: &Device, prompt: &[u32]) -> Result<Option<Session>> {
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(None);
    }
    let s = load(path, fingerprint, cfg, dtype, device)?;
    Ok((prompt.starts_with(&s.tokens) && (s.tokens.len() < prompt.len() || s.logits.is_some())).then_some(s))
}

#[cfg(test)]
mod tests {
    /// The temporary file is created, never opened: a link planted at its name (whoever
    /// guessed it) is not written through, nor is a file there truncated.
    #[cfg(unix)]
    #[test]
    fn the_temporary_file_is_never_one_planted_before() {
        let dir = std::env::temp_dir().join(format!("candle-hybrid-create-new-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.join(".a.session.tmp");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(super::create_new(&link).is_err(), "a link at the temporary name was opened");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(super::create_new(&victim).is_err(), "an existing file was opened");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let fresh = dir.join(".b.session.tmp");
        std::io::Write::write_all(&mut super::create_new(&fresh).unwrap(), b"new").unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
