//! Tool calls (OpenAI function calling) in the text of a chat: the [`ToolCall`] of a message,
//! and the per-family [`ToolCallFormat`] that finds calls in what a model wrote.
//!
//! Two families cover the templates stepppo knows: [`ToolCallFormat::Hermes`] (Qwen 2.5 and 3,
//! and the built-in template) writes each call as `<tool_call>\n{"name": …, "arguments": {…}}
//! \n</tool_call>` after optional text; [`ToolCallFormat::Llama3Json`] (Llama 3.1 and later)
//! writes the whole reply as `{"name": …, "parameters": {…}}`, optionally after
//! `<|python_tag|>`, one call per reply (its template refuses a message with several; a JSON
//! reply without a `name` that is not tagged is plain content). The format is read from the template
//! itself. Parsing never fails: a reply is plain content, a list of calls (with the content
//! before them), or — when it tries to call and the call does not parse (an unclosed tag,
//! invalid JSON, an unknown function, arguments that are not an object) — plain content with
//! the reason, which the gateway returns as text and records as a tool-call error.
//! The built-in template renders tools in the Hermes way ([`builtin_tools_system`],
//! [`builtin_call_text`], [`builtin_tool_results`]).

use serde_json::Value;

/// One call of an assistant turn: its id, the function's name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Id that the tool's result message refers back to.
    pub id: String,
    /// Name of the function called.
    pub name: String,
    /// The arguments object as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// A call with the given id, function name and JSON arguments text.
    pub fn new(id: &str, name: &str, arguments: &str) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }
}

/// How a template family writes a call in a model's reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": "f", "arguments": {…}}\n</tool_call>` blocks after optional text.
    Hermes,
    /// The whole reply `{"name": "f", "parameters": {…}}`, one call.
    Llama3Json,
}

/// A call found in a reply (no id yet: the gateway gives each one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// Name of the function called.
    pub name: String,
    /// The arguments object as compact JSON text, keys in the order written.
    pub arguments: String,
}

