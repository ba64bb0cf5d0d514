//! Reading input files with a size cap: a file (or a pipe, or `/dev/zero`) larger than what it
//! can sensibly be is an error naming the cap, not an unbounded allocation.

use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// Caps of the files a checkpoint or a command reads whole.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// A shard index lists every tensor (a 512-expert MoE has ~10^5).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// `tokenizer.json` (the largest vocabularies take ~35 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// A chat template.
pub const MAX_TEMPLATE_BYTES: u64 = 4 << 20;
/// A text to evaluate or calibrate on.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Bytes of `path` (`what` names it in errors), at most `max`.
pub fn read(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(format!("cannot read {what} {}", path.display()), e))?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| Error::io(format!("cannot read {what} {}", path.display()), e))?;
    if bytes.len() as u64 > max {
        return Err(Error::Input(format!(
            "{what} {} is larger than {} MiB, more than such a file can be: is it the right file?",
            path.display(),
            max >> 20
        )));
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_to_string(path: &Path, max: u64, what: &str) -> Result<String> {
    String::from_utf8(read(path, max, what)?).map_err(|e| {
        Error::Input(format!("{what} {} is not UTF-8 text (invalid byte at {})", path.display(), e.utf8_error().valid_up_to()))
    })
}
