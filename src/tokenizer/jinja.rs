//! A checkpoint's own chat template (`chat_template` in `tokenizer_config.json`, or
//! `chat_template.jinja`) rendered with `minijinja` the way transformers' `apply_chat_template`
//! renders it: `trim_blocks` and `lstrip_blocks` on, Python string methods (`.strip()`,
//! `.startswith()`, …) through `minijinja-contrib`'s pycompat, `raise_exception`, the special
//! token strings as variables, `tools` (the function schemas as sent, or none) and `documents`
//! (none), transformers' own `tojson` (Python's `json.dumps` with `ensure_ascii=False`: `", "` and
//! `": "` separators, keys in the order sent, nothing HTML-escaped), and `strftime_now(format)`
//! (Llama 3.x templates date their system prompt; the clock is read in UTC, common `strftime`
//! directives only, others an error). Messages reach the template as transformers receives them:
//! `content` absent when the client sent null (transformers drops None-valued keys), `tool_calls` (with `arguments` as a JSON object when
//! they parse as one, as vLLM passes them), `tool_call_id` and `name` only when present. It
//! renders text only; [`super::ChatTemplate`] turns the renders into the token pieces the rollout
//! appends.

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};

use super::tool_calls::ToolCall;
use super::{Result, TokenizerError};

/// One chat message as templates see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: &'a str,
    /// `None`: the client sent `content: null` (an assistant turn that only calls tools).
    pub content: Option<&'a str>,
    /// The calls of an assistant turn (absent from the template's view when empty).
    pub tool_calls: &'a [ToolCall],
    /// The call a `tool` message answers.
    pub tool_call_id: Option<&'a str>,
    /// The function a `tool` message answers, or a participant name.
    pub name: Option<&'a str>,
}

impl<'a> Message<'a> {
    /// A plain message: `role` and text `content`.
    pub fn text(role: &'a str, content: &'a str) -> Self {
        Self {
            role,
            content: Some(content),
            tool_calls: &[],
            tool_call_id: None,
            name: None,
        }
    }

    /// The message as transformers hands it to the template: absent keys stay undefined, and a
    /// null content is dropped as transformers drops every None-valued key.
    fn value(&self) -> Value {
        let mut entries: Vec<(&str, Value)> = vec![("role", Value::from(self.role))];
        if let Some(content) = self.content {
            entries.push(("content", Value::from(content)));
        }
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.iter().map(|c| {
                let function = Value::from_iter([
                    ("name", Value::from(c.name.as_str())),
                    ("arguments", arguments_value(&c.arguments)),
                ]);
                Value::from_iter([
                    ("id", Value::from(c.id.as_str())),
                    ("type", Value::from("function")),
                    ("function", function),
                ])
            });
            entries.push(("tool_calls", calls.collect()));
        }
        if let Some(id) = self.tool_call_id {
            entries.push(("tool_call_id", Value::from(id)));
        }
        if let Some(name) = self.name {
            entries.push(("name", Value::from(name)));
        }
        Value::from_iter(entries)
    }
}

/// A call's `arguments` JSON text as the template sees it: the parsed object (keys in the order
/// written) when it is one, else the text itself.
fn arguments_value(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v) if v.kind() == minijinja::value::ValueKind::Map => v,
        _ => Value::from(arguments),
    }
}

/// A compiled chat template and the special-token strings it may reference.
#[derive(Debug)]
pub struct JinjaTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl JinjaTemplate {
    /// Compiles `source` (from `origin`, a file named in errors).
    pub fn new(source: String, origin: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| template_error(origin, &e))?;
        Ok(Self {
            env,
            source,
            origin: origin.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template text, for saving it with an exported checkpoint.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text `apply_chat_template(messages, tools=…, add_generation_prompt=…,
    /// tokenize=False)` gives; `tools` are the function schemas' JSON texts as the client sent
    /// them (none: `tools` is none, as transformers passes it).
    pub fn render(
        &self,
        messages: &[Message],
        tools: &[String],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.origin, &e))?;
        let tools = if tools.is_empty() {
            Value::from(())
        } else {
            tools
                .iter()
                .map(|t| serde_json::from_str::<Value>(t))
                .collect::<std::result::Result<Value, _>>()
                .map_err(|e| TokenizerError::Template {
                    path: self.origin.clone(),
                    message: format!("a tool schema is not JSON: {e}"),
                })?
        };
        template
            .render(minijinja::context! {
                messages => messages.iter().map(Message::value).collect::<Value>(),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                tools => tools,
                documents => Value::from(()),
            })
            .map_err(|e| template_error(&self.origin, &e))
    }

