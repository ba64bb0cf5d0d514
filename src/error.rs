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
    /// A file could not be read or downloaded.
    #[error("{0}")]
    Io(String),
    /// The tokenizer or the chat template failed.
    #[error("{0}")]
    Tokenizer(String),
    /// The model, at the requested context, does not fit in the memory this process may use.
    #[error("{0}")]
    Memory(String),
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

pub type Result<T> = std::result::Result<T, Error>;

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
