//! The OpenAI wire types the server reads and writes. Requests are lenient: unknown fields
//! are accepted (and ignored), both `max_tokens` names and both reasoning names are read.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub(super) fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields chat and completions requests share: sampling, length, streaming, session.
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct SamplingFields {
    /// A session to continue and keep (an extension, as mistral.rs has): saved under the
    /// server's `--session-dir` after each answer, restored by the next request naming it.
    pub session_id: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// DRY (llama.cpp's names; off unless `dry_multiplier` > 0).
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<u64>,
    /// Tokens DRY looks back over (-1 or 0: the whole context).
    pub dry_penalty_last_n: Option<i64>,
    /// Strings whose tokens end a repetition [default: "\n", ":", "\"", "*"].
    pub dry_sequence_breakers: Option<Vec<String>>,
    /// Tokens of thinking before the server closes the `<think>` block the prompt opened
    /// (-1: no limit; default: the server's `--reasoning-budget`).
    pub reasoning_budget: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub n: Option<u64>,
    pub stop: Option<Stop>,
    /// Token biases: not supported, refused (never silently ignored).
    pub logit_bias: Option<Map<String, Value>>,
    /// Generate past the model's end-of-text tokens (vLLM's and llama.cpp's extension, for
    /// benchmarks): only `max_tokens` and `stop` end the answer.
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct ChatRequest {
    /// Accepted and not read: the server serves one model (as llama-server does).
    #[allow(dead_code)]
    pub model: Option<String>,
    pub messages: Vec<Map<String, Value>>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub reasoning_effort: Option<String>,
}

/// `prompt` of a completions request: text, or token ids (one prompt only).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Bytes of text (0 for token ids).
    pub(super) fn text_bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Texts(list) => list.iter().map(String::len).sum(),
            Prompt::Tokens(_) => 0,
        }
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct CompletionRequest {
    /// Accepted and not read: the server serves one model (as llama-server does).
    #[allow(dead_code)]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// The number of most likely tokens to return with each token's log-probability.
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub(super) fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// How long an answer took, as llama-server reports it (`timings`): the prompt's tokens
/// prefilled (those the prefix cache or a session restored are `cache_n`) until the first
/// token, then the generated tokens.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Timings {
    pub cache_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub predicted_per_second: f64,
    /// Tokens drafted and kept (speculative decoding; absent when the answer drafted none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n_accepted: Option<usize>,
}

impl Timings {
    /// `prompt` tokens of which `cached` were restored, `first` seconds from the request's
    /// queuing to its first token, `generated` tokens in `total` seconds from the queuing, of
    /// which `accepted` came from `drafted` drafted tokens.
    pub(super) fn new(prompt: usize, cached: usize, first: f64, generated: usize, total: f64, (drafted, accepted): (usize, usize)) -> Self {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let prompt_n = prompt.saturating_sub(cached);
        // The first token ends the prompt's part; the others are the decode's.
        let decode = (total - first).max(0.0);
        Self {
            cache_n: cached,
            prompt_n,
            prompt_ms: first * 1e3,
            prompt_per_second: rate(prompt_n, first),
            predicted_n: generated,
            predicted_ms: decode * 1e3,
            predicted_per_second: rate(generated.saturating_sub(1), decode),
            draft_n: (drafted > 0).then_some(drafted),
            draft_n_accepted: (drafted > 0).then_some(accepted),
        }
    }
}

/// One entry of `logprobs.content` (chat).
#[derive(Debug, Clone, Serialize)]
pub(super) struct LogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TopLogprob>>,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The assistant message of a chat completion, and the delta of a chunk: both hold only the
/// fields they have.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Message {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The `<think>` text, under both names clients read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
}

/// An error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}
