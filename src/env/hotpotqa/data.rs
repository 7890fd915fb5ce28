//! HotpotQA records: loading the official JSON (a list of `{_id, question, answer,
//! supporting_facts, context, type, level}`) and the Hugging Face layout (`id`,
//! `supporting_facts {title, sent_id}`, `context {title, sentences}`, as a JSON list or JSON
//! Lines), and writing records back in the official schema. Errors name the record index.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::env::EnvError;

/// The shipped synthetic fixture (regenerate with `stepppo env synth-hotpotqa`).
pub const EMBEDDED_FIXTURE: &str = include_str!("../../../data/hotpotqa/synthetic_dev.json");
/// Name used for the embedded fixture in errors.
pub const EMBEDDED_NAME: &str = "data/hotpotqa/synthetic_dev.json (embedded)";

/// One question with its context paragraphs, in the official schema's field order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HotpotRecord {
    /// Record id (`_id` in the official schema, `id` in the Hugging Face layout).
    #[serde(rename = "_id")]
    pub id: String,
    /// The question text.
    pub question: String,
    /// The gold answer (`yes`/`no` for yes/no comparison questions).
    pub answer: String,
    /// (paragraph title, 0-based sentence index).
    pub supporting_facts: Vec<(String, usize)>,
    /// (paragraph title, sentences); sentences after the first usually start with a space.
    pub context: Vec<(String, Vec<String>)>,
    /// `bridge` or `comparison`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `easy`, `medium` or `hard`.
    pub level: String,
}

/// Serializes records as an official-format JSON list, one record per line.
pub fn to_json(records: &[HotpotRecord]) -> String {
    let lines: Vec<String> = records
        .iter()
        .map(|r| serde_json::to_string(r).expect("records serialize"))
        .collect();
    format!("[\n{}\n]\n", lines.join(",\n"))
}

/// Reads records from a file in either layout.
pub fn load_file(path: &str) -> Result<Vec<HotpotRecord>, EnvError> {
    let text = std::fs::read_to_string(path).map_err(|source| EnvError::Io {
        path: path.to_string(),
        source,
    })?;
    parse_records(&text, path)
}

/// Parses a JSON list (official or HF records) or JSON Lines (HF export).
pub fn parse_records(text: &str, source_name: &str) -> Result<Vec<HotpotRecord>, EnvError> {
    let bad_data = |reason: String| EnvError::BadData {
        source_name: source_name.to_string(),
        reason,
    };
    let values: Vec<Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(text).map_err(|e| bad_data(format!("not a JSON list: {e}")))?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(n, line)| {
                serde_json::from_str(line)
                    .map_err(|e| bad_data(format!("line {}: not JSON: {e}", n + 1)))
            })
            .collect::<Result<_, _>>()?
    };
    values
        .iter()
        .enumerate()
        .map(|(index, value)| {
            parse_record(value).map_err(|reason| EnvError::MalformedRecord {
                source_name: source_name.to_string(),
                index,
                reason,
            })
        })
        .collect()
}

fn parse_record(value: &Value) -> Result<HotpotRecord, String> {
    let obj = value.as_object().ok_or("not a JSON object")?;
    let id = match (obj.get("_id"), obj.get("id")) {
        (Some(id), _) | (None, Some(id)) => id.as_str().ok_or("`_id` is not a string")?,
        (None, None) => return Err("missing `_id` (or `id`)".into()),
    };
    Ok(HotpotRecord {
        id: id.to_string(),
        question: string_field(obj, "question")?,
        answer: string_field(obj, "answer")?,
        supporting_facts: supporting_facts(obj.get("supporting_facts"))?,
        context: context(obj.get("context"))?,
        kind: optional_string(obj, "type")?,
        level: optional_string(obj, "level")?,
    })
}

fn string_field(obj: &Map<String, Value>, key: &str) -> Result<String, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("`{key}` is not a string")),
        None => Err(format!("missing `{key}`")),
    }
}

fn optional_string(obj: &Map<String, Value>, key: &str) -> Result<String, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(_) => string_field(obj, key),
    }
}

fn strings(value: &Value, what: &str) -> Result<Vec<String>, String> {
    value
        .as_array()
        .ok_or(format!("{what} is not a list"))?
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or(format!("{what} holds a non-string"))
        })
        .collect()
}

