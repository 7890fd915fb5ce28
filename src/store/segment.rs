//! One segment file: its byte format, the append-only writer and the scanning reader.
//!
//! ```text
//! header   : magic "STPPOSEG" | format_version u32 | flags u32 (0)                16 bytes
//! frame*   : "STPF" | payload_len u32 | crc32(payload_len ++ payload) u32 | payload   (payload_len % 4 == 0)
//! footer   : "STPS" | body | crc32(body) u32 | body_len u32 | "STPE"                 (sealed segments only)
//! body     : record_count u64 | record_count × (traj_id u64, frame offset u64), sorted by (traj_id, offset)
//! ```
//!
//! All integers are little-endian; frames start at multiples of 4, so the token arrays of a payload
//! (see `codec`) can be viewed in place over the memory map. A reader validates every frame (magic,
//! bounds, crc, payload counts); a bad frame is reported with its offset and the scan resumes at the
//! next valid frame, so one flipped byte never hides other records. Bytes after the last valid frame
//! of an unsealed segment are a torn tail (a crash mid-write, or a write still in progress).
//!
//! The header's version and flags fields have a second copy: the manifest lists each segment's
//! format version (checksummed), and the flags are 0 in every version (a writer that needs a
//! flag writes a new version). A header that disagrees with that copy, names a version or flags
//! this build does not read, or under whose version no frame decodes (with no listed copy to
//! agree with: under whose version some frame's metadata does not decode, since versions 4 and
//! 5, one bit apart, frame records alike and differ only in their metadata), is read under the
//! listed version when records decode under it, else (no listed copy: an old manifest, a
//! damaged one) under the supported version under which the most records decode (the header's
//! own on a tie); each field that disagrees is a [`ProblemKind::DamagedHeader`] at its offset
//! (8 or 12) that `repair` rewrites, and no record is lost. A version the manifest lists and
//! this build does not read, or an unknown version with no listed copy and no frame decoding
//! under any known version, is a newer format: the segment is refused
//! ([`ProblemKind::BadHeader`]) and none of its frames is read.
//!
//! The writer encodes each frame straight into an in-memory buffer (no per-record allocation or
//! system call); when the buffer passes [`WRITE_BUFFER_BYTES`] it goes to the segment's I/O
//! thread (`io_thread`), which copies it into the file while the next buffer is encoded, and
//! flush/seal wait for that thread. The writer keeps the per-segment text table behind the backward text references
//! (see `codec`). It appends only to segments of the current format version; an unsealed segment
//! of an older version is sealed as it is (the footer is the same in every version) and the
//! dataset continues in a new segment, since one file holds frames of one version only.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::codec::{self, Frame, StepView, TextField, TextRefs, FRAME_HEADER_LEN};
use super::error::{ProblemKind, StoreError};
use super::io_thread::{Batch, IoThread};
use super::record::StepRecord;
use crate::env::StepInfo;

