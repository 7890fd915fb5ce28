//! `stepppo dataset export|import`: a dataset through Parquet and back gives the same records and
//! a sound dataset; pyarrow, pandas, polars, DuckDB and HF datasets read the export; open and
//! incomplete trajectories are marked and not scored; OpenAI chat logs import as steps tokenised
//! as transformers renders them; bad input is refused by name and leaves no dataset behind.

mod examples_python;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, UInt32Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use examples_python::examples_python;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use serde_json::Value;
use stepppo::env::StepInfo;
use stepppo::store::{Dataset, DatasetWriter, StepRecord, WriterOptions};

fn stepppo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = stepppo(args);
    assert!(
        out.status.success(),
        "stepppo {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(args: &[&str]) -> String {
    let out = stepppo(args);
    assert!(!out.status.success(), "stepppo {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn collect(dir: &Path) {
    ok(&[
        "collect",
        "--env",
        "frozen_lake",
        "--agent",
        "random",
        "--episodes",
        "24",
        "--group-size",
        "4",
        "--seed",
        "3",
        "--out",
        path(dir),
    ]);
}

fn records(dataset: &Path) -> Vec<StepRecord> {
    let dataset = Dataset::open(dataset).unwrap();
    dataset.records().map(|v| v.to_record().unwrap()).collect()
}

/// The export's batches, read back with arrow-rs.
fn read_back(file: &Path) -> Vec<RecordBatch> {
    ParquetRecordBatchReaderBuilder::try_new(File::open(file).unwrap())
        .unwrap()
        .build()
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn parquet_round_trip_gives_identical_records_and_a_sound_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let (source, file, back) = (
        tmp.path().join("ds"),
        tmp.path().join("steps.parquet"),
        tmp.path().join("back"),
    );
    collect(&source);
    let said = ok(&[
        "dataset",
        "export",
        path(&source),
        "--out",
        path(&file),
        "--text",
        "--advantages",
        "grpo",
        "--row-group-mib",
        "1",
    ]);
    let want = records(&source);
    assert!(said.contains(&format!("{} rows", want.len())), "{said}");
    ok(&["dataset", "import", path(&file), "--out", path(&back)]);
    assert_eq!(records(&back), want, "records differ after the round trip");
    assert!(ok(&["dataset", "verify", path(&back)]).contains("sound"));
    let manifest = Dataset::open(&back).unwrap().manifest().metadata.clone();
    assert!(manifest.contains_key("collect") && manifest.contains_key("tokenizer"));
    assert_eq!(manifest["import"]["format"], "parquet");

    // The decoded text and the scores are there: GRPO advantages of a group sum to zero.
    let batches = read_back(&file);
    let batch = &batches[0];
    let text = batch
        .column_by_name("response_text")
        .unwrap()
        .as_string::<i32>();
    assert!(text.value(0).contains("<answer>"), "{}", text.value(0));
    assert_eq!(batch.column_by_name("advantage").unwrap().null_count(), 0);
    // A second import into the same place is refused, and the first stays whole.
    let err = fails(&["dataset", "import", path(&file), "--out", path(&back)]);
    assert!(err.contains("exists"), "{err}");
    assert_eq!(records(&back), want);
}

#[test]
fn python_readers_read_the_export() {
    let Some(python) = examples_python("python_readers_read_the_export") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (source, file) = (tmp.path().join("ds"), tmp.path().join("steps.parquet"));
    collect(&source);
    ok(&[
        "dataset",
        "export",
        path(&source),
        "--out",
        path(&file),
        "--text",
        "--advantages",
        "step_gae",
    ]);
    let jsonl = tmp.path().join("steps.jsonl");
    std::fs::write(&jsonl, ok(&["replay", path(&source), "--format", "jsonl"])).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/read_step_parquet.py");
    let out = Command::new(python)
        .arg(script)
        .arg(&file)
        .arg(&jsonl)
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", tmp.path().join("hf"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for reader in ["pyarrow", "pandas", "polars", "duckdb", "datasets"] {
        assert!(said.contains(&format!("{reader}: ")), "{said}");
    }
}

