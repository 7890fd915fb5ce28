//! Byte layout of one stored record (the payload of a segment frame) and the borrowed view over
//! it. This is the only module that calls bincode.
//!
//! Payload layout (little-endian, 4-byte aligned when the frame is):
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | `traj_id: u64` |
//! | 8..16 | `group_id: u64` |
//! | 16..20 | `step_index: u32` |
//! | 20..24 | `context_len: u32` |
//! | 24..40 | counts `n_obs, n_response, n_logprobs, meta_len: u32` |
//! | 40.. | `obs_ids: [u32; n_obs]`, `response_ids: [u32; n_response]`, `response_logprobs: [f32; n_logprobs]` |
//! | then | `meta_len` bytes of bincode (`config::standard`, serde) holding every other field (see below) |
//! | then | zero padding to a multiple of 4 |
//!
//! Ids and counts come first so that readers can index and group records without decoding the
//! metadata; the arrays are viewed in place (`bytemuck`) and copied only when the bytes are
//! misaligned or the host is big-endian. The metadata layout is fixed per segment format
//! version, and every version this build writes or wrote stays readable:
//!
//! - version 1: [`StepMeta`] as is (texts inline);
//! - version 2: two text entries, `observation_text` then `action_text`, then bincode of
//!   `StoredFields` (every other field, `info` flattened). A text entry starts with a LEB128
//!   varint `v`: even = the text inline, `v / 2` UTF-8 bytes following; odd = a backward
//!   reference to byte offset `v / 2`: an earlier frame of the same segment whose same field
//!   holds the identical text inline (the writer
//!   keeps a text → offset table per segment and compares texts, not hashes). A reader resolves
//!   a reference only to a frame its scan validated (framing, crc, counts) that starts before
//!   the referencing frame; when that fails the referencing record reports an error
//!   naming both offsets and never a wrong text.

use std::borrow::Cow;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::StoreError;
use super::record::{StepInfo, StepRecord};
use super::segment::Frame;

/// Bytes of the fixed header at the start of every payload.
pub const PAYLOAD_HEADER_LEN: usize = 40;
/// Largest metadata block accepted on write and on read (guards allocations from bad bytes).
pub const MAX_META_LEN: usize = 64 << 20;
/// Segment format versions whose payloads this build decodes.
pub const SUPPORTED_VERSIONS: std::ops::RangeInclusive<u32> = 1..=2;

type MetaConfig = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_META_LEN>,
>;

fn meta_config() -> MetaConfig {
    bincode::config::standard().with_limit::<MAX_META_LEN>()
}

/// Why a payload could not be encoded or decoded (the caller adds file and offset).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// Every field of a record that is not an id or an array: the bincode block (format version 1).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMeta {
    pub env_tag: String,
    pub seed: u64,
    pub policy_version: u64,
    pub reward: f32,
    pub terminated: bool,
    pub truncated: bool,
    pub state_hash: u64,
    pub info: StepInfo,
}

/// A text of a version-2 record: inline, or the offset of an earlier frame of the same segment
/// holding the same field's identical text inline.
#[derive(Clone, Copy, Debug, PartialEq)]
enum StoredText<'a> {
    Inline(&'a str),
    Earlier(u64),
}

fn encode_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 varint of at most 10 bytes; returns it and the bytes after it.
fn decode_varint(bytes: &[u8]) -> Result<(u64, &[u8]), CodecError> {
    let mut v = 0u64;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7F).checked_shl(7 * i as u32).unwrap_or(0);
        if b & 0x80 == 0 {
            return Ok((v, &bytes[i + 1..]));
        }
    }
    Err(CodecError("metadata ends inside a text entry".into()))
}

fn encode_text(text: &str, earlier: Option<u64>, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let tag = |n: u64, odd: u64| {
        n.checked_mul(2)
            .map(|v| v | odd)
            .ok_or_else(|| CodecError(format!("text entry value {n} is too large")))
    };
    match earlier {
        Some(offset) => encode_varint(tag(offset, 1)?, out),
        None => {
            encode_varint(tag(text.len() as u64, 0)?, out);
            out.extend_from_slice(text.as_bytes());
        }
    }
    Ok(())
}