/// First eight bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"STPPOSEG";
/// Format version written by this build (see `codec::SUPPORTED_VERSIONS` for what it reads).
pub use super::codec::FORMAT_VERSION;
/// Bytes of the segment header.
pub const HEADER_LEN: usize = 16;
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"STPF");
const SEAL_MARK: u32 = u32::from_le_bytes(*b"STPS");
const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"STPE");
const TRAILER_LEN: usize = 12;
const INDEX_ENTRY_LEN: usize = 16;
const MAX_PAYLOAD: usize = 1 << 30;
/// Bytes the segment writer buffers before handing them to its I/O thread.
pub const WRITE_BUFFER_BYTES: usize = 256 << 10;

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn frame_crc(len_field: u32, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len_field.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

/// Appends `record` as frame number `ordinal` of its segment to `out`, complete but for its crc
/// (see [`finish_frames`]); on error `out` is left as it was.
fn encode_frame(
    record: &StepRecord,
    ordinal: u64,
    refs: TextRefs,
    out: &mut Vec<u8>,
) -> Result<(), codec::CodecError> {
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
    let encoded = codec::encode_payload(record, ordinal, refs, out).and_then(|()| {
        let payload_len = out.len() - start - FRAME_HEADER_LEN;
        if payload_len > MAX_PAYLOAD {
            return Err(codec::CodecError(format!(
                "record is {payload_len} bytes, more than the {MAX_PAYLOAD} a frame holds"
            )));
        }
        Ok(payload_len as u32)
    });
    let len_field = match encoded {
        Ok(len) => len,
        Err(e) => {
            out.truncate(start);
            return Err(e);
        }
    };
    let header = &mut out[start..start + FRAME_HEADER_LEN];
    header[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&len_field.to_le_bytes());
    Ok(())
}

/// Fills in the crc of each frame that [`encode_frame`] put at the offsets `frames` of `bytes`
/// (run by the I/O thread just before the bytes are written).
fn finish_frames(bytes: &mut [u8], frames: &[u32]) {
    for &start in frames {
        let start = start as usize;
        let len_field = read_u32(bytes, start + 4).unwrap_or(0);
        let payload_start = start + FRAME_HEADER_LEN;
        let crc = frame_crc(
            len_field,
            &bytes[payload_start..payload_start + len_field as usize],
        );
        bytes[start + 8..payload_start].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The index stored in the footer of a sealed segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    /// Offset of the footer's seal mark (= end of the frames).
    pub seal_offset: u64,
    pub record_count: u64,
    entries_start: usize,
}

impl Footer {
    fn entry(&self, bytes: &[u8], i: usize) -> (u64, u64) {
        let at = self.entries_start + i * INDEX_ENTRY_LEN;
        let traj = read_u64(bytes, at).unwrap_or(u64::MAX);
        (traj, read_u64(bytes, at + 8).unwrap_or(u64::MAX))
    }

    /// All `(traj_id, frame offset)` entries in stored order.
    pub fn entries<'a>(&'a self, bytes: &'a [u8]) -> impl Iterator<Item = (u64, u64)> + 'a {
        (0..self.record_count as usize).map(move |i| self.entry(bytes, i))
    }

    /// Frame offsets of `traj_id`, by binary search over the sorted index.
    pub fn lookup(&self, bytes: &[u8], traj_id: u64) -> Vec<u64> {
        let n = self.record_count as usize;
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.entry(bytes, mid).0 < traj_id {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo..n)
            .map(|i| self.entry(bytes, i))
            .take_while(|&(t, _)| t == traj_id)
            .map(|(_, offset)| offset)
            .collect()
    }
}

/// Everything a scan of one segment's bytes found.
#[derive(Clone, Debug, Default)]
pub struct SegmentScan {
    /// The format version the frames were read under: the header's, or the one recovered when
    /// the header is damaged.
    pub format_version: u32,
    /// The valid frames, in file order.
    pub frames: Vec<Frame>,
    /// The footer's index; `None` when the segment is not sealed or its footer is damaged.
    pub footer: Option<Footer>,
    /// `(offset, problem)` in file order.
    pub problems: Vec<(u64, ProblemKind)>,
}

impl SegmentScan {
    /// Views the frame `frame` of this scan over the same `bytes` (text references resolve
    /// against the other frames of this scan).
    pub fn view<'a>(&'a self, bytes: &'a [u8], frame: &Frame) -> StepView<'a> {
        StepView::new(frame.payload(bytes), &frame.layout, self.format_version).in_segment(
            bytes,
            &self.frames,
            frame.index as usize,
        )
    }
}

/// The frame at `pos` when it is valid (numbered as if it came next after `scan`'s frames).
fn frame_at(bytes: &[u8], pos: usize, end: usize, scan: &SegmentScan) -> Option<Frame> {
    if read_u32(bytes, pos)? != FRAME_MAGIC {
        return None;
    }
    let len_field = read_u32(bytes, pos + 4)?;
    let len = len_field as usize;
    let payload_start = pos + FRAME_HEADER_LEN;
    if !len.is_multiple_of(4) || len > MAX_PAYLOAD || payload_start + len > end {
        return None;
    }
    let payload = &bytes[payload_start..payload_start + len];
    if frame_crc(len_field, payload) != read_u32(bytes, pos + 8)? {
        return None;
    }
    let layout = codec::parse_layout(payload, scan.format_version).ok()?;
    Some(Frame {
        offset: pos as u64,
        payload_len: len_field,
        index: scan.frames.len() as u32,
        layout,
    })
}

fn next_valid_frame(bytes: &[u8], from: usize, end: usize, scan: &SegmentScan) -> Option<Frame> {
    (from..end.saturating_sub(FRAME_HEADER_LEN - 1))
        .step_by(4)
        .find_map(|pos| frame_at(bytes, pos, end, scan))
}

fn parse_footer(bytes: &[u8]) -> Option<Footer> {
    let n = bytes.len();
    if n < HEADER_LEN + 4 + TRAILER_LEN || read_u32(bytes, n - 4)? != TRAILER_MAGIC {
        return None;
    }
    let body_len = read_u32(bytes, n - 8)? as usize;
    let body_end = n - TRAILER_LEN;
    let body_start = body_end.checked_sub(body_len)?;
    let seal = body_start.checked_sub(4)?;
    if seal < HEADER_LEN || !seal.is_multiple_of(4) || read_u32(bytes, seal)? != SEAL_MARK {
        return None;
    }
    let body = &bytes[body_start..body_end];
    if crc32fast::hash(body) != read_u32(bytes, n - TRAILER_LEN)? {
        return None;
    }
    let record_count = read_u64(body, 0)?;
    let expected = (record_count as u128) * INDEX_ENTRY_LEN as u128 + 8;
    (expected == body_len as u128).then_some(Footer {
        seal_offset: seal as u64,
        record_count,
        entries_start: body_start + 8,
    })
}

/// The version and flags fields of a segment header, as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HeaderFields {
    version: u32,
    flags: u32,
}

impl HeaderFields {
    fn read(bytes: &[u8]) -> Self {
        Self {
            version: read_u32(bytes, 8).unwrap_or(0),
            flags: read_u32(bytes, 12).unwrap_or(0),
        }
    }

    /// Whether this build reads frames of the version and flags the fields name.
    fn readable(&self) -> bool {
        self.flags == 0 && codec::SUPPORTED_VERSIONS.contains(&self.version)
    }
}

/// The header of a segment of format `version` (flags are 0 in every version).
pub(crate) fn header_bytes(version: u32) -> [u8; HEADER_LEN] {
    let mut header = [0; HEADER_LEN];
    header[..8].copy_from_slice(&SEGMENT_MAGIC);
    header[8..12].copy_from_slice(&version.to_le_bytes());
    header
}

/// Validates the bytes of one segment file: header, every frame, the footer. The frames are
/// read under the header's format version unless the header is damaged (see [`scan_listed`]).
pub fn scan(bytes: &[u8]) -> SegmentScan {
    scan_listed(bytes, None)
}

/// As [`scan`], where the manifest lists the segment as format version `listed`: a header
/// that disagrees with it is damaged (see [`recover_version`]).
pub fn scan_listed(bytes: &[u8], listed: Option<u32>) -> SegmentScan {
    if bytes.len() < HEADER_LEN {
        let torn = (!bytes.is_empty()).then_some((0, ProblemKind::TornTail));
        return SegmentScan {
            format_version: FORMAT_VERSION,
            problems: torn.into_iter().collect(),
            ..SegmentScan::default()
        };
    }
    let header = HeaderFields::read(bytes);
    let as_stored = (header.readable() && listed.is_none_or(|v| v == header.version))
        .then(|| scan_frames(bytes, header.version))
        .filter(|scan| !scan.frames.is_empty() || scan.problems.is_empty())
        .filter(|scan| listed.is_some() || every_record_decodes(bytes, scan));
    let mut scan = as_stored.unwrap_or_else(|| recover_version(bytes, header, listed));
    if bytes[..8] != SEGMENT_MAGIC {
        let wrong = ProblemKind::DamagedHeader("wrong magic".into());
        scan.problems.insert(0, (0, wrong));
    }
    scan
}

/// Reads a segment whose header cannot be taken at its word (a version or flags this build
/// does not read, a version other than the manifest's `listed` one, no frame decoding under
/// it, or, with nothing listed, a record whose metadata does not decode under it): under
/// `listed` when records decode under it, else under the supported version under which the
/// most records decode (the header's on a tie); each header field that disagrees is a
/// [`ProblemKind::DamagedHeader`]. Refused (no frame read) when the manifest lists a version this
/// build does not read, or when the manifest lists none, no version decodes a record, and the
/// header's version or flags are unknown: a newer format, as far as this build can tell.
fn recover_version(bytes: &[u8], header: HeaderFields, listed: Option<u32>) -> SegmentScan {
    if let Some(version) = listed {
        if !codec::SUPPORTED_VERSIONS.contains(&version) {
            return refused(HeaderFields { version, ..header });
        }
        let scan = scan_frames(bytes, version);
        if decoded_records(bytes, &scan) > 0 || scan.problems.is_empty() {
            return with_header_problems(scan, header, "the manifest lists");
        }
    }
    let best = (codec::SUPPORTED_VERSIONS)
        .filter(|&v| Some(v) != listed)
        .map(|v| scan_frames(bytes, v))
        .map(|scan| (decoded_records(bytes, &scan), scan))
        .filter(|(decoded, _)| *decoded > 0)
        .max_by_key(|(decoded, scan)| (*decoded, scan.format_version == header.version));
    match (best, listed) {
        (Some((_, scan)), _) => with_header_problems(scan, header, "its records decode as"),
        (None, Some(version)) => {
            with_header_problems(scan_frames(bytes, version), header, "the manifest lists")
        }
        (None, None) if header.readable() => scan_frames(bytes, header.version),
        (None, None) => refused(header),
    }
}

/// Whether the metadata of every valid frame of `scan` decodes (stops at the first that does
/// not).
fn every_record_decodes(bytes: &[u8], scan: &SegmentScan) -> bool {
    (scan.frames.iter()).all(|frame| scan.view(bytes, frame).meta_view().is_ok())
}

/// Valid frames of `scan` whose metadata decodes.
fn decoded_records(bytes: &[u8], scan: &SegmentScan) -> usize {
    let frames = scan.frames.iter();
    frames
        .filter(|frame| scan.view(bytes, frame).meta_view().is_ok())
        .count()
}

/// `scan` (read under its format version) with a problem for each field of `header` that
/// disagrees with it; `source`: what says the version, for the message.
fn with_header_problems(mut scan: SegmentScan, header: HeaderFields, source: &str) -> SegmentScan {
    let version = scan.format_version;
    let mut found = Vec::new();
    if header.version != version {
        let why = format!(
            "format version field holds {}, {source} version {version}: records read as version {version}",
            header.version
        );
        found.push((8, ProblemKind::DamagedHeader(why)));
    }
    if header.flags != 0 {
        let why = format!(
            "flags field holds {:#x}, 0 in every format version: records read as version {version}",
            header.flags
        );
        found.push((12, ProblemKind::DamagedHeader(why)));
    }
    scan.problems.splice(0..0, found);
    scan
}

/// The scan of a segment whose header names a version or flags this build does not read.
fn refused(header: HeaderFields) -> SegmentScan {
    let version = header.version;
    let problem = match codec::SUPPORTED_VERSIONS.contains(&version) {
        false => (
            8,
            format!("format version {version} is not supported by this build"),
        ),
        true => (12, format!("unknown flags {:#x}", header.flags)),
    };
    SegmentScan {
        format_version: version,
        problems: vec![(problem.0, ProblemKind::BadHeader(problem.1))],
        ..SegmentScan::default()
    }
}

/// Validates every frame and the footer of a segment of format `version`.
fn scan_frames(bytes: &[u8], version: u32) -> SegmentScan {
    let mut scan = SegmentScan {
        format_version: version,
        footer: parse_footer(bytes),
        ..SegmentScan::default()
    };
    let end = scan.footer.map_or(bytes.len(), |f| f.seal_offset as usize);
    let mut pos = HEADER_LEN;
    while pos < end {
        if let Some(frame) = frame_at(bytes, pos, end, &scan) {
            scan.frames.push(frame);
            pos = frame.end() as usize;
            continue;
        }
        match next_valid_frame(bytes, pos + 4, end, &scan) {
            Some(next) => {
                let skipped = next.offset - pos as u64;
                scan.problems
                    .push((pos as u64, ProblemKind::CorruptFrame { skipped }));
                pos = next.offset as usize;
            }
            None => {
                scan.problems
                    .push((pos as u64, tail_problem(bytes, pos, &scan)));
                break;
            }
        }
    }
    scan
}

fn tail_problem(bytes: &[u8], pos: usize, scan: &SegmentScan) -> ProblemKind {
    if scan.footer.is_some() {
        let skipped = (scan.footer.map_or(0, |f| f.seal_offset) as usize - pos) as u64;
        ProblemKind::CorruptFrame { skipped }
    } else if read_u32(bytes, pos) == Some(SEAL_MARK) {
        ProblemKind::BadFooter("footer is incomplete or fails its crc".into())
    } else {
        ProblemKind::TornTail
    }
}

/// A segment file mapped into memory together with its scan.
#[derive(Debug)]
pub struct MappedSegment {
    pub path: PathBuf,
    map: Option<Mmap>,
    pub scan: SegmentScan,
    /// Per frame of the scan: left out of [`MappedSegment::frames`] (empty: none is).
    skipped: Vec<bool>,
}

impl MappedSegment {
    /// Maps and scans `path`; `listed`: the format version the manifest lists for it (see
    /// [`scan_listed`]). The file must not be truncated while mapped (appends are fine: the map
    /// covers the length at open time, and only complete frames are ever returned).
    pub fn open(path: &Path, listed: Option<u32>) -> Result<Self, StoreError> {
        let file = File::open(path).map_err(StoreError::io(path))?;
        let len = file.metadata().map_err(StoreError::io(path))?.len();
        // SAFETY: segment files are append-only; stepppo never truncates a file that a reader
        // may have mapped except through `repair`, which runs on a dataset no one is using.
        let map = match len {
            0 => None,
            _ => Some(unsafe { Mmap::map(&file) }.map_err(StoreError::io(path))?),
        };
        let scan = scan_listed(map.as_deref().unwrap_or(&[]), listed);
        Ok(Self {
            path: path.to_path_buf(),
            map,
            scan,
            skipped: Vec::new(),
        })
    }

    /// The valid frames that are not skipped, in file order.
    pub fn frames(&self) -> impl Iterator<Item = &Frame> {
        self.scan.frames.iter().filter(|f| !self.is_skipped(f))
    }

    fn is_skipped(&self, frame: &Frame) -> bool {
        self.skipped
            .get(frame.index as usize)
            .copied()
            .unwrap_or(false)
    }

    /// `(offset, why)` of every valid frame whose metadata does not decode (a text reference to
    /// a damaged frame, say).
    pub(crate) fn undecodable(&self) -> Vec<(u64, String)> {
        let failures = self.scan.frames.iter().filter_map(|frame| {
            let why = match self.view(frame).meta_view().err()? {
                StoreError::Corrupt { reason, .. } => reason,
                other => other.to_string(),
            };
            Some((frame.offset, why))
        });
        failures.collect()
    }

    /// Leaves every frame whose metadata does not decode out of [`MappedSegment::frames`] and
    /// [`MappedSegment::lookup`]; returns `(offset, why)` of each.
    pub(crate) fn skip_undecodable(&mut self) -> Vec<(u64, String)> {
        let undecodable = self.undecodable();
        let offsets: Vec<u64> = undecodable.iter().map(|(offset, _)| *offset).collect();
        self.skipped = (self.scan.frames.iter())
            .map(|f| offsets.binary_search(&f.offset).is_ok())
            .collect();
        undecodable
    }

    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The record of one validated frame, viewed in place.
    pub fn view(&self, frame: &Frame) -> StepView<'_> {
        self.scan
            .view(self.bytes(), frame)
            .at(&self.path, frame.offset)
    }

    /// Frames of `traj_id` found through the footer index (sealed segments only).
    pub fn lookup(&self, traj_id: u64) -> Option<Vec<Frame>> {
        let footer = self.scan.footer?;
        let frames = &self.scan.frames;
        let found = footer
            .lookup(self.bytes(), traj_id)
            .into_iter()
            .filter_map(|offset| {
                let i = frames.binary_search_by_key(&offset, |f| f.offset).ok()?;
                Some(frames[i]).filter(|f| !self.is_skipped(f))
            });
        Some(found.collect())
    }
}

