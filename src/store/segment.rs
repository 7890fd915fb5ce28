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

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::codec::{self, PayloadLayout, StepView};
use super::error::{ProblemKind, StoreError};
use super::record::StepRecord;

/// First eight bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"STPPOSEG";
/// Format version written by this build (see `codec::SUPPORTED_VERSIONS` for what it reads).
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of the segment header.
pub const HEADER_LEN: usize = 16;
/// Bytes before the payload of every frame.
pub const FRAME_HEADER_LEN: usize = 12;
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"STPF");
const SEAL_MARK: u32 = u32::from_le_bytes(*b"STPS");
const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"STPE");
const TRAILER_LEN: usize = 12;
const INDEX_ENTRY_LEN: usize = 16;
const MAX_PAYLOAD: usize = 1 << 30;

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

/// Encodes `record` as one complete frame into `out` (cleared first).
pub fn encode_frame(record: &StepRecord, out: &mut Vec<u8>) -> Result<(), codec::CodecError> {
    out.clear();
    out.resize(FRAME_HEADER_LEN, 0);
    codec::encode_payload(record, out)?;
    let payload_len = out.len() - FRAME_HEADER_LEN;
    if payload_len > MAX_PAYLOAD {
        return Err(codec::CodecError(format!(
            "record is {payload_len} bytes, more than the {MAX_PAYLOAD} a frame holds"
        )));
    }
    let len_field = payload_len as u32;
    let crc = frame_crc(len_field, &out[FRAME_HEADER_LEN..]);
    out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&len_field.to_le_bytes());
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// A validated frame: where it starts and how its payload is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Byte offset of the frame (its magic) in the segment file.
    pub offset: u64,
    pub payload_len: u32,
    pub layout: PayloadLayout,
}

impl Frame {
    fn payload<'a>(&self, bytes: &'a [u8]) -> &'a [u8] {
        let start = self.offset as usize + FRAME_HEADER_LEN;
        &bytes[start..start + self.payload_len as usize]
    }

    /// Offset just past this frame.
    pub fn end(&self) -> u64 {
        self.offset + (FRAME_HEADER_LEN as u64) + self.payload_len as u64
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
    pub format_version: u32,
    pub frames: Vec<Frame>,
    pub footer: Option<Footer>,
    /// `(offset, problem)` in file order.
    pub problems: Vec<(u64, ProblemKind)>,
}

impl SegmentScan {
    /// Views the frame `frame` of this scan over the same `bytes`.
    pub fn view<'a>(&self, bytes: &'a [u8], frame: &Frame) -> StepView<'a> {
        StepView::new(frame.payload(bytes), &frame.layout, self.format_version)
    }
}

fn frame_at(bytes: &[u8], pos: usize, end: usize) -> Option<Frame> {
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
    let layout = codec::parse_layout(payload).ok()?;
    Some(Frame {
        offset: pos as u64,
        payload_len: len_field,
        layout,
    })
}

fn next_valid_frame(bytes: &[u8], from: usize, end: usize) -> Option<Frame> {
    (from..end.saturating_sub(FRAME_HEADER_LEN - 1))
        .step_by(4)
        .find_map(|pos| frame_at(bytes, pos, end))
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

fn check_header(bytes: &[u8], scan: &mut SegmentScan) -> bool {
    if bytes[..8] != SEGMENT_MAGIC {
        scan.problems
            .push((0, ProblemKind::BadHeader("wrong magic".into())));
    }
    let version = read_u32(bytes, 8).unwrap_or(0);
    let flags = read_u32(bytes, 12).unwrap_or(0);
    if !codec::SUPPORTED_VERSIONS.contains(&version) {
        let why = format!("format version {version} is not supported by this build");
        scan.problems.push((8, ProblemKind::BadHeader(why)));
        return false;
    }
    if flags != 0 {
        let why = format!("unknown flags {flags:#x}");
        scan.problems.push((12, ProblemKind::BadHeader(why)));
        return false;
    }
    scan.format_version = version;
    true
}

/// Validates the bytes of one segment file: header, every frame, the footer.
pub fn scan(bytes: &[u8]) -> SegmentScan {
    let mut scan = SegmentScan {
        format_version: FORMAT_VERSION,
        ..SegmentScan::default()
    };
    if bytes.is_empty() {
        return scan;
    }
    if bytes.len() < HEADER_LEN {
        scan.problems.push((0, ProblemKind::TornTail));
        return scan;
    }
    if !check_header(bytes, &mut scan) {
        return scan;
    }
    scan.footer = parse_footer(bytes);
    let end = scan.footer.map_or(bytes.len(), |f| f.seal_offset as usize);
    let mut pos = HEADER_LEN;
    while pos < end {
        if let Some(frame) = frame_at(bytes, pos, end) {
            scan.frames.push(frame);
            pos = frame.end() as usize;
            continue;
        }
        match next_valid_frame(bytes, pos + 4, end) {
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
}

impl MappedSegment {
    /// Maps and scans `path`. The file must not be truncated while mapped (appends are fine:
    /// the map covers the length at open time, and only complete frames are ever returned).
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let file = File::open(path).map_err(StoreError::io(path))?;
        let len = file.metadata().map_err(StoreError::io(path))?.len();
        // SAFETY: segment files are append-only; stepppo never truncates a file that a reader
        // may have mapped except through `repair`, which runs on a dataset no one is using.
        let map = match len {
            0 => None,
            _ => Some(unsafe { Mmap::map(&file) }.map_err(StoreError::io(path))?),
        };
        let scan = scan(map.as_deref().unwrap_or(&[]));
        Ok(Self {
            path: path.to_path_buf(),
            map,
            scan,
        })
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
                Some(frames[i])
            });
        Some(found.collect())
    }
}