/// Reads the text entry at the start of `bytes`; returns it and the bytes after it.
fn decode_text(bytes: &[u8]) -> Result<(StoredText<'_>, &[u8]), CodecError> {
    let (v, rest) = decode_varint(bytes)?;
    if v & 1 == 1 {
        return Ok((StoredText::Earlier(v >> 1), rest));
    }
    let len = usize::try_from(v >> 1)
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| CodecError(format!("text of {} bytes runs past the metadata", v >> 1)))?;
    let text = std::str::from_utf8(&rest[..len])
        .map_err(|e| CodecError(format!("text is not UTF-8: {e}")))?;
    Ok((StoredText::Inline(text), &rest[len..]))
}

/// The two text entries at the start of a version-2 metadata block (indexed like
/// [`TextField::ALL`]) and the bincode bytes after them.
fn decode_texts(meta: &[u8]) -> Result<([StoredText<'_>; 2], &[u8]), CodecError> {
    let (observation, rest) = decode_text(meta)?;
    let (action, rest) = decode_text(rest)?;
    Ok(([observation, action], rest))
}

/// The bincode part of a version-2 metadata block (borrowing its string from the payload).
#[derive(Serialize, Deserialize)]
struct StoredFields<'a> {
    env_tag: &'a str,
    seed: u64,
    policy_version: u64,
    reward: f32,
    terminated: bool,
    truncated: bool,
    state_hash: u64,
    success: bool,
    action_is_valid: bool,
    action_is_effective: bool,
    format_penalty: f32,
    num_actions: u32,
}

/// The two texts of a record that may be stored as backward references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextField {
    Observation,
    Action,
}

impl TextField {
    pub const ALL: [TextField; 2] = [TextField::Observation, TextField::Action];

    fn name(self) -> &'static str {
        match self {
            TextField::Observation => "observation_text",
            TextField::Action => "action_text",
        }
    }

    /// This field's text in `info`.
    pub fn of(self, info: &StepInfo) -> &str {
        match self {
            TextField::Observation => &info.observation_text,
            TextField::Action => &info.action_text,
        }
    }
}

/// Frame offsets of earlier frames holding a record's texts (`None`: store the text inline),
/// indexed like [`TextField::ALL`].
pub type TextRefs = [Option<u64>; 2];

/// Offsets of the parts of a validated payload; produced by [`parse_layout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadLayout {
    pub traj_id: u64,
    pub group_id: u64,
    pub step_index: u32,
    pub context_len: u32,
    n_obs: u32,
    n_response: u32,
    n_logprobs: u32,
    meta_len: u32,
}

impl PayloadLayout {
    fn obs_range(&self) -> std::ops::Range<usize> {
        PAYLOAD_HEADER_LEN..PAYLOAD_HEADER_LEN + 4 * self.n_obs as usize
    }

    fn response_range(&self) -> std::ops::Range<usize> {
        let start = self.obs_range().end;
        start..start + 4 * self.n_response as usize
    }

    fn logprob_range(&self) -> std::ops::Range<usize> {
        let start = self.response_range().end;
        start..start + 4 * self.n_logprobs as usize
    }

    fn meta_range(&self) -> std::ops::Range<usize> {
        let start = self.logprob_range().end;
        start..start + self.meta_len as usize
    }
}

/// Rounds `n` up to a multiple of 4.
pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Appends the version-2 payload of `record` (padded to a multiple of 4) to `out`, storing each
/// text with a `refs` entry as a reference. On error `out` may hold a partial payload.
pub fn encode_payload(
    record: &StepRecord,
    refs: TextRefs,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    let info = &record.info;
    let fields = StoredFields {
        env_tag: &record.env_tag,
        seed: record.seed,
        policy_version: record.policy_version,
        reward: record.reward,
        terminated: record.terminated,
        truncated: record.truncated,
        state_hash: record.state_hash,
        success: info.success,
        action_is_valid: info.action_is_valid,
        action_is_effective: info.action_is_effective,
        format_penalty: info.format_penalty,
        num_actions: info.num_actions,
    };
    let count = |n: usize, what: &str| {
        u32::try_from(n).map_err(|_| CodecError(format!("{what} has {n} elements, more than u32")))
    };
    let start = out.len();
    out.extend_from_slice(&record.traj_id.to_le_bytes());
    out.extend_from_slice(&record.group_id.to_le_bytes());
    out.extend_from_slice(&record.step_index.to_le_bytes());
    out.extend_from_slice(&record.context_len.to_le_bytes());
    out.extend_from_slice(&count(record.obs_ids.len(), "obs_ids")?.to_le_bytes());
    out.extend_from_slice(&count(record.response_ids.len(), "response_ids")?.to_le_bytes());
    out.extend_from_slice(
        &count(record.response_logprobs.len(), "response_logprobs")?.to_le_bytes(),
    );
    out.extend_from_slice(&0u32.to_le_bytes()); // meta_len, patched below
    extend_le_u32(out, &record.obs_ids);
    extend_le_u32(out, &record.response_ids);
    extend_le_f32(out, &record.response_logprobs);
    let meta_start = out.len();
    for (field, earlier) in TextField::ALL.into_iter().zip(refs) {
        encode_text(field.of(info), earlier, out)?;
    }
    bincode::serde::encode_into_std_write(&fields, out, meta_config())
        .map_err(|e| CodecError(format!("metadata does not encode: {e}")))?;
    let meta_len = out.len() - meta_start;
    if meta_len > MAX_META_LEN {
        return Err(CodecError(format!(
            "metadata is {meta_len} bytes, more than the {MAX_META_LEN} allowed"
        )));
    }
    out[start + 36..start + 40].copy_from_slice(&(meta_len as u32).to_le_bytes());
    out.resize(start + align4(out.len() - start), 0);
    Ok(())
}

