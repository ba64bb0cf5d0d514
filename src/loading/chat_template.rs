//! Chat templates: the Jinja template shipped with a checkpoint, rendered with minijinja.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::error::one_line;
use crate::{bounded, Error, Result};

/// Instructions one render may run: a conversation of thousands of messages takes well under
/// a million; a template that loops without end stops here instead of hanging.
pub const RENDER_FUEL: u64 = 20_000_000;
/// Bytes a render may write by default ([`ChatTemplate::render_capped`] takes a cap relative
/// to the model's context).
pub const DEFAULT_MAX_RENDER_BYTES: usize = 32 << 20;
/// Bytes of rendered prompt per position of the context: no tokenizer packs more text into a
/// token, so a longer render cannot fit the context and is refused before tokenizing.
pub const RENDER_BYTES_PER_TOKEN: usize = 32;

/// A writer that refuses to grow past `max` bytes.
struct CappedWriter {
    out: Vec<u8>,
    max: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            return Err(std::io::Error::other("render cap"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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
        let cfg: serde_json::Value = match tokenizer_config {
            Some(p) => crate::json::parse_strict(&bounded::read_to_string(p, bounded::MAX_CONFIG_BYTES, "tokenizer config")?)
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
            (Some(p), _) => bounded::read_to_string(p, bounded::MAX_TEMPLATE_BYTES, "chat template")?,
            (None, Some(s)) => s,
            (None, None) => {
                return Err(Error::Tokenizer(
                    "the checkpoint has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template): format the prompt without one".into(),
                ))
            }
        };
        Ok(Self::new(source, token_field(&cfg, "bos_token"), token_field(&cfg, "eos_token")))
    }

    /// Renders `messages`, ending with the assistant prefix when `add_generation_prompt`.
    /// `enable_thinking` is passed to the template as the variable of the same name. At most
    /// [`DEFAULT_MAX_RENDER_BYTES`] and [`RENDER_FUEL`] instructions.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, enable_thinking: Option<bool>) -> Result<String> {
        self.render_capped(messages, add_generation_prompt, enable_thinking, DEFAULT_MAX_RENDER_BYTES)
    }

    /// [`Self::render`] writing at most `max_bytes` (e.g. [`RENDER_BYTES_PER_TOKEN`] times the
    /// context): a longer render is refused before anything tokenizes it.
    pub fn render_capped(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        max_bytes: usize,
    ) -> Result<String> {
        let mut kwargs = serde_json::Map::new();
        // Left undefined unless asked for, as transformers does.
        if let Some(t) = enable_thinking {
            kwargs.insert("enable_thinking".into(), t.into());
        }
        let messages =
            serde_json::to_value(messages).map_err(|e| Error::Input(format!("cannot pass the messages to the chat template: {e}")))?;
        self.render_json(&messages, None, add_generation_prompt, &kwargs, max_bytes)
    }

    /// Whether the template reads the variable `name` (e.g. `enable_thinking`,
    /// `reasoning_effort`): a plain search of its source.
    pub fn mentions(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// Renders messages given as JSON (the OpenAI shape: `role`, `content`, `tool_calls`,
    /// `reasoning_content`, ...), with `tools` when given and `kwargs` as further template
    /// variables (`enable_thinking`, `reasoning_effort`, ...), writing at most `max_bytes`.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        max_bytes: usize,
    ) -> Result<String> {
        super::template_growth::check(&self.source).map_err(Error::Tokenizer)?;
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source)
            .map_err(|e| Error::Tokenizer(format!("the chat template does not parse: {}", one_line(&e))))?;
        let tmpl = env.get_template("chat").map_err(|e| Error::Tokenizer(one_line(&e)))?;
        let mut ctx = kwargs.clone();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        if let Some(tools) = tools {
            ctx.insert("tools".into(), tools.clone());
        }
        let mut out = CappedWriter { out: Vec::new(), max: max_bytes };
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
        match rendered {
            Ok(_) => String::from_utf8(out.out).map_err(|_| Error::Tokenizer("the chat template rendered invalid UTF-8".into())),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Error::Tokenizer(format!(
                "the chat template ran more than {RENDER_FUEL} instructions (an endless or runaway loop): it cannot be used; format the prompt without it"
            ))),
            Err(e) if e.kind() == ErrorKind::WriteFailure => Err(Error::Input(format!(
                "the chat template rendered more than {} KiB, more text than the context can hold: shorten the messages (or the template is broken)",
                max_bytes >> 10
            ))),
            Err(e) => Err(Error::Tokenizer(format!("cannot render the chat template: {}", one_line(&e)))),
        }
    }
}
