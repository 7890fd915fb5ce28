//! A checkpoint's own chat template (`chat_template` in `tokenizer_config.json`, or
//! `chat_template.jinja`) rendered with `minijinja` the way transformers' `apply_chat_template`
//! renders it: `trim_blocks` and `lstrip_blocks` on, Python string methods (`.strip()`,
//! `.startswith()`, …) through `minijinja-contrib`'s pycompat, `raise_exception`, the special
//! token strings as variables, and `tools`/`documents` set to none as transformers passes them
//! when a conversation has none. It renders text only; [`super::ChatTemplate`] turns the renders
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
