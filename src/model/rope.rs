//! Rotary position embeddings as Hugging Face transformers computes them: reading the RoPE
//! settings of a `config.json` in either layout (transformers 5's `rope_parameters` object, or
//! transformers 4's top-level `rope_theta` plus an optional `rope_scaling` object), and the
//! per-position cos/sin tables of each supported `rope_type`: `default`, `linear`, `dynamic`
//! (NTK), `yarn` and `llama3`. Any other type, or a key a type does not read, is an error naming
//! the key. Applying the tables to q/k is the trunk's.
//!
//! `dynamic` is stateful in transformers: a forward pass whose largest position is p recomputes
//! the frequencies for length `max(p + 1, max_position_embeddings)`, and keys cached earlier keep
//! the frequencies of the pass that computed them. Here every position p uses the frequencies of
//! length `max(p + 1, max_position_embeddings)`, which is exactly what transformers' cached
//! generation does when the prompt fits in `max_position_embeddings`, and is the same in the
//! rollout and training paths (so PPO ratios start at 1).

use serde_json::{Map, Value};

/// Base of the default RoPE when a config names none.
pub const DEFAULT_THETA: f64 = 10_000.0;

/// How the inverse frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
enum Scaling {
    Default,
    Linear {
        factor: f64,
    },
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    Yarn {
        factor: f64,
        original_max: f64,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max: f64,
    },
}

/// The RoPE of one model: base, head width and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    theta: f64,
    head_dim: usize,
    scaling: Scaling,
}

/// Keys every layout may carry next to the type's own.
const COMMON_KEYS: [&str; 4] = ["rope_theta", "rope_type", "type", "partial_rotary_factor"];

/// A RoPE object of a config (`rope_parameters` or `rope_scaling`) with its key name.
type RopeObject<'a> = (&'static str, &'a Map<String, Value>);

/// The RoPE settings of a config, wherever the layout put them.
struct Settings<'a> {
    params: Option<RopeObject<'a>>,
    theta: f64,
}

impl Rope {
    /// Reads the RoPE of a config (`extra` holds every key stepppo does not model as a field).
    /// Errors name the key.
    pub fn from_config(
        extra: &Map<String, Value>,
        top_level_theta: Option<f64>,
        head_dim: usize,
        max_position_embeddings: usize,
    ) -> Result<Self, String> {
        let top_level_prf = extra.get("partial_rotary_factor").filter(|v| !v.is_null());
        if let Some(value) = top_level_prf {
            check_full_rotary("partial_rotary_factor", value.as_f64())?;
        }
        let settings = settings(extra, top_level_theta)?;
        let scaling = match settings.params {
            None => Scaling::Default,
            Some((key, params)) => scaling(key, params, max_position_embeddings)?,
        };
        Ok(Self {
            theta: settings.theta,
            head_dim,
            scaling,
        })
    }

    /// Inverse frequencies `[head_dim / 2]` for a sequence of `seq_len` tokens, and the factor
    /// transformers multiplies cos and sin by (`attention_factor`, 1 except for YaRN).
    fn inv_freq(&self, seq_len: usize) -> (Vec<f64>, f64) {
        let dim = self.head_dim;
        let base_freqs = |base: f64| -> Vec<f64> {
            (0..dim / 2)
                .map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64))
                .collect()
        };
        match &self.scaling {
            Scaling::Default => (base_freqs(self.theta), 1.0),
            Scaling::Linear { factor } => (
                base_freqs(self.theta).iter().map(|f| f / factor).collect(),
                1.0,
            ),
            Scaling::Dynamic {
                factor,
                max_position_embeddings,
            } => {
                let max = *max_position_embeddings as f64;
                let len = (seq_len as f64).max(max);
                let base = self.theta
                    * ((factor * len / max) - (factor - 1.0)).powf(dim as f64 / (dim as f64 - 2.0));
                (base_freqs(base), 1.0)
            }
            Scaling::Yarn { .. } => self.yarn_inv_freq(),
            Scaling::Llama3 { .. } => (self.llama3_inv_freq(), 1.0),
        }
    }

    fn yarn_inv_freq(&self) -> (Vec<f64>, f64) {
        let Scaling::Yarn {
            factor,
            original_max,
            attention_factor,
            mscale,
            mscale_all_dim,
            beta_fast,
            beta_slow,
            truncate,
        } = self.scaling
        else {
            unreachable!("called for YaRN only")
        };
        let get_mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        let attention = attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                get_mscale(factor, m) / get_mscale(factor, a)
            }
            _ => get_mscale(factor, 1.0),
        });
        let dim = self.head_dim as f64;
        let correction_dim = |rotations: f64| {
            dim * (original_max / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * self.theta.ln())
        };
        let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
        if truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        let inv_freq = (0..self.head_dim / 2)
            .map(|i| {
                let pos_freq = self.theta.powf((2 * i) as f64 / dim);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                (1.0 / (factor * pos_freq)) * (1.0 - extrapolation)
                    + (1.0 / pos_freq) * extrapolation
            })
            .collect();
        (inv_freq, attention)
    }

    fn llama3_inv_freq(&self) -> Vec<f64> {
        let Scaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max,
        } = self.scaling
        else {
            unreachable!("called for Llama 3 only")
        };
        let low_freq_wavelen = original_max / low_freq_factor;
        let high_freq_wavelen = original_max / high_freq_factor;
        let dim = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = 1.0 / self.theta.powf((2 * i) as f64 / dim);
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_freq_wavelen {
                    f
                } else if wavelen > low_freq_wavelen {
                    f / factor
                } else {
                    let smooth = (original_max / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
    }

    /// `[positions.len(), head_dim]` cos and sin (f32, as transformers computes them), with the
    /// frequencies repeated over both halves and scaled by the attention factor.
    pub fn tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let hd = self.head_dim;
        let mut cos = Vec::with_capacity(positions.len() * hd);
        let mut sin = Vec::with_capacity(positions.len() * hd);
        let mut cached: Option<(usize, Vec<f32>, f32)> = None;
        for &p in positions {
            let key = self.table_key(p);
            if cached.as_ref().map(|c| c.0) != Some(key) {
                let (freqs, scale) = self.inv_freq(key);
                cached = Some((key, freqs.iter().map(|&f| f as f32).collect(), scale as f32));
            }
            let (_, freqs, scale) = cached.as_ref().expect("just filled");
            for _ in 0..2 {
                for f in freqs {
                    let angle = p as f32 * f;
                    cos.push(angle.cos() * scale);
                    sin.push(angle.sin() * scale);
                }
            }
        }
        (cos, sin)
    }

    /// The sequence length whose frequencies position `p` uses (only `dynamic` depends on it).
    fn table_key(&self, p: u32) -> usize {
        match self.scaling {
            Scaling::Dynamic {
                max_position_embeddings,
                ..
            } => (p as usize + 1).max(max_position_embeddings),
            _ => 0,
        }
    }
}

