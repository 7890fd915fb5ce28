//! A dataset: a directory of segment files plus `manifest.json`; the writer that appends records
//! and rolls segments, and the reader that iterates records, trajectories and groups
//! (reassembled across segments) and finds trajectories by id through the footer index.
//!
//! Segment files are `seg-NNNNNN.stp`, written by the lead writer (a single process, or rank 0 of
//! a data-parallel run), and `seg-rSSSS-NNNNNN.stp` (`SSSS`: 4 or more digits), written by the
//! writer of shard SSSS (rank SSSS), each rank into its own files of the one directory
//! ([`SegmentId`]; other names are ignored). The lead alone writes the manifest, listing the
//! shards' segments as their writers' positions report them ([`DatasetWriter::record_shards`]);
//! its position, and [`rewind`] to it, cover every shard.
//!
//! The segment files themselves are the truth for the records: a reader opens every segment
//! file of the directory, of every shard, in the order lead first, then by shard and number, and
//! reports disagreements with the manifest (see `manifest`): a segment it lists that is missing,
//! a sealed one whose footer, record count or size differs from the file, an unsealed one shorter
//! than listed, a file it does not list (a shard's segment written after the lead last recorded
//! the shards, say). A damaged or missing manifest does not stop a reader: the segment list is
//! then taken from the segment files, and the damage is a [`ProblemKind::Manifest`] problem. Each
//! segment is scanned with the format version the manifest lists for it, which a damaged header
//! gives way to (see `segment`). Readers may also skip records whose metadata does not decode
//! ([`Dataset::skip_undecodable`]); a trajectory that lost a step that way says which
//! ([`Trajectory::missing_step`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::codec::Frame;
use super::codec::StepView;
use super::error::{Problem, ProblemKind, StoreError};
use super::manifest::{LoadedManifest, Manifest, ManifestDamage, SegmentEntry, MANIFEST_FILE};
use super::record::StepRecord;
use super::segment::{self, MappedSegment, SegmentWriter};

/// Default segment size at which the writer rolls to a new segment.
pub const DEFAULT_ROLL_BYTES: u64 = 64 << 20;

/// Which segment file: the shard that writes it (`None`: the lead writer, or a single process)
/// and its number within that shard. The order is the file order of a dataset: the lead's
/// segments first, then each shard's, each by number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId {
    /// The shard that writes the file (`None`: the lead writer).
    pub shard: Option<u32>,
    /// The segment's number within its shard.
    pub number: u64,
}

impl SegmentId {
    /// The file name: `seg-NNNNNN.stp`, or `seg-rSSSS-NNNNNN.stp` for shard SSSS.
    pub fn file_name(self) -> String {
        match self.shard {
            None => format!("seg-{:06}.stp", self.number),
            Some(shard) => format!("seg-r{shard:04}-{:06}.stp", self.number),
        }
    }

    /// The segment a file name names (`seg-` and at least 6 digits, or `seg-r`, at least 4
    /// digits, `-` and at least 6 digits, then `.stp`); `None` for any other name.
    pub fn parse(name: &str) -> Option<Self> {
        let stem = name.strip_prefix("seg-")?.strip_suffix(".stp")?;
        let (shard, number) = match stem.strip_prefix('r') {
            Some(rest) => {
                let (shard, number) = rest.split_once('-')?;
                (Some(parse_digits(shard, 4)?), number)
            }
            None => (None, stem),
        };
        let number = parse_digits(number, 6)?;
        Some(Self { shard, number })
    }
}

/// `digits` as a number when it is at least `min` ASCII digits and fits `T`.
fn parse_digits<T: std::str::FromStr>(digits: &str, min: usize) -> Option<T> {
    let all_digits = digits.len() >= min && digits.bytes().all(|b| b.is_ascii_digit());
    all_digits.then(|| digits.parse().ok()).flatten()
}

/// The shard whose writer a manifest entry's file belongs to: `None` for the lead's segments
/// and for a name that is no segment's (the lead's manifest lists it, as it listed it before).
fn shard_of(file: &str) -> Option<u32> {
    SegmentId::parse(file).and_then(|id| id.shard)
}

