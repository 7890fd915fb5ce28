//! The `remote` env: an env served by another process over the HTTP/JSON bridge protocol of
//! `docs/guides/env-bridge.md` (`GET /spec`, `POST /reset`, `POST /step`, `POST /close`), so that
//! envs we did not write (gymnasium, WebShop- or GEM-style servers) train through the same agent
//! protocol.
//!
//! This module owns the client side only: the config (`url`, `timeout`, `on_error`), one episode
//! per [`RemoteEnv`] (the server's `env_id`), and the checks that turn every failure (no answer in
//! time, a dropped connection, an HTTP error, malformed JSON, a missing or mistyped field) into an
//! [`EnvError::Remote`] naming the server and the request sent, never a made-up transition. What a
//! rollout does with such an error (`on_error`) is the agent loop's business. The action space
//! comes from `/spec`: named actions, or free text when the server lists none. The optional
//! fields a server may add are read here too: `/spec`'s `seed_max` (larger seeds are sent modulo
//! its range), `/reset`'s per-episode `instruction`, and the `oracle_action` and
//! `admissible_actions` of each answer, which the oracle and the random agent play.

use std::time::Duration;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::{bad_value, Action, ActionSpace, Env, EnvError, EnvInfo, OnError, Transition};

/// Longest request body quoted in an error (free-text actions can be long).
const QUOTED_BODY_CHARS: usize = 200;
/// Longest wait for the `/close` sent when an env is dropped: a hung server must not hold up
/// the end of a rollout for `timeout` per env.
const CLOSE_ON_DROP_TIMEOUT: Duration = Duration::from_secs(1);

/// The remote env's own keys (`env_type: remote`): an env served by another process over a
/// small HTTP/JSON protocol (`GET /spec`, `POST /reset {seed}`, `POST /step {env_id, action}`,
/// `POST /close {env_id}`; `docs/env-bridge.md` has the bodies, errors and an example, and
/// README's "Environments in another process" a walk-through). The server lists the actions
/// (or none, for free text). A server that times out, disconnects or answers nonsense is an
/// error naming the server and the request. A config is checked without contacting the
/// server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(default)]
pub struct RemoteConfig {
    /// Base URL of the env server, e.g. `http://127.0.0.1:8765`; required, and plain HTTP
    /// (`http://`, no TLS is built in).
    #[schemars(extend("x-required" = true))]
    pub url: String,
    /// Seconds a request may take, connection included, before it fails; > 0.
    pub timeout: f64,
    /// What a rollout does when a request fails.
    pub on_error: OnError,
    /// Episodes a rollout steps at once (and groups it resets at once, a group's members in
    /// turn), each over its own connection: a batch's requests overlap instead of waiting for
    /// one another; ≥ 1 (1: one after another). The records do not depend on it.
    pub concurrency: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            url: String::new(),
            timeout: 30.0,
            on_error: OnError::Fail,
            concurrency: 16,
        }
    }
}

impl RemoteConfig {
    pub(crate) fn validate(&self) -> Result<(), EnvError> {
        if self.url.trim().is_empty() {
            return Err(bad_value(
                "remote",
                "url",
                "is required: the env server's base URL, e.g. http://127.0.0.1:8765",
            ));
        }
        if !self.url.starts_with("http://") {
            return Err(bad_value(
                "remote",
                "url",
                format!(
                    "`{}` must start with http:// (the bridge speaks plain HTTP; no TLS is built in)",
                    self.url
                ),
            ));
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(bad_value(
                "remote",
                "timeout",
                format!("must be a number of seconds > 0, got {}", self.timeout),
            ));
        }
        if self.concurrency == 0 {
            return Err(bad_value(
                "remote",
                "concurrency",
                "must be at least 1 (episodes stepped at once)",
            ));
        }
        Ok(())
    }
}

/// `GET /spec`.
#[derive(Deserialize)]
struct Spec {
    name: String,
    instruction: String,
    #[serde(default)]
    actions: Option<Vec<String>>,
    #[serde(default)]
    max_steps: Option<u64>,
    /// The largest seed the env takes; a larger one is sent as `seed mod (seed_max + 1)`.
    #[serde(default)]
    seed_max: Option<u64>,
}

/// What `/reset` and `/step` may add to an answer: the next action of the env's own oracle
/// (a walkthrough, a solver) and, for a free-text env, the actions the state admits.
#[derive(Deserialize, Default)]
struct Offers {
    #[serde(default)]
    oracle_action: Option<String>,
    #[serde(default)]
    admissible_actions: Option<Vec<String>>,
}

