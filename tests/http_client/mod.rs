//! A plain HTTP client for the tests that drive a server on loopback (ureq): status codes are
//! answers, not errors, and JSON bodies come back parsed (other bodies as a JSON string).

use serde_json::Value;

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

/// POSTs `body` (raw text) with optional headers; returns status and parsed body.
pub fn post(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut req = agent().post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = req.send(body).unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, parsed(text))
}

pub fn get(url: &str) -> (u16, Value) {
    let mut resp = agent().get(url).call().unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, parsed(text))
}

fn parsed(text: String) -> Value {
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

/// The `data:` events of a server-sent event stream, which must end with `[DONE]` (excluded).
pub fn sse_chunks(text: &str) -> Vec<Value> {
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}
