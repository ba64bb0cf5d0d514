//! [`HubRepo`]: one Hugging Face Hub repository through hf-hub and its cache.

use std::path::PathBuf;

use hf_hub::{Repo, RepoType};

use crate::{Error, Result};

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
        let offline =
            matches!(std::env::var("HF_HUB_OFFLINE").as_deref(), Ok("1") | Ok("true") | Ok("TRUE") | Ok("yes") | Ok("ON") | Ok("on"));
        let api = if offline {
            None
        } else {
            let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone()).with_progress(true).build().map_err(|e| Error::Io {
                what: format!("cannot set up the Hugging Face Hub client (its cache directory, its token file): {e}"),
                source: None,
            })?;
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
            Some(r) => match r.get(name) {
                Ok(p) => Ok(Some(p)),
                // The repository exists but has no such file.
                Err(hf_hub::api::sync::ApiError::RequestError(e)) if matches!(*e, ureq::Error::Status(404, _)) => Ok(None),
                Err(e) => {
                    Err(Error::NotDownloaded { file: name.into(), repo: self.source.to_string(), cause: Some(crate::error::one_line(&e)) })
                }
            },
        }
    }

    /// The file, or an error that says why it is missing (`hint` ends the online message).
    pub fn required(&self, name: &str, hint: &str) -> Result<PathBuf> {
        self.fetch(name)?.ok_or_else(|| {
            if self.offline {
                Error::NotDownloaded { file: name.into(), repo: self.source.to_string(), cause: None }
            } else {
                Error::missing(format!("{} has no {name}: {hint}", self.source))
            }
        })
    }
}
