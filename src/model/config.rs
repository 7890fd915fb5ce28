//! The HF `config.json` of a dense Qwen2, Qwen3 or Llama model: the fields stepppo reads, the
//! built-in `tiny` and `small` sizes, and reading/writing the file. Keys stepppo does not use are
//! kept verbatim so an exported directory round-trips into Hugging Face transformers unchanged.
//! Loading refuses every key that would make transformers compute something stepppo does not
//! (sliding-window attention, MoE, quantisation, other activations, biases stepppo lacks, unknown
//! RoPE types, …), naming the key, so a checkpoint is never silently run as a different model.
//! RoPE settings of both transformers layouts are read by [`super::rope`].

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::rope::Rope;
use super::{ModelError, Result};
use crate::kv::KvShape;
use crate::tokenizer::Tokenizer;

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_initializer_range() -> f64 {
    0.02
}
fn default_hidden_act() -> String {
    "silu".to_string()
}

/// The model families stepppo implements (`model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// q/k/v projections with bias, o without.
    Qwen2,
    /// Per-head RMSNorm on q and k; biases per `attention_bias`.
    Qwen3,
    /// Biases per `attention_bias`.
    Llama,
}

/// Keys whose presence (with any value but null, false or 0) asks for a computation stepppo does
/// not implement. (`partial_rotary_factor` and the RoPE objects are checked by [`Rope`].)
const UNSUPPORTED_KEYS: [(&str, &str); 10] = [
    ("quantization_config", "quantised weights"),
    ("num_experts", "mixture of experts"),
    ("num_local_experts", "mixture of experts"),
    ("n_routed_experts", "mixture of experts"),
    ("num_experts_per_tok", "mixture of experts"),
    ("moe_intermediate_size", "mixture of experts"),
    ("use_sliding_window", "sliding-window attention"),
    ("mlp_bias", "MLP biases"),
    ("attention_dropout", "attention dropout"),
    (
        "original_max_position_embeddings",
        "a top-level RoPE context length",
    ),
];