/// Segment files of `dir` (of every shard), in file order (see [`SegmentId`]); other names are
/// left out.
pub fn segment_files(dir: &Path) -> Result<Vec<(SegmentId, PathBuf)>, StoreError> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(StoreError::io(dir))? {
        let entry = entry.map_err(StoreError::io(dir))?;
        let name = entry.file_name();
        if let Some(id) = name.to_str().and_then(SegmentId::parse) {
            found.push((id, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Which segment files a [`Dataset`] opens: all of them (a reader), or those one writer writes
/// (`open_append` checks only its own; the shards' writers run beside it).
#[derive(Clone, Copy, Debug)]
enum Part {
    All,
    Shard(Option<u32>),
}

impl Part {
    /// Whether a segment of `shard` belongs to this part.
    fn holds(self, shard: Option<u32>) -> bool {
        match self {
            Part::All => true,
            Part::Shard(own) => own == shard,
        }
    }
}

/// Where a [`DatasetWriter`] stood at one moment: every segment with its state, bytes and record
/// count then (a shard writer's: its own segments; the lead's: its own and every shard's as
/// last recorded, see [`DatasetWriter::record_shards`]). A training checkpoint keeps one, and
/// [`rewind`] brings the directory back to it, so records written after the checkpoint are not
/// kept twice when the run resumes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DatasetPosition {
    /// Every segment's manifest entry at that moment.
    pub segments: Vec<SegmentEntry>,
}

impl DatasetPosition {
    /// Records the dataset held at this position.
    pub fn records(&self) -> u64 {
        self.segments.iter().map(|s| s.records).sum()
    }
}

/// Brings the dataset in `dir` back to `position`, every shard's files with the lead's: segment
/// files the position does not list are removed, each segment that was active then is cut at
/// its recorded length (dropping later records, a torn tail and a footer added since), and the
/// manifest lists the segments as they were, with its metadata kept (what can be recovered of it
/// when the manifest is damaged). Returns the number of records removed. Idempotent, so a crash
/// during a rewind is repaired by rewinding again. Fails, naming the file, when a segment is
/// missing or shorter than recorded (records the position counts are gone) or a sealed one has
/// changed. No writer may be writing to `dir` meanwhile. In a data-parallel dataset `position`
/// must be the lead writer's: a shard writer's lists only its own segments, and every other
/// segment file would go.
pub fn rewind(dir: &Path, position: &DatasetPosition) -> Result<u64, StoreError> {
    let mut removed = 0;
    for (_, path) in segment_files(dir)? {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if !position
            .segments
            .iter()
            .any(|e| Some(&e.file) == name.as_ref())
        {
            removed += MappedSegment::open(&path, None)?.scan.frames.len() as u64;
            fs::remove_file(&path).map_err(StoreError::io(&path))?;
        }
    }
    for entry in &position.segments {
        removed += cut_segment(&dir.join(&entry.file), entry)?;
    }
    let mut manifest = Manifest::load(dir)?.manifest;
    manifest.segments = position.segments.iter().map(manifest_entry).collect();
    manifest.write(dir)?;
    Ok(removed)
}

/// Cuts one segment file back to `entry` (its state at a position); returns the records dropped.
fn cut_segment(path: &Path, entry: &SegmentEntry) -> Result<u64, StoreError> {
    let invalid = |reason: String| StoreError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let len = fs::metadata(path).map_err(StoreError::io(path))?.len();
    if len < entry.bytes {
        return Err(invalid(format!(
            "holds {len} bytes, fewer than the {} recorded at the position to rewind to: \
             records it counted are lost",
            entry.bytes
        )));
    }
    if len == entry.bytes {
        return Ok(0);
    }
    if entry.sealed {
        return Err(invalid(format!(
            "was sealed at {} bytes and now holds {len}",
            entry.bytes
        )));
    }
    let segment = MappedSegment::open(path, entry.format_version)?;
    let dropped = segment
        .scan
        .frames
        .iter()
        .filter(|f| f.offset >= entry.bytes)
        .count() as u64;
    // The kept prefix goes to a new file that replaces the segment by rename, never a truncation
    // in place: a reader that has the segment mapped (`stepppo view` on a live run, a `replay`)
    // keeps its old pages instead of faulting on bytes cut from under it.
    let tmp = path.with_extension("stp.rewind");
    let kept = &segment.bytes()[..entry.bytes as usize];
    fs::write(&tmp, kept)
        .and_then(|_| fs::File::open(&tmp)?.sync_all())
        .map_err(StoreError::io(&tmp))?;
    drop(segment);
    fs::rename(&tmp, path).map_err(StoreError::io(path))?;
    Ok(dropped)
}

/// The manifest's entry for a segment in the state `entry` records: an unsealed segment of the
/// lead is listed with zero counts, as the lead writer lists its active segment; a shard's with
/// its counts, as [`DatasetWriter::record_shards`] lists them.
pub(crate) fn manifest_entry(entry: &SegmentEntry) -> SegmentEntry {
    if entry.sealed || shard_of(&entry.file).is_some() {
        entry.clone()
    } else {
        SegmentEntry {
            records: 0,
            bytes: 0,
            ..entry.clone()
        }
    }
}

/// Options of [`DatasetWriter`].
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Roll to a new segment before a segment would exceed this many bytes.
    pub roll_bytes: u64,
    /// Written into the manifest on create (not by a shard writer).
    pub created_by: String,
    /// Merged into the manifest's `metadata` map (not by a shard writer).
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// fsync sealed segments and every manifest replacement (default). `false` leaves the bytes
    /// in the OS page cache: readable at once, lost on a power cut (not on a process crash).
    pub durable: bool,
    /// The shard this writer writes: `None` (default) for the lead writer (a single process, or
    /// rank 0 of a data-parallel run), which writes `seg-NNNNNN.stp` files and the manifest;
    /// `Some(rank)` for another rank, which writes only its `seg-rRRRR-NNNNNN.stp` files and
    /// never the manifest: the lead lists them ([`DatasetWriter::record_shards`]).
    pub shard: Option<u32>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        Self {
            roll_bytes: DEFAULT_ROLL_BYTES,
            created_by: format!("stepppo {}", env!("CARGO_PKG_VERSION")),
            metadata: BTreeMap::new(),
            durable: true,
            shard: None,
        }
    }
}

/// Where [`DatasetWriter::append`] put a record: the writer's shard and segment number (file
/// `seg-NNNNNN.stp`, or `seg-rSSSS-NNNNNN.stp` in shard SSSS) and frame offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordLocation {
    /// The writer's shard (`None`: the lead).
    pub shard: Option<u32>,
    /// Number of the segment the record went into.
    pub segment: u64,
    /// Byte offset of the record's frame in the segment file.
    pub offset: u64,
}