/// `POST /reset`.
#[derive(Deserialize)]
struct ResetAnswer {
    env_id: String,
    observation: String,
    #[serde(default)]
    info: Map<String, Value>,
    /// This episode's instruction, in place of `/spec`'s (rules that vary with the seed).
    #[serde(default)]
    instruction: Option<String>,
    #[serde(flatten)]
    offers: Offers,
}

/// `POST /step`.
#[derive(Deserialize)]
struct StepAnswer {
    observation: String,
    reward: f64,
    terminated: bool,
    truncated: bool,
    #[serde(default)]
    info: Map<String, Value>,
    #[serde(flatten)]
    offers: Offers,
}

/// One episode of an env server.
pub struct RemoteEnv {
    /// The server's base URL without a trailing `/`.
    url: String,
    /// How errors name the server: the URL and, once known, the env's name.
    label: String,
    agent: ureq::Agent,
    /// How long each request may take (`timeout`).
    timeout: Duration,
    instruction: String,
    actions: Option<Vec<String>>,
    max_steps: usize,
    /// `/spec`'s `seed_max`.
    seed_max: Option<u64>,
    /// The server's id of the current episode (`None` before the first reset).
    env_id: Option<String>,
    observation: String,
    /// The current episode's own instruction, when its `/reset` gave one.
    episode_instruction: Option<String>,
    /// What the latest answer offered.
    offers: Offers,
}

impl RemoteEnv {
    /// Reads the server's `/spec`; fails when the server does not answer a valid one.
    pub fn connect(cfg: RemoteConfig) -> Result<Self, EnvError> {
        cfg.validate()?;
        let url = cfg.url.trim().trim_end_matches('/').to_string();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut env = RemoteEnv {
            label: url.clone(),
            url,
            agent,
            timeout: Duration::from_secs_f64(cfg.timeout),
            instruction: String::new(),
            actions: None,
            max_steps: usize::MAX,
            seed_max: None,
            env_id: None,
            observation: String::new(),
            episode_instruction: None,
            offers: Offers::default(),
        };
        let spec: Spec = env.request("/spec", None, env.timeout)?;
        env.adopt(spec)?;
        Ok(env)
    }

    /// Takes the env description of `/spec` after checking its action names.
    fn adopt(&mut self, spec: Spec) -> Result<(), EnvError> {
        let fail = |reason: String| self.error("GET /spec", reason);
        if let Some(actions) = &spec.actions {
            check_action_names(actions).map_err(|r| fail(format!("`actions`: {r}")))?;
        }
        if spec.max_steps == Some(0) {
            return Err(fail("`max_steps` must be at least 1 (or null)".into()));
        }
        self.label = format!("{} ({})", self.url, spec.name);
        self.instruction = spec.instruction;
        self.actions = spec.actions;
        self.max_steps = spec
            .max_steps
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
        self.seed_max = spec.seed_max;
        Ok(())
    }

    /// The seed sent for episode seed `seed`: itself within `/spec`'s `seed_max`, else
    /// `seed mod (seed_max + 1)` (the members of a group still share one; distinct seeds may
    /// meet when the range is small).
    fn wire_seed(&self, seed: u64) -> u64 {
        match self.seed_max {
            Some(max) if seed > max => seed % (max + 1),
            _ => seed,
        }
    }

    /// Checks what an answer offered: the admissible actions, like `/spec`'s, must be usable
    /// answers.
    fn check_offers(offers: &Offers) -> Result<(), String> {
        if let Some(actions) = &offers.admissible_actions {
            check_action_names(actions).map_err(|r| format!("`admissible_actions`: {r}"))?;
        }
        match &offers.oracle_action {
            Some(action) if action.trim().is_empty() => Err("`oracle_action` is empty".to_string()),
            _ => Ok(()),
        }
    }

    /// Sends one request, `GET path` without a body or `POST path` with one, failing after
    /// `timeout`, and decodes its JSON answer; every failure names the request.
    fn request<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<T, EnvError> {
        let body_text = body.map(Value::to_string);
        let request = describe(path, body_text.as_deref());
        let fail = |reason: String| self.error(&request, reason);
        let target = format!("{}{path}", self.url);
        let answer = match body_text {
            None => self
                .agent
                .get(&target)
                .config()
                .timeout_global(Some(timeout))
                .build()
                .call(),
            Some(text) => self
                .agent
                .post(&target)
                .header("content-type", "application/json")
                .config()
                .timeout_global(Some(timeout))
                .build()
                .send(text.as_str()),
        };
        let mut answer = answer.map_err(|e| fail(transport_reason(&e, timeout)))?;
        let status = answer.status().as_u16();
        let text = answer.body_mut().read_to_string().map_err(|e| {
            fail(format!(
                "reading the answer: {}",
                transport_reason(&e, timeout)
            ))
        })?;
        if !(200..300).contains(&status) {
            return Err(fail(format!("HTTP {status}: {}", error_message(&text))));
        }
        serde_json::from_str(&text).map_err(|e| {
            fail(format!(
                "malformed answer ({e}): {}",
                quote(&text, QUOTED_BODY_CHARS)
            ))
        })
    }