fn step(traj_id: u64, step_index: u32, last: bool) -> StepRecord {
    StepRecord {
        traj_id,
        group_id: traj_id / 2,
        step_index,
        env_tag: "bandit".into(),
        seed: 7,
        obs_ids: vec![1, 2, 3],
        response_ids: vec![4, 5],
        response_logprobs: vec![-0.5, -1.25],
        reward: if last { 1.0 } else { 0.0 },
        terminated: last,
        critic_state: vec![0.5, 2.0],
        admissible_actions: match traj_id % 2 {
            0 => vec!["open chest".into(), "take key from chest".into()],
            _ => Vec::new(),
        },
        info: StepInfo {
            action_is_valid: true,
            tool_call_error: traj_id == 3,
            ..StepInfo::default()
        },
        ..StepRecord::default()
    }
}

#[test]
fn open_and_incomplete_trajectories_are_marked_and_not_scored() {
    let tmp = tempfile::tempdir().unwrap();
    let (source, file, back) = (
        tmp.path().join("ds"),
        tmp.path().join("steps.parquet"),
        tmp.path().join("back"),
    );
    // 0: complete; 1: open (no terminal step); 2: step 1 missing; 3: complete, group of 2.
    let written = vec![
        step(0, 0, false),
        step(0, 1, true),
        step(1, 0, false),
        step(2, 0, false),
        step(2, 2, true),
        step(3, 0, true),
    ];
    let mut writer = DatasetWriter::create(&source, WriterOptions::default()).unwrap();
    for r in &written {
        writer.append(r).unwrap();
    }
    writer.seal().unwrap();
    ok(&[
        "dataset",
        "export",
        path(&source),
        "--out",
        path(&file),
        "--advantages",
        "grpo",
    ]);
    let batch = &read_back(&file)[0];
    let bools = |name| -> Vec<bool> {
        let c = batch.column_by_name(name).unwrap().as_boolean();
        c.iter().map(Option::unwrap).collect()
    };
    assert_eq!(bools("open"), [false, false, true, false, false, false]);
    assert_eq!(
        bools("incomplete"),
        [false, false, false, true, true, false]
    );
    let missing = batch
        .column_by_name("missing_step")
        .unwrap()
        .as_primitive::<UInt32Type>();
    assert_eq!(
        missing.iter().collect::<Vec<_>>(),
        [None, None, None, Some(1), Some(1), None]
    );
    let advantage = batch
        .column_by_name("advantage")
        .unwrap()
        .as_primitive::<Float32Type>();
    let scored: Vec<bool> = advantage.iter().map(|a| a.is_some()).collect();
    assert_eq!(scored, [true, true, false, false, false, true]);
    ok(&["dataset", "import", path(&file), "--out", path(&back)]);
    assert_eq!(records(&back), written);
}

