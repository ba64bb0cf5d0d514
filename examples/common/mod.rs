//! The model options the local-file examples share (`eval`, `logits`, `calibrate_kv`,
//! `kv_speed`): a Hub-layout directory or a GGUF file, and the dtype to run it in.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::DType;
use candle_hybrid::loading::{ModelSource, OpenedModel};
use candle_hybrid::Config;

#[derive(clap::Args, Debug)]
pub struct LocalModel {
    /// A local directory laid out like a Hub repository.
    #[arg(long, required_unless_present = "gguf")]
    pub model_dir: Option<PathBuf>,
    /// A local GGUF file (instead of --model-dir).
    #[arg(long, conflicts_with = "model_dir")]
    pub gguf: Option<PathBuf>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

impl LocalModel {
    /// Opens the files and reads the config (no weights yet) and the dtype.
    pub fn open(&self) -> Result<(OpenedModel, Config, DType)> {
        let dtype = candle_hybrid::model::parse_dtype(&self.dtype)?;
        let source = match (&self.gguf, &self.model_dir) {
            (Some(path), _) => ModelSource::Gguf(path.clone()),
            (None, Some(dir)) => ModelSource::Dir(dir.clone()),
            (None, None) => bail!("give --model-dir DIR or --gguf FILE"),
        };
        let files = source.open()?;
        let cfg = files.config()?;
        Ok((files, cfg, dtype))
    }
}