    fn error(&self, request: &str, reason: String) -> EnvError {
        EnvError::Remote {
            url: self.label.clone(),
            request: request.to_string(),
            reason,
        }
    }

    /// The current episode's id, or an error naming `request` when there is none.
    fn episode(&self, request: &str) -> Result<&str, EnvError> {
        self.env_id
            .as_deref()
            .ok_or_else(|| self.error(request, "no episode: reset first".into()))
    }

    /// Ends the current episode on the server (`POST /close`), if there is one.
    fn close(&mut self, timeout: Duration) -> Result<(), EnvError> {
        let Some(env_id) = self.env_id.take() else {
            return Ok(());
        };
        let body = json!({ "env_id": env_id });
        let _: Value = self.request("/close", Some(&body), timeout)?;
        Ok(())
    }
}

impl Drop for RemoteEnv {
    fn drop(&mut self) {
        // Best effort: a server that cannot close the episode keeps it until it evicts it.
        let _ = self.close(self.timeout.min(CLOSE_ON_DROP_TIMEOUT));
    }
}

impl Env for RemoteEnv {
    fn tag(&self) -> &str {
        "remote"
    }

    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        self.close(self.timeout)?;
        let body = json!({ "seed": self.wire_seed(seed) });
        let answer: ResetAnswer = self.request("/reset", Some(&body), self.timeout)?;
        let request = describe("/reset", Some(&body.to_string()));
        env_info(&answer.info)
            .and_then(|_| Self::check_offers(&answer.offers))
            .map_err(|r| self.error(&request, r))?;
        self.env_id = Some(answer.env_id);
        self.observation = answer.observation;
        self.episode_instruction = answer.instruction;
        self.offers = answer.offers;
        Ok(self.observation.clone())
    }

    fn step(&mut self, action: &Action) -> Result<Transition, EnvError> {
        let text = match action {
            Action::Move(text) | Action::Answer(text) | Action::Search(text) => text,
        };
        let env_id = self.episode("POST /step")?;
        let body = json!({ "env_id": env_id, "action": text });
        let answer: StepAnswer = self.request("/step", Some(&body), self.timeout)?;
        let fail = |reason: String| {
            let request = describe("/step", Some(&body.to_string()));
            self.error(&request, reason)
        };
        let info = env_info(&answer.info).map_err(fail)?;
        Self::check_offers(&answer.offers).map_err(fail)?;
        let reward = answer.reward as f32;
        if !reward.is_finite() {
            return Err(fail(format!(
                "`reward` {} is not a finite f32",
                answer.reward
            )));
        }
        self.observation = answer.observation;
        self.offers = answer.offers;
        Ok(Transition {
            observation: self.observation.clone(),
            reward,
            terminated: answer.terminated,
            truncated: answer.truncated,
            info,
        })
    }

    fn instruction(&self) -> String {
        self.episode_instruction
            .clone()
            .unwrap_or_else(|| self.instruction.clone())
    }

    fn state_text(&self) -> String {
        self.observation.clone()
    }

    fn action_space(&self) -> ActionSpace {
        match &self.actions {
            Some(names) => ActionSpace::Named(names.clone()),
            None => ActionSpace::FreeText,
        }
    }

    fn max_steps(&self) -> usize {
        self.max_steps
    }

    fn oracle_action(&self) -> Result<Action, EnvError> {
        match &self.offers.oracle_action {
            Some(action) => Ok(Action::Move(action.clone())),
            None => Err(EnvError::NoAgent {
                env: format!("remote {}", self.label),
                agent: "oracle",
                reason: "its last answer offered no `oracle_action` (a server without an \
                         oracle: play with the random agent or stdin, warm-start with \
                         sft.agent: random)"
                    .into(),
            }),
        }
    }

    fn admissible_actions(&self) -> Option<&[String]> {
        self.offers
            .admissible_actions
            .as_deref()
            .filter(|actions| !actions.is_empty())
    }

    fn random_action(&self, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        let names = self
            .actions
            .as_ref()
            .or(self.offers.admissible_actions.as_ref())
            .filter(|names| !names.is_empty());
        match names {
            Some(names) => Ok(Action::Move(
                names[rng.random_range(0..names.len())].clone(),
            )),
            None => Err(EnvError::NoAgent {
                env: format!("remote {}", self.label),
                agent: "random",
                reason: "its /spec lists no actions and its last answer offered no \
                         `admissible_actions` (free-text answers)"
                    .into(),
            }),
        }
    }
}

