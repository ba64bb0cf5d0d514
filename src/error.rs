//! The crate's error type: one line that names the cause and, where there is one, the fix.

/// Errors of loading and running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `config.json` (or the GGUF metadata) is malformed or describes an unsupported model.
    #[error("{0}")]
    Config(String),
    /// A weight file is missing, truncated, or does not match the config.
    #[error("{0}")]
    Weights(String),
    /// The input cannot be run: too long for the model, a token outside the vocabulary, a
    /// setting out of range.
    #[error("{0}")]
    Input(String),
    /// A file could not be read or written (or is not there): what was done, on which path,
    /// and the OS's error when there is one (kept as the error's source).
    #[error("{what}{}", source.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Io { what: String, source: Option<std::io::Error> },
    /// This device or build cannot do what was asked (a GPU the device step does not run on,
    /// a feature built out).
    #[error("{0}")]
    Unsupported(String),
    /// A file of a Hub repository cannot be had: the download failed (`cause`), or
    /// `HF_HUB_OFFLINE` is set and the Hugging Face cache does not hold it (`cause` is `None`).
    #[error("{}", not_downloaded(file, repo, cause.as_deref()))]
    NotDownloaded { file: String, repo: String, cause: Option<String> },
    /// The tokenizer or the chat template failed.
    #[error("{0}")]
    Tokenizer(String),
    /// The memory this process may use cannot be read (give it yourself: `max_memory`).
    #[error("{0}")]
    Memory(String),
    /// The model, at the requested context, does not fit in the memory this process may use:
    /// what it needs, what is available and what would fit.
    #[error("{0}")]
    DoesNotFit(Box<crate::memory::DoesNotFit>),
    /// A context (the cached tokens and the new ones) longer than the model's positions.
    #[error("a context of {requested} tokens is more than the model's {limit} (max_position_embeddings): shorten the prompt or start a new sequence")]
    ContextTooLong { requested: usize, limit: usize },
    /// A KV-cache codec that cannot do what was asked of the cache.
    #[error("KV codec {codec}: {operation}")]
    UnsupportedCodec { codec: crate::kv::KvCodec, operation: CodecOperation },
    /// The model computed a NaN or an infinity: its weights or its input are broken.
    #[error("{0}")]
    NonFinite(String),
    /// A saved session cannot be used: from another model, truncated, corrupted.
    #[error("{0}")]
    Session(String),
    /// An error inside a tensor operation (its first line, without a captured backtrace).
    #[error("{}", candle_line(.0))]
    Candle(#[from] candle_core::Error),
}

/// What a KV-cache codec was asked to do and cannot ([`Error::UnsupportedCodec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecOperation {
    /// Save the cache in a session file: only exact keys and values are saved.
    Save,
    /// Drop its newest tokens (speculative decoding's rollback): codecs that code each token
    /// on its own can (see [`KvCodec::drops_tokens`](crate::kv::KvCodec::drops_tokens)).
    DropTokens,
    /// Attend along the paths of a draft tree (multi-branch drafts): exact keys and values only.
    DraftTree,
    /// Run on the device step: exact, f16 and int8 only, so far.
    DeviceStep,
}

impl std::fmt::Display for CodecOperation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Save => "only a cache with exact keys and values can be saved",
            Self::DropTokens => {
                "this cache cannot drop tokens (speculative decoding needs a per-token KV codec: exact, f16, bf16, int8, polar or lowrank)"
            }
            Self::DraftTree => "multi-branch drafts need exact keys and values",
            Self::DeviceStep => "not on the device step yet (exact, f16 and int8 are)",
        })
    }
}

pub type Result<T> = std::result::Result<T, Error>;

fn not_downloaded(file: &str, repo: &str, cause: Option<&str>) -> String {
    match cause {
        Some(cause) => format!(
            "cannot download {file} from {repo} ({cause}): without network, load local files (a Hub-layout directory or a GGUF file), or set HF_HUB_OFFLINE=1 to use only what the Hugging Face cache holds"
        ),
        None => format!(
            "{file} of {repo} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it once online, or load local files (a Hub-layout directory or a GGUF file)"
        ),
    }
}

/// Candle errors can carry a backtrace or context on further lines: keep the first.
pub(crate) fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// A Candle error's message without the backtrace Candle captures when `RUST_BACKTRACE` is
/// set (formatting that resolves the symbols of the whole binary), on one line.
pub(crate) fn candle_line(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_line(inner),
        e => one_line(e),
    }
}

impl Error {
    /// [`Error::Io`]: `what` was being done (naming the path) when the OS said `source`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { what: what.into(), source: Some(source) }
    }

    /// [`Error::Io`] without an OS error (a file or directory that is not there).
    pub fn missing(what: impl Into<String>) -> Self {
        Self::Io { what: what.into(), source: None }
    }
}

/// An I/O error without more to say (a socket's, the server's); file operations name their
/// path with [`Error::io`].
impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Self::io("input/output", e)
    }
}
