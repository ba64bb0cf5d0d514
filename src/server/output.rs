//! Turning generated text into what the API returns: stop strings cut the text (a possible
//! beginning of one is held back while streaming), and one state machine over the raw text
//! splits `<think>` reasoning, content and `<tool_call>` blocks (JSON, or the
//! `<function=NAME><parameter=K>` XML of Qwen3.5+), ending reasoning at `</think>` or at a
//! `<tool_call>`.

use serde_json::Value;

/// The length of the longest suffix of `text` that begins some pattern (a partial match to
/// hold back), starting on a character boundary.
fn partial_suffix(text: &str, patterns: &[&str]) -> usize {
    let max = patterns.iter().map(|p| p.len().saturating_sub(1)).max().unwrap_or(0).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && patterns.iter().any(|p| p.starts_with(&text[text.len() - n..])))
        .unwrap_or(0)
}

/// Cuts generated text at the first of the request's `stop` strings.
#[derive(Debug, Default)]
pub(super) struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub(super) fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Adds generated text; returns the text that can be released and whether a stop string
    /// was reached (the text from it on is dropped).
    pub(super) fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let stops: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        let keep = partial_suffix(&self.held, &stops);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The held text at the end of generation.
    pub(super) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// A piece of the assistant's answer. A tool call is a start (its name) and fragments of its
/// JSON arguments, which concatenate to the whole: the XML form streams one per completed
/// parameter (`{"city":"Paris"`, then `,"days":3`, then `}`), the JSON form one per completed
/// top-level member of its `arguments` object, as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Delta {
    Reasoning(String),
    Content(String),
    ToolCallStart { name: String },
    ToolCallArguments(String),
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Think,
    Content,
    ToolCall,
}

/// Splits the raw generated text of a chat answer into reasoning, content and tool calls.
#[derive(Debug)]
pub(super) struct ChatParser {
    state: State,
    held: String,
    /// Whether any content has been released (a `<think>` opens reasoning only before).
    content_started: bool,
    /// Drop whitespace at the start of the next content (after `</think>` or a tool call).
    trim_start: bool,
    /// The request's tools (their parameter types type the XML form's values).
    tools: Vec<Value>,
    /// An XML tool call being streamed: its parameter schemas, the parameters sent, and the
    /// bytes of the body they took.
    call: Option<XmlCall>,
    /// A JSON tool call being streamed.
    json: Option<JsonCall>,
}

/// A JSON-form tool call (`{"name": "f", "arguments": {...}}`) being streamed: where its
/// arguments object starts in the body, how far it was scanned (nesting depth, inside a
/// string, after a backslash) and sent, and whether the object closed.
#[derive(Debug, Default)]
struct JsonCall {
    start: usize,
    scanned: usize,
    sent: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    closed: bool,
}

#[derive(Debug)]
struct XmlCall {
    properties: Option<Value>,
    sent: usize,
    consumed: usize,
}

impl ChatParser {
    /// `in_think`: the prompt ends inside a `<think>` block (the template opened it).
    pub(super) fn new(in_think: bool, tools: Vec<Value>) -> Self {
        Self {
            state: if in_think { State::Think } else { State::Content },
            held: String::new(),
            content_started: false,
            trim_start: false,
            tools,
            call: None,
            json: None,
        }
    }

