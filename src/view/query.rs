//! The query parameters of the list and trajectory pages: parsed strictly (unknown, repeated or
//! malformed parameters are errors naming the parameter, answered 400), with empty values read
//! as absent so a plain HTML form can submit blank fields. Also writes a query string back for
//! links that keep the current filters.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::Deserialize;

use crate::algo::{AdvantageConfig, Estimator};

use super::index::{Filter, SortKey};

/// Most trajectories one list page shows.
pub const MAX_PER_PAGE: usize = 500;
const DEFAULT_PER_PAGE: usize = 50;

/// A parameter that could not be read: the message names it (it is shown escaped).
#[derive(Debug, PartialEq)]
pub struct BadQuery(pub String);

/// The list page's parameters, raw.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    env: Option<String>,
    step: Option<String>,
    version: Option<String>,
    group: Option<String>,
    success: Option<String>,
    open: Option<String>,
    min_return: Option<String>,
    max_return: Option<String>,
    min_len: Option<String>,
    max_len: Option<String>,
    sort: Option<String>,
    order: Option<String>,
    page: Option<String>,
    per_page: Option<String>,
}

/// A validated list request.
#[derive(Clone, Debug, PartialEq)]
pub struct ListQuery {
    pub filter: Filter,
    pub sort: SortKey,
    pub desc: bool,
    /// 1-based.
    pub page: usize,
    pub per_page: usize,
}

fn value<T: FromStr>(name: &str, raw: &Option<String>) -> Result<Option<T>, BadQuery> {
    match raw.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|_| {
            let shown: String = text.chars().take(40).collect();
            BadQuery(format!("parameter `{name}`: cannot read `{shown}`"))
        }),
    }
}

fn finite(name: &str, raw: &Option<String>) -> Result<Option<f32>, BadQuery> {
    match value::<f32>(name, raw)? {
        Some(x) if !x.is_finite() => Err(BadQuery(format!("parameter `{name}`: not finite"))),
        other => Ok(other),
    }
}

fn sort_key(raw: &Option<String>) -> Result<SortKey, BadQuery> {
    Ok(match raw.as_deref().unwrap_or("") {
        "" | "id" => SortKey::Id,
        "return" => SortKey::Return,
        "length" => SortKey::Length,
        "version" | "step" => SortKey::Version,
        "group" => SortKey::Group,
        "env" => SortKey::Env,
        _ => {
            return Err(BadQuery(
                "parameter `sort`: one of id, return, length, version, step, group, env".into(),
            ))
        }
    })
}

impl ListParams {
    /// Validates every parameter; `step` N selects policy version N − 1.
    pub fn validate(&self) -> Result<ListQuery, BadQuery> {
        let version = match (value::<u64>("step", &self.step)?, value("version", &self.version)?) {
            (Some(_), Some(_)) => return Err(BadQuery("give `step` or `version`, not both".into())),
            (Some(0), None) => {
                return Err(BadQuery(
                    "parameter `step`: training steps start at 1 (step N rolls out with policy version N − 1)".into(),
                ))
            }
            (Some(step), None) => Some(step - 1),
            (None, version) => version,
        };
        let filter = Filter {
            env: self.env.clone().filter(|e| !e.is_empty()),
            version,
            group: value("group", &self.group)?,
            success: value("success", &self.success)?,
            open: value("open", &self.open)?,
            min_return: finite("min_return", &self.min_return)?,
            max_return: finite("max_return", &self.max_return)?,
            min_len: value("min_len", &self.min_len)?,
            max_len: value("max_len", &self.max_len)?,
        };
        let desc = match self.order.as_deref().unwrap_or("") {
            "" | "asc" => false,
            "desc" => true,
            _ => return Err(BadQuery("parameter `order`: asc or desc".into())),
        };
        let page = value::<usize>("page", &self.page)?.unwrap_or(1);
        let per_page = value::<usize>("per_page", &self.per_page)?.unwrap_or(DEFAULT_PER_PAGE);
        if page == 0 || page > u32::MAX as usize {
            return Err(BadQuery("parameter `page`: from 1".into()));
        }
        if per_page == 0 || per_page > MAX_PER_PAGE {
            return Err(BadQuery(format!(
                "parameter `per_page`: 1 to {MAX_PER_PAGE}"
            )));
        }
        Ok(ListQuery {
            filter,
            sort: sort_key(&self.sort)?,
            desc,
            page,
            per_page,
        })
    }
}

