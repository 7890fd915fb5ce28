//! `verify` (every problem of a dataset, with file and offset) and `repair` (truncate torn
//! tails, seal again the segments the manifest lists as sealed, rewrite damaged headers in place,
//! rewrite damaged segments with their valid records, rebuild the manifest keeping its metadata).
//! Both cover the segment files of every shard (data-parallel ranks' `seg-rSSSS-NNNNNN.stp`): a
//! shard segment the manifest does not list yet (a rank wrote it after the lead last recorded
//! the shards) is a manifest problem, and `repair` lists it.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::dataset::{manifest_entry, Dataset};
use super::error::{Problem, ProblemKind, StoreError};
use super::manifest::{SegmentEntry, MANIFEST_FILE};
use super::segment::{self, MappedSegment, SegmentWriter, FORMAT_VERSION};

/// What `verify` found.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// Segment files scanned, across every shard.
    pub segments: usize,
    /// Records that decode.
    pub records: usize,
    /// Every problem found, sorted by file and offset.
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// True when no problem was found.
    pub fn is_sound(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks every frame, every record's metadata, each footer index against its frames, the
/// manifest (its checksum, and its segment list against the files: a segment it lists as sealed
/// must have its footer, byte count and record count), and that no two records share a
/// (traj_id, step_index) key.
pub fn verify(dir: &Path) -> Result<VerifyReport, StoreError> {
    let mut dataset = Dataset::open(dir)?;
    dataset.skip_undecodable();
    let mut problems = dataset.problems().to_vec();
    problems.extend(dataset.segments().filter_map(index_mismatch));
    problems.extend(duplicate_keys(&dataset));
    problems.sort_by(|a, b| (&a.path, a.offset).cmp(&(&b.path, b.offset)));
    Ok(VerifyReport {
        segments: dataset.segments().count(),
        records: dataset.len(),
        problems,
    })
}

/// Every record whose (traj_id, step_index) key an earlier record (in file order) already has;
/// records `dataset` skips (see [`Dataset::skip_undecodable`]) neither repeat nor are repeated.
pub(crate) fn duplicate_keys(dataset: &Dataset) -> Vec<Problem> {
    let mut first: HashMap<(u64, u32), (&Path, u64)> = HashMap::new();
    let mut problems = Vec::new();
    for seg in dataset.segments() {
        for frame in seg.frames() {
            let key = (frame.layout.traj_id, frame.layout.step_index);
            match first.entry(key) {
                Entry::Vacant(slot) => {
                    slot.insert((&seg.path, frame.offset));
                }
                Entry::Occupied(seen) => {
                    let (first_path, first_offset) = *seen.get();
                    problems.push(Problem {
                        path: seg.path.clone(),
                        offset: frame.offset,
                        kind: ProblemKind::DuplicateKey {
                            traj_id: key.0,
                            step_index: key.1,
                            first_path: first_path.to_path_buf(),
                            first_offset,
                        },
                    });
                }
            }
        }
    }
    problems
}

fn index_mismatch(seg: &MappedSegment) -> Option<Problem> {
    let footer = seg.scan.footer?;
    let indexed: BTreeSet<(u64, u64)> = footer.entries(seg.bytes()).collect();
    let scanned: BTreeSet<(u64, u64)> = seg
        .scan
        .frames
        .iter()
        .map(|f| (f.layout.traj_id, f.offset))
        .collect();
    (indexed != scanned).then(|| Problem {
        path: seg.path.clone(),
        offset: footer.seal_offset,
        kind: ProblemKind::BadFooter(format!(
            "index lists {} records, {} valid frames found",
            indexed.len(),
            scanned.len()
        )),
    })
}

/// What `repair` did.
#[derive(Clone, Debug, Default)]
pub struct RepairReport {
    /// One line per action, naming the file.
    pub actions: Vec<String>,
    /// Records that remain readable after the repair.
    pub records: usize,
}

enum Fix {
    /// Write the header of format `version` over the file's first bytes.
    Header { path: PathBuf, version: u32 },
    /// Cut the file at `at`, then write its footer when `seal`.
    Truncate { path: PathBuf, at: u64, seal: bool },
    Replace {
        path: PathBuf,
        tmp: PathBuf,
        records: usize,
        duplicates: usize,
    },
}

/// Repairs `dir`: a damaged header field is rewritten in place (the version the records were
/// read under, flags 0); a torn tail (or torn footer) at the end of a segment is truncated, and a
/// segment the manifest lists as sealed is sealed again (its footer written anew); a segment
/// with corrupt or undecodable records (a record whose text reference points at a corrupt frame
/// included) or with records repeating an earlier record's (traj_id, step_index) key is
/// rewritten (sealed, current format) with its valid, first-of-their-key records only; the
/// manifest is rebuilt from the segment files, keeping its metadata (what can be recovered of it
/// when it is damaged). Must not run while the dataset is in use.
pub fn repair(dir: &Path) -> Result<RepairReport, StoreError> {
    let report = verify(dir)?;
    let dataset = Dataset::open(dir)?;
    let mut fixes = Vec::new();
    for seg in dataset.segments() {
        let problems: Vec<&Problem> = report
            .problems
            .iter()
            .filter(|p| p.path == seg.path)
            .collect();
        let listed = SegmentEntry::found(seg).file;
        let sealed = (dataset.manifest().segments.iter()).any(|e| e.sealed && e.file == listed);
        fixes.extend(plan_fixes(seg, &problems, sealed)?);
    }
    drop(dataset);
    let mut actions = Vec::new();
    for fix in fixes {
        actions.push(apply_fix(fix)?);
    }
    let manifest_problem = report
        .problems
        .iter()
        .any(|p| matches!(p.kind, ProblemKind::Manifest(_)));
    if manifest_problem || !actions.is_empty() {
        actions.push(rebuild_manifest(dir)?);
    }
    let records = Dataset::open(dir)?.len();
    Ok(RepairReport { actions, records })
}

/// What to do with `seg` given its `problems`, in order; `sealed`: whether the manifest lists it
/// as sealed. A damaged header is rewritten first, unless the whole segment is rewritten.
fn plan_fixes(
    seg: &MappedSegment,
    problems: &[&Problem],
    sealed: bool,
) -> Result<Vec<Fix>, StoreError> {
    for problem in problems {
        if let ProblemKind::BadHeader(why) = &problem.kind {
            return Err(StoreError::Corrupt {
                path: seg.path.clone(),
                offset: problem.offset,
                reason: format!(
                    "bad segment header: {why}; repair leaves a segment of an unknown format alone"
                ),
            });
        }
    }
    let (header, rest): (Vec<&Problem>, Vec<&Problem>) =
        (problems.iter()).partition(|p| matches!(p.kind, ProblemKind::DamagedHeader(_)));
    let body = plan_body_fix(seg, &rest, sealed)?;
    if matches!(body, Some(Fix::Replace { .. })) || header.is_empty() {
        return Ok(body.into_iter().collect());
    }
    let version = seg.scan.format_version;
    let path = seg.path.clone();
    Ok([Fix::Header { path, version }]
        .into_iter()
        .chain(body)
        .collect())
}

/// What to do with `seg` given its `problems` past its header.
fn plan_body_fix(
    seg: &MappedSegment,
    problems: &[&Problem],
    sealed: bool,
) -> Result<Option<Fix>, StoreError> {
    let [.., last] = problems else {
        return Ok(None);
    };
    let tail_only = problems.len() == 1
        && matches!(last.kind, ProblemKind::TornTail | ProblemKind::BadFooter(_))
        && seg.scan.footer.is_none();
    if tail_only {
        return Ok(Some(Fix::Truncate {
            path: seg.path.clone(),
            at: last.offset,
            seal: sealed,
        }));
    }
    let tmp = seg.path.with_extension("stp.tmp");
    let _ = fs::remove_file(&tmp);
    let mut writer = SegmentWriter::create(&tmp, true)?;
    let duplicates: BTreeSet<u64> = problems
        .iter()
        .filter(|p| matches!(p.kind, ProblemKind::DuplicateKey { .. }))
        .map(|p| p.offset)
        .collect();
    let mut records = 0;
    for frame in &seg.scan.frames {
        if duplicates.contains(&frame.offset) {
            continue;
        }
        // Re-encoded (not copied): frame offsets change, and text references with them.
        if let Ok(record) = seg.view(frame).to_record() {
            writer.append(&record, u64::MAX)?;
            records += 1;
        }
    }
    writer.seal()?;
    Ok(Some(Fix::Replace {
        path: seg.path.clone(),
        tmp,
        records,
        duplicates: duplicates.len(),
    }))
}

fn apply_fix(fix: Fix) -> Result<String, StoreError> {
    match fix {
        Fix::Header { path, version } => {
            let mut file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(StoreError::io(&path))?;
            file.write_all(&segment::header_bytes(version))
                .and_then(|_| file.sync_all())
                .map_err(StoreError::io(&path))?;
            Ok(format!(
                "{}: header rewritten (format version {version}, flags 0)",
                path.display()
            ))
        }
        Fix::Truncate { path, at, seal } => {
            let at = if at < segment::HEADER_LEN as u64 {
                0
            } else {
                at
            };
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(StoreError::io(&path))?;
            let cut = file.metadata().map_err(StoreError::io(&path))?.len() > at;
            file.set_len(at)
                .and_then(|_| file.sync_all())
                .map_err(StoreError::io(&path))?;
            drop(file);
            if seal {
                SegmentWriter::resume(&MappedSegment::open(&path, None)?, true)?.seal()?;
            }
            let what = match (cut, seal) {
                (true, true) => format!("truncated at byte {at} and sealed"),
                (true, false) => format!("truncated at byte {at}"),
                (false, _) => format!("sealed (its footer was missing at byte {at})"),
            };
            Ok(format!("{}: {what}", path.display()))
        }
        Fix::Replace {
            path,
            tmp,
            records,
            duplicates,
        } => {
            fs::rename(&tmp, &path).map_err(StoreError::io(&path))?;
            let removed = match duplicates {
                0 => String::new(),
                n => format!(", {n} records repeating an earlier key removed"),
            };
            Ok(format!(
                "{}: rewritten with its {records} valid records{removed}",
                path.display()
            ))
        }
    }
}

/// Writes the manifest anew listing the segment files (of every shard) as they are (a shard's
/// unsealed segment with its records and bytes, as the lead lists it), with the metadata of the
/// manifest (what can be recovered of it when it is damaged); a format version newer than this
/// build's is lowered to it (every segment read, else repair would have stopped); returns the
/// action line.
fn rebuild_manifest(dir: &Path) -> Result<String, StoreError> {
    let dataset = Dataset::open(dir)?;
    let mut manifest = dataset.manifest().clone();
    manifest.format_version = manifest.format_version.min(FORMAT_VERSION);
    let held = dataset.segments().map(SegmentEntry::held);
    manifest.segments = held.map(|entry| manifest_entry(&entry)).collect();
    manifest.write(dir)?;
    Ok(format!(
        "{}: rebuilt from the segment files ({} metadata entries kept)",
        dir.join(MANIFEST_FILE).display(),
        manifest.metadata.len()
    ))
}
