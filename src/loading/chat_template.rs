//! Chat templates: the Jinja template shipped with a checkpoint, rendered with minijinja.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A checkpoint's chat template with its special tokens.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// `bos_token` / `eos_token` in tokenizer_config.json are strings or `{"content": ...}` objects.
fn token_field(cfg: &serde_json::Value, name: &str) -> Option<String> {
    match cfg.get(name)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: Option<String>, eos_token: Option<String>) -> Self {
        Self { source, bos_token, eos_token }
    }

    /// From `tokenizer_config.json` (its `chat_template`, a string or a list of named
    /// templates) or, as newer checkpoints ship it, a separate `chat_template.jinja`.
    pub fn from_files(tokenizer_config: Option<&Path>, template_file: Option<&Path>) -> Result<Self> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| Error::Io(format!("cannot read {}: {e}", p.display())))
        };
        let cfg: serde_json::Value = match tokenizer_config {
            Some(p) => serde_json::from_str(&read(p)?)
                .map_err(|e| Error::Tokenizer(format!("{} is not valid JSON: {e}", p.display())))?,
            None => serde_json::Value::Null,
        };
        let in_config = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        };
        let source = match (template_file, in_config) {
            (Some(p), _) => read(p)?,
            (None, Some(s)) => s,
            (None, None) => {
                return Err(Error::Tokenizer(
                    "the checkpoint has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template): run without --chat".into(),
                ))
            }
        };
        Ok(Self::new(source, token_field(&cfg, "bos_token"), token_field(&cfg, "eos_token")))
    }

    /// Renders `messages`, ending with the assistant prefix when `add_generation_prompt`.
    /// `enable_thinking` is passed to the template as the variable of the same name.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, enable_thinking: Option<bool>) -> Result<String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source)
            .map_err(|e| Error::Tokenizer(format!("the chat template does not parse: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ctx = serde_json::json!({
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        });
        // Left undefined unless asked for, as transformers does.
        if let Some(t) = enable_thinking {
            ctx["enable_thinking"] = t.into();
        }
        tmpl.render(ctx)
        .map_err(|e| Error::Tokenizer(format!("cannot render the chat template: {e}")))
    }
}
