//! Who may talk to the gateway: the API key every request sends as `Authorization: Bearer
//! <key>` (what OpenAI's clients send from their `api_key`), compared in constant time. The key
//! is never printed: its `Debug` form is redacted, and nothing writes it to a log or a run
//! directory. Binding an address other than loopback requires one.

use std::net::IpAddr;

/// The environment variable `stepppo serve` and a training run's gateway read the key from.
pub const API_KEY_ENV: &str = "STEPPPO_API_KEY";

/// A secret API key (non-empty).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// The key, or why it cannot be one (empty, or with whitespace a header cannot carry).
    pub fn new(key: impl Into<String>) -> Result<Self, String> {
        let key = key.into();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("the API key contains whitespace or control characters".into());
        }
        Ok(Self(key))
    }

    /// The key of `flag` when given, else of [`API_KEY_ENV`] when set and non-empty.
    pub fn from_flag_or_env(flag: Option<String>) -> Result<Option<Self>, String> {
        let source = flag.or_else(|| std::env::var(API_KEY_ENV).ok().filter(|k| !k.is_empty()));
        source.map(Self::new).transpose()
    }

    /// Whether an `Authorization` header value carries this key (`Bearer <key>`).
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(sent) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        constant_time_eq(sent, self.0.as_bytes())
    }
}

/// Byte equality whose time depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `host` (an address or `localhost`) serves this machine only.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_key_is_admitted() {
        let key = ApiKey::new("sk-test-123").unwrap();
        assert!(key.admits(Some(b"Bearer sk-test-123")));
        for wrong in [
            &b"Bearer sk-test-12"[..],
            b"Bearer sk-test-1234",
            b"bearer sk-test-123",
            b"sk-test-123",
            b"Bearer ",
        ] {
            assert!(
                !key.admits(Some(wrong)),
                "{}",
                String::from_utf8_lossy(wrong)
            );
        }
        assert!(!key.admits(None));
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
        assert!(ApiKey::new("").is_err() && ApiKey::new("a b").is_err());
    }

    #[test]
    fn loopback_hosts() {
        for host in ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["0.0.0.0", "::", "10.0.0.2", "example.com"] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