/// Appends records to a dataset, rolling segments at `roll_bytes`; seals the active segment
/// on [`DatasetWriter::seal`] or drop. The lead writer (no shard) writes the manifest on
/// create, when a segment starts, when one is sealed and when it records the other shards'
/// segments, never per record; a shard writer never writes it.
///
/// Data-parallel ranks write one dataset: rank 0 through the lead writer, rank r > 0 through a
/// writer of shard r, each into its own segment files. Once per step the lead records what the
/// shard writers' [`position`](Self::position)s returned ([`record_shards`](Self::record_shards)),
/// so the manifest lists every shard's segments and the lead's position covers every rank.
#[derive(Debug)]
pub struct DatasetWriter {
    dir: PathBuf,
    /// The shard written (`None`: the lead, which alone writes the manifest).
    shard: Option<u32>,
    /// The manifest as this writer keeps it, `segments` listing its own segments only.
    manifest: Manifest,
    /// The other shards' segments as the lead last recorded them (empty for a shard writer).
    shards: Vec<SegmentEntry>,
    roll_bytes: u64,
    durable: bool,
    /// The segment being written and its number.
    active: Option<(u64, SegmentWriter)>,
    next_number: u64,
}

impl DatasetWriter {
    /// Creates a new dataset in `dir` (created if missing). The lead writer needs a directory
    /// that holds no dataset yet (no manifest, no segment file of any shard: create it before
    /// the other ranks append) and writes the manifest; a shard writer needs only that `dir`
    /// holds no segment of its shard, and writes nothing until its first record.
    pub fn create(dir: &Path, opts: WriterOptions) -> Result<Self, StoreError> {
        fs::create_dir_all(dir).map_err(StoreError::io(dir))?;
        let manifest = dir.join(MANIFEST_FILE);
        let files = segment_files(dir)?;
        let taken = match opts.shard {
            None if manifest.exists() => Some(&manifest),
            None => files.first().map(|(_, path)| path),
            Some(shard) => (files.iter())
                .find(|(id, _)| id.shard == Some(shard))
                .map(|(_, path)| path),
        };
        if let Some(path) = taken {
            let file = path.file_name().unwrap_or_default().to_string_lossy();
            let what = opts
                .shard
                .map_or("a dataset".into(), |s| format!("shard {s}'s segments"));
            return Err(StoreError::Invalid {
                path: dir.to_path_buf(),
                reason: format!("already holds {what} ({file})"),
            });
        }
        let writer = Self {
            dir: dir.to_path_buf(),
            shard: opts.shard,
            manifest: Manifest::new(opts.created_by, opts.metadata),
            shards: Vec::new(),
            roll_bytes: opts.roll_bytes,
            durable: opts.durable,
            active: None,
            next_number: 0,
        };
        writer.store_manifest()?;
        Ok(writer)
    }

