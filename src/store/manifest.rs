//! `manifest.json`: the dataset's description (format version, creator, the segment list with
//! per-segment state and format version, a free-form `metadata` map for env config / tokenizer /
//! run info), its checksum, its atomic replacement, and what is recovered of it when it is damaged.
//! The per-segment format version is the checksummed second copy of each segment header's version
//! field: a reader trusts it over a damaged header (see `segment`). The segment list names the
//! segments of every shard (`seg-rSSSS-NNNNNN.stp` of data-parallel rank SSSS after the lead's
//! `seg-NNNNNN.stp`); only the lead writer writes the file, and it lists an unsealed shard
//! segment with its records and bytes as that rank's writer last reported them.
//!
//! The file is pretty-printed JSON whose first member is `"checksum": "crc32:xxxxxxxx"` (lowercase
//! hex): the crc32
//! of the file's bytes without that line (the canonical serialisation of everything else), so
//! any flipped byte is noticed. A manifest written before manifests carried a checksum is accepted
//! when it parses and holds only the known keys. A manifest that is missing, does not parse or
//! fails its checksum is not trusted: readers take the segment list from the segment files (they
//! are self-describing) and keep what [`salvage`] recovers of the rest: the creator, the format
//! version and every `metadata` entry that still parses on its own. The manifest is replaced
//! atomically: temp file in the same directory, fsync, rename. It never decides which records
//! exist; the segment files do (see `dataset`).

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::StoreError;
use super::segment::{self, MappedSegment};

/// Name of the manifest file inside a dataset directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// How every checksummed manifest starts; eight hex digits, `",` and a newline follow.
const CHECKSUM_PREFIX: &str = "{\n  \"checksum\": \"crc32:";
/// Top-level keys of a manifest written without a checksum.
const KNOWN_KEYS: [&str; 4] = ["format_version", "created_by", "segments", "metadata"];

/// State of one segment as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentEntry {
    /// File name of the segment within the dataset directory.
    pub file: String,
    /// The segment has a footer and takes no more records.
    pub sealed: bool,
    /// Record count and file size: of a sealed segment, at its seal; of an unsealed segment of
    /// a data-parallel rank's shard (`seg-rSSSS-NNNNNN.stp`), as the lead writer last recorded
    /// them; 0 for the lead's unsealed segment (its writer's position tells them).
    pub records: u64,
    /// File size in bytes (see `records`).
    pub bytes: u64,
    /// Format version of the segment's frames: the checksummed copy of its header's version
    /// field, trusted when the header is damaged (see `segment`). Absent in manifests written
    /// before it was kept; the header alone decides then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_version: Option<u32>,
}

impl SegmentEntry {
    /// The entry of a segment as its file shows it: sealed, with its valid records and its
    /// size, when it has a footer; else active.
    pub(crate) fn found(seg: &MappedSegment) -> Self {
        let sealed = seg.scan.footer.is_some();
        let file = seg.path.file_name().map(|n| n.to_string_lossy());
        Self {
            file: file.unwrap_or_default().into_owned(),
            sealed,
            records: if sealed {
                seg.scan.frames.len() as u64
            } else {
                0
            },
            bytes: if sealed { seg.bytes().len() as u64 } else { 0 },
            format_version: Some(seg.scan.format_version),
        }
    }

    /// The state of a segment as a position records it: its valid records and its file size,
    /// sealed or not (for a segment without damage: where a rewind keeps it whole).
    pub(crate) fn held(seg: &MappedSegment) -> Self {
        Self {
            records: seg.scan.frames.len() as u64,
            bytes: seg.bytes().len() as u64,
            ..Self::found(seg)
        }
    }
}

/// `manifest.json`: small, human-readable description of a dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Segment format version of the build that created the dataset.
    pub format_version: u32,
    /// Creator string (e.g. `stepppo 0.1.0`).
    pub created_by: String,
    /// The segments of every shard (the lead's and each data-parallel rank's).
    pub segments: Vec<SegmentEntry>,
    /// Free-form run information (env config, tokenizer, agent, seed, ...).
    #[serde(default)]
    pub metadata: BTreeMap<String, Value>,
}

/// Why a manifest is not trusted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManifestDamage {
    /// There is no `manifest.json` in the dataset directory.
    Missing,
    /// It does not parse, fails its checksum, or is not UTF-8.
    Invalid(String),
}

impl fmt::Display for ManifestDamage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestDamage::Missing => write!(f, "is missing"),
            ManifestDamage::Invalid(why) => write!(f, "{why}"),
        }
    }
}

/// What reading `manifest.json` gave: the manifest, or (`damage` set) what was recovered of it,
/// with no segments listed.
#[derive(Clone, Debug)]
pub struct LoadedManifest {
    /// The manifest read, or what was salvaged of it (no segments) when `damage` is set.
    pub manifest: Manifest,
    /// Why the file was not trusted; `None` when it read and checked cleanly.
    pub damage: Option<ManifestDamage>,
}

