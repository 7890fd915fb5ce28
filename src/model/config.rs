//! The HF `config.json` of a Qwen2/Llama-family model: the fields stepppo reads, the built-in
//! `tiny` and `small` sizes, and reading/writing the file. Keys stepppo does not use are kept
//! verbatim so an exported directory round-trips into Hugging Face transformers unchanged.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{ModelError, Result};
use crate::tokenizer::Tokenizer;

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_initializer_range() -> f64 {
    0.02
}
fn default_hidden_act() -> String {
    "silu".to_string()
}
fn default_true() -> bool {
    true
}
fn default_model_type() -> String {
    "qwen2".to_string()
}

/// Model hyper-parameters with HF key names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Llama's switch for q/k/v/o biases; absent in Qwen2 configs, where q/k/v always have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Every other key of the file, written back unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ModelConfig {
    /// Test size: 2 layers, hidden 32, 4 heads, 2 kv heads, MLP 64.
    pub fn tiny(vocab_size: usize) -> Self {
        Self::qwen2(vocab_size, 2, 32, 4, 2, 64)
    }

    /// The embedded default: 4 layers, hidden 128, 4 heads, 2 kv heads, MLP 352, tied embeddings.
    pub fn small(vocab_size: usize) -> Self {
        Self::qwen2(vocab_size, 4, 128, 4, 2, 352)
    }

    /// A named built-in size (`tiny`, `small`) over the tokenizer's vocabulary.
    pub fn named(name: &str, tokenizer: &Tokenizer) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny(tokenizer.vocab_size())),
            "small" => Some(Self::small(tokenizer.vocab_size())),
            _ => None,
        }
    }

    fn qwen2(
        vocab: usize,
        layers: usize,
        hidden: usize,
        heads: usize,
        kv: usize,
        mlp: usize,
    ) -> Self {
        let mut extra = serde_json::Map::new();
        extra.insert(
            "architectures".into(),
            serde_json::json!(["Qwen2ForCausalLM"]),
        );
        extra.insert("torch_dtype".into(), "float32".into());
        extra.insert("use_sliding_window".into(), false.into());
        extra.insert("attention_dropout".into(), 0.0.into());
        Self {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: mlp,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            max_position_embeddings: 2048,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            hidden_act: "silu".into(),
            model_type: "qwen2".into(),
            attention_bias: None,
            extra,
        }
    }

    /// Reads and validates a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let cfg: Self = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        cfg.validate().map_err(|message| ModelError::Config {
            path: path.display().to_string(),
            message,
        })?;
        Ok(cfg)
    }

    /// Writes the config as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| ModelError::Config {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        std::fs::write(path, text).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Checks the shape constraints the forward passes rely on; the message names the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("key `{key}` must be positive"));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            return Err(
                "key `hidden_size` must be an even multiple of `num_attention_heads`".into(),
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(
                "key `num_attention_heads` must be a multiple of `num_key_value_heads`".into(),
            );
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "key `hidden_act`: only \"silu\" is supported, got {:?}",
                self.hidden_act
            ));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Whether q/k/v projections carry a bias (always in Qwen2; `attention_bias` in Llama).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    /// Whether the output projection carries a bias (Llama `attention_bias`; never in Qwen2).
    pub fn o_bias(&self) -> bool {
        self.model_type != "qwen2" && self.attention_bias.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_round_trip_and_bad_keys_are_named() {
        let json = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":32,
            "sliding_window":4096,"bos_token_id":1}"#;
        let cfg: ModelConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg.extra["sliding_window"], 4096);
        let back: ModelConfig =
            serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        let bad = ModelConfig {
            num_key_value_heads: 3,
            ..cfg
        };
        assert!(bad.validate().unwrap_err().contains("num_key_value_heads"));
    }
}
