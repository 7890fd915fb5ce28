//! Metric sinks of a run: `<run>/metrics.jsonl` (one JSON object per step with `step` and the
//! metric names as keys) and TensorBoard event files (`<run>/tb/events.out.tfevents.*`) encoded by
//! hand: the record framing (length, masked CRC-32C, data, masked CRC-32C) and the three protobuf
//! messages TensorBoard reads for scalars (`Event`, `Summary`, `Summary.Value`). This module owns
//! writing and reading back metrics; what is measured is decided by the trainer.

use crate::train::Scalars;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Whether the metric `name` measures the machine (wall-clock time, throughput, memory) rather
/// than the run: two runs of one config and seed differ in these and agree in every other.
pub fn is_measurement(name: &str) -> bool {
    ["time/", "throughput/", "memory/"]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

/// Errors of the metric sinks and readers; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A metric file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A JSON Lines row that does not parse.
    #[error("{path}:{line}: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parse error.
        msg: String,
    },
    /// A record that cannot be encoded or read back, or a file shorter than a checkpoint
    /// recorded.
    #[error("{path}: byte {offset}: {msg}")]
    Record {
        /// The file.
        path: PathBuf,
        /// Byte offset of the problem (0 for a row that failed to encode).
        offset: u64,
        /// What is wrong.
        msg: String,
    },
}

pub(in crate::train) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MetricsError + '_ {
    move |source| MetricsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Appends one JSON object per step to `metrics.jsonl`.
pub struct JsonlSink {
    path: PathBuf,
    out: BufWriter<File>,
}

impl JsonlSink {
    /// Opens `path` for appending (a resumed run continues the same file).
    pub fn open(path: &Path) -> Result<Self, MetricsError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io_err(path))?;
        Ok(JsonlSink {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// Writes `{"step": step, name: value, ...}`; non-finite values are written as `null`.
    pub fn write(&mut self, step: u64, scalars: &Scalars) -> Result<(), MetricsError> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (name, &v) in scalars {
            let value = serde_json::Number::from_f64(v)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null);
            obj.insert(name.clone(), value);
        }
        let line = serde_json::Value::Object(obj).to_string();
        writeln!(self.out, "{line}").map_err(io_err(&self.path))?;
        self.out.flush().map_err(io_err(&self.path))
    }
}

/// Reads `metrics.jsonl` back as (step, scalars) rows; `null` values are skipped.
pub fn read_jsonl(path: &Path) -> Result<Vec<(u64, Scalars)>, MetricsError> {
    let file = File::open(path).map_err(io_err(path))?;
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io_err(path))?;
        if line.trim().is_empty() {
            continue;
        }
        let parse_err = |msg: String| MetricsError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            msg,
        };
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| parse_err(e.to_string()))?;
        let obj = value
            .as_object()
            .ok_or_else(|| parse_err("not a JSON object".into()))?;
        let step = obj
            .get("step")
            .and_then(|s| s.as_u64())
            .ok_or_else(|| parse_err("missing integer `step`".into()))?;
        let scalars = obj
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
            .collect();
        rows.push((step, scalars));
    }
    Ok(rows)
}

