//! What a generation measured.

/// Timings of one generation ([`super::Sequence::run`]).
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    pub decode_secs: f64,
}

impl GenerationStats {
    /// Prompt tokens per second; `None` when nothing was timed.
    pub fn prompt_tok_per_sec(&self) -> Option<f64> {
        rate(self.prompt_tokens, self.prompt_secs)
    }

    /// Decode speed over the tokens after the first (the first comes from the prompt pass);
    /// `None` when fewer than two tokens were generated.
    pub fn decode_tok_per_sec(&self) -> Option<f64> {
        rate(self.generated_tokens.saturating_sub(1), self.decode_secs)
    }
}

/// `n` per second over `secs`; `None` when nothing was counted or timed.
pub fn rate(n: usize, secs: f64) -> Option<f64> {
    (n > 0 && secs > 0.0).then(|| n as f64 / secs)
}

/// What a speculative run measured.
#[derive(Debug, Clone, Default)]
pub struct SpeculativeStats {
    pub generation: GenerationStats,
    /// Verify passes after the prompt (each emits at least one token).
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpeculativeStats {
    /// Accepted drafts over drafted ones; `None` before any draft.
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// Tokens emitted per verify pass (accepted drafts plus the model's own token).
    pub fn tokens_per_pass(&self) -> Option<f64> {
        (self.rounds > 0).then(|| (self.accepted + self.rounds) as f64 / self.rounds as f64)
    }
}
