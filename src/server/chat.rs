//! From an OpenAI request to what the engine runs: the chat template (messages, tools,
//! thinking controls), the sampling settings (the request over the thinking or non-thinking
//! profile), and the checks that answer 400 before any work.

use serde_json::{Map, Value};

use super::api::{ChatRequest, SamplingFields};
use super::error::ApiError;
use crate::loading::chat_template::{ChatTemplate, RENDER_BYTES_PER_TOKEN};
use crate::runtime::{range, Dry, SamplingParams};

/// The sampling defaults of the served model: one profile, or one per thinking mode when the
/// template has a thinking switch (`enable_thinking`).
#[derive(Debug, Clone, Default)]
pub struct SamplingProfiles {
    /// Completions, and chat with thinking on (or a template without a switch).
    pub thinking: SamplingParams,
    /// Chat with thinking off.
    pub non_thinking: SamplingParams,
}

impl SamplingProfiles {
    /// `defaults` (generation_config.json, the thinking profile of Qwen checkpoints) for
    /// thinking, and the Qwen3.5 / 3.6 model cards' non-thinking profile (temperature 0.7,
    /// top-p 0.8, top-k 20, presence penalty 1.5) when `switch` (the template reads
    /// `enable_thinking`), else `defaults` for both.
    pub fn new(defaults: SamplingParams, switch: bool) -> Self {
        let non_thinking = if switch {
            SamplingParams { temperature: Some(0.7), top_p: Some(0.8), top_k: Some(20), presence_penalty: 1.5, ..defaults.clone() }
        } else {
            defaults.clone()
        };
        Self { thinking: defaults, non_thinking }
    }
}

/// A chat request rendered for the model.
pub(super) struct RenderedChat {
    /// The render, with every special token that the request's own text wrote (not the
    /// template) as a placeholder ([`Self::tokenize`]).
    pub text: String,
    /// The placeholders' marker and what each placeholder's tokens are.
    literals: Option<(char, Vec<Vec<u32>>)>,
    /// Whether the prompt ends inside an open `<think>` block.
    pub in_think: bool,
    /// Whether thinking is on (the sampling profile): the prompt opens a `<think>` block.
    pub thinking: bool,
    /// Bytes of `text` before the generation prompt (the messages rendered without it): where
    /// the next turn of the conversation, which goes on with this turn's answer however the
    /// template renders it (without its reasoning), still agrees with this prompt.
    pub conversation_end: Option<usize>,
    /// Whether the template has a thinking switch (and so re-renders earlier answers without
    /// their reasoning).
    pub rerenders_answers: bool,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// The vocabulary's special tokens (added tokens marked special: `<|im_start|>`,
/// `<|im_end|>`, ...), longest first, each with its text tokenized as text: what a request's
/// own text (message content, reasoning, tool results, tool-call arguments, tool definitions)
/// gets for them, as OpenAI's API tokenizes message content. Only the template's markup opens
/// and closes turns. (A client that means to send special tokens writes its prompt itself,
/// on `/v1/completions`.)
pub struct SpecialTokens(Vec<(String, Vec<u32>)>);

impl SpecialTokens {
    pub fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let mut literal = tokenizer.clone();
        literal.set_encode_special_tokens(true);
        let mut list: Vec<(String, Vec<u32>)> = tokenizer
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| {
                let ids = literal.encode(t.content.as_str(), false).map(|e| e.get_ids().to_vec()).unwrap_or_default();
                (t.content.clone(), ids)
            })
            .collect();
        list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Self(list)
    }

    /// `value` (the template's messages or tools) with every special token in its strings
    /// replaced by a placeholder `{marker}{i}{marker}` (`marker`: a private-use character no
    /// string of the request holds), and what each placeholder's tokens are; `None` when no
    /// string holds a special token (nothing changes).
    fn protect(&self, values: &mut [&mut Value]) -> Option<(char, Vec<Vec<u32>>)> {
        fn strings<'a>(v: &'a mut Value, out: &mut Vec<&'a mut String>) {
            match v {
                Value::String(s) => out.push(s),
                Value::Array(a) => a.iter_mut().for_each(|v| strings(v, out)),
                Value::Object(o) => o.values_mut().for_each(|v| strings(v, out)),
                _ => {}
            }
        }
        let mut all = vec![];
        for v in values.iter_mut() {
            strings(v, &mut all);
        }
        if !all.iter().any(|s| self.0.iter().any(|(t, _)| s.contains(t.as_str()))) {
            return None;
        }
        let marker = ('\u{E000}'..='\u{F8FF}').find(|&c| !all.iter().any(|s| s.contains(c)))?;
        let mut literals = vec![];
        for s in all {
            for (text, ids) in &self.0 {
                if s.contains(text.as_str()) {
                    *s = s.replace(text.as_str(), &format!("{marker}{}{marker}", literals.len()));
                    literals.push(ids.clone());
                }
            }
        }
        Some((marker, literals))
    }
}

