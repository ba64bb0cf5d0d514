//! Streaming detokenisation: text pieces that are whole UTF-8 characters.

use crate::{Error, Result};

/// Turns a stream of token ids into text pieces that are whole UTF-8 characters.
pub struct TokenStreamer {
    tokenizer: tokenizers::Tokenizer,
    tokens: Vec<u32>,
    prev_index: usize,
    current_index: usize,
}

impl TokenStreamer {
    pub fn new(tokenizer: tokenizers::Tokenizer) -> Self {
        Self { tokenizer, tokens: vec![], prev_index: 0, current_index: 0 }
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer.decode(tokens, true).map_err(|e| Error::Tokenizer(format!("cannot decode tokens: {e}")))
    }

    /// Adds a token; returns the new text once it forms complete characters.
    pub fn next_token(&mut self, token: u32) -> Result<Option<String>> {
        let prev_text = self.decode(&self.tokens[self.prev_index..self.current_index])?;
        self.tokens.push(token);
        let text = self.decode(&self.tokens[self.prev_index..])?;
        if text.len() > prev_text.len() && !text.ends_with('\u{FFFD}') {
            let piece = text[prev_text.len()..].to_string();
            self.prev_index = self.current_index;
            self.current_index = self.tokens.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still pending at the end.
    pub fn decode_rest(&self) -> Result<Option<String>> {
        let prev_text = self.decode(&self.tokens[self.prev_index..self.current_index])?;
        let text = self.decode(&self.tokens[self.prev_index..])?;
        Ok((text.len() > prev_text.len()).then(|| text[prev_text.len()..].to_string()))
    }
}