/// Writes TensorBoard event files with scalar summaries.
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardWriter {
    /// Creates `dir/events.out.tfevents.<unix secs>.stepppo` and writes the file-version event.
    pub fn create(dir: &Path) -> Result<Self, MetricsError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let secs = wall_time() as u64;
        let mut n = 0;
        let path = loop {
            let candidate = dir.join(format!("events.out.tfevents.{secs}.stepppo.{n}"));
            if !candidate.exists() {
                break candidate;
            }
            n += 1;
        };
        let file = File::create(&path).map_err(io_err(&path))?;
        let mut writer = TensorBoardWriter {
            path,
            out: BufWriter::new(file),
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.write_record(&event)?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event holding every scalar of the step (non-finite values are skipped).
    pub fn write_scalars(&mut self, step: u64, scalars: &Scalars) -> Result<(), MetricsError> {
        let mut summary = Vec::new();
        for (tag, &v) in scalars.iter().filter(|(_, v)| v.is_finite()) {
            let mut value = Vec::new();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_float(&mut value, 2, v as f32);
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)?;
        self.out.flush().map_err(io_err(&self.path))
    }

    fn write_record(&mut self, data: &[u8]) -> Result<(), MetricsError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(data.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        frame.extend_from_slice(data);
        frame.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.out.write_all(&frame).map_err(io_err(&self.path))
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// TFRecord's masked CRC-32C.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, ((field as u64) << 3) | wire_type as u64);
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, x: u64) {
    put_key(out, field, 0);
    put_varint(out, x);
}

fn put_double(out: &mut Vec<u8>, field: u32, x: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u32, x: f32) {
    put_key(out, field, 5);
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// One decoded TensorBoard event (only the fields stepppo writes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodedEvent {
    /// Seconds since the Unix epoch when the event was written.
    pub wall_time: f64,
    /// Training step of the scalars (0 on the file-version event).
    pub step: u64,
    /// `brain.Event:2` on the file's first event; `None` on the others.
    pub file_version: Option<String>,
    /// `(tag, value)` of each scalar of the event, in file order.
    pub scalars: Vec<(String, f32)>,
}

/// Reads an event file back, checking both CRCs of every record (used by tests and `plot`).
pub fn read_events(path: &Path) -> Result<Vec<DecodedEvent>, MetricsError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let mut events = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let rec_err = |msg: &str| MetricsError::Record {
            path: path.to_path_buf(),
            offset: pos as u64,
            msg: msg.into(),
        };
        let header = bytes
            .get(pos..pos + 12)
            .ok_or_else(|| rec_err("truncated record header"))?;
        let len_bytes = &header[..8];
        if u32::from_le_bytes(header[8..12].try_into().unwrap()) != masked_crc32c(len_bytes) {
            return Err(rec_err("length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let data = bytes
            .get(pos + 12..pos + 12 + len)
            .ok_or_else(|| rec_err("truncated record data"))?;
        let crc = bytes
            .get(pos + 12 + len..pos + 16 + len)
            .ok_or_else(|| rec_err("truncated data CRC"))?;
        if u32::from_le_bytes(crc.try_into().unwrap()) != masked_crc32c(data) {
            return Err(rec_err("data CRC mismatch"));
        }
        events.push(decode_event(data).map_err(|m| rec_err(&m))?);
        pos += 16 + len;
    }
    Ok(events)
}

enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn get_varint(buf: &[u8], pos: &mut usize) -> Result<u64, String> {
    let mut x = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos).ok_or("truncated varint")?;
        *pos += 1;
        x |= ((b & 0x7f) as u64) << shift;
        if b < 0x80 {
            return Ok(x);
        }
    }
    Err("varint too long".into())
}

fn fields(buf: &[u8]) -> Result<Vec<(u32, Field<'_>)>, String> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = get_varint(buf, &mut pos)?;
        let field = (key >> 3) as u32;
        let take = |pos: &mut usize, n: usize| -> Result<&[u8], String> {
            let s = buf.get(*pos..*pos + n).ok_or("truncated field")?;
            *pos += n;
            Ok(s)
        };
        let value = match key & 7 {
            0 => Field::Varint(get_varint(buf, &mut pos)?),
            1 => Field::Fixed64(take(&mut pos, 8)?.try_into().unwrap()),
            5 => Field::Fixed32(take(&mut pos, 4)?.try_into().unwrap()),
            2 => {
                let n = get_varint(buf, &mut pos)? as usize;
                Field::Bytes(take(&mut pos, n)?)
            }
            w => return Err(format!("unsupported wire type {w}")),
        };
        out.push((field, value));
    }
    Ok(out)
}