/// Model hyper-parameters with HF key names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Number of token ids (rows of the embedding and the LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per attention layer.
    pub num_attention_heads: usize,
    /// Key/value heads per attention layer (fewer than the query heads under GQA).
    pub num_key_value_heads: usize,
    /// Longest context the model is configured for, in tokens.
    pub max_position_embeddings: usize,
    /// Width of one attention head; `hidden_size / num_attention_heads` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RoPE base in the transformers 4 layout (transformers 5 puts it in `rope_parameters`,
    /// kept in `extra`); see [`ModelConfig::rope`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// ε of the RMS norms (default 1e-6).
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// transformers' default for all three families is false.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal init of fresh weights (default 0.02).
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    /// MLP activation; only `silu` (the default) is supported.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Model family: `qwen2`, `qwen3` or `llama`.
    pub model_type: String,
    /// Llama's and Qwen3's switch for q/k/v/o biases; Qwen2 ignores it (q/k/v always have one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Every other key of the file, written back unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl From<&ModelConfig> for KvShape {
    fn from(cfg: &ModelConfig) -> Self {
        KvShape {
            num_layers: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
        }
    }
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
            head_dim: None,
            rope_theta: Some(super::rope::DEFAULT_THETA),
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

    /// Checks that stepppo computes exactly what transformers computes for this config: the family
    /// is known, no key asks for an unimplemented computation, RoPE settings are supported, and
    /// the shapes fit the forward passes. The message names the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.family()?;
        self.check_unsupported_keys()?;
        self.check_layer_types()?;
        self.check_shapes()?;
        if self.hidden_act != "silu" {
            return Err(format!(
                "key `hidden_act`: only \"silu\" is supported, got {:?}",
                self.hidden_act
            ));
        }
        self.rope()?;
        Ok(())
    }

    /// The family named by `model_type`.
    pub fn family(&self) -> std::result::Result<Family, String> {
        match self.model_type.as_str() {
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "llama" => Ok(Family::Llama),
            other => Err(format!(
                "key `model_type` = {other:?} is not supported (supported: qwen2, qwen3, llama; dense only)"
            )),
        }
    }

    /// The RoPE of this config, from either transformers layout.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        Rope::from_config(
            &self.extra,
            self.rope_theta,
            self.head_dim(),
            self.max_position_embeddings,
        )
    }

    fn check_unsupported_keys(&self) -> std::result::Result<(), String> {
        let off = |v: &serde_json::Value| match v {
            serde_json::Value::Null => true,
            serde_json::Value::Bool(b) => !b,
            serde_json::Value::Number(n) => n.as_f64() == Some(0.0),
            _ => false,
        };
        for (key, what) in UNSUPPORTED_KEYS {
            if let Some(value) = self.extra.get(key).filter(|v| !off(v)) {
                return Err(format!(
                    "key `{key}` = {value} asks for {what}, which stepppo does not implement"
                ));
            }
        }
        Ok(())
    }

    /// `layer_types` may only list full attention.
    fn check_layer_types(&self) -> std::result::Result<(), String> {
        let Some(types) = self.extra.get("layer_types").filter(|v| !v.is_null()) else {
            return Ok(());
        };
        let list = types
            .as_array()
            .ok_or_else(|| format!("key `layer_types` must be a list, got {types}"))?;
        match list.iter().position(|t| t != "full_attention") {
            Some(i) => Err(format!(
                "key `layer_types[{i}]` = {}: only \"full_attention\" is supported",
                list[i]
            )),
            None => Ok(()),
        }
    }

    /// The shape constraints the forward passes rely on.
    fn check_shapes(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
            ("head_dim", self.head_dim.unwrap_or(1)),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("key `{key}` must be positive"));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(
                "key `hidden_size` must be a multiple of `num_attention_heads` (or set `head_dim`)"
                    .into(),
            );
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "key `head_dim`: heads must have an even width, got {}",
                self.head_dim()
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(
                "key `num_attention_heads` must be a multiple of `num_key_value_heads`".into(),
            );
        }
        Ok(())
    }

    /// Width of one attention head: `head_dim`, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Whether q/k/v projections carry a bias (always in Qwen2; `attention_bias` otherwise).
    pub fn qkv_bias(&self) -> bool {
        match self.family() {
            Ok(Family::Qwen2) => true,
            _ => self.attention_bias.unwrap_or(false),
        }
    }

    /// Whether the output projection carries a bias (never in Qwen2; `attention_bias` otherwise).
    pub fn o_bias(&self) -> bool {
        match self.family() {
            Ok(Family::Qwen2) => false,
            _ => self.attention_bias.unwrap_or(false),
        }
    }

    /// Whether q and k get a per-head RMSNorm before RoPE (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.family() == Ok(Family::Qwen3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_round_trip_and_bad_keys_are_named() {
        let json = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
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

    #[test]
    fn keys_that_change_the_computation_are_refused_by_name() {
        let base = ModelConfig::tiny(16);
        assert!(base.validate().is_ok());
        let with = |key: &str, value: serde_json::Value| {
            let mut cfg = base.clone();
            cfg.extra.insert(key.into(), value);
            cfg.validate()
        };
        for (key, _) in UNSUPPORTED_KEYS {
            let err = with(key, serde_json::json!(2)).unwrap_err();
            assert!(err.contains(&format!("`{key}`")), "{err}");
        }
        assert!(with("use_sliding_window", false.into()).is_ok());
        assert!(with("quantization_config", serde_json::Value::Null).is_ok());
        let err = with(
            "layer_types",
            serde_json::json!(["full_attention", "sliding_attention"]),
        )
        .unwrap_err();
        assert!(err.contains("layer_types[1]"), "{err}");
        let err = ModelConfig {
            model_type: "qwen2_moe".into(),
            ..base.clone()
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("model_type"), "{err}");
        let err = ModelConfig {
            hidden_act: "gelu".into(),
            ..base
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("hidden_act"), "{err}");
    }
}