impl Manifest {
    pub(crate) fn new(created_by: String, metadata: BTreeMap<String, Value>) -> Self {
        Self {
            format_version: segment::FORMAT_VERSION,
            created_by,
            segments: Vec::new(),
            metadata,
        }
    }

    /// Reads `dir/manifest.json`: an error (naming the file) when it cannot be read or is damaged.
    pub fn read(dir: &Path) -> Result<Self, StoreError> {
        let loaded = Self::load(dir)?;
        match loaded.damage {
            None => Ok(loaded.manifest),
            Some(damage) => Err(StoreError::Invalid {
                path: dir.join(MANIFEST_FILE),
                reason: format!("manifest {damage}"),
            }),
        }
    }

    /// Reads `dir/manifest.json`, recovering what it can when the file is missing or damaged;
    /// an error only when the file exists and cannot be read.
    pub fn load(dir: &Path) -> Result<LoadedManifest, StoreError> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(LoadedManifest {
                    manifest: Self::new(recovered_by(), BTreeMap::new()),
                    damage: Some(ManifestDamage::Missing),
                })
            }
            Err(e) => return Err(StoreError::io(&path)(e)),
        };
        let parsed = std::str::from_utf8(&bytes)
            .map_err(|e| format!("is not UTF-8 at byte {}", e.valid_up_to()))
            .and_then(Self::parse);
        Ok(match parsed {
            Ok(manifest) => LoadedManifest {
                manifest,
                damage: None,
            },
            Err(why) => LoadedManifest {
                manifest: salvage(&String::from_utf8_lossy(&bytes)),
                damage: Some(ManifestDamage::Invalid(why)),
            },
        })
    }

    /// Parses the text of a manifest, checking its checksum (a manifest without one must
    /// parse and hold only the known keys); the error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some(rest) = text.strip_prefix(CHECKSUM_PREFIX) else {
            return parse_unchecked(text);
        };
        let (hex, rest) = rest
            .split_at_checked(8)
            .ok_or("the checksum line is cut short")?;
        let tail = rest
            .strip_prefix("\",\n")
            .filter(|_| hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .ok_or("the checksum line is damaged")?;
        let body = format!("{{\n{tail}");
        let actual = crc32fast::hash(body.as_bytes());
        if u32::from_str_radix(hex, 16) != Ok(actual) {
            return Err(format!(
                "fails its checksum (crc32:{hex} stored, crc32:{actual:08x} computed)"
            ));
        }
        serde_json::from_str(&body).map_err(|e| format!("does not parse: {e}"))
    }

    /// The text of the manifest file: the checksum line, then the pretty-printed manifest.
    pub fn to_text(&self) -> Result<String, serde_json::Error> {
        let body = serde_json::to_string_pretty(self)?;
        let crc = crc32fast::hash(body.as_bytes());
        let rest = body.strip_prefix("{\n").unwrap_or(&body);
        Ok(format!("{CHECKSUM_PREFIX}{crc:08x}\",\n{rest}"))
    }

    /// Replaces `dir/manifest.json` atomically and durably.
    pub fn write(&self, dir: &Path) -> Result<(), StoreError> {
        self.replace(dir, true)
    }

    /// Replaces `dir/manifest.json` atomically (temp file + rename), with fsyncs when `durable`.
    pub(crate) fn replace(&self, dir: &Path, durable: bool) -> Result<(), StoreError> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let text = self.to_text().map_err(|e| StoreError::Invalid {
            path: path.clone(),
            reason: format!("manifest does not serialise: {e}"),
        })?;
        let mut file = fs::File::create(&tmp).map_err(StoreError::io(&tmp))?;
        file.write_all(text.as_bytes())
            .and_then(|_| if durable { file.sync_all() } else { Ok(()) })
            .map_err(StoreError::io(&tmp))?;
        fs::rename(&tmp, &path).map_err(StoreError::io(&path))?;
        if !durable {
            return Ok(());
        }
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(StoreError::io(dir))
    }

    pub(crate) fn entry_mut(&mut self, file: &str) -> Option<&mut SegmentEntry> {
        self.segments.iter_mut().find(|s| s.file == file)
    }
}

fn recovered_by() -> String {
    format!(
        "stepppo {} (manifest recovered from the segment files)",
        env!("CARGO_PKG_VERSION")
    )
}

/// A manifest written before manifests carried a checksum.
fn parse_unchecked(text: &str) -> Result<Manifest, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("does not parse: {e}"))?;
    let keys = value.as_object().into_iter().flat_map(|o| o.keys());
    if let Some(key) = keys.into_iter().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
        return Err(format!("has an unknown key `{key}` and no checksum line"));
    }
    serde_json::from_value(value).map_err(|e| format!("does not parse: {e}"))
}