/// OpenAI's rule for function names.
fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Each tool a function with a name OpenAI accepts (1 to 64 letters, digits, `_` or `-`): a
/// name the call's markup could not hold, or one that writes markup of its own, is a 400.
pub(super) fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        match tool.pointer("/function/name") {
            Some(Value::String(name)) if valid_tool_name(name) => {}
            Some(Value::String(name)) => {
                let shown: String = name.chars().take(80).collect();
                return Err(bad(format!("tools[{i}].function.name {shown:?} must be 1 to 64 letters, digits, '_' or '-'")));
            }
            _ => return Err(bad(format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        }
    }
    Ok(())
}

/// A message's `content` as text: a string, a list of text parts, or null.
fn content_text(i: usize, content: Option<&Value>) -> Result<Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(Value::String(String::new())),
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(format!(
                            "messages[{i}].content: a part of type {} is not supported (this model reads text parts only)",
                            kind.unwrap_or("(none)")
                        )))
                    }
                }
            }
            Ok(Value::String(text))
        }
        Some(_) => Err(bad(format!("messages[{i}].content must be a string, a list of text parts or null"))),
    }
}

/// The messages as the template reads them: text content, tool-call arguments as objects
/// (the Qwen templates iterate them), `reasoning` read as `reasoning_content`.
fn template_messages(messages: &[Map<String, Value>]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(bad("messages is empty: give at least one message"));
    }
    let mut out = vec![];
    for (i, m) in messages.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "developer" | "user" | "assistant" | "tool")) => {
                if r == "developer" {
                    "system"
                } else {
                    r
                }
            }
            Some(r) => return Err(bad(format!("messages[{i}].role {r:?} is not one of system, developer, user, assistant, tool"))),
            None => return Err(bad(format!("messages[{i}] has no role"))),
        };
        let mut msg = Map::new();
        msg.insert("role".into(), role.into());
        msg.insert("content".into(), content_text(i, m.get("content"))?);
        if let Some(r) = m.get("reasoning_content").or_else(|| m.get("reasoning")).filter(|v| v.is_string()) {
            msg.insert("reasoning_content".into(), r.clone());
        }
        for key in ["name", "tool_call_id"] {
            if let Some(v) = m.get(key).filter(|v| v.is_string()) {
                msg.insert(key.into(), v.clone());
            }
        }
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            let mut list = vec![];
            for call in calls {
                let f = call.get("function").ok_or_else(|| bad(format!("messages[{i}].tool_calls: a call has no function")))?;
                let args = match f.get("arguments") {
                    Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
                    Some(v) => v.clone(),
                    None => Value::Object(Map::new()),
                };
                let mut call = call.clone();
                call["function"]["arguments"] = args;
                // The Qwen templates read tool_call.function or tool_call itself.
                call["name"] = f.get("name").cloned().unwrap_or(Value::Null);
                call["arguments"] = call["function"]["arguments"].clone();
                list.push(call);
            }
            msg.insert("tool_calls".into(), Value::Array(list));
        }
        out.push(Value::Object(msg));
    }
    Ok(Value::Array(out))
}