    /// The file the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn python_tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let invalid = |m: String| minijinja::Error::new(ErrorKind::InvalidOperation, m);
    if ensure_ascii == Some(true) {
        return Err(invalid("tojson: ensure_ascii=True is not supported".into()));
    }
    let (item_sep, key_sep) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(invalid("tojson: separators is a pair of strings".into())),
    };
    let json: serde_json::Value = if sort_keys == Some(true) {
        // serde_json's own maps are sorted by key.
        serde_json::to_value(value).map_err(|e| invalid(format!("tojson: {e}")))?
    } else {
        return python_json(value, indent, &item_sep, &key_sep).map(Value::from_safe_string);
    };
    python_json(&json, indent, &item_sep, &key_sep).map(Value::from_safe_string)
}

/// `value` serialised as Python's `json.dumps` writes it (`ensure_ascii=False`).
fn python_json(
    value: &impl serde::Serialize,
    indent: Option<usize>,
    item_sep: &str,
    key_sep: &str,
) -> std::result::Result<String, minijinja::Error> {
    let mut out = Vec::new();
    let formatter = PythonJson {
        indent,
        item_sep: item_sep.as_bytes(),
        key_sep: key_sep.as_bytes(),
        open_has_items: Vec::new(),
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    value
        .serialize(&mut ser)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// A `serde_json` formatter writing Python's `json.dumps` layout: its separators, its
/// indentation and its float spelling (`1e-05`, `1e+20`, `1.0`).
struct PythonJson<'a> {
    indent: Option<usize>,
    item_sep: &'a [u8],
    key_sep: &'a [u8],
    /// Per open container: whether it has an item yet (an empty one closes on the same line).
    open_has_items: Vec<bool>,
}

impl PythonJson<'_> {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            w.write_all(" ".repeat(n * self.open_has_items.len()).as_bytes())?;
        }
        Ok(())
    }

    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.open_has_items.push(false);
        w.write_all(b)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        if self.open_has_items.pop() == Some(true) {
            self.newline(w)?;
        }
        w.write_all(b)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item_sep)?;
        }
        if let Some(top) = self.open_has_items.last_mut() {
            *top = true;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PythonJson<'_> {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key_sep)
    }
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, x: f64) -> std::io::Result<()> {
        w.write_all(python_float(x).as_bytes())
    }
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, x: f32) -> std::io::Result<()> {
        w.write_all(python_float(f64::from(x)).as_bytes())
    }
}

/// Python's `repr(float)`: the shortest round-trip digits, fixed notation for exponents in
/// [-4, 16), else `d.ddde±XX`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "1.5e-7", "1e20", "-2.5e0".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    if (-4..16).contains(&exp) {
        let fixed = format!("{x}");
        return if fixed.contains('.') {
            fixed
        } else {
            format!("{fixed}.0")
        };
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

/// Python's `datetime.now().strftime(format)`, in UTC.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, now).map_err(|m| minijinja::Error::new(ErrorKind::InvalidOperation, m))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// `format` with the directives `%d %m %Y %y %b %B %a %A %H %M %S %j %%` filled in for the UTC
/// time `unix_secs`; any other directive is an error naming it.
fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, String> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = WEEKDAYS[(days + 4).rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let year_start = days - days_from_civil(year, 1, 1);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let field = match chars.next() {
            Some('d') => format!("{day:02}"),
            Some('m') => format!("{month:02}"),
            Some('Y') => year.to_string(),
            Some('y') => format!("{:02}", year.rem_euclid(100)),
            Some('b') => month_name[..3].to_string(),
            Some('B') => month_name.to_string(),
            Some('a') => weekday[..3].to_string(),
            Some('A') => weekday.to_string(),
            Some('H') => format!("{:02}", secs / 3600),
            Some('M') => format!("{:02}", secs / 60 % 60),
            Some('S') => format!("{:02}", secs % 60),
            Some('j') => format!("{:03}", year_start + 1),
            Some('%') => "%".to_string(),
            other => {
                return Err(format!(
                    "strftime_now: directive %{} is not supported",
                    other.map(String::from).unwrap_or_default()
                ))
            }
        };
        out.push_str(&field);
    }
    Ok(out)
}