    /// Opens an existing, undamaged dataset to append more records (a problem with the
    /// writer's own segments, or with the manifest's entries of them, refuses). The writer's
    /// unsealed last segment of the current format version is resumed; one of an older version
    /// is sealed as it is (one file holds frames of one version) and the next record starts a
    /// new segment, numbered after the writer's last. The lead merges `opts.metadata` into the
    /// manifest, lists every one of its segments' format versions, and keeps the other shards'
    /// entries as the manifest lists them; a shard writer takes its segments' state from its
    /// files.
    pub fn open_append(dir: &Path, opts: WriterOptions) -> Result<Self, StoreError> {
        let dataset = Dataset::open_part(dir, Part::Shard(opts.shard))?;
        if let Some(problem) = dataset.problems().first() {
            return Err(StoreError::Damaged {
                problem: problem.clone(),
            });
        }
        let mut manifest = dataset.manifest.clone();
        manifest.metadata.extend(opts.metadata);
        manifest.format_version = segment::FORMAT_VERSION;
        let (own, shards) = match opts.shard {
            None => lead_entries(&dataset, manifest.segments),
            Some(_) => (dataset.segments().map(SegmentEntry::held).collect(), vec![]),
        };
        manifest.segments = own;
        let last = dataset.segments.last();
        let resumed = match last {
            Some((id, seg)) if seg.scan.footer.is_none() => {
                Some((id.number, SegmentWriter::resume(seg, opts.durable)?))
            }
            _ => None,
        };
        let mut writer = Self {
            dir: dir.to_path_buf(),
            shard: opts.shard,
            manifest,
            shards,
            roll_bytes: opts.roll_bytes,
            durable: opts.durable,
            active: None,
            next_number: last.map_or(0, |(id, _)| id.number + 1),
        };
        match resumed {
            Some(active) if active.1.appendable() => writer.active = Some(active),
            Some((_, older)) => writer.seal_writer(older)?,
            None => {}
        }
        writer.store_manifest()?;
        Ok(writer)
    }

    /// Sets one entry of the manifest's `metadata` map (written at the next roll or seal; a
    /// shard writer writes no manifest).
    pub fn set_metadata(&mut self, key: &str, value: serde_json::Value) {
        self.manifest.metadata.insert(key.to_string(), value);
    }

    /// The dataset directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shard this writer writes (`None`: the lead).
    pub fn shard(&self) -> Option<u32> {
        self.shard
    }

    /// Lists `entries` (what the shard writers' [`position`](Self::position)s returned) as the
    /// segments of their shards in the manifest, in place of the entries it held for those
    /// shards (a shard `entries` does not name keeps its entries), and replaces the manifest.
    /// From then on [`position`](Self::position) includes them. Only the lead writer records
    /// shards; an entry whose file is not a shard's segment (`seg-rSSSS-NNNNNN.stp`), or a file
    /// listed twice, is refused and nothing is recorded.
    pub fn record_shards(&mut self, entries: Vec<SegmentEntry>) -> Result<(), StoreError> {
        let invalid = |path: PathBuf, reason: String| StoreError::Invalid { path, reason };
        if let Some(shard) = self.shard {
            let reason = format!("the writer of shard {shard} cannot record shards: the lead does");
            return Err(invalid(self.dir.join(MANIFEST_FILE), reason));
        }
        let mut named = BTreeSet::new();
        for entry in &entries {
            match shard_of(&entry.file) {
                Some(shard) => named.insert(shard),
                None => {
                    let reason = "is not a shard's segment file (seg-rSSSS-NNNNNN.stp)".into();
                    return Err(invalid(self.dir.join(&entry.file), reason));
                }
            };
        }
        let mut shards: Vec<SegmentEntry> = (self.shards.iter())
            .filter(|e| !shard_of(&e.file).is_some_and(|s| named.contains(&s)))
            .cloned()
            .chain(entries)
            .collect();
        shards.sort_by_key(|e| SegmentId::parse(&e.file));
        if let Some(twice) = shards.windows(2).find(|w| w[0].file == w[1].file) {
            let reason = "is listed twice in the shards' segments to record".into();
            return Err(invalid(self.dir.join(&twice[0].file), reason));
        }
        self.shards = shards;
        self.store_manifest()
    }

    /// Appends one record (encoded straight into the active segment's buffer).
    pub fn append(&mut self, record: &StepRecord) -> Result<RecordLocation, StoreError> {
        let shard = self.shard;
        if let Some((segment, writer)) = &mut self.active {
            if let Some(offset) = writer.append(record, self.roll_bytes)? {
                let segment = *segment;
                return Ok(RecordLocation {
                    shard,
                    segment,
                    offset,
                });
            }
            self.seal_active()?;
        }
        let (segment, mut writer) = self.start_segment()?;
        let appended = writer.append(record, u64::MAX);
        let path = writer.path().to_path_buf();
        self.active = Some((segment, writer));
        let offset = appended?.ok_or_else(|| StoreError::Invalid {
            path,
            reason: "a fresh segment refused a record".into(),
        })?;
        Ok(RecordLocation {
            shard,
            segment,
            offset,
        })
    }

    fn start_segment(&mut self) -> Result<(u64, SegmentWriter), StoreError> {
        let number = self.next_number;
        let file = SegmentId {
            shard: self.shard,
            number,
        }
        .file_name();
        self.next_number += 1;
        let writer = SegmentWriter::create(&self.dir.join(&file), self.durable)?;
        self.manifest.segments.push(SegmentEntry {
            file,
            sealed: false,
            records: 0,
            bytes: 0,
            format_version: Some(writer.format_version()),
        });
        self.store_manifest()?;
        Ok((number, writer))
    }

