//! The tokenizer settings of an HF checkpoint directory: `tokenizer_config.json` (special token
//! strings, `chat_template`) and transformers 5's `chat_template.jinja`, read for what stepppo
//! uses and kept verbatim so an export writes them back unchanged.

use std::path::Path;

use serde_json::Value;

use super::{JinjaTemplate, Result, TokenizerError, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE};

/// What a directory's tokenizer settings say.
pub(super) struct Settings {
    pub eos_token: Option<String>,
    bos_token: Option<String>,
    /// Template source and the file (and key) it came from.
    template: Option<(String, String)>,
    /// The files as read.
    pub files: Vec<(&'static str, String)>,
}

impl Settings {
    /// Reads whichever of the two files exist; neither is required.
    pub fn read(dir: &Path) -> Result<Self> {
        let mut settings = Self {
            eos_token: None,
            bos_token: None,
            template: None,
            files: Vec::new(),
        };
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        if let Some(text) = read_optional(&config_path)? {
            settings.read_config(&config_path, &text)?;
            settings.files.push((TOKENIZER_CONFIG_FILE, text));
        }
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        if let Some(text) = read_optional(&jinja_path)? {
            settings.template = Some((text.clone(), jinja_path.display().to_string()));
            settings.files.push((CHAT_TEMPLATE_FILE, text));
        }
        Ok(settings)
    }

    fn read_config(&mut self, path: &Path, text: &str) -> Result<()> {
        let bad = |message: String| TokenizerError::Load {
            path: path.display().to_string(),
            message,
        };
        let json: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        self.eos_token = token_string(&json, "eos_token").map_err(bad)?;
        self.bos_token = token_string(&json, "bos_token").map_err(bad)?;
        let origin = format!("{} (key `chat_template`)", path.display());
        self.template = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some((s.clone(), origin)),
            Some(Value::Array(named)) => Some((default_template(named).map_err(bad)?, origin)),
            Some(other) => {
                return Err(bad(format!(
                    "key `chat_template` must be a string or a list of named templates, got {other}"
                )))
            }
        };
        Ok(())
    }

    /// The compiled chat template, if the directory has one.
    pub fn template(&self) -> Result<Option<JinjaTemplate>> {
        self.template
            .as_ref()
            .map(|(source, origin)| {
                JinjaTemplate::new(
                    source.clone(),
                    origin,
                    self.bos_token.as_deref().unwrap_or_default(),
                    self.eos_token.as_deref().unwrap_or_default(),
                )
            })
            .transpose()
    }
}

/// A special token given as a string or as an added-token object `{"content": …}`.
fn token_string(json: &Value, key: &str) -> std::result::Result<Option<String>, String> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!("key `{key}.content` must be a string")),
        },
        Some(other) => Err(format!("key `{key}` must be a string, got {other}")),
    }
}

/// The template named `default` of a list of `{"name", "template"}`.
fn default_template(named: &[Value]) -> std::result::Result<String, String> {
    named
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
        .and_then(|t| t.get("template").and_then(Value::as_str))
        .map(str::to_string)
        .ok_or_else(|| "key `chat_template` lists no template named \"default\"".to_string())
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        }),
    }
}

/// Writes `files` (as [`Settings::read`] kept them) into `dir`.
pub(super) fn write(dir: &Path, files: &[(&'static str, String)]) -> Result<()> {
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| TokenizerError::Save {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(())
}