/// (year, month 1–12, day 1–31) of the day `days` after 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Days from 1970-01-01 to the given date (the inverse of [`civil_from_days`]).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn template_error(origin: &str, e: &minijinja::Error) -> TokenizerError {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    TokenizerError::Template {
        path: origin.to_string(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python_for_known_dates() {
        // 2024-07-26 13:25:09 UTC (a Friday, day 208) and 2000-02-29, as Python formats them.
        assert_eq!(
            strftime("%d %b %Y|%A %a|%B %m %y|%H:%M:%S|%j|%%", 1_722_000_309).unwrap(),
            "26 Jul 2024|Friday Fri|July 07 24|13:25:09|208|%"
        );
        assert_eq!(
            strftime("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        assert!(strftime("%Z", 0).unwrap_err().contains("%Z"));
    }

    #[test]
    fn templates_can_date_their_prompt() {
        let t =
            JinjaTemplate::new("{{ strftime_now('%d %b %Y') }}".into(), "test", "", "").unwrap();
        let text = t.render(&[], &[], false).unwrap();
        assert_eq!(text.len(), 11, "{text}");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = JinjaTemplate::new(
            "{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ 1.0e-5 | tojson }} \
             {{ 1.0e20 | tojson }} {{ 2.5 | tojson }} {{ 3.0 | tojson }}|{{ tools[0] | tojson(sort_keys=true) }}"
                .into(),
            "test",
            "",
            "",
        )
        .unwrap();
        let tool = r#"{"z": "a <b> & 'c' é \"q\"\n", "a": [1, {}, []], "n": null}"#;
        let text = t.render(&[], &[tool.to_string()], false).unwrap();
        // What Python 3 prints for json.dumps of the same values.
        let expected = [
            r#"{"z": "a <b> & 'c' é \"q\"\n", "a": [1, {}, []], "n": null}"#,
            "{\n  \"z\": \"a <b> & 'c' é \\\"q\\\"\\n\",\n  \"a\": [\n    1,\n    {},\n    []\n  ],\n  \"n\": null\n}",
            "1e-05 1e+20 2.5 3.0",
            r#"{"a": [1, {}, []], "n": null, "z": "a <b> & 'c' é \"q\"\n"}"#,
        ]
        .join("|");
        assert_eq!(text, expected);
    }

    #[test]
    fn messages_reach_the_template_as_transformers_passes_them() {
        let t = JinjaTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content is undefined }}:{{ 'tool_calls' in m }}\
             {% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.id }} {{ c.function.name }} \
             {{ c.function.arguments | tojson }} {{ c.function.arguments is mapping }}]{% endfor %}{% endif %}\
             {% if m.tool_call_id is defined %}<{{ m.tool_call_id }}>{% endif %};{% endfor %}"
                .into(),
            "test",
            "",
            "",
        )
        .unwrap();
        let calls = [
            ToolCall::new("call_1", "search", r#"{"query": "x", "k": 2}"#),
            ToolCall::new("call_2", "answer", "not json"),
        ];
        let assistant = Message {
            content: None,
            tool_calls: &calls,
            ..Message::text("assistant", "")
        };
        let tool = Message {
            tool_call_id: Some("call_1"),
            ..Message::text("tool", "result")
        };
        let text = t
            .render(&[Message::text("user", "q"), assistant, tool], &[], false)
            .unwrap();
        assert_eq!(
            text,
            r#"user:False:False;assistant:True:True[call_1 search {"query": "x", "k": 2} True][call_2 answer "not json" False];tool:False:False<call_1>;"#
        );
    }
}