impl ListQuery {
    /// The query string of these filters and sort at `page` (no leading `?`).
    pub fn to_query(&self, page: usize) -> String {
        let f = &self.filter;
        let mut pairs: BTreeMap<&str, String> = BTreeMap::new();
        let mut put = |k, v: Option<String>| {
            if let Some(v) = v {
                pairs.insert(k, v);
            }
        };
        put("env", f.env.clone());
        put("version", f.version.map(|v| v.to_string()));
        put("group", f.group.map(|v| v.to_string()));
        put("success", f.success.map(|v| v.to_string()));
        put("open", f.open.map(|v| v.to_string()));
        put("min_return", f.min_return.map(|v| v.to_string()));
        put("max_return", f.max_return.map(|v| v.to_string()));
        put("min_len", f.min_len.map(|v| v.to_string()));
        put("max_len", f.max_len.map(|v| v.to_string()));
        put("sort", Some(sort_name(self.sort).to_string()));
        put(
            "order",
            Some(if self.desc { "desc" } else { "asc" }.to_string()),
        );
        put("page", Some(page.to_string()));
        put("per_page", Some(self.per_page.to_string()));
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// The `sort` parameter's name for `key`.
pub fn sort_name(key: SortKey) -> &'static str {
    match key {
        SortKey::Id => "id",
        SortKey::Return => "return",
        SortKey::Length => "length",
        SortKey::Version => "version",
        SortKey::Group => "group",
        SortKey::Env => "env",
    }
}

/// Percent-encodes everything but unreserved characters.
pub fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// How token spans are coloured on the trajectory page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Colour {
    #[default]
    Logprob,
    Advantage,
}

/// The trajectory page's parameters, raw.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrajParams {
    estimator: Option<String>,
    color: Option<String>,
}

/// A validated trajectory request: the advantage settings to score with and the colouring.
#[derive(Clone, Debug)]
pub struct TrajQuery {
    pub advantage: AdvantageConfig,
    pub colour: Colour,
}

impl TrajParams {
    /// `estimator` replaces the run's `adv_estimator` in `base` (names as in configs).
    pub fn validate(&self, base: &AdvantageConfig) -> Result<TrajQuery, BadQuery> {
        let mut advantage = base.clone();
        if let Some(name) = self.estimator.as_deref().filter(|n| !n.is_empty()) {
            advantage.adv_estimator = parse_estimator(name)?;
        }
        let colour = match self.color.as_deref().unwrap_or("") {
            "" | "logprob" => Colour::Logprob,
            "advantage" => Colour::Advantage,
            _ => return Err(BadQuery("parameter `color`: logprob or advantage".into())),
        };
        Ok(TrajQuery { advantage, colour })
    }
}

/// An estimator by its config name (`step_gae`, `grpo`, `rloo`, ...).
pub fn parse_estimator(name: &str) -> Result<Estimator, BadQuery> {
    serde_json::from_value(serde_json::Value::String(name.to_string())).map_err(|_| {
        let shown: String = name.chars().take(40).collect();
        BadQuery(format!(
            "parameter `estimator`: unknown estimator `{shown}` (names: {})",
            ESTIMATORS.join(", ")
        ))
    })
}

/// The estimator names the page offers.
pub const ESTIMATORS: &[&str] = &[
    "step_gae",
    "token_gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gigpo",
    "step_reinforce",
];

/// The config name of `estimator`.
pub fn estimator_name(estimator: Estimator) -> String {
    match serde_json::to_value(estimator) {
        Ok(serde_json::Value::String(name)) => name,
        _ => format!("{estimator:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &str) -> Result<ListQuery, BadQuery> {
        let p: ListParams = serde_urlencoded_like(pairs);
        p.validate()
    }

    fn serde_urlencoded_like(pairs: &str) -> ListParams {
        let map: serde_json::Map<String, serde_json::Value> = pairs
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap();
                (k.to_string(), serde_json::Value::String(v.to_string()))
            })
            .collect();
        serde_json::from_value(serde_json::Value::Object(map)).unwrap()
    }

    #[test]
    fn step_selects_the_previous_policy_version_and_blank_fields_are_absent() {
        let q = params("step=3&env=&min_len=&sort=return&order=desc").unwrap();
        assert_eq!(q.filter.version, Some(2));
        assert_eq!(q.filter.env, None);
        assert_eq!(q.sort, SortKey::Return);
        assert!(q.desc);
        assert_eq!((q.page, q.per_page), (1, DEFAULT_PER_PAGE));
    }

    #[test]
    fn malformed_values_name_their_parameter() {
        for (query, name) in [
            ("step=0", "step"),
            ("page=0", "page"),
            ("per_page=100000", "per_page"),
            ("min_return=NaN", "min_return"),
            ("success=maybe", "success"),
            ("sort=../../etc", "sort"),
            ("group=-1", "group"),
        ] {
            let err = params(query).unwrap_err();
            assert!(err.0.contains(name), "{query}: {}", err.0);
        }
    }

    #[test]
    fn the_query_string_round_trips_filters() {
        let q = params("env=a b&success=true&sort=length&page=2").unwrap();
        let again = params(&q.to_query(2).replace("%20", " ")).unwrap();
        assert_eq!(again, q);
    }

    #[test]
    fn estimators_parse_by_config_name() {
        for name in ESTIMATORS {
            assert!(parse_estimator(name).is_ok(), "{name}");
        }
        assert!(parse_estimator("<script>")
            .unwrap_err()
            .0
            .contains("estimator"));
    }
}