/// Finds the RoPE object and base of either layout; conflicting layouts are an error.
fn settings(
    extra: &Map<String, Value>,
    top_level_theta: Option<f64>,
) -> Result<Settings<'_>, String> {
    let object = |key: &'static str| -> Result<Option<RopeObject<'_>>, String> {
        match extra.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some((key, m))),
            Some(other) => Err(format!("key `{key}` must be an object, got {other}")),
        }
    };
    let params = match (object("rope_parameters")?, object("rope_scaling")?) {
        (Some(_), Some(_)) => {
            return Err(
                "keys `rope_parameters` and `rope_scaling` are both set; keep one".to_string(),
            )
        }
        (p, s) => p.or(s),
    };
    let nested_theta = match params {
        Some((key, m)) => optional_f64(key, m, "rope_theta")?,
        None => None,
    };
    let theta = match (nested_theta, top_level_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "key `rope_theta` ({b}) disagrees with `{}.rope_theta` ({a})",
                params.map(|p| p.0).unwrap_or_default()
            ))
        }
        (a, b) => a.or(b).unwrap_or(DEFAULT_THETA),
    };
    if !(theta.is_finite() && theta > 1.0) {
        return Err(format!("key `rope_theta` must be above 1, got {theta}"));
    }
    Ok(Settings { params, theta })
}

/// The scaling named by `params` (the object under `key`), checking it reads every key.
fn scaling(
    key: &str,
    params: &Map<String, Value>,
    max_position_embeddings: usize,
) -> Result<Scaling, String> {
    let rope_type = rope_type(key, params)?;
    if params
        .get("partial_rotary_factor")
        .is_some_and(|v| !v.is_null())
    {
        check_full_rotary(
            &format!("{key}.partial_rotary_factor"),
            params["partial_rotary_factor"].as_f64(),
        )?;
    }
    let f = |name: &str| required_f64(key, params, name);
    let original_max = || -> Result<f64, String> {
        Ok(
            optional_f64(key, params, "original_max_position_embeddings")?
                .unwrap_or(max_position_embeddings as f64),
        )
    };
    let (scaling, keys): (Scaling, &[&str]) = match rope_type.as_str() {
        "default" => (Scaling::Default, &[]),
        "linear" => (Scaling::Linear { factor: f("factor")? }, &["factor"]),
        "dynamic" => (
            Scaling::Dynamic {
                factor: f("factor")?,
                max_position_embeddings,
            },
            &["factor"],
        ),
        "yarn" => (yarn(key, params, original_max()?, max_position_embeddings)?, &YARN_KEYS),
        "llama3" => (
            Scaling::Llama3 {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max: original_max()?,
            },
            &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
        ),
        other => {
            return Err(format!(
                "key `{key}.rope_type` = {other:?} is not supported (supported: default, linear, dynamic, yarn, llama3)"
            ))
        }
    };
    if let Some(unread) = params
        .keys()
        .find(|k| !COMMON_KEYS.contains(&k.as_str()) && !keys.contains(&k.as_str()))
    {
        return Err(format!(
            "key `{key}.{unread}` is not read by rope_type {rope_type:?}; stepppo cannot honour it"
        ));
    }
    check_factor(key, &scaling)?;
    Ok(scaling)
}