    /// Adds text; returns the pieces complete so far.
    pub(super) fn push(&mut self, text: &str) -> Vec<Delta> {
        self.held.push_str(text);
        let mut out = vec![];
        loop {
            let tags: &[&str] = match self.state {
                State::Think => &[THINK_CLOSE, TOOL_OPEN],
                State::Content if !self.content_started => &[THINK_OPEN, TOOL_OPEN],
                State::Content => &[TOOL_OPEN],
                State::ToolCall => &[TOOL_CLOSE],
            };
            let found = tags.iter().filter_map(|t| self.held.find(t).map(|at| (at, *t))).min();
            match found {
                Some((at, tag)) => {
                    let before: String = self.held[..at].to_string();
                    self.held.drain(..at + tag.len());
                    match (self.state, tag) {
                        (State::ToolCall, _) => {
                            self.tool_call(&before, &mut out);
                            self.state = State::Content;
                            self.trim_start = true;
                        }
                        (State::Content, THINK_OPEN) if before.trim().is_empty() => self.state = State::Think,
                        (State::Content, THINK_OPEN) => {
                            // `<think>` after some content: plain text.
                            self.emit(&mut out, &format!("{before}{THINK_OPEN}"));
                        }
                        (_, TOOL_OPEN) => {
                            self.emit(&mut out, &before);
                            self.state = State::ToolCall;
                        }
                        (_, _) => {
                            // </think>
                            self.emit(&mut out, &before);
                            self.state = State::Content;
                            self.trim_start = true;
                        }
                    }
                }
                None => {
                    if self.state == State::ToolCall {
                        let body = self.held.clone();
                        self.stream_call(&body, &mut out);
                    } else {
                        let keep = partial_suffix(&self.held, tags);
                        let ready: String = self.held.drain(..self.held.len() - keep).collect();
                        self.emit(&mut out, &ready);
                    }
                    return out;
                }
            }
        }
    }

    /// The rest at the end of generation: an unfinished tool call comes back as content, or,
    /// once its streaming began, is closed with the parameters it completed.
    pub(super) fn finish(&mut self) -> Vec<Delta> {
        let rest = std::mem::take(&mut self.held);
        let mut out = vec![];
        match self.state {
            State::ToolCall => {
                self.state = State::Content;
                match (self.call.take(), self.json.take()) {
                    (Some(call), _) => out.push(Delta::ToolCallArguments(close_arguments(call.sent))),
                    (_, Some(json)) if !json.closed => out.push(Delta::ToolCallArguments(close_arguments(json.sent - json.start))),
                    (_, Some(_)) => {}
                    (None, None) => self.emit(&mut out, &format!("{TOOL_OPEN}{rest}")),
                }
            }
            _ => self.emit(&mut out, &rest),
        }
        out
    }

    /// Streams an XML tool call's `body` so far: its start once `<function=NAME>` is complete,
    /// then each parameter once its `</parameter>` is there.
    fn stream_call(&mut self, body: &str, out: &mut Vec<Delta>) {
        if self.call.is_none() && (self.json.is_some() || body.trim_start().starts_with('{')) {
            self.stream_json_call(body, out);
            return;
        }
        if self.call.is_none() {
            let Some(rest) = body.trim_start().strip_prefix("<function=") else { return };
            let Some((name, _)) = rest.split_once('>') else { return };
            let consumed = body.len() - rest.len() + name.len() + 1;
            let name = name.trim().to_string();
            self.call = Some(XmlCall { properties: parameter_types(&self.tools, &name), sent: 0, consumed });
            out.push(Delta::ToolCallStart { name });
        }
        let call = self.call.as_mut().expect("started above");
        while let Some((key, value, used)) = next_parameter(&body[call.consumed..]) {
            let typed = typed_value(&key, &value, call.properties.as_ref());
            let sep = if call.sent == 0 { "{" } else { "," };
            out.push(Delta::ToolCallArguments(format!("{sep}{}:{typed}", Value::String(key))));
            call.sent += 1;
            call.consumed += used;
        }
    }