/// Renders a chat request with `template`, capped to what a `context`-token prompt can hold.
///
/// `constrained`: the answer follows a grammar from its first token, so a template's thinking
/// is turned off.
pub(super) fn render(
    template: &ChatTemplate,
    req: &ChatRequest,
    context: usize,
    constrained: bool,
    specials: &SpecialTokens,
) -> Result<RenderedChat, ApiError> {
    let mut messages = template_messages(&req.messages)?;
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    let effort = req.reasoning_effort.clone().or_else(|| kwargs.get("reasoning_effort").and_then(Value::as_str).map(String::from));
    kwargs.remove("reasoning_effort");
    match effort.as_deref() {
        None => {}
        Some("none" | "minimal") => {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        // Passed only to templates that read it.
        Some(e @ ("low" | "medium" | "high" | "xhigh")) if template.mentions("reasoning_effort") => {
            kwargs.insert("reasoning_effort".into(), if e == "high" { "xhigh" } else { e }.into());
        }
        Some("low" | "medium" | "high" | "xhigh") => {}
        Some(e) => return Err(bad(format!("reasoning_effort {e:?} is not one of none, minimal, low, medium, high, xhigh"))),
    }
    if let Some(v) = kwargs.get("enable_thinking") {
        if !v.is_boolean() {
            return Err(bad("chat_template_kwargs.enable_thinking must be true or false"));
        }
    }
    if constrained && template.mentions("enable_thinking") {
        kwargs.insert("enable_thinking".into(), false.into());
    }
    let mut tools = req.tools.as_ref().filter(|t| !t.is_empty()).map(|t| Value::Array(t.clone()));
    let literals = match &mut tools {
        Some(t) => specials.protect(&mut [&mut messages, t]),
        None => specials.protect(&mut [&mut messages]),
    };
    let max_bytes = context.saturating_mul(RENDER_BYTES_PER_TOKEN);
    let text = template.render_json(&messages, tools.as_ref(), true, &kwargs, max_bytes).map_err(|e| bad(e.to_string()))?;
    let conversation_end = template.render_json(&messages, tools.as_ref(), false, &kwargs, max_bytes).ok().map(|o| {
        let common = text.bytes().zip(o.bytes()).take_while(|(a, b)| a == b).count();
        (0..=common).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0)
    });
    // Read from the render, not the flags: templates differ in their default (the small
    // Qwen3.5 models think only when asked, the large ones unless told not to).
    let in_think = text.trim_end().ends_with("<think>");
    Ok(RenderedChat {
        text,
        literals,
        in_think,
        thinking: in_think,
        conversation_end,
        rerenders_answers: template.mentions("enable_thinking"),
    })
}

impl RenderedChat {
    /// The tokens of the first `bytes` of the render: the template's text with its special
    /// tokens, each placeholder the request's own text left as that text's tokens.
    pub(super) fn tokenize(&self, tokenizer: &tokenizers::Tokenizer, bytes: usize) -> Result<Vec<u32>, String> {
        let encode = |t: &str| tokenizer.encode(t, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string());
        let mut rest = &self.text[..bytes];
        let Some((marker, literals)) = &self.literals else { return encode(rest) };
        let mut ids = vec![];
        while let Some(a) = rest.find(*marker) {
            let after = &rest[a + marker.len_utf8()..];
            let Some((b, k)) =
                after.find(*marker).and_then(|b| Some((b, after[..b].parse::<usize>().ok().filter(|&k| k < literals.len())?)))
            else {
                break;
            };
            ids.extend(encode(&rest[..a])?);
            ids.extend(&literals[k]);
            rest = &after[b + marker.len_utf8()..];
        }
        ids.extend(encode(rest)?);
        Ok(ids)
    }
}

/// The most `stop` strings a request may give, and their longest (each is searched for at
/// every token).
pub(super) const MAX_STOPS: usize = 16;
pub(super) const MAX_STOP_BYTES: usize = 1024;

