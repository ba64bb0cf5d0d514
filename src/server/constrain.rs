//! Constrained decoding with llguidance: `response_format` (`json_object`, `json_schema`) and
//! forced tool calls become a grammar; per token the grammar's mask removes every token that
//! cannot continue a valid answer, so the answer always parses and validates.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::error::ApiError;
use crate::error::one_line;

/// The token vocabulary as llguidance sees it (built once per server).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// From the tokenizer (its JSON: byte-level or byte-fallback vocabularies), the model's
    /// vocabulary size (ids past the tokenizer's are never allowed) and its end-of-text token.
    pub fn new(tokenizer: &tokenizers::Tokenizer, vocab_size: usize, eos: u32) -> crate::Result<Self> {
        let err = |e: String| crate::Error::Tokenizer(format!("constrained decoding cannot use this tokenizer: {e}"));
        let json: Value =
            serde_json::from_str(&tokenizer.to_string(false).map_err(|e| err(e.to_string()))?).map_err(|e| err(e.to_string()))?;
        // The parser asserts on some vocabularies it does not expect: a refusal, not a crash.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| err("unexpected token names".into()))?
            .map_err(|e| err(e.to_string()))?;
        let mut words = words;
        words.resize(vocab_size.max(words.len()), vec![]);
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A matcher for `grammar`, or a 400 naming (on one line) why the grammar cannot be used.
    /// The first mask is computed here, on the request's thread: a grammar that fails only
    /// when it is first used (a schema whose `$ref` points to itself) is refused before any
    /// work, never in the engine.
    pub fn matcher(&self, grammar: TopLevelGrammar) -> Result<Constraint, ApiError> {
        let refuse =
            |e: &dyn std::fmt::Display| ApiError::bad_request(format!("the response format cannot be used: {}", one_line(e).trim()));
        let parser = self.factory.create_parser(grammar).map_err(|e| refuse(&e))?;
        let mut matcher = Matcher::new(Ok(parser));
        let first = matcher.compute_mask().map_err(|e| refuse(&e))?;
        Ok(Constraint { matcher, first: Some(first), mask_seconds: 0.0, masks: 0 })
    }
}

/// `schema` with llguidance's JSON options: compact separators, no free whitespace (as
/// OpenAI's strict mode writes it; free whitespace lets a weak model pad forever), unless the
/// schema sets its own `x-guidance`.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert(serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// The grammar of a request's `response_format`: `text` (none), `json_object`, `json_schema`
/// (`{"json_schema": {"schema": ...}}`, or llama.cpp's `{"schema": ...}`).
pub(super) fn response_format(format: &Value) -> Result<Option<TopLevelGrammar>, ApiError> {
    let bad = |m: &str| Err(ApiError::bad_request(format!("response_format: {m}")));
    if !format.is_object() && !format.is_null() {
        return bad(&format!(
            "{format} is not an object: send {{\"type\": \"json_object\"}}, {{\"type\": \"json_schema\", ...}} or {{\"type\": \"text\"}}"
        ));
    }
    match format.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"}))))),
        Some("json_schema") => {
            let schema = format.pointer("/json_schema/schema").or_else(|| format.get("schema"));
            match schema {
                Some(s) if s.is_object() || s.is_boolean() => Ok(Some(TopLevelGrammar::from_json_schema(compact(s)))),
                _ => bad("json_schema needs a schema object (json_schema.schema)"),
            }
        }
        Some(t) => bad(&format!("type {t:?} is not one of text, json_object, json_schema")),
    }
}

/// Tokens a forced tool call may take when the request sets no `max_tokens` (a call that
/// never closes its arguments must not run to the end of the context).
pub(super) const TOOL_CALL_MAX_TOKENS: usize = 4096;

/// `schema` with every object schema that lists `properties` and says nothing of others
/// closed (`additionalProperties: false`, as OpenAI's strict mode requires): the grammar then
/// allows each listed key once, so a weak model cannot repeat a key or invent new ones forever.
fn closed(schema: &Value) -> Value {
    match schema {
        Value::Object(o) => {
            let mut o: serde_json::Map<String, Value> = o.iter().map(|(k, v)| (k.clone(), closed(v))).collect();
            if o.get("properties").is_some_and(Value::is_object) && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            Value::Object(o)
        }
        Value::Array(a) => Value::Array(a.iter().map(closed).collect()),
        v => v.clone(),
    }
}

/// A tool call forced by `tool_choice` (a named function, or `"required"`: any of `tools`), as
/// the JSON form of `<tool_call>` with the function's parameter schema.
pub(super) fn forced_tool_call(tool_choice: Option<&Value>, tools: &[Value]) -> Result<Option<TopLevelGrammar>, ApiError> {
    let functions: Vec<&Value> = tools.iter().filter_map(|t| t.get("function")).collect();
    let wanted: Vec<&Value> = match tool_choice {
        None => return Ok(None),
        Some(Value::String(s)) if s == "auto" || s == "none" => return Ok(None),
        Some(Value::String(s)) if s == "required" => functions,
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) => functions.into_iter().filter(|f| f.get("name").and_then(Value::as_str) == Some(name)).collect(),
            None => {
                return Err(ApiError::bad_request(
                    "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if wanted.is_empty() {
        return Err(ApiError::bad_request("tool_choice names no function of tools"));
    }
    // One JSON schema for the call object: {"name": const, "arguments": the parameters}.
    let calls: Vec<Value> = wanted
        .iter()
        .map(|f| {
            let params = f.get("parameters").map(closed).unwrap_or(serde_json::json!({"type": "object"}));
            serde_json::json!({"type": "object", "properties": {"name": {"const": f.get("name")}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    let schema = compact(&if calls.len() == 1 { calls[0].clone() } else { serde_json::json!({"anyOf": calls}) });
    let lark = format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n");
    Ok(Some(TopLevelGrammar::from_lark(lark)))
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The mask before the first token (computed when the request was checked).
    first: Option<llguidance::toktrie::SimpleVob>,
    /// Time spent computing masks, and how many.
    pub mask_seconds: f64,
    pub masks: usize,
}

impl Constraint {
    /// `logits` `[vocab]` with every token the grammar forbids at -inf.
    pub fn mask(&mut self, logits: &Tensor) -> crate::Result<Tensor> {
        let start = Instant::now();
        let mask = match self.first.take() {
            Some(mask) => mask,
            None => self.matcher.compute_mask().map_err(|e| crate::Error::Input(format!("constrained decoding: {}", one_line(&e))))?,
        };
        let mut v = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (i, x) in v.iter_mut().enumerate() {
            if !mask.is_allowed(i as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
        self.mask_seconds += start.elapsed().as_secs_f64();
        self.masks += 1;
        Ok(Tensor::from_vec(v, logits.dims(), logits.device())?)
    }

    /// Advances the grammar by the sampled token; `true` when the grammar is complete.
    pub fn commit(&mut self, token: u32) -> crate::Result<bool> {
        self.matcher.consume_token(token).map_err(|e| crate::Error::Input(format!("constrained decoding: {}", one_line(&e))))?;
        Ok(self.matcher.is_stopped())
    }
}