    fn seal_active(&mut self) -> Result<(), StoreError> {
        match self.active.take() {
            Some((_, writer)) => self.seal_writer(writer),
            None => Ok(()),
        }
    }

    fn seal_writer(&mut self, writer: SegmentWriter) -> Result<(), StoreError> {
        let file = writer
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let format_version = Some(writer.format_version());
        let (records, bytes) = writer.seal()?;
        let entry = SegmentEntry {
            file: file.clone(),
            sealed: true,
            records,
            bytes,
            format_version,
        };
        match self.manifest.entry_mut(&file) {
            Some(listed) => *listed = entry,
            None => self.manifest.segments.push(entry),
        }
        self.store_manifest()
    }

    /// Replaces the manifest (the lead's segments, then the other shards' as recorded); a shard
    /// writer writes none.
    fn store_manifest(&self) -> Result<(), StoreError> {
        if self.shard.is_some() {
            return Ok(());
        }
        let mut manifest = self.manifest.clone();
        manifest.segments.extend(self.shards.iter().cloned());
        manifest.replace(&self.dir, self.durable)
    }

    /// Flushes (and, when durable, syncs) every appended record and returns where the dataset
    /// stands now: the position [`rewind`] can bring it back to. A shard writer's lists its own
    /// segments; the lead's lists its own, then every shard's as last recorded.
    pub fn position(&mut self) -> Result<DatasetPosition, StoreError> {
        let mut segments = self.manifest.segments.clone();
        if let Some((_, writer)) = &mut self.active {
            writer.flush()?;
            if self.durable {
                writer.sync()?;
            }
            let file = writer.path().file_name().map(|n| n.to_string_lossy());
            if let Some(entry) = segments
                .iter_mut()
                .find(|e| Some(&e.file[..]) == file.as_deref())
            {
                entry.records = writer.records();
                entry.bytes = writer.len();
            }
        }
        segments.extend(self.shards.iter().cloned());
        Ok(DatasetPosition { segments })
    }

    /// Makes every appended record visible to readers (no fsync).
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.active.as_mut().map_or(Ok(()), |(_, w)| w.flush())
    }

    /// Seals the active segment and (the lead) writes the manifest.
    pub fn seal(mut self) -> Result<(), StoreError> {
        match self.active.take() {
            Some((_, writer)) => self.seal_writer(writer),
            None => self.store_manifest(),
        }
    }
}

/// The lead writer's own entries and the other shards' among `listed` (the manifest's), with
/// the format version of each of the lead's segments in `dataset` listed: a manifest written
/// before it listed versions gets them, to read damaged headers by.
fn lead_entries(
    dataset: &Dataset,
    listed: Vec<SegmentEntry>,
) -> (Vec<SegmentEntry>, Vec<SegmentEntry>) {
    let (mut own, shards): (Vec<_>, Vec<_>) =
        (listed.into_iter()).partition(|e| shard_of(&e.file).is_none());
    for seg in dataset.segments() {
        let found = SegmentEntry::found(seg);
        if let Some(entry) = own.iter_mut().find(|e| e.file == found.file) {
            entry.format_version = found.format_version;
        }
    }
    (own, shards)
}

impl Drop for DatasetWriter {
    fn drop(&mut self) {
        // Best effort: an unsealed segment stays fully readable, so an error here loses nothing.
        let _ = self.seal_active();
    }
}

/// The steps of one trajectory, ordered by `step_index`.
#[derive(Clone, Debug)]
pub struct Trajectory<'a> {
    /// The trajectory's id.
    pub traj_id: u64,
    /// Its group's id.
    pub group_id: u64,
    /// Its stored steps, ordered by `step_index`.
    pub steps: Vec<StepView<'a>>,
}

impl Trajectory<'_> {
    /// Whether the trajectory has no end yet: its last stored step is neither terminated nor
    /// truncated. That is a trajectory still being written (a reader of a live dataset), or one
    /// whose writer stopped mid-episode; either way its return and length are not final.
    pub fn is_open(&self) -> Result<bool, StoreError> {
        match self.steps.last() {
            Some(last) => {
                let meta = last.meta_view()?;
                Ok(!meta.terminated && !meta.truncated)
            }
            None => Ok(false),
        }
    }

    /// The first step index absent from the stored steps (`None` when they hold every index
    /// from 0 to the last): a step lost to damage (a corrupt frame, a record that does not
    /// decode). The trajectory's return, length and advantages are then not its episode's.
    pub fn missing_step(&self) -> Option<u32> {
        first_missing_step(self.steps.iter().map(|s| s.step_index))
    }

    /// The full token context in front of step `t`'s response: the `obs_ids ++ response_ids`
    /// of the earlier steps of its context (from the last step with `context_len == 0`, the
    /// start of a re-rendered window) followed by step `t`'s `obs_ids`. Empty when `t` is out
    /// of range.
    pub fn context(&self, t: usize) -> Vec<u32> {
        let Some(step) = self.steps.get(t) else {
            return Vec::new();
        };
        let start = self.steps[..=t]
            .iter()
            .rposition(|s| s.context_len == 0)
            .unwrap_or(0);
        let mut tokens = Vec::with_capacity(step.context_len as usize + step.obs_ids.len());
        for earlier in &self.steps[start..t] {
            tokens.extend(earlier.obs_ids.iter().chain(earlier.response_ids.iter()));
        }
        tokens.extend(step.obs_ids.iter());
        tokens
    }
}