fn extend_le_u32(out: &mut Vec<u8>, values: &[u32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    }
}

fn extend_le_f32(out: &mut Vec<u8>, values: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    }
}

fn read_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(std::array::from_fn(|i| bytes[at + i]))
}

/// Checks that the counts in the payload header describe exactly `payload.len()` bytes.
pub fn parse_layout(payload: &[u8]) -> Result<PayloadLayout, CodecError> {
    if payload.len() < PAYLOAD_HEADER_LEN {
        return Err(CodecError(format!(
            "payload of {} bytes is shorter than its {PAYLOAD_HEADER_LEN}-byte header",
            payload.len()
        )));
    }
    let layout = PayloadLayout {
        traj_id: read_u64(payload, 0),
        group_id: read_u64(payload, 8),
        step_index: read_u32(payload, 16),
        context_len: read_u32(payload, 20),
        n_obs: read_u32(payload, 24),
        n_response: read_u32(payload, 28),
        n_logprobs: read_u32(payload, 32),
        meta_len: read_u32(payload, 36),
    };
    let arrays = 4 * (layout.n_obs as u64 + layout.n_response as u64 + layout.n_logprobs as u64);
    let expected = PAYLOAD_HEADER_LEN as u64 + arrays + layout.meta_len as u64;
    let padded = (expected + 3) & !3;
    if padded != payload.len() as u64 || layout.meta_len as usize > MAX_META_LEN {
        return Err(CodecError(format!(
            "payload header counts ({} obs, {} response, {} logprob, {} meta bytes) do not match its {} bytes",
            layout.n_obs,
            layout.n_response,
            layout.n_logprobs,
            layout.meta_len,
            payload.len()
        )));
    }
    Ok(layout)
}

fn view_u32(bytes: &[u8]) -> Cow<'_, [u32]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) if cfg!(target_endian = "little") => Cow::Borrowed(slice),
        _ => Cow::Owned(bytes.chunks_exact(4).map(|c| read_u32(c, 0)).collect()),
    }
}

fn view_f32(bytes: &[u8]) -> Cow<'_, [f32]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) if cfg!(target_endian = "little") => Cow::Borrowed(slice),
        _ => Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_bits(read_u32(c, 0)))
                .collect(),
        ),
    }
}

fn decode_exact<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    let (value, used): (T, usize) = bincode::serde::borrow_decode_from_slice(bytes, meta_config())
        .map_err(|e| CodecError(format!("metadata does not decode: {e}")))?;
    if used != bytes.len() {
        return Err(CodecError(format!(
            "metadata has {} trailing bytes",
            bytes.len() - used
        )));
    }
    Ok(value)
}

/// Decodes a version-1 metadata block (texts inline).
pub fn decode_meta_v1(bytes: &[u8]) -> Result<StepMeta, CodecError> {
    decode_exact(bytes)
}

/// The texts a version-2 payload stores inline (`None` for references), indexed like
/// [`TextField::ALL`]; used to rebuild a writer's text table when it resumes a segment.
pub fn inline_texts(payload: &[u8]) -> Result<[Option<&str>; 2], CodecError> {
    let layout = parse_layout(payload)?;
    let (texts, _) = decode_texts(&payload[layout.meta_range()])?;
    Ok(texts.map(|text| match text {
        StoredText::Inline(text) => Some(text),
        StoredText::Earlier(_) => None,
    }))
}