/// Slots per text field of the writer's text cache: a power of two, four times
/// [`codec::REFERENCE_WINDOW`], so that the texts of the window rarely share a slot.
const TEXT_SLOTS: usize = 1024;

/// FxHash of `text` (rotate, xor, multiply per 8 bytes, then the length): the writer hashes its
/// own texts, so a fast non-keyed hash is enough; the cache still compares the texts themselves.
fn text_hash(text: &str) -> u64 {
    let add = |h: u64, word: u64| (h.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    let words = text.as_bytes().chunks_exact(8);
    let tail = words.remainder();
    let mut h = words.fold(0, |h, w| {
        add(h, u64::from_le_bytes(std::array::from_fn(|i| w[i])))
    });
    if !tail.is_empty() {
        let mut word = [0u8; 8];
        word[..tail.len()].copy_from_slice(tail);
        h = add(h, u64::from_le_bytes(word));
    }
    add(h, text.len() as u64)
}

#[derive(Clone, Debug, Default)]
struct TextSlot {
    hash: u64,
    /// Number of the last frame that stored `text` inline (`None`: empty slot).
    ordinal: Option<u64>,
    text: String,
}

/// Where a text of the record being appended goes in the [`TextCache`], and how many frames
/// back an earlier frame holds it inline (within [`codec::REFERENCE_WINDOW`]).
#[derive(Clone, Copy, Debug)]
struct Probe {
    slot: usize,
    hash: u64,
    back: Option<u64>,
}

/// Per segment and text field: a direct-mapped cache from a text's hash to the text and the
/// number of the last frame that stored it inline. A text whose slot another text has taken is
/// simply stored inline again; a reference is only made to an equal text (compared, not just
/// its hash) in the same block of [`codec::REFERENCE_BLOCK`] frames.
#[derive(Debug)]
struct TextCache {
    /// `TEXT_SLOTS` slots per field, field by field.
    slots: Vec<TextSlot>,
    /// Frames per reference block: a reference from frame `n` only points at a frame `m` with
    /// `m / block == n / block`.
    block: u64,
}

impl Default for TextCache {
    fn default() -> Self {
        Self {
            slots: vec![TextSlot::default(); TEXT_SLOTS * TextField::ALL.len()],
            block: codec::REFERENCE_BLOCK,
        }
    }
}

impl TextCache {
    /// For the frame numbered `ordinal`: where `text` of `field` goes and whether it can be a
    /// reference.
    fn probe(&self, field: TextField, text: &str, ordinal: u64) -> Probe {
        let hash = text_hash(text);
        let slot =
            field as usize * TEXT_SLOTS + (hash >> (64 - TEXT_SLOTS.trailing_zeros())) as usize;
        let held = &self.slots[slot];
        let back = held
            .ordinal
            .filter(|_| held.hash == hash && held.text == text)
            .filter(|earlier| earlier / self.block == ordinal / self.block)
            .map(|earlier| ordinal - earlier)
            .filter(|&back| back <= codec::REFERENCE_WINDOW);
        Probe { slot, hash, back }
    }

    fn probes(&self, info: &StepInfo, ordinal: u64) -> [Probe; 2] {
        TextField::ALL.map(|field| self.probe(field, field.of(info), ordinal))
    }

    /// Records that the frame numbered `ordinal` stored `text` inline at `probe`'s slot.
    fn store(&mut self, probe: Probe, text: &str, ordinal: u64) {
        let slot = &mut self.slots[probe.slot];
        slot.hash = probe.hash;
        slot.ordinal = Some(ordinal);
        slot.text.clear();
        slot.text.push_str(text);
    }

    /// Records the texts that the frame numbered `ordinal` stored inline.
    fn remember(&mut self, texts: [Option<&str>; 2], ordinal: u64) {
        for (field, text) in TextField::ALL.into_iter().zip(texts) {
            if let Some(text) = text {
                self.store(self.probe(field, text, ordinal), text, ordinal);
            }
        }
    }
}

/// Appends frames to one segment file and seals it with its footer.
#[derive(Debug)]
pub struct SegmentWriter {
    path: PathBuf,
    /// Writes full buffers to the file in the background.
    io: IoThread,
    /// Encoded frames not yet handed to the I/O thread.
    batch: Batch,
    /// Bytes in the file or handed to the I/O thread.
    written: u64,
    index: Vec<(u64, u64)>,
    texts: TextCache,
    /// Format version of the file: only [`FORMAT_VERSION`] accepts appends.
    format_version: u32,
    /// Whether `seal` fsyncs the file.
    durable: bool,
}

impl SegmentWriter {
    /// Creates a new segment file (it must not exist) and writes its header; `durable`: whether
    /// sealing fsyncs the file.
    pub fn create(path: &Path, durable: bool) -> Result<Self, StoreError> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(StoreError::io(path))?;
        let mut writer = Self::start(path, file, 0, FORMAT_VERSION, durable)?;
        (writer.batch.bytes).extend_from_slice(&header_bytes(FORMAT_VERSION));
        Ok(writer)
    }

    /// A writer appending to `file` (open for writing at byte `written`, its end).
    fn start(
        path: &Path,
        file: File,
        written: u64,
        format_version: u32,
        durable: bool,
    ) -> Result<Self, StoreError> {
        Ok(Self {
            path: path.to_path_buf(),
            io: IoThread::start(path, file, finish_frames)?,
            batch: Batch {
                bytes: Vec::with_capacity(WRITE_BUFFER_BYTES * 2),
                frames: Vec::new(),
            },
            written,
            index: Vec::new(),
            texts: TextCache::default(),
            format_version,
            durable,
        })
    }

    /// Reopens an unsealed, undamaged segment: to append to it when it has the current format
    /// version, else only to seal it ([`SegmentWriter::append`] refuses).
    pub fn resume(segment: &MappedSegment, durable: bool) -> Result<Self, StoreError> {
        let path = &segment.path;
        if segment.scan.footer.is_some() {
            return Err(StoreError::Invalid {
                path: path.clone(),
                reason: "segment is already sealed".into(),
            });
        }
        if segment.bytes().is_empty() {
            std::fs::remove_file(path).map_err(StoreError::io(path))?;
            return Self::create(path, durable);
        }
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(StoreError::io(path))?;
        let written = segment.bytes().len() as u64;
        let version = segment.scan.format_version;
        let mut writer = Self::start(path, file, written, version, durable)?;
        for frame in &segment.scan.frames {
            if writer.appendable() {
                let payload = frame.payload(segment.bytes());
                let texts = codec::inline_texts(payload, &frame.layout).map_err(|e| {
                    StoreError::Corrupt {
                        path: path.clone(),
                        offset: frame.offset,
                        reason: e.0,
                    }
                })?;
                writer.texts.remember(texts, writer.index.len() as u64);
            }
            writer.index.push((frame.layout.traj_id, frame.offset));
        }
        Ok(writer)
    }

    /// The same writer making text references within blocks of `block` frames.
    #[cfg(test)]
    pub(crate) fn with_reference_block(mut self, block: u64) -> Self {
        self.texts.block = block;
        self
    }

    /// Format version of the segment's frames.
    pub fn format_version(&self) -> u32 {
        self.format_version
    }

    /// Whether this segment takes more records (it has the current format version).
    pub fn appendable(&self) -> bool {
        self.format_version == FORMAT_VERSION
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records appended so far.
    pub fn records(&self) -> u64 {
        self.index.len() as u64
    }

    /// Syncs what is in the file to the disk (call after [`flush`](Self::flush)).
    pub fn sync(&self) -> Result<(), StoreError> {
        self.io
            .file()
            .sync_data()
            .map_err(StoreError::io(&self.path))
    }

    /// Bytes written so far (header included, buffered bytes included).
    pub fn len(&self) -> u64 {
        self.written + self.batch.bytes.len() as u64
    }

    /// Encodes `record` as a frame at the end of the segment and returns its offset, or `None`
    /// (nothing written) when the segment already holds records and would grow past `max_len`.
    pub fn append(&mut self, record: &StepRecord, max_len: u64) -> Result<Option<u64>, StoreError> {
        if !self.appendable() {
            return Err(StoreError::Invalid {
                path: self.path.clone(),
                reason: format!(
                    "segment has format version {}; only version {FORMAT_VERSION} takes appends",
                    self.format_version
                ),
            });
        }
        if self.batch.bytes.len() >= WRITE_BUFFER_BYTES {
            self.hand_off()?;
        }
        let offset = self.len();
        let start = self.batch.bytes.len();
        let ordinal = self.index.len() as u64;
        let probes = self.texts.probes(&record.info, ordinal);
        let refs = probes.map(|p| p.back);
        encode_frame(record, ordinal, refs, &mut self.batch.bytes).map_err(|e| {
            StoreError::Encode {
                path: self.path.clone(),
                traj_id: record.traj_id,
                step_index: record.step_index,
                reason: e.0,
            }
        })?;
        if !self.index.is_empty() && self.len() > max_len {
            self.batch.bytes.truncate(start);
            return Ok(None);
        }
        self.batch.frames.push(start as u32);
        for (field, probe) in TextField::ALL.into_iter().zip(probes) {
            if probe.back.is_none() {
                self.texts.store(probe, field.of(&record.info), ordinal);
            }
        }
        self.index.push((record.traj_id, offset));
        Ok(Some(offset))
    }

    /// Gives the buffered frames to the I/O thread and continues in an empty buffer.
    fn hand_off(&mut self) -> Result<(), StoreError> {
        let full = std::mem::take(&mut self.batch);
        self.written += full.bytes.len() as u64;
        self.batch = self.io.submit(full)?;
        Ok(())
    }

    /// Writes every buffered frame to the file and waits for it: from now on readers see them.
    /// Returns the error of any earlier background write as well.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        if !self.batch.is_empty() {
            self.hand_off()?;
        }
        self.io.wait()
    }

    /// Writes the footer, flushes and (when durable) syncs; returns (records, bytes).
    pub fn seal(mut self) -> Result<(u64, u64), StoreError> {
        self.index.sort_unstable();
        let body_len = 8 + self.index.len() * INDEX_ENTRY_LEN;
        let out = &mut self.batch.bytes;
        out.extend_from_slice(&SEAL_MARK.to_le_bytes());
        let body_start = out.len();
        out.extend_from_slice(&(self.index.len() as u64).to_le_bytes());
        for (traj_id, offset) in &self.index {
            out.extend_from_slice(&traj_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[body_start..]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(body_len as u32).to_le_bytes());
        out.extend_from_slice(&TRAILER_MAGIC.to_le_bytes());
        self.flush()?;
        if self.durable {
            self.sync()?;
        }
        Ok((self.index.len() as u64, self.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(traj_id: u64, step_index: u32) -> StepRecord {
        StepRecord {
            traj_id,
            step_index,
            obs_ids: vec![traj_id as u32; 5],
            response_ids: vec![9; 3],
            response_logprobs: vec![-0.25; 3],
            env_tag: "bandit".into(),
            ..StepRecord::default()
        }
    }

    fn segment_bytes(records: &[StepRecord], seal: bool) -> Vec<u8> {
        blocked_segment_bytes(records, seal, codec::REFERENCE_BLOCK)
    }

    fn blocked_segment_bytes(records: &[StepRecord], seal: bool, block: u64) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg.stp");
        let mut writer = SegmentWriter::create(&path, false)
            .unwrap()
            .with_reference_block(block);
        for r in records {
            writer.append(r, u64::MAX).unwrap();
        }
        if seal {
            writer.seal().unwrap();
        } else {
            writer.flush().unwrap();
        }
        std::fs::read(&path).unwrap()
    }

    #[test]
    fn sealed_segment_scans_clean_and_indexes_every_frame() {
        let records: Vec<_> = (0..4).map(|i| record(3 - i, 0)).collect();
        let bytes = segment_bytes(&records, true);
        let scan = scan(&bytes);
        assert!(scan.problems.is_empty(), "{:?}", scan.problems);
        assert_eq!(scan.frames.len(), 4);
        let footer = scan.footer.unwrap();
        assert_eq!(footer.lookup(&bytes, 1), vec![scan.frames[2].offset]);
        assert!(footer.lookup(&bytes, 9).is_empty());
    }

    fn with_texts(traj_id: u64, observation: &str, action: &str) -> StepRecord {
        let mut r = record(traj_id, 0);
        r.info.observation_text = observation.into();
        r.info.action_text = action.into();
        r
    }

    #[test]
    fn repeated_texts_become_references_and_read_back_identical() {
        let long = "_P_\n_O_\n__G\n".repeat(8);
        let records = vec![
            with_texts(0, &long, "<answer>Up</answer>"),
            with_texts(1, &long, "<answer>Left</answer>"),
            with_texts(2, "other", "<answer>Up</answer>"),
            with_texts(3, "<answer>Up</answer>", "other"),
        ];
        let bytes = segment_bytes(&records, true);
        let scan = scan(&bytes);
        assert!(scan.problems.is_empty(), "{:?}", scan.problems);
        let read: Vec<StepRecord> = (scan.frames.iter())
            .map(|f| scan.view(&bytes, f).to_record().unwrap())
            .collect();
        assert_eq!(read, records);
        let sizes: Vec<u64> = scan.frames.iter().map(|f| f.end() - f.offset).collect();
        assert!(sizes[1] + long.len() as u64 - 20 < sizes[0], "{sizes:?}");
        // Texts are compared per field: record 3's observation equals an action text, stored inline.
        let frame = scan.frames[3];
        let texts = codec::inline_texts(frame.payload(&bytes), &frame.layout).unwrap();
        assert_eq!(texts, [Some("<answer>Up</answer>"), Some("other")]);
    }

    #[test]
    fn a_corrupt_referenced_frame_fails_the_dependent_record() {
        let long = "x".repeat(100);
        let records = vec![with_texts(0, &long, "a"), with_texts(1, &long, "b")];
        let mut bytes = segment_bytes(&records, false);
        let first = scan(&bytes).frames[0];
        bytes[first.offset as usize + FRAME_HEADER_LEN + 2] ^= 1;
        let scan = scan(&bytes);
        assert_eq!(scan.frames.len(), 1);
        let second = scan.frames[0];
        let err = scan
            .view(&bytes, &second)
            .to_record()
            .unwrap_err()
            .to_string();
        let both = format!(
            "at byte {}: observation_text refers to the record 1 frames back, which is not a valid",
            second.offset
        );
        assert!(err.contains(&both), "{err}");
    }

    #[test]
    fn a_reference_across_a_skipped_damaged_frame_still_resolves() {
        let records = vec![
            with_texts(0, "shared", "a"),
            with_texts(1, "other", "b"),
            with_texts(2, "shared", "c"),
        ];
        let mut bytes = segment_bytes(&records, false);
        let damaged = scan(&bytes).frames[1];
        bytes[damaged.offset as usize + FRAME_HEADER_LEN + 1] ^= 1;
        let scan = scan(&bytes);
        assert_eq!(scan.frames.len(), 2);
        let last = scan.view(&bytes, &scan.frames[1]).to_record().unwrap();
        assert_eq!(last, records[2]);
    }

    /// Which frames of `bytes` store their observation text inline.
    fn inline_observations(bytes: &[u8]) -> Vec<bool> {
        let scan = scan(bytes);
        (scan.frames.iter())
            .map(|f| codec::inline_texts(f.payload(bytes), &f.layout).unwrap()[0].is_some())
            .collect()
    }

    #[test]
    fn a_text_is_stored_inline_again_once_out_of_the_reference_window() {
        let window = codec::REFERENCE_WINDOW as usize;
        let records: Vec<_> = (0..window as u64 + 2)
            .map(|i| with_texts(i, "same", "same"))
            .collect();
        let bytes = blocked_segment_bytes(&records, true, u64::MAX);
        let expected: Vec<bool> = (0..window + 2).map(|i| i % (window + 1) == 0).collect();
        assert_eq!(inline_observations(&bytes), expected);
        let scan = scan(&bytes);
        let last = scan.frames.last().unwrap();
        assert_eq!(
            scan.view(&bytes, last).to_record().unwrap(),
            records[window + 1]
        );
    }

    #[test]
    fn references_stay_within_their_block_and_its_first_frame_stores_texts_inline() {
        let block = codec::REFERENCE_BLOCK as usize;
        let records: Vec<_> = (0..2 * block as u64 + 3)
            .map(|i| with_texts(i, "same", "same"))
            .collect();
        let bytes = segment_bytes(&records, true);
        let expected: Vec<bool> = (0..records.len()).map(|i| i % block == 0).collect();
        assert_eq!(inline_observations(&bytes), expected);
        let scan = scan(&bytes);
        let read: Vec<StepRecord> = (scan.frames.iter())
            .map(|f| scan.view(&bytes, f).to_record().unwrap())
            .collect();
        assert_eq!(read, records);
    }

    /// Records of `ids` 2-byte ids each, enough of them to fill several write buffers.
    fn big_records(count: u64, ids: usize) -> Vec<StepRecord> {
        (0..count)
            .map(|i| StepRecord {
                obs_ids: (0..ids as u32)
                    .map(|t| (t * 7 + i as u32) % 50_000)
                    .collect(),
                ..record(i, 0)
            })
            .collect()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_background_write_is_returned_with_the_path_by_every_later_call() {
        let path = Path::new("/dev/full");
        let file = OpenOptions::new().write(true).open(path).unwrap();
        let mut writer = SegmentWriter::start(path, file, 0, FORMAT_VERSION, false).unwrap();
        for r in big_records(3 * (WRITE_BUFFER_BYTES as u64 / 20_000 + 1), 10_000) {
            // Appends that hand a buffer over may already see the failure.
            if writer.append(&r, u64::MAX).is_err() {
                break;
            }
        }
        for _ in 0..2 {
            let err = writer.flush().unwrap_err().to_string();
            assert!(err.starts_with("/dev/full: "), "{err}");
            assert!(err.contains("No space left"), "{err}");
        }
        let err = writer
            .append(&record(9, 0), u64::MAX)
            .and_then(|_| writer.flush());
        assert!(err.is_err());
        assert!(writer.seal().unwrap_err().to_string().contains("/dev/full"));
    }

    #[test]
    fn readers_see_a_prefix_of_complete_frames_while_buffers_are_written_in_the_background() {
        let records = big_records(120, 6_000);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg.stp");
        let mut writer = SegmentWriter::create(&path, false).unwrap();
        let check = |bytes: &[u8]| {
            let scan = scan(bytes);
            for (frame, expected) in scan.frames.iter().zip(&records) {
                assert_eq!(&scan.view(bytes, frame).to_record().unwrap(), expected);
            }
            let torn = [(
                scan.frames.last().map_or(HEADER_LEN as u64, |f| f.end()),
                ProblemKind::TornTail,
            )];
            assert!(
                scan.problems.is_empty() || scan.problems == torn,
                "{:?}",
                scan.problems
            );
            scan.frames.len()
        };
        let mut seen = 0;
        for r in &records {
            writer.append(r, u64::MAX).unwrap();
            let now = check(&std::fs::read(&path).unwrap());
            assert!(now >= seen);
            seen = now;
        }
        assert!(seen > 0 && seen < records.len(), "{seen}");
        writer.flush().unwrap();
        assert_eq!(check(&std::fs::read(&path).unwrap()), records.len());
    }

    /// Checks that the only problem of `scan` is the damaged header field holding byte `at`.
    fn assert_damaged_field(scan: &SegmentScan, at: usize) {
        let field = if at < 12 { 8 } else { 12 };
        let damaged = (scan.problems.iter())
            .filter(|(_, kind)| matches!(kind, ProblemKind::DamagedHeader(_)))
            .map(|(offset, _)| *offset);
        assert_eq!(damaged.collect::<Vec<_>>(), [field], "byte {at}");
        assert_eq!(scan.problems.len(), 1, "byte {at}: {:?}", scan.problems);
    }

    #[test]
    fn every_flipped_bit_of_the_version_or_flags_field_loses_no_record() {
        let records: Vec<_> = (0..6).map(|i| with_texts(i, "shared", "a")).collect();
        let bytes = segment_bytes(&records, true);
        for listed in [Some(FORMAT_VERSION), None] {
            for at in 8..HEADER_LEN {
                for bit in 0..8 {
                    let mut damaged = bytes.clone();
                    damaged[at] ^= 1 << bit;
                    let scan = scan_listed(&damaged, listed);
                    assert_damaged_field(&scan, at);
                    assert_eq!(scan.format_version, FORMAT_VERSION);
                    let read: Vec<StepRecord> = (scan.frames.iter())
                        .map(|f| scan.view(&damaged, f).to_record().unwrap())
                        .collect();
                    assert_eq!(read, records, "byte {at} bit {bit}, listed {listed:?}");
                }
            }
        }
    }

    /// `bytes` with format version `version` in its header and every payload overwritten with
    /// `0xff` (crc fixed), so that no frame decodes under any version this build reads.
    fn newer_format(bytes: &[u8], version: u32) -> Vec<u8> {
        let frames = scan(bytes).frames;
        let mut out = bytes.to_vec();
        out[8..12].copy_from_slice(&version.to_le_bytes());
        for frame in &frames {
            let start = frame.offset as usize + FRAME_HEADER_LEN;
            out[start..start + frame.payload_len as usize].fill(0xff);
        }
        let offsets: Vec<u32> = frames.iter().map(|f| f.offset as u32).collect();
        finish_frames(&mut out, &offsets);
        out
    }

    #[test]
    fn a_newer_format_is_refused_when_listed_or_when_no_frame_decodes() {
        let bytes = segment_bytes(&[record(1, 0), record(2, 0)], true);
        let refused = |scan: SegmentScan| {
            assert!(scan.frames.is_empty());
            let newer = FORMAT_VERSION + 1;
            let why = format!("format version {newer} is not supported by this build");
            assert_eq!(scan.problems, vec![(8, ProblemKind::BadHeader(why))]);
        };
        refused(scan_listed(&bytes, Some(FORMAT_VERSION + 1)));
        let newer = newer_format(&bytes, FORMAT_VERSION + 1);
        refused(scan_listed(&newer, None));
        let mut flagged = newer_format(&bytes, FORMAT_VERSION);
        flagged[12] = 1;
        let scan = scan_listed(&flagged, None);
        let why = "unknown flags 0x1".to_string();
        assert_eq!(scan.problems, vec![(12, ProblemKind::BadHeader(why))]);
    }

    #[test]
    fn a_listed_version_that_no_record_decodes_under_gives_way_to_the_header() {
        let bytes = segment_bytes(&[record(1, 0), record(2, 0)], true);
        let scan = scan_listed(&bytes, Some(1));
        assert!(scan.problems.is_empty(), "{:?}", scan.problems);
        assert_eq!(
            (scan.format_version, scan.frames.len()),
            (FORMAT_VERSION, 2)
        );
    }

    #[test]
    fn truncation_is_a_torn_tail_and_garbage_never_panics() {
        let bytes = segment_bytes(&[record(1, 0), record(1, 1)], false);
        let cut = bytes.len() - 5;
        let scan = scan(&bytes[..cut]);
        assert_eq!(scan.frames.len(), 1);
        assert_eq!(
            scan.problems,
            vec![(scan.frames[0].end(), ProblemKind::TornTail)]
        );
        for len in 0..64 {
            let noise: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
            super::scan(&noise);
        }
    }
}