/// What a reply says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParsedReply {
    /// No call attempted: the text is the content.
    Content,
    /// Calls, and the text before them as written (what a stream sent; `None` when blank).
    Calls {
        /// Text before the first call; `None` when blank.
        content: Option<String>,
        /// The calls in the order written (at least one).
        calls: Vec<ParsedCall>,
    },
    /// A call was attempted and did not parse: the text is returned as content.
    Malformed {
        /// Why the call did not parse.
        reason: String,
    },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolCallFormat {
    /// The format of a chat template's source (`None`: the built-in template, Hermes); `Err`
    /// when the template renders no tool calls stepppo can read.
    pub fn of_template(source: Option<&str>) -> Result<Self, String> {
        let Some(source) = source else {
            return Ok(Self::Hermes);
        };
        if source.contains("<function=") {
            Err(
                "the chat template writes XML tool calls (`<function=…>`, as Qwen3-Coder's), \
                 which stepppo does not parse"
                    .into(),
            )
        } else if source.contains(HERMES_OPEN) {
            Ok(Self::Hermes)
        } else if source.contains("\"parameters\": ") || source.contains(PYTHON_TAG) {
            Ok(Self::Llama3Json)
        } else {
            Err(
                "the chat template writes no tool calls in a format stepppo parses \
                 (Hermes `<tool_call>` blocks, as Qwen's, or Llama 3's JSON calls)"
                    .into(),
            )
        }
    }

    /// Finds the calls in `text`, the reply of a request offering the functions `known`.
    pub fn parse(self, text: &str, known: &[&str]) -> ParsedReply {
        let reply = self.find_calls(text);
        if let ParsedReply::Calls { calls, .. } = &reply {
            if let Some(unknown) = calls.iter().find(|c| !known.contains(&c.name.as_str())) {
                return ParsedReply::Malformed {
                    reason: format!("call of unknown function `{}`", unknown.name),
                };
            }
        }
        reply
    }

    /// Finds the calls in `text` whatever functions they name (for showing a recorded reply).
    pub fn find_calls(self, text: &str) -> ParsedReply {
        let parsed = match self {
            Self::Hermes => parse_hermes(text),
            Self::Llama3Json => parse_llama3(text),
        };
        match parsed {
            Ok(None) => ParsedReply::Content,
            Ok(Some((content, calls))) => ParsedReply::Calls { content, calls },
            Err(reason) => ParsedReply::Malformed { reason },
        }
    }

    /// Byte offset in streamed `text` from which it may be a call, so is held back from the
    /// content stream until the reply ends (`None`: all of it is content so far).
    pub fn call_start(self, text: &str) -> Option<usize> {
        match self {
            Self::Hermes => text
                .find(HERMES_OPEN)
                .or_else(|| partial_suffix(text, HERMES_OPEN)),
            Self::Llama3Json => {
                let lead = text.len() - text.trim_start().len();
                let rest = &text[lead..];
                (rest.is_empty()
                    || rest.starts_with('{')
                    || rest.starts_with(PYTHON_TAG)
                    || PYTHON_TAG.starts_with(rest))
                .then_some(0)
            }
        }
    }

    /// The text that opens a call of `name` — what `tool_choice` forces a reply to begin with
    /// (then the arguments follow). It stops after the colon, so the space before the arguments
    /// comes with them as the tokenizer writes ` {` (a forced lone space token would be a split
    /// the model never saw).
    pub fn call_opening(self, name: &str) -> String {
        let name = json_string(name);
        match self {
            Self::Hermes => format!("{HERMES_OPEN}\n{{\"name\": {name}, \"arguments\":"),
            Self::Llama3Json => format!("{{\"name\": {name}, \"parameters\":"),
        }
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialise")
}

/// Start of the longest proper prefix of `marker` that `text` ends with.
fn partial_suffix(text: &str, marker: &str) -> Option<usize> {
    (1..marker.len())
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .map(|k| text.len() - k)
}

type Found = Option<(Option<String>, Vec<ParsedCall>)>;

fn parse_hermes(text: &str) -> Result<Found, String> {
    let Some(first) = text.find(HERMES_OPEN) else {
        if text.contains(HERMES_CLOSE) {
            return Err(format!("`{HERMES_CLOSE}` without `{HERMES_OPEN}`"));
        }
        return Ok(None);
    };
    let content = Some(&text[..first]).filter(|c| !c.trim().is_empty());
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(after_open) = rest.strip_prefix(HERMES_OPEN) {
        let Some(end) = after_open.find(HERMES_CLOSE) else {
            return Err(format!("call {} has no `{HERMES_CLOSE}`", calls.len() + 1));
        };
        let body = &after_open[..end];
        if body.contains(HERMES_OPEN) {
            return Err(format!("call {} opens a call inside it", calls.len() + 1));
        }
        calls.push(call_object(body.trim(), "arguments", calls.len() + 1)?);
        rest = after_open[end + HERMES_CLOSE.len()..].trim_start();
    }
    if !rest.trim().is_empty() {
        return Err(format!(
            "text after the last `{HERMES_CLOSE}`: {:?}",
            clip(rest.trim())
        ));
    }
    Ok(Some((content.map(str::to_string), calls)))
}

fn parse_llama3(text: &str) -> Result<Found, String> {
    let trimmed = text.trim();
    let (tagged, body) = match trimmed.strip_prefix(PYTHON_TAG) {
        Some(rest) => (true, rest.trim_start()),
        None => (false, trimmed),
    };
    if !body.starts_with('{') {
        return Ok(None);
    }
    if !tagged && !names_a_function(body) {
        return Ok(None);
    }
    let mut stream = serde_json::Deserializer::from_str(body).into_iter::<Value>();
    if let Some(Err(e)) = stream.next() {
        return Err(format!("call 1 is not JSON: {e}"));
    }
    let consumed = stream.byte_offset();
    let rest = body[consumed..].trim_start();
    if !rest.is_empty() {
        return Err(format!(
            "text after the call (Llama 3's template renders one call per message): {:?}",
            clip(rest)
        ));
    }
    Ok(Some((
        None,
        vec![call_object(&body[..consumed], "parameters", 1)?],
    )))
}

/// Whether an untagged JSON reply means to call: it has a top-level `"name"` key, or is not JSON
/// at all (cut or broken, so nothing else it could be).
fn names_a_function(body: &str) -> bool {
    let mut stream = serde_json::Deserializer::from_str(body).into_iter::<Value>();
    match stream.next() {
        Some(Ok(Value::Object(object))) => object.contains_key("name"),
        Some(Ok(_)) => false,
        _ => true,
    }
}

/// One call object `{"name": "f", "<arguments_key>": {…}}` (`arguments` also read for Llama).
fn call_object(json: &str, arguments_key: &str, n: usize) -> Result<ParsedCall, String> {
    let value: Value =
        serde_json::from_str(json).map_err(|e| format!("call {n} is not JSON: {e}"))?;
    let Value::Object(mut object) = value else {
        return Err(format!("call {n} is not a JSON object"));
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.is_empty() => name,
        _ => return Err(format!("call {n} has no function `name` string")),
    };
    let arguments = object
        .remove(arguments_key)
        .or_else(|| object.remove("arguments"));
    match arguments {
        Some(Value::Object(_)) => {}
        None => return Err(format!("call {n} has no `{arguments_key}`")),
        Some(_) => return Err(format!("call {n}: `{arguments_key}` is not an object")),
    }
    // Re-read the arguments from the text so their keys keep the order written.
    let arguments = raw_member(json, arguments_key)
        .or_else(|| raw_member(json, "arguments"))
        .ok_or_else(|| format!("call {n}: `{arguments_key}` could not be read back"))?;
    Ok(ParsedCall { name, arguments })
}

/// The compact JSON text of member `key` of the object `json`, in the order written.
fn raw_member(json: &str, key: &str) -> Option<String> {
    let members: std::collections::HashMap<String, &serde_json::value::RawValue> =
        serde_json::from_str(json).ok()?;
    let raw = members.get(key)?;
    Some(compact(raw.get()))
}

/// `json` without insignificant whitespace, keys in their order.
fn compact(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in json.chars() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    out
}

/// At most 80 characters of `text`, for error messages.
fn clip(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// The system message of the built-in template when tools are offered: `system` (or a default)
/// followed by the function schemas in Qwen 2.5's Hermes layout.
pub fn builtin_tools_system(system: Option<&str>, tools: &[String]) -> String {
    let mut text = system.unwrap_or("You are a helpful assistant.").to_string();
    text.push_str(
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        text.push('\n');
        text.push_str(&compact(tool));
    }
    text.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    text
}

/// An assistant turn of the built-in template: its text, then each call as a Hermes block.
pub fn builtin_call_text(content: Option<&str>, calls: &[ToolCall]) -> String {
    let mut text = content.unwrap_or_default().to_string();
    for call in calls {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!(
            "{HERMES_OPEN}\n{{\"name\": {}, \"arguments\": {}}}\n{HERMES_CLOSE}",
            json_string(&call.name),
            arguments_json(&call.arguments)
        ));
    }
    text
}

/// A call's arguments as the built-in template writes them: compact JSON when they are JSON,
/// else the text as a JSON string (as the checkpoint templates' `tojson` writes a string).
fn arguments_json(arguments: &str) -> String {
    match serde_json::from_str::<serde::de::IgnoredAny>(arguments) {
        Ok(_) => compact(arguments),
        Err(_) => json_string(arguments),
    }
}

/// Everything the built-in template writes around calls of `tools` (OpenAI tool JSON texts),
/// as one text: the system block with their schemas, a call of each function with its
/// parameters, and a tool result. A tool-mode run's built-in tokenizer holds its pieces whole
/// ([`crate::tokenizer::builtin_pieces_of`]), as real tokenizers hold their tool markup, so a
/// call costs the model about a dozen tokens instead of fifty bytes.
pub fn builtin_tool_text(tools: &[String]) -> String {
    let calls: Vec<ToolCall> = tools.iter().filter_map(|tool| example_call(tool)).collect();
    [
        builtin_tools_system(None, tools),
        builtin_call_text(None, &calls),
        builtin_tool_results(["x"]),
    ]
    .join("\n")
}

/// A call of the function `tool` describes, each parameter given `"x"`; `None` for a tool text
/// that names no function (the template renders it as it is).
fn example_call(tool: &str) -> Option<ToolCall> {
    let tool: serde_json::Value = serde_json::from_str(tool).ok()?;
    let function = tool.get("function").unwrap_or(&tool);
    let name = function.get("name")?.as_str()?;
    let parameters: serde_json::Map<String, serde_json::Value> = function
        .pointer("/parameters/properties")
        .and_then(|p| p.as_object())
        .map(|p| p.keys().map(|k| (k.clone(), "x".into())).collect())
        .unwrap_or_default();
    let arguments = serde_json::Value::Object(parameters).to_string();
    Some(ToolCall::new("", name, &arguments))
}

/// Consecutive tool results of the built-in template, as one user turn's text.
pub fn builtin_tool_results<'a>(results: impl IntoIterator<Item = &'a str>) -> String {
    results
        .into_iter()
        .map(|r| format!("<tool_response>\n{r}\n</tool_response>"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: [&str; 2] = ["search", "answer"];

    fn calls(reply: ParsedReply) -> (Option<String>, Vec<(String, String)>) {
        match reply {
            ParsedReply::Calls { content, calls } => (
                content,
                calls.into_iter().map(|c| (c.name, c.arguments)).collect(),
            ),
            other => panic!("expected calls, got {other:?}"),
        }
    }

    fn malformed(reply: ParsedReply) -> String {
        match reply {
            ParsedReply::Malformed { reason } => reason,
            other => panic!("expected a malformed call, got {other:?}"),
        }
    }

    #[test]
    fn hermes_calls_and_the_text_before_them() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a b\", \"k\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"answer\", \"arguments\": {}}\n</tool_call>";
        let (content, found) = calls(ToolCallFormat::Hermes.parse(text, &KNOWN));
        assert_eq!(content.as_deref(), Some("Let me look.\n"), "as streamed");
        assert_eq!(
            found,
            vec![
                ("search".into(), r#"{"q":"a b","k":2}"#.into()),
                ("answer".into(), "{}".into())
            ]
        );
        assert_eq!(
            ToolCallFormat::Hermes.parse("just words", &KNOWN),
            ParsedReply::Content
        );
    }

    #[test]
    fn hostile_hermes_texts_come_back_as_content_with_a_reason() {
        let h = ToolCallFormat::Hermes;
        let cases = [
            (
                "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}",
                "no `</tool_call>`",
            ),
            (
                "<tool_call>{\"name\": \"search\", \"arguments\": {</tool_call>",
                "not JSON",
            ),
            (
                "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
                "unknown function `rm_rf`",
            ),
            (
                "<tool_call>{\"name\": \"search\", \"arguments\": \"q\"}</tool_call>",
                "not an object",
            ),
            (
                "<tool_call>{\"name\": \"search\"}</tool_call>",
                "no `arguments`",
            ),
            ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
            (
                "<tool_call>{\"arguments\": {}}</tool_call>",
                "no function `name`",
            ),
            ("done</tool_call>", "without `<tool_call>`"),
            (
                "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call> and more",
                "text after",
            ),
            ("<tool_call><tool_call>{}</tool_call>", "inside it"),
        ];
        for (text, expected) in cases {
            let reason = malformed(h.parse(text, &KNOWN));
            assert!(reason.contains(expected), "{text:?}: {reason}");
        }
    }

    #[test]
    fn a_megabyte_of_arguments_parses_in_linear_time() {
        let big = "x".repeat(1 << 20);
        let text = format!(
            "<tool_call>\n{{\"name\": \"search\", \"arguments\": {{\"q\": \"{big}\"}}}}\n</tool_call>"
        );
        let start = std::time::Instant::now();
        let (_, found) = calls(ToolCallFormat::Hermes.parse(&text, &KNOWN));
        assert_eq!(found[0].1.len(), big.len() + 8);
        let unclosed = &text[..text.len() - HERMES_CLOSE.len()];
        malformed(ToolCallFormat::Hermes.parse(unclosed, &KNOWN));
        assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
    }

    #[test]
    fn llama3_json_calls() {
        let l = ToolCallFormat::Llama3Json;
        let (content, found) = calls(l.parse(
            "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"x\"}}",
            &KNOWN,
        ));
        assert_eq!(content, None);
        assert_eq!(found, [("search".into(), r#"{"q":"x"}"#.into())]);
        let (_, untagged) =
            calls(l.parse("{\"name\": \"answer\", \"parameters\": {\"t\": 1}}", &KNOWN));
        assert_eq!(untagged, [("answer".into(), r#"{"t":1}"#.into())]);
        assert_eq!(l.parse("Paris.", &KNOWN), ParsedReply::Content);
        assert_eq!(
            l.parse("{\"answer\": 42}", &KNOWN),
            ParsedReply::Content,
            "a JSON answer is not a call"
        );
        assert!(malformed(l.parse(
            "{\"name\": \"search\", \"parameters\": {}}; {\"name\": \"answer\", \"parameters\": {}}",
            &KNOWN
        ))
        .contains("one call per message"));
        assert!(
            malformed(l.parse("{\"name\": \"search\", \"parameters\": {", &KNOWN))
                .contains("not JSON")
        );
        assert!(malformed(l.parse(
            "{\"name\": \"search\", \"parameters\": {}} trailing",
            &KNOWN
        ))
        .contains("text after"));
    }

    #[test]
    fn streaming_holds_back_what_may_be_a_call() {
        let h = ToolCallFormat::Hermes;
        assert_eq!(h.call_start("Let me <tool_c"), Some(7));
        assert_eq!(h.call_start("Let me <tool_call>{"), Some(7));
        assert_eq!(h.call_start("Let me look"), None);
        let l = ToolCallFormat::Llama3Json;
        assert_eq!(l.call_start("  {\"na"), Some(0));
        assert_eq!(l.call_start("<|pyt"), Some(0));
        assert_eq!(l.call_start("Paris"), None);
    }

    #[test]
    fn formats_are_read_from_templates() {
        assert_eq!(
            ToolCallFormat::of_template(None),
            Ok(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::of_template(Some("{{- '<tool_call>\\n' }}")),
            Ok(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::of_template(Some("{{- '\"parameters\": ' }}")),
            Ok(ToolCallFormat::Llama3Json)
        );
        assert!(ToolCallFormat::of_template(Some("{{ messages }}")).is_err());
        let xml = "{{- '<tool_call>\\n<function=' + name + '>' }}";
        assert!(ToolCallFormat::of_template(Some(xml))
            .unwrap_err()
            .contains("XML"));
        assert_eq!(
            ToolCallFormat::Hermes.call_opening("search"),
            "<tool_call>\n{\"name\": \"search\", \"arguments\":"
        );
    }

    #[test]
    fn builtin_calls_keep_arguments_that_are_not_json() {
        let calls = [
            ToolCall::new("a", "search", "{ \"q\" : \"x y\" }"),
            ToolCall::new("b", "search", "hello world"),
        ];
        assert_eq!(
            builtin_call_text(None, &calls),
            "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\":\"x y\"}}\n</tool_call>\n\
             <tool_call>\n{\"name\": \"search\", \"arguments\": \"hello world\"}\n</tool_call>"
        );
    }

    #[test]
    fn compact_keeps_strings_and_order() {
        assert_eq!(
            compact("{ \"b\" : [1, 2],\n \"a\": \"x y\\\" z\" }"),
            "{\"b\":[1,2],\"a\":\"x y\\\" z\"}"
        );
    }
}