const YARN_KEYS: [&str; 8] = [
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "beta_fast",
    "beta_slow",
    "truncate",
];

fn yarn(
    key: &str,
    params: &Map<String, Value>,
    original_max: f64,
    max_position_embeddings: usize,
) -> Result<Scaling, String> {
    let opt = |name: &str| optional_f64(key, params, name);
    let nonzero_or = |v: Option<f64>, default: f64| v.filter(|x| *x != 0.0).unwrap_or(default);
    let truncate = match params.get("truncate") {
        None => true,
        Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(format!(
                "key `{key}.truncate` must be a boolean, got {other}"
            ))
        }
    };
    Ok(Scaling::Yarn {
        factor: opt("factor")?.unwrap_or(max_position_embeddings as f64 / original_max),
        original_max,
        attention_factor: opt("attention_factor")?,
        mscale: opt("mscale")?,
        mscale_all_dim: opt("mscale_all_dim")?,
        beta_fast: nonzero_or(opt("beta_fast")?, 32.0),
        beta_slow: nonzero_or(opt("beta_slow")?, 1.0),
        truncate,
    })
}

/// Partial rotary embeddings (a factor other than 1) are not implemented.
fn check_full_rotary(key: &str, factor: Option<f64>) -> Result<(), String> {
    match factor {
        Some(1.0) => Ok(()),
        _ => Err(format!(
            "key `{key}`: only full rotary embeddings (1.0) are supported"
        )),
    }
}

/// Scaling factors must be finite and at least 1 (transformers' own validation).
fn check_factor(key: &str, scaling: &Scaling) -> Result<(), String> {
    let factor = match scaling {
        Scaling::Default => return Ok(()),
        Scaling::Linear { factor }
        | Scaling::Dynamic { factor, .. }
        | Scaling::Yarn { factor, .. }
        | Scaling::Llama3 { factor, .. } => *factor,
    };
    if factor.is_finite() && factor >= 1.0 {
        Ok(())
    } else {
        Err(format!("key `{key}.factor` must be ≥ 1, got {factor}"))
    }
}

/// `rope_type` (or the older `type`), `default` when absent.
fn rope_type(key: &str, params: &Map<String, Value>) -> Result<String, String> {
    let value = params.get("rope_type").or_else(|| params.get("type"));
    match value {
        None | Some(Value::Null) => Ok("default".to_string()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!(
            "key `{key}.rope_type` must be a string, got {other}"
        )),
    }
}

fn optional_f64(key: &str, params: &Map<String, Value>, name: &str) -> Result<Option<f64>, String> {
    match params.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("key `{key}.{name}` must be a number, got {v}")),
    }
}

fn required_f64(key: &str, params: &Map<String, Value>, name: &str) -> Result<f64, String> {
    optional_f64(key, params, name)?.ok_or_else(|| format!("key `{key}.{name}` is missing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(json: Value, top: Option<f64>) -> Result<Rope, String> {
        Rope::from_config(json.as_object().unwrap(), top, 8, 32)
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let v5 = rope(
            serde_json::json!({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
            None,
        )
        .unwrap();
        let v4 = rope(serde_json::json!({"rope_scaling": null}), Some(1e6)).unwrap();
        assert_eq!(v5, v4);
        assert_eq!(v5, rope(serde_json::json!({}), Some(1e6)).unwrap());
        let v4_scaled = rope(
            serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
            Some(1e6),
        )
        .unwrap();
        let v5_scaled = rope(
            serde_json::json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
            None,
        )
        .unwrap();
        assert_eq!(v4_scaled, v5_scaled);
    }

    #[test]
    fn unsupported_settings_name_their_key() {
        let cases = [
            (
                serde_json::json!({"rope_parameters": {"rope_type": "longrope"}}),
                "rope_parameters.rope_type",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "linear"}}),
                "rope_scaling.factor",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}),
                "rope_parameters.low_freq_factor",
            ),
            (
                serde_json::json!({"rope_parameters": {"partial_rotary_factor": 0.5}}),
                "rope_parameters.partial_rotary_factor",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_theta": 1e4}, "rope_scaling": {"type": "linear", "factor": 2.0}}),
                "rope_scaling",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_theta": 1e4}}),
                "rope_theta",
            ),
        ];
        for (json, key) in cases {
            let err = rope(json.clone(), Some(5e5))
                .err()
                .unwrap_or_else(|| panic!("{json} loaded"));
            assert!(err.contains(key), "{err} should name {key}");
        }
    }

    #[test]
    fn dynamic_equals_default_inside_the_trained_length() {
        let dynamic = rope(
            serde_json::json!({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}),
            None,
        )
        .unwrap();
        let plain = rope(serde_json::json!({}), None).unwrap();
        let inside: Vec<u32> = (0..32).collect();
        assert_eq!(dynamic.tables(&inside), plain.tables(&inside));
        assert_ne!(dynamic.tables(&[40]), plain.tables(&[40]));
    }
}