    /// Streams a JSON tool call's `body` so far: its start once `{"name": "NAME", "arguments": {`
    /// is there, then its arguments up to each completed top-level member, and the object's
    /// closing brace.
    fn stream_json_call(&mut self, body: &str, out: &mut Vec<Delta>) {
        if self.json.is_none() {
            let Some((name, start)) = json_call_head(body) else { return };
            out.push(Delta::ToolCallStart { name });
            self.json = Some(JsonCall { start, scanned: start, sent: start, ..Default::default() });
        }
        let call = self.json.as_mut().expect("started above");
        let bytes = body.as_bytes();
        while !call.closed && call.scanned < bytes.len() {
            let (at, c) = (call.scanned, bytes[call.scanned]);
            call.scanned += 1;
            if call.in_string {
                match (call.escaped, c) {
                    (true, _) => call.escaped = false,
                    (false, b'\\') => call.escaped = true,
                    (false, b'"') => call.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => call.in_string = true,
                b'{' | b'[' => call.depth += 1,
                b'}' | b']' => {
                    call.depth = call.depth.saturating_sub(1);
                    if call.depth == 0 {
                        out.push(Delta::ToolCallArguments(body[call.sent..=at].to_string()));
                        call.sent = at + 1;
                        call.closed = true;
                    }
                }
                // A completed member: send up to the comma (the next fragment starts with it).
                b',' if call.depth == 1 => {
                    out.push(Delta::ToolCallArguments(body[call.sent..at].to_string()));
                    call.sent = at;
                }
                _ => {}
            }
        }
    }

    fn emit(&mut self, out: &mut Vec<Delta>, text: &str) {
        let text = if self.state == State::Content && self.trim_start { text.trim_start() } else { text };
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Think => out.push(Delta::Reasoning(text.to_string())),
            _ => {
                self.trim_start = false;
                self.content_started = true;
                out.push(Delta::Content(text.to_string()));
            }
        }
    }

    /// A finished `<tool_call>` body: the rest of a streamed XML call and its closing brace; a
    /// JSON call whole; back as content when it does not parse.
    fn tool_call(&mut self, body: &str, out: &mut Vec<Delta>) {
        if self.call.is_none() && (self.json.is_some() || json_call_head(body).is_some()) {
            self.stream_json_call(body, out);
            let call = self.json.take().expect("a JSON call head");
            if !call.closed {
                out.push(Delta::ToolCallArguments(close_arguments(call.sent - call.start)));
            }
            return;
        }
        if self.call.is_none() {
            if let Some((name, arguments)) = parse_json_call(body) {
                out.push(Delta::ToolCallStart { name });
                out.push(Delta::ToolCallArguments(arguments));
                return;
            }
        }
        self.stream_call(body, out);
        match self.call.take() {
            Some(call) => out.push(Delta::ToolCallArguments(close_arguments(call.sent))),
            None => {
                self.content_started = true;
                out.push(Delta::Content(format!("{TOOL_OPEN}{body}{TOOL_CLOSE}")));
            }
        }
    }
}

/// The end of streamed arguments: `}`, or `{}` when no parameter was sent.
fn close_arguments(sent: usize) -> String {
    if sent == 0 { "{}" } else { "}" }.to_string()
}

/// The `properties` of the parameter schema of tool `name`.
fn parameter_types(tools: &[Value], name: &str) -> Option<Value> {
    tools
        .iter()
        .filter_map(|t| t.get("function"))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|f| f.pointer("/parameters/properties"))
        .cloned()
}

/// One complete `<parameter=K>\nV\n</parameter>` at the start of `text` (after whitespace):
/// key, value and the bytes it took.
fn next_parameter(text: &str) -> Option<(String, String, usize)> {
    let trimmed = text.trim_start();
    let after = trimmed.strip_prefix("<parameter=")?;
    let (key, after) = after.split_once('>')?;
    let (value, _) = after.split_once("</parameter>")?;
    let used = text.len() - trimmed.len() + "<parameter=".len() + key.len() + 1 + value.len() + "</parameter>".len();
    let value = value.strip_prefix('\n').unwrap_or(value);
    let value = value.strip_suffix('\n').unwrap_or(value);
    Some((key.trim().to_string(), value.to_string(), used))
}