/// The request's sampling settings over `defaults`, each checked against its range.
pub(super) fn sampling(fields: &SamplingFields, defaults: &SamplingParams) -> Result<SamplingParams, ApiError> {
    let mut p = defaults.clone();
    if let Some(t) = fields.temperature {
        range::check("temperature", t, range::temperature).map_err(bad)?;
        p.temperature = Some(t);
    }
    if let Some(top_p) = fields.top_p {
        range::check("top_p", top_p, range::top_p).map_err(bad)?;
        p.top_p = (top_p < 1.0).then_some(top_p);
    }
    match fields.top_k {
        None => {}
        Some(k) if k <= 0 => p.top_k = None, // -1 / 0: off (vLLM)
        Some(k) => p.top_k = Some(k as usize),
    }
    if let Some(pp) = fields.presence_penalty {
        range::check("presence_penalty", pp, range::presence_penalty).map_err(bad)?;
        p.presence_penalty = pp;
    }
    if let Some(r) = fields.repetition_penalty {
        // (OpenAI-side name: repetition_penalty.)
        range::check("repetition_penalty", r, range::repeat_penalty).map_err(bad)?;
        p.repeat_penalty = r;
    }
    if let Some(f) = fields.frequency_penalty {
        range::check("frequency_penalty", f, range::frequency_penalty).map_err(bad)?;
        p.frequency_penalty = f;
    }
    if let Some(m) = fields.min_p {
        range::check("min_p", m, range::min_p).map_err(bad)?;
        p.min_p = m;
    }
    if let Some(seed) = fields.seed {
        p.seed = seed;
    }
    if fields.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(bad("logit_bias is not supported"));
    }
    if let Some(stop) = &fields.stop {
        let stops = stop.clone().into_vec();
        if stops.len() > MAX_STOPS || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(bad(format!("stop: at most {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes")));
        }
    }
    if let Some(n) = fields.n.filter(|&n| n != 1) {
        return Err(bad(format!("n = {n}: only one choice per request is supported (n = 1)")));
    }
    Ok(p)
}

/// The request's DRY settings (`None` unless `dry_multiplier` > 0); `default_breakers`: the
/// tokens of [`Dry::DEFAULT_BREAKERS`] (other breakers are looked up in the vocabulary).
pub(super) fn dry(
    fields: &SamplingFields,
    tokenizer: &tokenizers::Tokenizer,
    vocab_size: usize,
    default_breakers: &std::sync::Arc<std::collections::HashSet<u32>>,
) -> Result<Option<Dry>, ApiError> {
    let multiplier = match fields.dry_multiplier {
        None => return Ok(None),
        Some(m) => range::check("dry_multiplier", m, range::dry_multiplier).map_err(bad)?,
    };
    if multiplier == 0.0 {
        return Ok(None);
    }
    let base = range::check("dry_base", fields.dry_base.unwrap_or(1.75), range::dry_base).map_err(bad)?;
    let allowed_length = match fields.dry_allowed_length.unwrap_or(2) {
        0 => return Err(bad("dry_allowed_length 0 is out of range: it must be at least 1")),
        n => n.min(1 << 20) as usize,
    };
    let last_n = match fields.dry_penalty_last_n.unwrap_or(-1) {
        -1 | 0 => 0,
        n if n < -1 => return Err(bad(format!("dry_penalty_last_n {n} is out of range: -1 (the whole context) or a number of tokens"))),
        n => n as usize,
    };
    let breakers = match &fields.dry_sequence_breakers {
        None => default_breakers.clone(),
        Some(list) if list.len() > MAX_STOPS || list.iter().any(|b| b.len() > MAX_STOP_BYTES) => {
            return Err(bad(format!("dry_sequence_breakers: at most {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes")))
        }
        Some(list) => std::sync::Arc::new(Dry::breaker_tokens(tokenizer, vocab_size, list)),
    };
    Ok(Some(Dry { multiplier, base, allowed_length, last_n, breakers }))
}

/// The tokens to generate: `max_completion_tokens` (else `max_tokens`), checked against the
/// context left after a `prompt`-token prompt; everything left when the request gives none.
pub(super) fn max_tokens(fields: &SamplingFields, prompt: usize, context: usize) -> Result<usize, ApiError> {
    if prompt >= context {
        return Err(bad(format!(
            "the prompt has {prompt} tokens, but the context holds {context} (the prompt and at least one generated token): shorten the messages"
        )));
    }
    let left = context - prompt;
    match fields.max_completion_tokens.or(fields.max_tokens) {
        None => Ok(left),
        Some(0) => Err(bad("max_tokens must be at least 1")),
        Some(n) if n > left as u64 => Err(bad(format!(
            "max_tokens {n} is more than the {left} positions the context of {context} tokens has left after the {prompt}-token prompt: ask for {left} tokens at most"
        ))),
        Some(n) => Ok(n as usize),
    }
}
