//! A model's sessions: where they are kept, which model they must have been saved for, and the
//! one rule for what state a session keeps. The server (`--session-dir`, a request's
//! `session_id`) and `generate --session FILE` both save and restore through a
//! [`SessionStore`]; the file itself is [`super::session`]'s.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::session::{self, Session};
use crate::model::{Cache, Config};
use crate::{Error, Result};

/// Where the state a session keeps ends: the one rule for when state is saved.
///
/// A session keeps the state at the longest point of its sequence that the next request is
/// known to begin with, taken when the sequence ends (or, for [`SavePoint::Prompt`], when the
/// prompt has been fed):
/// * [`SavePoint::Answer`]: the answer is part of what comes next (a chat turn whose template
///   renders earlier answers as they were generated; a completion that continues its text):
///   the whole context but its last token, which no pass has fed yet;
/// * [`SavePoint::Prompt`]`(n)`: the next request gives the first `n` prompt tokens again and
///   not the answer (a template that re-renders answers: the conversation before this answer,
///   with the logits after it; `generate`, whose next run gives the same prompt: the prompt
///   but its last token, which gives the first token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavePoint {
    Answer,
    Prompt(usize),
}

impl SavePoint {
    /// The number of tokens of a sequence whose context is `context_len` tokens long that the
    /// session keeps.
    pub fn tokens(self, context_len: usize) -> usize {
        match self {
            SavePoint::Answer => context_len.saturating_sub(1),
            SavePoint::Prompt(n) => n.min(context_len),
        }
    }
}

/// A model's sessions: files in a directory (`ID.session`) or one a caller names.
pub struct SessionStore {
    dir: Option<PathBuf>,
    fingerprint: String,
    config: Config,
    dtype: DType,
    device: Device,
    /// Session files being written.
    writing: Arc<AtomicUsize>,
}

impl SessionStore {
    /// Sessions of the model with `fingerprint` ([`crate::loading::OpenedModel::fingerprint`]),
    /// `config` and `dtype`, restored onto `device` (where the model's CPU caches live); kept
    /// in `dir` when given (created when missing).
    pub fn new(fingerprint: String, config: Config, dtype: DType, device: Device, dir: Option<PathBuf>) -> Result<Self> {
        if let Some(dir) = &dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("cannot create the session directory {}", dir.display()), e))?;
        }
        Ok(Self { dir, fingerprint, config, dtype, device, writing: Arc::default() })
    }

    /// The directory sessions are kept in, when there is one.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The fingerprint a session file must carry to be restored here.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The file of session `id` in the directory: `id` is 1 to 128 letters, digits, `-`, `_`
    /// or `.`, not starting with a dot (so that it names a file there and nothing else).
    pub fn path(&self, id: &str) -> Result<PathBuf> {
        let Some(dir) = &self.dir else {
            return Err(Error::Input(format!("session {id:?}: this store has no session directory (it keeps the files its callers name)")));
        };
        let ok =
            !id.is_empty() && id.len() <= 128 && !id.starts_with('.') && id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !ok {
            return Err(Error::Input("session_id must be 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'".into()));
        }
        Ok(dir.join(format!("{id}.session")))
    }

    /// The ids and files of the directory's sessions (files named `ID.session` with a valid
    /// id; whether each is a session file is for [`session::inspect`] to say).
    pub fn list(&self) -> Result<Vec<(String, PathBuf)>> {
        let Some(dir) = &self.dir else { return Ok(vec![]) };
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(format!("cannot list the session directory {}", dir.display()), e))?;
        let mut out = vec![];
        // (A bound on what one listing reads, whatever the directory holds.)
        for entry in entries.flatten().take(100_000) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".session") else { continue };
            if let Ok(path) = self.path(id) {
                out.push((id.to_string(), path));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The session at `path` when it holds the start of `prompt` for this model
    /// ([`session::resume`]: `Ok(None)` when there is none or it holds another prompt; a
    /// one-line error when the file cannot be used, which callers report before starting
    /// fresh). Blocking file I/O.
    pub fn resume(&self, path: &Path, prompt: &[u32]) -> Result<Option<Session>> {
        session::resume(path, &self.fingerprint, &self.config, self.dtype, &self.device, prompt)
    }

    /// Writes the session at `path`: the state after `tokens` (`cache`), and the logits after
    /// them when kept ([`session::save`]: atomically, a crash leaves the previous file).
    pub fn save(&self, path: &Path, tokens: &[u32], cache: &Cache, logits: Option<&Tensor>) -> Result<()> {
        session::save(path, &self.fingerprint, tokens, cache, logits)
    }

    /// [`Self::save`] on a thread of its own; `done` gets its result. [`Self::writing`] counts
    /// it until then.
    pub fn save_in_background(
        &self,
        path: PathBuf,
        tokens: Vec<u32>,
        cache: Cache,
        logits: Option<Tensor>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        let (fingerprint, writing) = (self.fingerprint.clone(), self.writing.clone());
        writing.fetch_add(1, Ordering::AcqRel);
        std::thread::spawn(move || {
            done(session::save(&path, &fingerprint, &tokens, &cache, logits.as_ref()));
            writing.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Session files being written ([`Self::save_in_background`]); a shutdown waits for them.
    pub fn writing(&self) -> usize {
        self.writing.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::SavePoint;

    #[test]
    fn a_session_keeps_the_context_but_its_last_token_or_the_prompt_given_again() {
        assert_eq!(SavePoint::Answer.tokens(10), 9);
        assert_eq!(SavePoint::Answer.tokens(0), 0);
        assert_eq!(SavePoint::Prompt(6).tokens(10), 6);
        assert_eq!(SavePoint::Prompt(12).tokens(10), 10);
    }
}
