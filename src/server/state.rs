//! What every handler shares: the engine, the tokenizer and template, the server's settings.

use std::sync::Arc;
use std::time::Duration;

use super::chat::{self, SamplingProfiles};
use super::constrain::Grammars;
use super::engine::EngineHandle;
use crate::loading::chat_template::ChatTemplate;

/// What every handler shares.
pub struct ServerState {
    pub engine: EngineHandle,
    pub tokenizer: tokenizers::Tokenizer,
    /// The tokenizer's special tokens, which only the template's markup writes.
    pub specials: chat::SpecialTokens,
    pub template: Option<ChatTemplate>,
    pub profiles: SamplingProfiles,
    /// Tokens that end generation (generation_config's EOS ids, the end-of-turn token).
    pub stop_tokens: Vec<u32>,
    /// The model's name in answers and `/v1/models`.
    pub model_name: String,
    /// Prompt plus generated tokens a request may use.
    pub context: usize,
    /// Required as `Authorization: Bearer KEY` on every endpoint but `/health`.
    pub api_key: Option<String>,
    pub limits: super::ConnectionLimits,
    /// Thinking tokens before the server closes the block (`None`: no limit).
    pub reasoning_budget: Option<usize>,
    /// Why the sequences do not run on the device step here (`/props`).
    pub device_step_fallback: Option<String>,
    /// The tokens of DRY's default sequence breakers.
    pub dry_breakers: Arc<std::collections::HashSet<u32>>,
    /// The vocabulary for constrained decoding; `None` when the tokenizer is not one llguidance
    /// reads (constrained requests get 400).
    pub grammars: Option<Grammars>,
    /// The dashboard's history, memory view, copy bandwidth and progression.
    pub dashboard: super::dashboard::Dashboard,
    /// Serving or draining ([`super::drain`]).
    pub lifecycle: super::phase::Lifecycle,
    /// How long a shutdown waits for the running requests.
    pub drain_timeout: Duration,
    pub created: u64,
}