/// `[[title, sent_id], …]` (official) or `{title: […], sent_id: […]}` (HF).
fn supporting_facts(value: Option<&Value>) -> Result<Vec<(String, usize)>, String> {
    let sent_id = |v: &Value| {
        v.as_u64()
            .map(|n| n as usize)
            .ok_or("`supporting_facts` sentence id is not a non-negative integer".to_string())
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(facts)) => facts
            .iter()
            .map(|fact| match fact.as_array().map(Vec::as_slice) {
                Some([Value::String(title), id]) => Ok((title.clone(), sent_id(id)?)),
                _ => Err("`supporting_facts` entry is not [title, sent_id]".to_string()),
            })
            .collect(),
        Some(Value::Object(cols)) => {
            let titles = strings(
                cols.get("title")
                    .ok_or("`supporting_facts.title` missing")?,
                "`supporting_facts.title`",
            )?;
            let ids = cols
                .get("sent_id")
                .and_then(Value::as_array)
                .ok_or("`supporting_facts.sent_id` missing or not a list")?;
            if ids.len() != titles.len() {
                return Err("`supporting_facts` title and sent_id lengths differ".into());
            }
            titles
                .into_iter()
                .zip(ids)
                .map(|(t, id)| Ok((t, sent_id(id)?)))
                .collect()
        }
        Some(_) => Err("`supporting_facts` is neither a list nor an object".into()),
    }
}

/// `[[title, [sentence, …]], …]` (official) or `{title: […], sentences: [[…]]}` (HF).
fn context(value: Option<&Value>) -> Result<Vec<(String, Vec<String>)>, String> {
    match value {
        None => Err("missing `context`".into()),
        Some(Value::Array(paragraphs)) => paragraphs
            .iter()
            .map(|p| match p.as_array().map(Vec::as_slice) {
                Some([Value::String(title), sentences]) => {
                    Ok((title.clone(), strings(sentences, "`context` sentences")?))
                }
                _ => Err("`context` entry is not [title, [sentences]]".to_string()),
            })
            .collect(),
        Some(Value::Object(cols)) => {
            let titles = strings(
                cols.get("title").ok_or("`context.title` missing")?,
                "`context.title`",
            )?;
            let sentences = cols
                .get("sentences")
                .and_then(Value::as_array)
                .ok_or("`context.sentences` missing or not a list")?;
            if sentences.len() != titles.len() {
                return Err("`context` title and sentences lengths differ".into());
            }
            titles
                .into_iter()
                .zip(sentences)
                .map(|(t, s)| Ok((t, strings(s, "`context.sentences`")?)))
                .collect()
        }
        Some(_) => Err("`context` is neither a list nor an object".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixture_round_trips() {
        let records = parse_records(EMBEDDED_FIXTURE, EMBEDDED_NAME).unwrap();
        assert!(records.len() >= 50);
        assert_eq!(to_json(&records), EMBEDDED_FIXTURE);
    }

    #[test]
    fn hf_layout_matches_the_official_one() {
        let official = r#"[{"_id":"x1","question":"Q?","answer":"A","supporting_facts":[["T1",0],["T2",1]],
            "context":[["T1",["s0."," s1."]],["T2",["u0."," u1."]]],"type":"bridge","level":"easy"}]"#;
        let hf = r#"{"id":"x1","question":"Q?","answer":"A","supporting_facts":{"title":["T1","T2"],"sent_id":[0,1]},"context":{"title":["T1","T2"],"sentences":[["s0."," s1."],["u0."," u1."]]},"type":"bridge","level":"easy"}"#;
        let a = parse_records(official, "official").unwrap();
        let b = parse_records(hf, "hf.jsonl").unwrap();
        assert_eq!(a, b);
        let c = parse_records(&format!("[{hf}]"), "hf.json").unwrap();
        assert_eq!(a, c);
    }

    #[test]
    fn malformed_records_are_named_by_index() {
        let text = r#"[{"_id":"a","question":"q","answer":"x","context":[]},
                       {"_id":"b","question":"q","context":[]}]"#;
        let err = parse_records(text, "dev.json").unwrap_err().to_string();
        assert!(
            err.contains("dev.json") && err.contains("record 1") && err.contains("answer"),
            "{err}"
        );
        let err = parse_records(
            r#"[{"_id":"a","question":"q","answer":"x","context":[["T",[1]]]}]"#,
            "d",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("record 0") && err.contains("non-string"),
            "{err}"
        );
        let err = parse_records("[1,", "d").unwrap_err().to_string();
        assert!(err.contains("not a JSON list"), "{err}");
        let err = parse_records("{}\n{oops", "d.jsonl")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2"), "{err}");
    }
}