fn decode_event(data: &[u8]) -> Result<DecodedEvent, String> {
    let mut event = DecodedEvent::default();
    for (field, value) in fields(data)? {
        match (field, value) {
            (1, Field::Fixed64(b)) => event.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(s)) => event.step = s,
            (3, Field::Bytes(b)) => event.file_version = Some(String::from_utf8_lossy(b).into()),
            (5, Field::Bytes(summary)) => {
                for (f, v) in fields(summary)? {
                    if let (1, Field::Bytes(value)) = (f, v) {
                        event.scalars.push(decode_value(value)?);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(event)
}

fn decode_value(buf: &[u8]) -> Result<(String, f32), String> {
    let (mut tag, mut v) = (String::new(), f32::NAN);
    for (f, value) in fields(buf)? {
        match (f, value) {
            (1, Field::Bytes(b)) => tag = String::from_utf8_lossy(b).into(),
            (2, Field::Fixed32(b)) => v = f32::from_le_bytes(b),
            _ => {}
        }
    }
    Ok((tag, v))
}

/// Both sinks of a run directory.
pub struct MetricsSink {
    jsonl: JsonlSink,
    tb: TensorBoardWriter,
}

/// The metric files of a run as they stood at one moment: the length of `metrics.jsonl` and of
/// every TensorBoard event file. A checkpoint keeps one; [`rewind`] brings the files back to it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricsPosition {
    /// Length of `metrics.jsonl` in bytes.
    pub jsonl_bytes: u64,
    /// Event file name (under `<run>/tb`) → bytes.
    pub event_files: BTreeMap<String, u64>,
}

const JSONL_FILE: &str = "metrics.jsonl";
const EVENTS_DIR: &str = "tb";

impl MetricsSink {
    /// Opens `<run>/metrics.jsonl` (append) and a new event file under `<run>/tb`.
    pub fn open(run_dir: &Path) -> Result<Self, MetricsError> {
        Ok(MetricsSink {
            jsonl: JsonlSink::open(&run_dir.join(JSONL_FILE))?,
            tb: TensorBoardWriter::create(&run_dir.join(EVENTS_DIR))?,
        })
    }

    /// Writes one step's scalars to both sinks.
    pub fn write(&mut self, step: u64, scalars: &Scalars) -> Result<(), MetricsError> {
        self.jsonl.write(step, scalars)?;
        self.tb.write_scalars(step, scalars)
    }

    /// Flushes both sinks and returns the length of every metric file of the run.
    pub fn position(&mut self, run_dir: &Path) -> Result<MetricsPosition, MetricsError> {
        self.tb.out.flush().map_err(io_err(&self.tb.path))?;
        let jsonl = run_dir.join(JSONL_FILE);
        let mut position = MetricsPosition {
            jsonl_bytes: file_len(&jsonl)?,
            event_files: BTreeMap::new(),
        };
        for (name, path) in event_files(&run_dir.join(EVENTS_DIR))? {
            position.event_files.insert(name, file_len(&path)?);
        }
        Ok(position)
    }
}

/// Brings the metric files of `run_dir` back to `position`: `metrics.jsonl` and the event files
/// are cut to their recorded lengths and event files started later are removed, so a resumed run
/// does not repeat the rows written after its checkpoint. Returns the JSONL rows removed.
pub fn rewind(run_dir: &Path, position: &MetricsPosition) -> Result<usize, MetricsError> {
    let jsonl = run_dir.join(JSONL_FILE);
    // Lines, not parsed rows: a crash may have left half a line at the end.
    let rows = |path: &Path| -> Result<usize, MetricsError> {
        Ok(match std::fs::read(path) {
            Ok(bytes) => bytes.iter().filter(|&&b| b == b'\n').count(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(io_err(path)(e)),
        })
    };
    let rows_before = rows(&jsonl)?;
    cut(&jsonl, position.jsonl_bytes)?;
    let rows_after = rows(&jsonl)?;
    for (name, path) in event_files(&run_dir.join(EVENTS_DIR))? {
        match position.event_files.get(&name) {
            Some(&bytes) => cut(&path, bytes)?,
            None => std::fs::remove_file(&path).map_err(io_err(&path))?,
        }
    }
    Ok(rows_before - rows_after)
}

/// Cuts `path` to `bytes`; a file shorter than that (or missing) is an error: rows are lost.
pub(in crate::train) fn cut(path: &Path, bytes: u64) -> Result<(), MetricsError> {
    let len = if path.exists() { file_len(path)? } else { 0 };
    if len < bytes {
        return Err(MetricsError::Record {
            path: path.to_path_buf(),
            offset: len,
            msg: format!("ends before byte {bytes}, where the checkpoint recorded its end"),
        });
    }
    if len > bytes {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io_err(path))?;
        file.set_len(bytes)
            .and_then(|_| file.sync_all())
            .map_err(io_err(path))?;
    }
    Ok(())
}

pub(in crate::train) fn file_len(path: &Path) -> Result<u64, MetricsError> {
    Ok(std::fs::metadata(path).map_err(io_err(path))?.len())
}

/// The TensorBoard event files under `dir` (none when it does not exist), by file name.
fn event_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, MetricsError> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name.filter(|n| n.starts_with("events.out.tfevents.")) {
            files.push((name, path));
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalars(pairs: &[(&str, f64)]) -> Scalars {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn masked_crc_matches_tensorflow() {
        // crc32c("") = 0 and crc32c("123456789") = 0xe3069283 (the CRC-32C check value), masked
        // as ((crc >> 15) | (crc << 17)) + 0xa282ead8.
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn event_file_decodes_to_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardWriter::create(dir.path()).unwrap();
        tb.write_scalars(
            3,
            &scalars(&[("actor/pg_loss", -0.25), ("env/x/success", 0.5)]),
        )
        .unwrap();
        tb.write_scalars(300, &scalars(&[("bad", f64::NAN), ("ok", 1.0)]))
            .unwrap();
        let events = read_events(tb.path()).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert!(events[0].wall_time > 1.0e9);
        assert_eq!(events[1].step, 3);
        assert_eq!(
            events[1].scalars,
            vec![
                ("actor/pg_loss".to_string(), -0.25),
                ("env/x/success".to_string(), 0.5)
            ]
        );
        assert_eq!(events[2].step, 300);
        assert_eq!(events[2].scalars, vec![("ok".to_string(), 1.0)]);
    }

    #[test]
    fn corrupted_event_file_is_reported_with_offset() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardWriter::create(dir.path()).unwrap();
        tb.write_scalars(1, &scalars(&[("a", 1.0)])).unwrap();
        let path = tb.path().to_path_buf();
        drop(tb);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_events(&path).unwrap_err().to_string();
        assert!(err.contains("CRC"), "{err}");
    }

    #[test]
    fn jsonl_round_trips_and_appends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        JsonlSink::open(&path)
            .unwrap()
            .write(1, &scalars(&[("a", 0.5), ("nan", f64::NAN)]))
            .unwrap();
        JsonlSink::open(&path)
            .unwrap()
            .write(2, &scalars(&[("a", 1.5)]))
            .unwrap();
        let rows = read_jsonl(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, 1);
        assert_eq!(rows[0].1, scalars(&[("a", 0.5)]));
        assert_eq!(rows[1], (2, scalars(&[("a", 1.5)])));
        std::fs::write(&path, "{\"step\": 1}\nnot json\n").unwrap();
        assert!(read_jsonl(&path).unwrap_err().to_string().contains(":2:"));
    }
}
