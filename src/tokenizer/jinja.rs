//! A checkpoint's own chat template (`chat_template` in `tokenizer_config.json`, or
//! `chat_template.jinja`) rendered with `minijinja` the way transformers' `apply_chat_template`
//! renders it: `trim_blocks` and `lstrip_blocks` on, Python string methods (`.strip()`,
//! `.startswith()`, …) through `minijinja-contrib`'s pycompat, `raise_exception`, the special
//! token strings as variables, `tools`/`documents` set to none as transformers passes them
//! when a conversation has none, and `strftime_now(format)` (Llama 3.x templates date their
//! system prompt; the clock is read in UTC, common `strftime` directives only, others an error). It renders text only; [`super::ChatTemplate`] turns the renders
//! into the token pieces the rollout appends.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::{Result, TokenizerError};

/// One chat message as templates see it.
#[derive(Debug, Clone, Serialize)]
pub struct Message<'a> {
    pub role: &'a str,
    pub content: &'a str,
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

    /// The text `apply_chat_template(messages, add_generation_prompt=…, tokenize=False)` gives.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.origin, &e))?;
        template
            .render(minijinja::context! {
                messages => Value::from_serialize(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                tools => Value::from(()),
                documents => Value::from(()),
            })
            .map_err(|e| template_error(&self.origin, &e))
    }

    /// The file the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }
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
        let text = t.render(&[], false).unwrap();
        assert_eq!(text.len(), 11, "{text}");
    }
}