/// The first index absent from the ascending step indices `sorted` (`None` when they hold every
/// index from 0 to the last).
pub fn first_missing_step(sorted: impl IntoIterator<Item = u32>) -> Option<u32> {
    let mut next = 0u32;
    for index in sorted {
        if index > next {
            return Some(next);
        }
        next = next.max(index.saturating_add(1));
    }
    None
}

/// The trajectories of one group, ordered by `traj_id`.
#[derive(Clone, Debug)]
pub struct Group<'a> {
    /// The group's id.
    pub group_id: u64,
    /// Its trajectories, ordered by `traj_id`.
    pub trajectories: Vec<Trajectory<'a>>,
}

/// A read-only snapshot of a dataset: every segment mapped and scanned at open.
#[derive(Debug)]
pub struct Dataset {
    dir: PathBuf,
    manifest: Manifest,
    segments: Vec<(SegmentId, MappedSegment)>,
    problems: Vec<Problem>,
}

impl Dataset {
    /// Maps and validates every segment of `dir`, of every shard. Damage does not fail the
    /// open: it is listed in [`Dataset::problems`] and every valid record stays readable; a
    /// missing or damaged manifest is replaced by the segment list of the files (with what can
    /// be recovered of its metadata). Fails when the directory holds neither a manifest nor a
    /// segment file.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_part(dir, Part::All)
    }

    /// [`Dataset::open`] of the segment files of `part` alone, checked against the manifest's
    /// entries of them (and the manifest's own soundness).
    fn open_part(dir: &Path, part: Part) -> Result<Self, StoreError> {
        let loaded = Manifest::load(dir)?;
        let mut segments = Vec::new();
        let mut problems = Vec::new();
        for (id, path) in segment_files(dir)? {
            if !part.holds(id.shard) {
                continue;
            }
            let seg = MappedSegment::open(&path, listed_version(&loaded.manifest, &path))?;
            problems.extend(seg.scan.problems.iter().map(|(offset, kind)| Problem {
                path: path.clone(),
                offset: *offset,
                kind: kind.clone(),
            }));
            segments.push((id, seg));
        }
        let manifest = checked_manifest(dir, loaded, (&segments, part), &mut problems)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            segments,
            problems,
        })
    }

    /// Leaves the records whose metadata does not decode (a text reference to a damaged frame,
    /// say) out of every reader of this dataset ([`records`](Self::records),
    /// [`trajectories`](Self::trajectories), ...), adds each to [`problems`](Self::problems)
    /// as [`ProblemKind::Undecodable`] and returns them, in file order.
    pub fn skip_undecodable(&mut self) -> Vec<Problem> {
        let mut skipped = Vec::new();
        for (_, seg) in &mut self.segments {
            for (offset, why) in seg.skip_undecodable() {
                skipped.push(Problem {
                    path: seg.path.clone(),
                    offset,
                    kind: ProblemKind::Undecodable(why),
                });
            }
        }
        self.problems.extend(skipped.iter().cloned());
        skipped
    }

    /// The dataset directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest as checked at open (rebuilt from the segment files when missing or damaged).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Torn tails, corrupt frames and manifest disagreements found at open.
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }

    /// The mapped segments in file order.
    pub fn segments(&self) -> impl Iterator<Item = &MappedSegment> {
        self.segments.iter().map(|(_, s)| s)
    }

    /// Number of valid records (skipped ones left out).
    pub fn len(&self) -> usize {
        self.segments().map(|s| s.frames().count()).sum()
    }

    /// Whether the dataset holds no valid record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every valid record in file order, viewed in place.
    pub fn records(&self) -> impl Iterator<Item = StepView<'_>> {
        self.segments()
            .flat_map(|seg| seg.frames().map(move |f| seg.view(f)))
    }

    /// All trajectories ordered by `traj_id`, each with its steps ordered by `step_index`.
    pub fn trajectories(&self) -> Vec<Trajectory<'_>> {
        let mut located: Vec<(u64, u32, usize, &Frame)> = self
            .segments()
            .enumerate()
            .flat_map(|(i, seg)| {
                seg.frames()
                    .map(move |f| (f.layout.traj_id, f.layout.step_index, i, f))
            })
            .collect();
        located.sort_by_key(|&(traj, step, seg, f)| (traj, step, seg, f.offset));
        let segs: Vec<&MappedSegment> = self.segments().collect();
        let mut out: Vec<Trajectory<'_>> = Vec::new();
        for (traj_id, _, seg, frame) in located {
            let view = segs[seg].view(frame);
            match out.last_mut() {
                Some(t) if t.traj_id == traj_id => t.steps.push(view),
                _ => out.push(Trajectory {
                    traj_id,
                    group_id: view.group_id,
                    steps: vec![view],
                }),
            }
        }
        out
    }

    /// All groups ordered by `group_id`, each with its trajectories ordered by `traj_id`.
    pub fn groups(&self) -> Vec<Group<'_>> {
        let mut by_group: BTreeMap<u64, Vec<Trajectory<'_>>> = BTreeMap::new();
        for traj in self.trajectories() {
            by_group.entry(traj.group_id).or_default().push(traj);
        }
        by_group
            .into_iter()
            .map(|(group_id, trajectories)| Group {
                group_id,
                trajectories,
            })
            .collect()
    }

    /// One trajectory by id: through the footer index of sealed segments, by scanning the
    /// frames of unsealed ones.
    pub fn trajectory(&self, traj_id: u64) -> Option<Trajectory<'_>> {
        let mut steps: Vec<StepView<'_>> = Vec::new();
        for seg in self.segments() {
            let frames = seg.lookup(traj_id).unwrap_or_else(|| {
                let all = seg.frames();
                all.filter(|f| f.layout.traj_id == traj_id)
                    .copied()
                    .collect()
            });
            steps.extend(frames.iter().map(|f| seg.view(f)));
        }
        steps.sort_by_key(|s| s.step_index);
        let group_id = steps.first()?.group_id;
        Some(Trajectory {
            traj_id,
            group_id,
            steps,
        })
    }
}