/// `GET /path`, or `POST /path BODY` with the body cut to [`QUOTED_BODY_CHARS`].
fn describe(path: &str, body: Option<&str>) -> String {
    match body {
        Some(body) => format!("POST {path} {}", quote(body, QUOTED_BODY_CHARS)),
        None => format!("GET {path}"),
    }
}

/// `text` cut to `max` characters (marked with `…`).
fn quote(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

/// Why a request got no answer, in words.
fn transport_reason(e: &ureq::Error, timeout: Duration) -> String {
    match e {
        ureq::Error::Timeout(_) => {
            format!("no answer in time (timeout {} s)", timeout.as_secs_f64())
        }
        ureq::Error::Io(io) => format!("connection error: {io}"),
        other => other.to_string(),
    }
}

/// The `error` field of an error answer, else the answer itself (cut).
fn error_message(text: &str) -> String {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| quote(text, QUOTED_BODY_CHARS))
}

/// Action names must be non-empty, free of `||` (the multi-action separator) and distinct
/// ignoring case (answers match names case-insensitively).
fn check_action_names(actions: &[String]) -> Result<(), String> {
    if actions.is_empty() {
        return Err("is empty (use null for free-text answers)".into());
    }
    for (i, name) in actions.iter().enumerate() {
        if name.trim().is_empty() || name.trim() != name || name.contains("||") {
            return Err(format!(
                "`{name}` must be non-empty, without surrounding spaces or ||"
            ));
        }
        if actions[..i].iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return Err(format!(
                "`{name}` is listed twice (names match ignoring case)"
            ));
        }
    }
    Ok(())
}

/// The step facts of an answer's `info`: the three flags (`success` defaults to false,
/// `action_is_valid` to true, `action_is_effective` to `action_is_valid`) and every other numeric
/// entry as a metric, by name.
fn env_info(info: &Map<String, Value>) -> Result<EnvInfo, String> {
    let flag = |key: &str, default: bool| match info.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("`info.{key}` must be true or false, got {other}")),
    };
    let success = flag("success", false)?;
    let action_is_valid = flag("action_is_valid", true)?;
    let action_is_effective = flag("action_is_effective", action_is_valid)?;
    let metrics = info
        .iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "success" | "action_is_valid" | "action_is_effective"
            )
        })
        .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x as f32)))
        .collect();
    Ok(EnvInfo {
        success,
        action_is_valid,
        action_is_effective,
        metrics,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_needs_an_http_url_and_a_positive_timeout() {
        let err = |cfg: RemoteConfig| cfg.validate().unwrap_err().to_string();
        let e = err(RemoteConfig::default());
        assert!(e.contains("url") && e.contains("required"), "{e}");
        let e = err(RemoteConfig {
            url: "https://example.org".into(),
            ..RemoteConfig::default()
        });
        assert!(e.contains("http://"), "{e}");
        let e = err(RemoteConfig {
            url: "http://127.0.0.1:1".into(),
            timeout: 0.0,
            ..RemoteConfig::default()
        });
        assert!(e.contains("timeout"), "{e}");
    }

    #[test]
    fn info_flags_default_and_numbers_become_metrics() {
        let info: Map<String, Value> =
            serde_json::from_str(r#"{"success": true, "score": 0.5, "n": 3, "note": "x"}"#)
                .unwrap();
        let parsed = env_info(&info).unwrap();
        assert!(parsed.success && parsed.action_is_valid && parsed.action_is_effective);
        assert_eq!(
            parsed.metrics,
            vec![("n".to_string(), 3.0), ("score".to_string(), 0.5)]
        );
        let invalid: Map<String, Value> =
            serde_json::from_str(r#"{"action_is_valid": false}"#).unwrap();
        assert!(!env_info(&invalid).unwrap().action_is_effective);
        let bad: Map<String, Value> = serde_json::from_str(r#"{"success": "yes"}"#).unwrap();
        assert!(env_info(&bad).unwrap_err().contains("info.success"));
    }

    #[test]
    fn action_names_must_be_usable_answers() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(check_action_names(&names(&["Left", "Right"])).is_ok());
        assert!(check_action_names(&names(&[])).is_err());
        assert!(check_action_names(&names(&["a||b"])).is_err());
        assert!(check_action_names(&names(&[" Left"])).is_err());
        let e = check_action_names(&names(&["Left", "left"])).unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn long_bodies_are_cut_in_messages() {
        let long = "x".repeat(500);
        let text = describe("/step", Some(&long));
        assert!(text.starts_with("POST /step xxx") && text.ends_with('…'));
        assert_eq!(
            text.chars().count(),
            "POST /step ".len() + QUOTED_BODY_CHARS + 1
        );
    }
}