/// A record read in place: ids and token arrays borrowed from the mapped segment, the rest
/// decoded on demand with [`StepView::meta`] or [`StepView::to_record`].
#[derive(Clone, Debug)]
pub struct StepView<'a> {
    pub traj_id: u64,
    pub group_id: u64,
    pub step_index: u32,
    pub context_len: u32,
    pub obs_ids: Cow<'a, [u32]>,
    pub response_ids: Cow<'a, [u32]>,
    pub response_logprobs: Cow<'a, [f32]>,
    /// Segment file and frame offset the record was read from (empty path, 0 for a bare payload).
    pub path: &'a Path,
    pub offset: u64,
    meta_bytes: &'a [u8],
    format_version: u32,
    /// Bytes of the whole segment and its validated frames (empty for a bare payload): where
    /// text references are resolved.
    segment: &'a [u8],
    frames: &'a [Frame],
}

impl<'a> StepView<'a> {
    /// Views a payload whose `layout` came from [`parse_layout`] on the same bytes.
    pub fn new(payload: &'a [u8], layout: &PayloadLayout, format_version: u32) -> Self {
        Self {
            path: Path::new(""),
            offset: 0,
            traj_id: layout.traj_id,
            group_id: layout.group_id,
            step_index: layout.step_index,
            context_len: layout.context_len,
            obs_ids: view_u32(&payload[layout.obs_range()]),
            response_ids: view_u32(&payload[layout.response_range()]),
            response_logprobs: view_f32(&payload[layout.logprob_range()]),
            meta_bytes: &payload[layout.meta_range()],
            format_version,
            segment: &[],
            frames: &[],
        }
    }

    /// Validates and views a payload in one call.
    pub fn parse(payload: &'a [u8], format_version: u32) -> Result<Self, CodecError> {
        let layout = parse_layout(payload)?;
        Ok(Self::new(payload, &layout, format_version))
    }

    /// Records where the viewed payload lives, for error messages.
    pub fn at(self, path: &'a Path, offset: u64) -> Self {
        Self {
            path,
            offset,
            ..self
        }
    }

    /// Places the view in its segment (the segment's bytes, its validated frames in offset
    /// order, this frame's offset): needed to resolve the text references of format version 2.
    pub(crate) fn in_segment(self, segment: &'a [u8], frames: &'a [Frame], offset: u64) -> Self {
        Self {
            segment,
            frames,
            offset,
            ..self
        }
    }

    fn corrupt(&self, reason: String) -> StoreError {
        StoreError::Corrupt {
            path: self.path.to_path_buf(),
            offset: self.offset,
            reason,
        }
    }

    /// Decodes the metadata block (env tag, seed, rewards, flags, texts), resolving text
    /// references against earlier frames of the segment.
    pub fn meta(&self) -> Result<StepMeta, StoreError> {
        match self.format_version {
            1 => decode_meta_v1(self.meta_bytes).map_err(|e| self.corrupt(e.0)),
            2 => {
                let (texts, fields) =
                    decode_texts(self.meta_bytes).map_err(|e| self.corrupt(e.0))?;
                let meta: StoredFields<'_> = decode_exact(fields).map_err(|e| self.corrupt(e.0))?;
                let [observation_text, action_text] =
                    [0, 1].map(|i| self.resolve(texts[i], TextField::ALL[i]));
                Ok(StepMeta {
                    env_tag: meta.env_tag.to_string(),
                    seed: meta.seed,
                    policy_version: meta.policy_version,
                    reward: meta.reward,
                    terminated: meta.terminated,
                    truncated: meta.truncated,
                    state_hash: meta.state_hash,
                    info: StepInfo {
                        success: meta.success,
                        action_is_valid: meta.action_is_valid,
                        action_is_effective: meta.action_is_effective,
                        format_penalty: meta.format_penalty,
                        num_actions: meta.num_actions,
                        observation_text: observation_text?,
                        action_text: action_text?,
                    },
                })
            }
            other => Err(self.corrupt(format!(
                "segment format version {other} is not supported by this build"
            ))),
        }
    }