/// The format version `manifest` lists for the segment file at `path` (none for a damaged
/// manifest, which lists no segments, or one written before it kept versions).
fn listed_version(manifest: &Manifest, path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let entry = manifest.segments.iter().find(|e| e.file == name)?;
    entry.format_version
}

/// The manifest of a dataset whose segments (of `part`) are `segments`: the one read, with its
/// disagreements with the files (its entries of `part`) added to `problems`; or, when it is missing or damaged, what was recovered of
/// it listing the segment files, with the damage added to `problems`.
fn checked_manifest(
    dir: &Path,
    loaded: LoadedManifest,
    (segments, part): (&[(SegmentId, MappedSegment)], Part),
    problems: &mut Vec<Problem>,
) -> Result<Manifest, StoreError> {
    let path = dir.join(MANIFEST_FILE);
    let Some(damage) = loaded.damage else {
        problems.extend(manifest_problems(&path, &loaded.manifest, (segments, part)));
        return Ok(loaded.manifest);
    };
    if segments.is_empty() && damage == ManifestDamage::Missing {
        return Err(StoreError::Invalid {
            path: dir.to_path_buf(),
            reason: format!("not a dataset: no {MANIFEST_FILE} and no segment files"),
        });
    }
    problems.push(Problem {
        path,
        offset: 0,
        kind: ProblemKind::Manifest(format!(
            "{damage}; the segment list is read from the segment files"
        )),
    });
    let mut manifest = loaded.manifest;
    manifest.segments = segments
        .iter()
        .map(|(_, s)| SegmentEntry::found(s))
        .collect();
    Ok(manifest)
}

/// Where `manifest` disagrees with `segments`, the files of `part`: newer than this build, an
/// entry of `part` that is missing or differs from its file, a file it does not list.
fn manifest_problems(
    manifest_path: &Path,
    manifest: &Manifest,
    (segments, part): (&[(SegmentId, MappedSegment)], Part),
) -> Vec<Problem> {
    let problem = |why: String| Problem {
        path: manifest_path.to_path_buf(),
        offset: 0,
        kind: ProblemKind::Manifest(why),
    };
    let mut problems = Vec::new();
    if manifest.format_version > segment::FORMAT_VERSION {
        let v = manifest.format_version;
        problems.push(problem(format!(
            "format version {v} is newer than this build"
        )));
    }
    let entries = (manifest.segments.iter()).filter(|e| part.holds(shard_of(&e.file)));
    for entry in entries {
        let on_disk = segments
            .iter()
            .find(|(_, s)| s.path.file_name().is_some_and(|n| n == entry.file.as_str()));
        let Some((_, seg)) = on_disk else {
            problems.push(problem(format!("lists {} which is missing", entry.file)));
            continue;
        };
        problems.extend(version_problem(entry, seg, &problem));
        if entry.sealed {
            problems.extend(sealed_problems(entry, seg, &problem));
        } else {
            problems.extend(unsealed_problem(entry, seg, &problem));
        }
    }
    for (_, seg) in segments {
        let name = seg
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !manifest.segments.iter().any(|e| e.file == name) {
            problems.push(problem(format!("does not list {name}")));
        }
    }
    problems
}