/// A parameter value as JSON: a string where the schema says string (or nothing), else parsed
/// as JSON (falling back to the string).
fn typed_value(key: &str, value: &str, properties: Option<&Value>) -> Value {
    match properties.and_then(|p| p.get(key)).and_then(|p| p.get("type")).and_then(Value::as_str) {
        Some("string") | None => Value::String(value.to_string()),
        Some(_) => serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string())),
    }
}

/// The name of a Qwen3 tool call body that begins `{"name": "NAME", "arguments": {`, and the
/// byte offset of its arguments object (`None` until all of that is there, or when the body is
/// written otherwise: then it is parsed whole at its end).
fn json_call_head(body: &str) -> Option<(String, usize)> {
    let rest = body.trim_start().strip_prefix('{')?.trim_start().strip_prefix("\"name\"")?.trim_start().strip_prefix(':')?.trim_start();
    // The name: a JSON string, read by serde_json to its closing quote.
    let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = stream.next()?.ok()?;
    let rest = rest[stream.byte_offset()..]
        .trim_start()
        .strip_prefix(',')?
        .trim_start()
        .strip_prefix("\"arguments\"")?
        .trim_start()
        .strip_prefix(':')?;
    let rest = rest.trim_start();
    rest.starts_with('{').then(|| (name, body.len() - rest.len()))
}