/// What can be recovered of a damaged manifest's text (as the writer pretty-prints it): the
/// creator, the format version and each `metadata` entry that parses on its own. Lists no
/// segments.
fn salvage(text: &str) -> Manifest {
    let mut manifest = Manifest::new(recovered_by(), BTreeMap::new());
    let top = text
        .lines()
        .filter(|l| starts_member(l, 2))
        .filter_map(member);
    for (key, value) in top.flatten() {
        match (key.as_str(), value) {
            ("created_by", Value::String(by)) => manifest.created_by = by,
            ("format_version", Value::Number(n)) => {
                let version = n.as_u64().and_then(|v| u32::try_from(v).ok());
                manifest.format_version = version.unwrap_or(manifest.format_version);
            }
            _ => {}
        }
    }
    manifest.metadata = salvage_metadata(text);
    manifest
}

/// The entries of the `metadata` object, one member (which may span lines) at a time.
fn salvage_metadata(text: &str) -> BTreeMap<String, Value> {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("  \"metadata\": {"));
    let mut out = BTreeMap::new();
    if lines.next().is_none() {
        return out;
    }
    let mut chunk = String::new();
    for line in lines.take_while(|l| !l.starts_with("  }")) {
        if starts_member(line, 4) && !chunk.is_empty() {
            out.extend(member(&chunk).into_iter().flatten());
            chunk.clear();
        }
        chunk.push_str(line);
        chunk.push('\n');
    }
    out.extend(member(&chunk).into_iter().flatten());
    out
}

/// Whether `line` starts an object member at `indent` spaces.
fn starts_member(line: &str, indent: usize) -> bool {
    let bytes = line.as_bytes();
    bytes.len() > indent && bytes[..indent].iter().all(|&b| b == b' ') && bytes[indent] == b'"'
}

/// `"key": value` (a trailing comma allowed) as a one-member map, when it parses.
fn member(text: &str) -> Option<Map<String, Value>> {
    let text = text.trim_end();
    let text = text.strip_suffix(',').unwrap_or(text);
    serde_json::from_str(&format!("{{{text}}}")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let metadata = [
            ("agent".to_string(), Value::from("random")),
            (
                "collect".to_string(),
                serde_json::json!({"env": "sokoban", "episodes": 512, "gamma": 0.1}),
            ),
            ("seed".to_string(), Value::from(7)),
        ];
        let mut manifest = Manifest::new("stepppo test".into(), metadata.into_iter().collect());
        manifest.segments.push(SegmentEntry {
            file: "seg-000000.stp".into(),
            sealed: true,
            records: 12,
            bytes: 4096,
            format_version: Some(3),
        });
        manifest
    }

    #[test]
    fn the_checksum_line_comes_first_and_the_text_parses_back() {
        let text = sample().to_text().unwrap();
        assert!(text.starts_with(CHECKSUM_PREFIX), "{text}");
        assert_eq!(Manifest::parse(&text).unwrap(), sample());
        let old = serde_json::to_string(&sample()).unwrap();
        assert_eq!(Manifest::parse(&old).unwrap(), sample());
    }

    #[test]
    fn every_flipped_byte_is_noticed() {
        let text = sample().to_text().unwrap();
        for at in 0..text.len() {
            for mask in [0x01, 0x20, 0x80] {
                let mut bytes = text.clone().into_bytes();
                bytes[at] ^= mask;
                let parsed = std::str::from_utf8(&bytes)
                    .map_err(|e| e.to_string())
                    .and_then(Manifest::parse);
                assert!(parsed.is_err(), "byte {at} ^ {mask:#x} went unnoticed");
            }
        }
    }

    #[test]
    fn a_damaged_manifest_keeps_its_creator_and_every_intact_metadata_entry() {
        let text = sample().to_text().unwrap();
        let at = text.find("\"episodes\"").unwrap();
        let mut damaged = text.clone().into_bytes();
        damaged[at + 3] = b'"';
        let damaged = String::from_utf8(damaged).unwrap();
        assert!(Manifest::parse(&damaged).is_err());
        let recovered = salvage(&damaged);
        assert_eq!(recovered.created_by, "stepppo test");
        let keys: Vec<&str> = recovered.metadata.keys().map(String::as_str).collect();
        assert_eq!(keys, ["agent", "seed"]);
        assert!(recovered.segments.is_empty());
        assert_eq!(salvage(&text).metadata, sample().metadata);
    }

    #[test]
    fn an_old_manifest_with_an_unknown_key_is_damaged() {
        let old = serde_json::to_string(&sample()).unwrap();
        let renamed = old.replace("\"created_by\"", "\"created_bz\"");
        let err = Manifest::parse(&renamed).unwrap_err();
        assert!(err.contains("created_bz"), "{err}");
    }
}