/// A segment whose records decode under another format version than its `entry` lists (the
/// scan trusts the listed version whenever a record decodes under it).
fn version_problem(
    entry: &SegmentEntry,
    seg: &MappedSegment,
    problem: &dyn Fn(String) -> Problem,
) -> Option<Problem> {
    let listed = entry.format_version?;
    let read = seg.scan.format_version;
    (listed != read && !seg.scan.frames.is_empty()).then(|| {
        problem(format!(
            "lists {} as format version {listed}, its records decode as version {read}",
            entry.file
        ))
    })
}

/// An unsealed segment the manifest lists with more bytes than its file holds (a shard's
/// segment, listed with its counts): records the lead recorded are gone.
fn unsealed_problem(
    entry: &SegmentEntry,
    seg: &MappedSegment,
    problem: &dyn Fn(String) -> Problem,
) -> Option<Problem> {
    let len = seg.bytes().len() as u64;
    (entry.bytes > len).then(|| {
        problem(format!(
            "lists {} at {} bytes, the file holds {len}: records it counted are lost",
            entry.file, entry.bytes
        ))
    })
}

/// Where a segment the manifest lists as sealed differs from its `entry`: no footer (and no
/// damaged tail that the scan reported already: a file cut at its seal offset), another byte
/// count, another record count.
fn sealed_problems(
    entry: &SegmentEntry,
    seg: &MappedSegment,
    problem: &dyn Fn(String) -> Problem,
) -> Vec<Problem> {
    let len = seg.bytes().len() as u64;
    let tail_reported = (seg.scan.problems.iter())
        .any(|(_, k)| matches!(k, ProblemKind::TornTail | ProblemKind::BadFooter(_)));
    let mut problems = Vec::new();
    if seg.scan.footer.is_none() && !tail_reported {
        problems.push(Problem {
            path: seg.path.clone(),
            offset: len,
            kind: ProblemKind::BadFooter(format!(
                "missing: the file ends at byte {len}, and the manifest lists the segment as \
                 sealed at {} bytes",
                entry.bytes
            )),
        });
    } else if seg.scan.footer.is_some() && len != entry.bytes {
        problems.push(problem(format!(
            "lists {} as sealed at {} bytes, the file holds {len}",
            entry.file, entry.bytes
        )));
    }
    let found = seg.scan.frames.len() as u64;
    if found != entry.records {
        problems.push(problem(format!(
            "{} lists {} records, {found} are valid",
            entry.file, entry.records
        )));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_of_the_lead_and_of_shards_parse_back() {
        for id in [
            SegmentId {
                shard: None,
                number: 7,
            },
            SegmentId {
                shard: Some(1),
                number: 0,
            },
            SegmentId {
                shard: Some(12_345),
                number: 1_234_567,
            },
        ] {
            assert_eq!(SegmentId::parse(&id.file_name()), Some(id), "{id:?}");
        }
        assert_eq!(SegmentId::parse("seg-r0001-000002.stp").unwrap().number, 2);
        let malformed = [
            "seg-00001.stp",
            "seg-r001-000000.stp",
            "seg-r0001-00000.stp",
            "seg-r0001000000.stp",
            "seg-rx001-000000.stp",
            "seg-R0001-000000.stp",
            "seg-r0001-000000.stp.tmp",
            "seg-r99999999999-000000.stp",
            "seg--000000.stp",
            "manifest.json",
        ];
        for name in malformed {
            assert_eq!(SegmentId::parse(name), None, "{name}");
        }
    }

    #[test]
    fn segment_files_come_lead_first_then_by_shard_and_number() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "seg-r0002-000000.stp",
            "seg-000001.stp",
            "seg-r0001-000010.stp",
            "seg-r0010-000000.stp",
            "seg-r0001-000002.stp",
            "seg-000000.stp",
            "seg-r001-000000.stp",
            "seg-r0001-000002.stp.rewind",
            "manifest.json",
        ];
        for name in names {
            fs::write(dir.path().join(name), b"").unwrap();
        }
        let listed: Vec<String> = segment_files(dir.path())
            .unwrap()
            .into_iter()
            .map(|(id, path)| {
                assert_eq!(path, dir.path().join(id.file_name()));
                id.file_name()
            })
            .collect();
        let expected = [
            "seg-000000.stp",
            "seg-000001.stp",
            "seg-r0001-000002.stp",
            "seg-r0001-000010.stp",
            "seg-r0002-000000.stp",
            "seg-r0010-000000.stp",
        ];
        assert_eq!(listed, expected);
    }
}
