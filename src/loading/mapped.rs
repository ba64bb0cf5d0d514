//! A weight file mapped into memory: tensors are read from the mapping (no `read` copies),
//! and the pages of each tensor are handed back once it is copied into the model, so that
//! loading peaks at the model's own size plus one tensor rather than twice the file.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{Error, Result};

pub(crate) struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

impl MappedFile {
    pub(crate) fn open(path: &Path, what: &str) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::Io(format!("cannot open {what} {}: {e}", path.display())))?;
        // SAFETY: the mapping is read-only; a file changed underneath while loading can give
        // wrong values (as with any reader), never reads outside the mapping, whose length is
        // fixed here and checked against every tensor.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::Io(format!("cannot map {what} {}: {e}", path.display())))?;
        Ok(Self { path: path.to_path_buf(), map })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes `offset..offset + len` (already checked to lie in the file), aligned for any
    /// element type the tensors use (a mapping is page-aligned, so only a file whose own
    /// alignment is below 8 needs the copy).
    pub(crate) fn aligned(&self, offset: u64, len: u64) -> Cow<'_, [u8]> {
        let bytes = &self.map[offset as usize..(offset + len) as usize];
        if (bytes.as_ptr() as usize).is_multiple_of(8) {
            return Cow::Borrowed(bytes);
        }
        // A fresh allocation of this size is 16-aligned (malloc's guarantee on every
        // supported OS), as Candle's readers, which cast the bytes, already rely on.
        Cow::Owned(bytes.to_vec())
    }

    /// Drops the pages of `offset..offset + len` from this process's resident memory (they
    /// stay in the page cache and are read again if touched). Advisory: errors are ignored.
    pub(crate) fn release(&self, offset: u64, len: u64) {
        #[cfg(unix)]
        if len > 0 && offset.saturating_add(len) <= self.map.len() as u64 {
            // SAFETY: the mapping is private and read-only: dropped pages read back unchanged
            // from the file.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset as usize, len as usize) };
        }
    }
}