/// Appends frames to one segment file and seals it with its footer.
#[derive(Debug)]
pub struct SegmentWriter {
    path: PathBuf,
    out: BufWriter<File>,
    len: u64,
    index: Vec<(u64, u64)>,
}

impl SegmentWriter {
    /// Creates a new segment file (it must not exist) and writes its header.
    pub fn create(path: &Path) -> Result<Self, StoreError> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(StoreError::io(path))?;
        let mut writer = Self {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            len: 0,
            index: Vec::new(),
        };
        let mut header = SEGMENT_MAGIC.to_vec();
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        writer.write(&header)?;
        Ok(writer)
    }

    /// Reopens an unsealed, undamaged segment of the current format to append to it.
    pub fn resume(segment: &MappedSegment) -> Result<Self, StoreError> {
        let path = &segment.path;
        let invalid = |reason: &str| StoreError::Invalid {
            path: path.clone(),
            reason: reason.into(),
        };
        if segment.scan.footer.is_some() || segment.scan.format_version != FORMAT_VERSION {
            return Err(invalid("segment is sealed or of another format version"));
        }
        if segment.bytes().is_empty() {
            std::fs::remove_file(path).map_err(StoreError::io(path))?;
            return Self::create(path);
        }
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(StoreError::io(path))?;
        let len = segment.bytes().len() as u64;
        let frames = &segment.scan.frames;
        let index = frames
            .iter()
            .map(|f| (f.layout.traj_id, f.offset))
            .collect();
        Ok(Self {
            path: path.clone(),
            out: BufWriter::with_capacity(1 << 20, file),
            len,
            index,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.out
            .write_all(bytes)
            .map_err(StoreError::io(&self.path))?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far (header included).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn records(&self) -> u64 {
        self.index.len() as u64
    }

    /// Appends one frame made by [`encode_frame`]; returns its offset.
    pub fn append_frame(&mut self, frame: &[u8], traj_id: u64) -> Result<u64, StoreError> {
        let offset = self.len;
        self.write(frame)?;
        self.index.push((traj_id, offset));
        Ok(offset)
    }

    /// Hands buffered frames to the OS: from now on readers see them.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.out.flush().map_err(StoreError::io(&self.path))
    }

    /// Writes the footer, flushes and syncs; returns (records, bytes).
    pub fn seal(mut self) -> Result<(u64, u64), StoreError> {
        self.index.sort_unstable();
        let mut body = Vec::with_capacity(8 + self.index.len() * INDEX_ENTRY_LEN);
        body.extend_from_slice(&(self.index.len() as u64).to_le_bytes());
        for (traj_id, offset) in &self.index {
            body.extend_from_slice(&traj_id.to_le_bytes());
            body.extend_from_slice(&offset.to_le_bytes());
        }
        let mut footer = SEAL_MARK.to_le_bytes().to_vec();
        footer.extend_from_slice(&body);
        footer.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        footer.extend_from_slice(&(body.len() as u32).to_le_bytes());
        footer.extend_from_slice(&TRAILER_MAGIC.to_le_bytes());
        self.write(&footer)?;
        self.flush()?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(StoreError::io(&self.path))?;
        Ok((self.index.len() as u64, self.len))
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg.stp");
        let mut writer = SegmentWriter::create(&path).unwrap();
        let mut frame = Vec::new();
        for r in records {
            encode_frame(r, &mut frame).unwrap();
            writer.append_frame(&frame, r.traj_id).unwrap();
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