/// Writes a Parquet file of the given columns.
fn write_parquet(file: &Path, columns: Vec<(&str, ArrayRef)>) {
    let fields: Vec<Field> = columns
        .iter()
        .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
        .collect();
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap();
    let mut writer =
        ArrowWriter::try_new(File::create(file).unwrap(), batch.schema(), None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

/// The columns of a good export, as a notebook would edit them.
fn exported_columns(tmp: &Path) -> Vec<(String, ArrayRef)> {
    let (source, file) = (tmp.join("src"), tmp.join("good.parquet"));
    let mut writer = DatasetWriter::create(&source, WriterOptions::default()).unwrap();
    for r in [step(0, 0, false), step(0, 1, true)] {
        writer.append(&r).unwrap();
    }
    writer.seal().unwrap();
    ok(&["dataset", "export", path(&source), "--out", path(&file)]);
    let batch = &read_back(&file)[0];
    let schema = batch.schema();
    schema
        .fields()
        .iter()
        .map(|f| {
            (
                f.name().clone(),
                batch.column_by_name(f.name()).unwrap().clone(),
            )
        })
        .collect()
}

fn import_fails(
    tmp: &Path,
    name: &str,
    columns: Vec<(String, ArrayRef)>,
    extra: &[&str],
) -> String {
    let file = tmp.join(format!("{name}.parquet"));
    let columns = columns
        .iter()
        .map(|(n, a)| (n.as_str(), a.clone()))
        .collect();
    write_parquet(&file, columns);
    let out = tmp.join(name);
    let mut args = vec!["dataset", "import", path(&file), "--out", path(&out)];
    args.extend_from_slice(extra);
    let err = fails(&args);
    assert!(!out.exists(), "a failed import left {}", out.display());
    assert!(!tmp.join(format!("{name}.importing")).exists());
    assert!(
        err.contains(&format!("{name}.parquet")),
        "the error names no file: {err}"
    );
    err
}

#[test]
fn bad_parquet_input_is_refused_by_column_and_row() {
    let tmp = tempfile::tempdir().unwrap();
    let good = exported_columns(tmp.path());
    let without = |name: &str| -> Vec<(String, ArrayRef)> {
        good.iter().filter(|(n, _)| n != name).cloned().collect()
    };
    let replaced = |name: &str, array: ArrayRef| -> Vec<(String, ArrayRef)> {
        let mut cols = without(name);
        cols.push((name.to_string(), array));
        cols
    };
    let err = import_fails(tmp.path(), "missing", without("reward"), &[]);
    assert!(err.contains("column `reward` is missing"), "{err}");
    let text = Arc::new(StringArray::from(vec!["high", "low"])) as ArrayRef;
    let err = import_fails(tmp.path(), "mistyped", replaced("reward", text), &[]);
    assert!(err.contains("column `reward`"), "{err}");
    let nulls = Arc::new(UInt64Array::from(vec![Some(0), None])) as ArrayRef;
    let err = import_fails(tmp.path(), "nulls", replaced("traj_id", nulls), &[]);
    assert!(err.contains("column `traj_id`, row 1: null"), "{err}");
    // Integers of another width load when they fit (what pandas may write back) ...
    let wide = arrow_cast::cast(
        good.iter()
            .find(|(n, _)| n == "step_index")
            .unwrap()
            .1
            .as_ref(),
        &DataType::Int64,
    )
    .unwrap();
    let file = tmp.path().join("wide.parquet");
    let cols = replaced("step_index", wide);
    write_parquet(
        &file,
        cols.iter().map(|(n, a)| (n.as_str(), a.clone())).collect(),
    );
    ok(&[
        "dataset",
        "import",
        path(&file),
        "--out",
        path(&tmp.path().join("wide")),
    ]);
    // ... and not when they do not.
    let negative = Arc::new(arrow_array::Int64Array::from(vec![0, -1])) as ArrayRef;
    let err = import_fails(
        tmp.path(),
        "negative",
        replaced("step_index", negative),
        &[],
    );
    assert!(err.contains("column `step_index`"), "{err}");
    // Token ids beyond the tokenizer named.
    let mut big = StepRecord {
        obs_ids: vec![1, 999_999],
        ..step(0, 0, true)
    };
    big.response_logprobs = vec![0.0; 2];
    let (src, file) = (tmp.path().join("big-src"), tmp.path().join("vocab.parquet"));
    let mut writer = DatasetWriter::create(&src, WriterOptions::default()).unwrap();
    writer.append(&big).unwrap();
    writer.seal().unwrap();
    ok(&["dataset", "export", path(&src), "--out", path(&file)]);
    let out = tmp.path().join("vocab");
    let err = fails(&[
        "dataset",
        "import",
        path(&file),
        "--out",
        path(&out),
        "--tokenizer",
        "builtin",
    ]);
    assert!(
        err.contains("row 0") && err.contains("`obs_ids`, element 1: token id 999999"),
        "{err}"
    );
    assert!(!out.exists());
    // Not Parquet at all.
    let junk = tmp.path().join("junk.parquet");
    std::fs::write(&junk, "not parquet").unwrap();
    let err = fails(&[
        "dataset",
        "import",
        path(&junk),
        "--out",
        path(&tmp.path().join("j")),
    ]);
    assert!(err.contains("junk.parquet: not a Parquet file"), "{err}");
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf/chat-tools")
        .join(name)
}

/// A case of the Qwen2.5 fixture: its messages, its tools as transformers received them (raw
/// text, so their key order survives) and the ids of transformers' rendering.
#[derive(serde::Deserialize)]
struct TemplateCase {
    name: String,
    messages: Value,
    tools: Box<serde_json::value::RawValue>,
    ids: Vec<u32>,
}

fn qwen_case(case: &str) -> TemplateCase {
    #[derive(serde::Deserialize)]
    struct Cases {
        cases: Vec<TemplateCase>,
    }
    let text = std::fs::read_to_string(fixture("qwen2.5").join("expected.json")).unwrap();
    let cases: Cases = serde_json::from_str(&text).unwrap();
    cases.cases.into_iter().find(|c| c.name == case).unwrap()
}

#[test]
fn chat_logs_import_as_steps_with_the_checkpoint_template() {
    let tmp = tempfile::tempdir().unwrap();
    // A multi-turn tool conversation whose generation prompt transformers rendered (fixture),
    // closed by one more assistant reply so the rendered prompt is that reply's context.
    let case = qwen_case("d_multi_turn");
    let mut messages = case.messages.as_array().unwrap().clone();
    // OpenAI sends a call's arguments as JSON text (the fixture holds them as transformers takes
    // them, an object).
    for m in &mut messages {
        for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
            let arguments = call["function"]["arguments"].to_string();
            call["function"]["arguments"] = Value::String(arguments);
        }
    }
    messages.push(serde_json::json!({"role": "assistant", "content": "Done."}));
    let replies = messages.iter().filter(|m| m["role"] == "assistant").count();
    let conversation = serde_json::json!({
        "messages": messages, "rewards": vec![0.25; replies], "group": "paris", "success": true,
    });
    let conversation = conversation.to_string().replacen(
        '{',
        // (a line of JSONL: the fixture's newlines are whitespace between tokens)
        &format!("{{\"tools\": {}, ", case.tools.get().replace('\n', " ")),
        1,
    );
    let short = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "reward": 1.0, "group": "paris", "env": "greeting",
    });
    let lines = [
        conversation,
        "{\"messages\": 3}".into(),
        String::new(),
        short.to_string(),
        serde_json::json!({"messages": [{"role": "user", "content": "alone"}]}).to_string(),
    ];
    let logs = tmp.path().join("logs.jsonl");
    std::fs::write(&logs, lines.join("\n")).unwrap();
    let out = tmp.path().join("chat");
    let qwen = fixture("qwen2.5");
    let o = stepppo(&[
        "dataset",
        "import",
        path(&logs),
        "--out",
        path(&out),
        "--tokenizer",
        path(&qwen),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("logs.jsonl: line 2: not a conversation"),
        "{stderr}"
    );
    assert!(stderr.contains("line 5: no assistant message"), "{stderr}");
    let got = records(&out);
    let (first, second): (Vec<_>, Vec<_>) = got.iter().partition(|r| r.traj_id == 0);
    assert_eq!(first.len(), replies);
    // Every later step extends the last one's context, and the last step's context is exactly
    // transformers' `apply_chat_template(messages[:-1], tools, add_generation_prompt=True)`.
    let mut context: Vec<u32> = Vec::new();
    for r in &first {
        assert_eq!(
            r.context_len as usize,
            context.len(),
            "step {}",
            r.step_index
        );
        assert!(!r.info.context_rebuilt);
        context.extend(&r.obs_ids);
        if r.step_index as usize + 1 < replies {
            context.extend(&r.response_ids);
        }
    }
    assert_eq!(
        context, case.ids,
        "the last step's context differs from transformers'"
    );
    let last = first.last().unwrap();
    assert!(last.terminated && last.info.success && last.reward == 0.25);
    assert_eq!(last.response_logprobs.len(), last.response_ids.len());
    assert_eq!(last.info.action_text, "Done.");
    // Same group, own env tag, the reward on the last (only) step.
    assert_eq!(
        (second[0].group_id, second[0].env_tag.as_str()),
        (first[0].group_id, "greeting")
    );
    assert_eq!(second[0].reward, 1.0);
    assert!(ok(&["dataset", "verify", path(&out)]).contains("sound"));
    // The manifest names the checkpoint, so the transcript decodes with its tokenizer.
    let transcript = ok(&["replay", path(&out), "--traj", "0"]);
    assert!(
        transcript.contains("<|im_start|>user\nAnd what about Japan"),
        "{transcript}"
    );

    // --strict stops at the first bad line and leaves nothing.
    let strict = tmp.path().join("strict");
    let err = fails(&[
        "dataset",
        "import",
        path(&logs),
        "--out",
        path(&strict),
        "--tokenizer",
        path(&qwen),
        "--strict",
    ]);
    assert!(err.contains("line 2: not a conversation"), "{err}");
    assert!(!strict.exists() && !tmp.path().join("strict.importing").exists());
    // A chat import needs the checkpoint that tokenises it.
    let err = fails(&["dataset", "import", path(&logs), "--out", path(&strict)]);
    assert!(err.contains("--tokenizer"), "{err}");
}