    /// The text `stored` stands for: itself when inline, else the same field of the earlier frame.
    fn resolve(&self, stored: StoredText<'_>, field: TextField) -> Result<String, StoreError> {
        let at = match stored {
            StoredText::Inline(text) => return Ok(text.to_string()),
            StoredText::Earlier(at) => at,
        };
        let broken = |why: &str| {
            self.corrupt(format!(
                "{} refers to the record at byte {at}, which {why}",
                field.name()
            ))
        };
        let frame = (at < self.offset)
            .then(|| self.frames.binary_search_by_key(&at, |f| f.offset).ok())
            .flatten()
            .map(|i| self.frames[i])
            .ok_or_else(|| broken("is not a valid earlier record of this segment"))?;
        let payload = frame.payload(self.segment);
        let (texts, _) =
            decode_texts(&payload[frame.layout.meta_range()]).map_err(|e| broken(&e.0))?;
        match texts[field as usize] {
            StoredText::Inline(text) => Ok(text.to_string()),
            StoredText::Earlier(_) => Err(broken("holds a reference, not the text")),
        }
    }

    /// Copies everything into an owned [`StepRecord`].
    pub fn to_record(&self) -> Result<StepRecord, StoreError> {
        let meta = self.meta()?;
        Ok(StepRecord {
            traj_id: self.traj_id,
            group_id: self.group_id,
            step_index: self.step_index,
            env_tag: meta.env_tag,
            seed: meta.seed,
            policy_version: meta.policy_version,
            context_len: self.context_len,
            obs_ids: self.obs_ids.to_vec(),
            response_ids: self.response_ids.to_vec(),
            response_logprobs: self.response_logprobs.to_vec(),
            reward: meta.reward,
            terminated: meta.terminated,
            truncated: meta.truncated,
            state_hash: meta.state_hash,
            info: meta.info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StepRecord {
        StepRecord {
            traj_id: 7,
            group_id: 3,
            step_index: 2,
            env_tag: "frozen_lake".into(),
            seed: 99,
            policy_version: 4,
            context_len: 120,
            obs_ids: vec![1, 2, 3],
            response_ids: vec![10, 11],
            response_logprobs: vec![-0.5, -1.25],
            reward: 1.0,
            terminated: true,
            truncated: false,
            state_hash: 0xDEAD_BEEF,
            info: StepInfo {
                success: true,
                action_is_valid: true,
                action_is_effective: false,
                format_penalty: -0.1,
                num_actions: 2,
                observation_text: "_P_\nG__".into(),
                action_text: "<answer>Left</answer>".into(),
            },
        }
    }

    #[test]
    fn payload_round_trips_and_is_aligned() {
        let mut bytes = Vec::new();
        encode_payload(&sample(), [None, None], &mut bytes).unwrap();
        assert_eq!(bytes.len() % 4, 0);
        let view = StepView::parse(&bytes, 2).unwrap();
        assert_eq!(&*view.obs_ids, &[1, 2, 3]);
        assert_eq!(view.to_record().unwrap(), sample());
    }

    #[test]
    fn inconsistent_counts_are_rejected() {
        let mut bytes = Vec::new();
        encode_payload(&sample(), [None, None], &mut bytes).unwrap();
        bytes[24] = 200;
        assert!(parse_layout(&bytes).is_err());
        assert!(parse_layout(&bytes[..10]).is_err());
    }

    #[test]
    fn garbage_metadata_is_an_error() {
        assert!(decode_meta_v1(&[0xFF; 9]).is_err());
        let mut bytes = Vec::new();
        encode_payload(&sample(), [None, None], &mut bytes).unwrap();
        assert!(StepView::parse(&bytes, 3).unwrap().meta().is_err());
    }

    #[test]
    fn a_reference_without_its_segment_is_an_error_naming_both_offsets() {
        let mut bytes = Vec::new();
        encode_payload(&sample(), [None, Some(16)], &mut bytes).unwrap();
        assert_eq!(inline_texts(&bytes).unwrap(), [Some("_P_\nG__"), None]);
        let view = StepView::parse(&bytes, 2)
            .unwrap()
            .at(Path::new("s.stp"), 96);
        let err = view.to_record().unwrap_err().to_string();
        assert!(
            err.contains("s.stp at byte 96")
                && err.contains("action_text refers to the record at byte 16"),
            "{err}"
        );
    }

    #[test]
    fn misaligned_bytes_are_copied() {
        let mut bytes = vec![0u8];
        encode_payload(&sample(), [None, None], &mut bytes).unwrap();
        let view = StepView::parse(&bytes[1..], 2).unwrap();
        assert_eq!(view.to_record().unwrap(), sample());
    }
}