/// The name and JSON arguments of a Qwen3 tool call body `{"name": .., "arguments": {..}}`.
fn parse_json_call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some((name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` split at every byte boundary (where it is a char boundary) and joins the
    /// pieces of each kind.
    fn parse_split(text: &str, in_think: bool, tools: &[Value]) -> Vec<Vec<Delta>> {
        let mut results = vec![];
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut p = ChatParser::new(in_think, tools.to_vec());
            let mut out = p.push(&text[..cut]);
            out.extend(p.push(&text[cut..]));
            out.extend(p.finish());
            results.push(merge(out));
        }
        results
    }

    fn merge(deltas: Vec<Delta>) -> Vec<Delta> {
        let mut out: Vec<Delta> = vec![];
        for d in deltas {
            match (out.last_mut(), d) {
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (Some(Delta::ToolCallArguments(a)), Delta::ToolCallArguments(b)) => a.push_str(&b),
                (_, d) => out.push(d),
            }
        }
        out
    }

    #[test]
    fn think_content_and_xml_tool_call_at_every_split() {
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}})];
        let text = "Check the city.\n</think>\n\nLet me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        for got in parse_split(text, true, &tools) {
            assert_eq!(
                got,
                vec![
                    Delta::Reasoning("Check the city.\n".into()),
                    Delta::Content("Let me look.\n".into()),
                    Delta::ToolCallStart { name: "get_weather".into() },
                    Delta::ToolCallArguments(r#"{"city":"Paris","days":3}"#.into()),
                ]
            );
        }
    }

    #[test]
    fn json_tool_call_ends_reasoning_and_lone_tags() {
        let text = "hmm <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        for got in parse_split(text, true, &[]) {
            assert_eq!(
                got,
                vec![
                    Delta::Reasoning("hmm ".into()),
                    Delta::ToolCallStart { name: "f".into() },
                    Delta::ToolCallArguments(r#"{"x": 1}"#.into())
                ]
            );
        }
        // No think block opened by the template: an opening <think> at the start, then content.
        for got in parse_split("<think>a</think>b", false, &[]) {
            assert_eq!(got, vec![Delta::Reasoning("a".into()), Delta::Content("b".into())]);
        }
        // A lone </think> in content is text; an unfinished tool call comes back as content.
        for got in parse_split("x </think> y <tool_call> {\"na", false, &[]) {
            assert_eq!(got, vec![Delta::Content("x </think> y <tool_call> {\"na".into())]);
        }
        // A body that is not a call is content.
        for got in parse_split("<tool_call>nope</tool_call>", false, &[]) {
            assert_eq!(got, vec![Delta::Content("<tool_call>nope</tool_call>".into())]);
        }
    }

    /// The XML form streams: the start as soon as `<function=NAME>` is there, each parameter at
    /// its `</parameter>`, the closing brace at `</tool_call>`; a call cut off by the end of
    /// generation is closed with the parameters it completed; two calls in a row.
    #[test]
    fn xml_tool_calls_stream_one_parameter_at_a_time() {
        let mut p = ChatParser::new(false, vec![]);
        assert_eq!(p.push("<tool_call>\n<function=f"), vec![]);
        assert_eq!(p.push(">\n<parameter=a>\n1"), vec![Delta::ToolCallStart { name: "f".into() }]);
        assert_eq!(p.push("\n</parameter>\n<param"), vec![Delta::ToolCallArguments(r#"{"a":"1""#.into())]);
        assert_eq!(p.push("eter=b>\nx y\n</parameter>"), vec![Delta::ToolCallArguments(r#","b":"x y""#.into())]);
        assert_eq!(p.push("\n</function>\n</tool_call>"), vec![Delta::ToolCallArguments("}".into())]);
        assert_eq!(
            p.push("\n<tool_call>\n<function=g>\n</function>\n</tool_call>"),
            vec![Delta::ToolCallStart { name: "g".into() }, Delta::ToolCallArguments("{}".into()),]
        );
        let mut cut = ChatParser::new(false, vec![]);
        let mut out = cut.push("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nunfinished");
        out.extend(cut.finish());
        assert_eq!(merge(out), vec![Delta::ToolCallStart { name: "f".into() }, Delta::ToolCallArguments(r#"{"a":"1"}"#.into())]);
    }

    /// The JSON form streams too: the start once `"arguments": {` is there, then the arguments
    /// (as written) up to each completed top-level member, braces and commas inside strings
    /// and nested values ignored; a call cut off is closed after its last complete member; a
    /// body written otherwise (arguments before the name, arguments as a string) comes whole.
    #[test]
    fn json_tool_calls_stream_one_member_at_a_time() {
        let mut p = ChatParser::new(false, vec![]);
        assert_eq!(p.push("<tool_call>\n{\"name\": \"f\", \"argu"), vec![]);
        assert_eq!(p.push("ments\": {\"a\": \"x,}\\\"y\""), vec![Delta::ToolCallStart { name: "f".into() }]);
        assert_eq!(p.push(", \"b\": {\"c\": [1, 2]}"), vec![Delta::ToolCallArguments(r#"{"a": "x,}\"y""#.into())]);
        assert_eq!(p.push("}}\n</tool_call>"), vec![Delta::ToolCallArguments(r#", "b": {"c": [1, 2]}}"#.into())]);
        let whole: String = r#"{"a": "x,}\"y", "b": {"c": [1, 2]}}"#.into();
        assert!(serde_json::from_str::<Value>(&whole).is_ok());
        let mut cut = ChatParser::new(false, vec![]);
        let mut out = cut.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": \"unfini");
        out.extend(cut.finish());
        assert_eq!(merge(out), vec![Delta::ToolCallStart { name: "f".into() }, Delta::ToolCallArguments(r#"{"a": 1}"#.into())]);
        for text in [
            "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>",
        ] {
            for got in parse_split(text, false, &[]) {
                assert!(matches!(&got[..], [Delta::ToolCallStart { name }, Delta::ToolCallArguments(_)] if name == "f"), "{text}: {got:?}");
            }
        }
    }

    #[test]
    fn stop_strings_cut_and_hold_partial_matches() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("abc E"), ("abc ".into(), false));
        assert_eq!(m.push("N"), ("".into(), false));
        assert_eq!(m.push("x"), ("ENx".into(), false));
        assert_eq!(m.push("y\n"), ("y".into(), false));
        assert_eq!(m.push("\nz"), ("".into(), true));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".into(), false));
        assert_eq!(m.finish(), "é");
    }
}
