//! Byte layout of one stored record (the payload of a segment frame) and the borrowed views over
//! it. This is the only module that calls bincode (formats 1 and 2 only).
//!
//! Format version 6 (written by this build), little-endian, payload 4-byte aligned when the frame
//! is:
//!
//! | bytes | content |
//! |---|---|
//! | header | LEB128 varints `ordinal` (the frame's number in its segment, from 0), `traj_id, group_id, step_index, context_len, n_obs, n_response, n_logprobs`, then one byte of id widths: bits 0-1 = obs width − 1, bits 2-3 = response width − 1 (bits 4-7 zero) |
//! | pad | zeros to a multiple of 4 |
//! | logprobs | `response_logprobs: [f32; n_logprobs]` (exact bits) |
//! | obs ids | `n_obs` ids of the obs width (1 to 4 bytes each: the narrowest that holds the array's largest id), zeros to a multiple of 4 |
//! | response ids | `n_response` ids of the response width |
//! | metadata | to the end of the payload (see below), then 0 to 3 zero bytes of padding |
//!
//! Version-6 metadata: one flag byte (bit 0 terminated, 1 truncated, 2 success,
//! 3 action_is_valid, 4 action_is_effective, 5 `reward` stored, 6 `format_penalty` stored,
//! 7 `critic_state` stored; a float that is not stored is +0.0, a critic state that is not
//! stored is empty); a second flag byte (bit 0 tool_call_error, bit 1 context_rebuilt, bit 2
//! `admissible_actions` stored, bits 3-7 zero: a set unknown bit is an error); two text entries
//! `observation_text`, `action_text`; `env_tag` (varint length, UTF-8 bytes); `seed: u64`,
//! `state_hash: u64`; varints `policy_version`, `num_actions`; then `reward: f32` and
//! `format_penalty: f32` when their flag is set; then, when its flag is set, `critic_state` as a
//! varint count and that many `f32`; then, when its flag is set, `admissible_actions` as a
//! varint count and that many strings (varint length, UTF-8 bytes). A text entry starts with a
//! varint `v`: even = the text inline, `v / 2` UTF-8 bytes following; odd = a backward reference: the frame numbered `v / 2` (1 to
//! [`REFERENCE_WINDOW`]) before this one in the same segment holds the identical text inline in
//! the same field (the writer keeps a text → frame cache per segment, compares texts, not
//! hashes, and refers only to frames of the same block of [`REFERENCE_BLOCK`] frames, storing a
//! text inline again in the first frame of each block that uses it, so a damaged frame can only
//! cost the texts of the records of its block; segments written before that rule refer anywhere
//! in the window, and read the same). A reader finds the referenced frame in O(1) through the
//! scan's frame list (by binary search over frame numbers when damaged frames were skipped in
//! between); when it is not a valid earlier frame the referencing record reports an error,
//! never a wrong text.
//!
//! Ids come first so that readers can index and group records without decoding the metadata;
//! arrays are viewed in place: log-probs as `&[f32]` (copied only when misaligned or on a
//! big-endian host), ids through [`TokenIds`]. Every version this build wrote stays readable:
//!
//! - version 1: a 40-byte header (`traj_id, group_id: u64`, `step_index, context_len, n_obs,
//!   n_response, n_logprobs, meta_len: u32`), `u32` ids and `f32` log-probs, then [`StepMeta`]
//!   without `tool_call_error` and `context_rebuilt` in bincode (`config::standard`, serde),
//!   zero padding to a multiple of 4;
//! - version 2: as version 1, but the metadata is two text entries (`observation_text`,
//!   `action_text`; a reference holds the byte offset of the earlier frame instead of a frame
//!   count) followed by bincode of every other field (`info` flattened);
//! - version 3: as version 4, with flag bit 7 zero (no critic state);
//! - version 4: as version 5 without the second flag byte (the text entries follow the first);
//! - version 5: as version 6 with bit 2 of the second flag byte zero (no admissible actions).
//!
//! Versions 1 to 4 do not store `tool_call_error` and `context_rebuilt`: their records read
//! with both false.

use std::borrow::Cow;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::StoreError;
use super::record::StepRecord;
use super::tokens::{self, TokenIds};
use crate::env::StepInfo;

/// Bytes of the fixed payload header of format versions 1 and 2.
const LEGACY_HEADER_LEN: usize = 40;
/// Largest metadata block accepted on read of versions 1 and 2 (guards allocations from bad bytes).
pub const MAX_META_LEN: usize = 64 << 20;
/// How many frames back a text reference of version 3 or later may point.
pub const REFERENCE_WINDOW: u64 = 256;
/// Frames per reference block: the writer makes a text reference from frame `n` only to a
/// frame `m` of the same block (`m / REFERENCE_BLOCK == n / REFERENCE_BLOCK`), so the first frame
/// of a block stores its texts inline and one damaged frame costs at most the records of its
/// block. A writer-side rule: readers resolve any reference within [`REFERENCE_WINDOW`], as
/// segments written before the rule have them.
pub const REFERENCE_BLOCK: u64 = 32;
/// Segment format version written by this build.
pub const FORMAT_VERSION: u32 = 6;
/// Segment format versions whose payloads this build decodes.
pub const SUPPORTED_VERSIONS: std::ops::RangeInclusive<u32> = 1..=FORMAT_VERSION;

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

/// Every field of a record that is not an id or an array, owned (format version 1 stored it in
/// bincode, before `info` had `tool_call_error` and `context_rebuilt`: see `MetaV1`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMeta {
    /// Environment tag (e.g. `frozen_lake`).
    pub env_tag: String,
    /// Seed the episode's environment was reset with.
    pub seed: u64,
    /// Version of the policy weights that generated the response.
    pub policy_version: u64,
    /// Reward of the round, format penalty included.
    pub reward: f32,
    /// The episode ended in a terminal state at this step.
    pub terminated: bool,
    /// The episode was cut (turn/step/length limit) at this step.
    pub truncated: bool,
    /// Hash of the raw environment observation at the start of the step.
    pub state_hash: u64,
    /// Flags and texts of the step.
    pub info: StepInfo,
}

/// The metadata of a record decoded in place: texts borrowed from the mapped segment (text
/// references resolved to the earlier frame's bytes), nothing allocated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepMetaView<'a> {
    /// Environment tag (e.g. `frozen_lake`).
    pub env_tag: &'a str,
    /// Seed the episode's environment was reset with.
    pub seed: u64,
    /// Version of the policy weights that generated the response.
    pub policy_version: u64,
    /// Reward of the round, format penalty included.
    pub reward: f32,
    /// The episode ended in a terminal state at this step.
    pub terminated: bool,
    /// The episode was cut (turn/step/length limit) at this step.
    pub truncated: bool,
    /// Hash of the raw environment observation at the start of the step.
    pub state_hash: u64,
    /// `info.success`: the episode is solved at or before the end of this step.
    pub success: bool,
    /// `info.action_is_valid`: every parsed action was valid.
    pub action_is_valid: bool,
    /// `info.action_is_effective`: at least one action changed the environment state.
    pub action_is_effective: bool,
    /// `info.format_penalty`: the penalty included in `reward` (0 when well formed).
    pub format_penalty: f32,
    /// `info.num_actions`: env actions executed in this round.
    pub num_actions: u32,
    /// `info.observation_text`: the observation shown at the start of the step.
    pub observation_text: &'a str,
    /// `info.action_text`: the decoded response text.
    pub action_text: &'a str,
    /// `critic_state` as stored: little-endian `f32`s (empty before format version 4).
    pub critic_state: &'a [u8],
    /// `info.tool_call_error` (false before format version 5).
    pub tool_call_error: bool,
    /// `info.context_rebuilt` (false before format version 5).
    pub context_rebuilt: bool,
    /// `admissible_actions` as stored: a varint count, then each action as a varint length
    /// and UTF-8 bytes, checked when the view was made (empty before format version 6).
    pub admissible_actions: &'a [u8],
}

impl StepMetaView<'_> {
    /// The record's critic state.
    pub fn critic_state(&self) -> Vec<f32> {
        self.critic_state
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// The record's admissible actions (empty when none were stored).
    pub fn admissible_actions(&self) -> Vec<String> {
        let mut cursor = Cursor {
            rest: self.admissible_actions,
        };
        let count = match self.admissible_actions {
            [] => 0,
            _ => cursor.varint("").unwrap_or(0),
        };
        (0..count)
            .map_while(|_| cursor.str("").ok().map(str::to_string))
            .collect()
    }

    /// Copies the view into an owned [`StepMeta`].
    pub fn to_meta(&self) -> StepMeta {
        StepMeta {
            env_tag: self.env_tag.to_string(),
            seed: self.seed,
            policy_version: self.policy_version,
            reward: self.reward,
            terminated: self.terminated,
            truncated: self.truncated,
            state_hash: self.state_hash,
            info: StepInfo {
                success: self.success,
                action_is_valid: self.action_is_valid,
                action_is_effective: self.action_is_effective,
                format_penalty: self.format_penalty,
                num_actions: self.num_actions,
                observation_text: self.observation_text.to_string(),
                action_text: self.action_text.to_string(),
                tool_call_error: self.tool_call_error,
                context_rebuilt: self.context_rebuilt,
            },
        }
    }
}

/// Version-1 metadata read in place (the bincode layout of [`StepMeta`] before `info` had its
/// two format-5 flags).
#[derive(Deserialize)]
struct MetaV1<'a> {
    env_tag: &'a str,
    seed: u64,
    policy_version: u64,
    reward: f32,
    terminated: bool,
    truncated: bool,
    state_hash: u64,
    #[serde(borrow)]
    info: InfoV1<'a>,
}

#[derive(Deserialize)]
struct InfoV1<'a> {
    success: bool,
    action_is_valid: bool,
    action_is_effective: bool,
    format_penalty: f32,
    num_actions: u32,
    observation_text: &'a str,
    action_text: &'a str,
}

/// The bincode part of a version-2 metadata block (after its two text entries).
#[derive(Deserialize)]
struct FieldsV2<'a> {
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

/// A stored text: inline (UTF-8 not yet checked), or a reference to an earlier frame (format 2:
/// its byte offset; formats 3 to 6: how many frame numbers back).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum StoredText<'a> {
    Inline(&'a [u8]),
    Earlier(u64),
}

/// The texts a record may store as backward references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextField {
    Observation,
    Action,
}

impl TextField {
    /// The text entries at the start of a version-2 metadata block, after the flag byte of a
    /// version-3 or -4 one and after the two flag bytes of a version-5 one, in stored order.
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

/// Per text field (indexed like [`TextField::ALL`]): how many frames back an earlier frame of
/// the segment holds the same text inline (`None`: store the text inline).
pub type TextRefs = [Option<u64>; 2];

const FLAG_TERMINATED: u8 = 1;
const FLAG_TRUNCATED: u8 = 1 << 1;
const FLAG_SUCCESS: u8 = 1 << 2;
const FLAG_VALID: u8 = 1 << 3;
const FLAG_EFFECTIVE: u8 = 1 << 4;
const FLAG_REWARD: u8 = 1 << 5;
const FLAG_PENALTY: u8 = 1 << 6;
const FLAG_CRITIC_STATE: u8 = 1 << 7;
/// Bits of the second flag byte (format version 5; bit 2 from version 6).
const FLAG2_TOOL_CALL_ERROR: u8 = 1;
const FLAG2_CONTEXT_REBUILT: u8 = 1 << 1;
const FLAG2_ADMISSIBLE_ACTIONS: u8 = 1 << 2;
/// The bits of the second flag byte each version knows.
fn flags2_known(version: u32) -> u8 {
    match version {
        ..=5 => FLAG2_TOOL_CALL_ERROR | FLAG2_CONTEXT_REBUILT,
        _ => FLAG2_TOOL_CALL_ERROR | FLAG2_CONTEXT_REBUILT | FLAG2_ADMISSIBLE_ACTIONS,
    }
}

fn encode_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads values off the front of a byte slice; every read names what ran out.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn ends_inside(what: &str) -> CodecError {
        CodecError(format!("bytes end inside {what}"))
    }

    /// A LEB128 varint of at most 10 bytes.
    #[inline]
    fn varint(&mut self, what: &str) -> Result<u64, CodecError> {
        let mut v = 0u64;
        for (i, &b) in self.rest.iter().enumerate().take(10) {
            v |= u64::from(b & 0x7F).checked_shl(7 * i as u32).unwrap_or(0);
            if b & 0x80 == 0 {
                self.rest = &self.rest[i + 1..];
                return Ok(v);
            }
        }
        Err(Self::ends_inside(what))
    }

    #[inline]
    fn varint_u32(&mut self, what: &str) -> Result<u32, CodecError> {
        let v = self.varint(what)?;
        u32::try_from(v).map_err(|_| CodecError(format!("{what} {v} does not fit in u32")))
    }

    #[inline]
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CodecError> {
        if n > self.rest.len() {
            return Err(Self::ends_inside(what));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    #[inline]
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], CodecError> {
        let bytes = self.take(N, what)?;
        Ok(std::array::from_fn(|i| bytes[i]))
    }

    #[inline]
    fn text(&mut self, field: TextField) -> Result<StoredText<'a>, CodecError> {
        let v = self.varint(field.name())?;
        if v & 1 == 1 {
            return Ok(StoredText::Earlier(v >> 1));
        }
        let len = usize::try_from(v >> 1).unwrap_or(usize::MAX);
        Ok(StoredText::Inline(self.take(len, field.name())?))
    }

    /// The bytes of a list of admissible actions (a varint count, then length-prefixed
    /// strings), each checked.
    fn admissible_actions(&mut self) -> Result<&'a [u8], CodecError> {
        let start = self.rest;
        let count = self.varint("the admissible actions' count")?;
        if count == 0 {
            return Err(CodecError(
                "the admissible actions' flag is set on an empty list".into(),
            ));
        }
        for i in 0..count {
            self.str("an admissible action")
                .map_err(|e| CodecError(format!("{} (action {i})", e.0)))?;
        }
        Ok(&start[..start.len() - self.rest.len()])
    }

    /// A length-prefixed string.
    #[inline]
    fn str(&mut self, what: &str) -> Result<&'a str, CodecError> {
        let len = usize::try_from(self.varint(what)?).unwrap_or(usize::MAX);
        as_text(self.take(len, what)?).map_err(|e| CodecError(format!("{what} is not UTF-8: {e}")))
    }
}

fn utf8(bytes: &[u8], field: TextField) -> Result<&str, CodecError> {
    as_text(bytes).map_err(|e| CodecError(format!("{} is not UTF-8: {e}", field.name())))
}

/// `bytes` as text. Stored texts are mostly short ASCII (and a reference makes the same text be
/// checked once per record that points to it), so the word-at-a-time ASCII test runs first.
fn as_text(bytes: &[u8]) -> Result<&str, std::str::Utf8Error> {
    if bytes.is_ascii() {
        // SAFETY: ASCII bytes are valid UTF-8.
        return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes)
}

fn encode_text(text: &str, back: Option<u64>, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let tag = |n: u64, odd: u64| {
        n.checked_mul(2)
            .map(|v| v | odd)
            .ok_or_else(|| CodecError(format!("text entry value {n} is too large")))
    };
    match back {
        Some(frames) => encode_varint(tag(frames, 1)?, out),
        None => {
            encode_varint(tag(text.len() as u64, 0)?, out);
            out.extend_from_slice(text.as_bytes());
        }
    }
    Ok(())
}

/// Flag bytes before the text entries of a metadata block of format `version` (none in
/// version 2, whose block starts with the texts; version 1 has no text entries).
fn flag_bytes(version: u32) -> usize {
    match version {
        ..=2 => 0,
        3 | 4 => 1,
        _ => 2,
    }
}

/// The entry of `field` in a metadata block of `version` (texts of earlier fields skipped).
pub(super) fn text_entry(
    version: u32,
    meta: &[u8],
    field: TextField,
) -> Result<StoredText<'_>, CodecError> {
    let start = flag_bytes(version);
    let mut cursor = Cursor {
        rest: meta.get(start..).unwrap_or_default(),
    };
    let observation = cursor.text(TextField::Observation)?;
    match field {
        TextField::Observation => Ok(observation),
        TextField::Action => cursor.text(TextField::Action),
    }
}

/// Bytes before the payload of every segment frame (magic, payload length, crc32).
pub const FRAME_HEADER_LEN: usize = 12;

/// A validated frame: where it starts and how its payload is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Byte offset of the frame (its magic) in the segment file.
    pub offset: u64,
    pub payload_len: u32,
    /// Position of this frame among the scan's valid frames.
    pub index: u32,
    pub layout: PayloadLayout,
}

impl Frame {
    pub(crate) fn payload<'a>(&self, bytes: &'a [u8]) -> &'a [u8] {
        let start = self.offset as usize + FRAME_HEADER_LEN;
        &bytes[start..start + self.payload_len as usize]
    }

    /// Offset just past this frame.
    pub fn end(&self) -> u64 {
        self.offset + (FRAME_HEADER_LEN as u64) + self.payload_len as u64
    }
}

/// Where the parts of a validated payload lie (byte ranges into the payload); produced by
/// [`parse_layout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadLayout {
    /// Number of the frame in its segment (formats 3 and later; 0 in older formats).
    pub ordinal: u64,
    pub traj_id: u64,
    pub group_id: u64,
    pub step_index: u32,
    pub context_len: u32,
    obs: [u32; 2],
    obs_width: u8,
    response: [u32; 2],
    response_width: u8,
    logprobs: [u32; 2],
    meta: [u32; 2],
}

fn range([start, end]: [u32; 2]) -> std::ops::Range<usize> {
    start as usize..end as usize
}

impl PayloadLayout {
    pub(crate) fn meta_range(&self) -> std::ops::Range<usize> {
        range(self.meta)
    }
}

/// Rounds `n` up to a multiple of 4.
pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn pad4(out: &mut Vec<u8>, start: usize) {
    out.resize(start + align4(out.len() - start), 0);
}

/// Appends the version-5 payload of `record` as frame number `ordinal` of its segment (padded
/// to a multiple of 4) to `out`, storing each text with a `refs` entry as a reference. On error
/// `out` may hold a partial payload.
pub fn encode_payload(
    record: &StepRecord,
    ordinal: u64,
    refs: TextRefs,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    let start = out.len();
    let obs_width = tokens::width_for(&record.obs_ids);
    let response_width = tokens::width_for(&record.response_ids);
    for v in [
        ordinal,
        record.traj_id,
        record.group_id,
        record.step_index.into(),
        record.context_len.into(),
        record.obs_ids.len() as u64,
        record.response_ids.len() as u64,
        record.response_logprobs.len() as u64,
    ] {
        encode_varint(v, out);
    }
    out.push((obs_width - 1) as u8 | ((response_width - 1) as u8) << 2);
    pad4(out, start);
    extend_le_f32(out, &record.response_logprobs);
    tokens::extend_packed(out, &record.obs_ids, obs_width);
    pad4(out, start);
    tokens::extend_packed(out, &record.response_ids, response_width);
    encode_meta(record, refs, out)?;
    pad4(out, start);
    Ok(())
}

fn encode_meta(record: &StepRecord, refs: TextRefs, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let info = &record.info;
    let stored = |x: f32| x.to_bits() != 0;
    let flags = [
        (record.terminated, FLAG_TERMINATED),
        (record.truncated, FLAG_TRUNCATED),
        (info.success, FLAG_SUCCESS),
        (info.action_is_valid, FLAG_VALID),
        (info.action_is_effective, FLAG_EFFECTIVE),
        (stored(record.reward), FLAG_REWARD),
        (stored(info.format_penalty), FLAG_PENALTY),
        (!record.critic_state.is_empty(), FLAG_CRITIC_STATE),
    ];
    let flags2 = [
        (info.tool_call_error, FLAG2_TOOL_CALL_ERROR),
        (info.context_rebuilt, FLAG2_CONTEXT_REBUILT),
        (
            !record.admissible_actions.is_empty(),
            FLAG2_ADMISSIBLE_ACTIONS,
        ),
    ];
    let byte = |bits: &[(bool, u8)]| {
        bits.iter()
            .fold(0, |acc, &(set, bit)| acc | (bit * set as u8))
    };
    out.extend_from_slice(&[byte(&flags), byte(&flags2)]);
    for (field, back) in TextField::ALL.into_iter().zip(refs) {
        encode_text(field.of(info), back, out)?;
    }
    encode_varint(record.env_tag.len() as u64, out);
    out.extend_from_slice(record.env_tag.as_bytes());
    out.extend_from_slice(&record.seed.to_le_bytes());
    out.extend_from_slice(&record.state_hash.to_le_bytes());
    encode_varint(record.policy_version, out);
    encode_varint(info.num_actions.into(), out);
    for x in [record.reward, info.format_penalty] {
        if stored(x) {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    if !record.critic_state.is_empty() {
        encode_varint(record.critic_state.len() as u64, out);
        extend_le_f32(out, &record.critic_state);
    }
    if !record.admissible_actions.is_empty() {
        encode_varint(record.admissible_actions.len() as u64, out);
        for action in &record.admissible_actions {
            encode_varint(action.len() as u64, out);
            out.extend_from_slice(action.as_bytes());
        }
    }
    Ok(())
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

/// Checks that the header of a payload of format `version` describes `payload` and returns
/// where its parts lie.
pub fn parse_layout(payload: &[u8], version: u32) -> Result<PayloadLayout, CodecError> {
    if payload.len() > u32::MAX as usize {
        return Err(CodecError(format!(
            "payload of {} bytes is too large",
            payload.len()
        )));
    }
    match version {
        1 | 2 => parse_legacy_layout(payload),
        _ => parse_layout_v3(payload),
    }
}

fn parse_layout_v3(payload: &[u8]) -> Result<PayloadLayout, CodecError> {
    let mut cursor = Cursor { rest: payload };
    let ordinal = cursor.varint("the payload header")?;
    let traj_id = cursor.varint("the payload header")?;
    let group_id = cursor.varint("the payload header")?;
    let step_index = cursor.varint_u32("step_index")?;
    let context_len = cursor.varint_u32("context_len")?;
    let counts = [
        cursor.varint("the payload header")?,
        cursor.varint("the payload header")?,
        cursor.varint("the payload header")?,
    ];
    let widths = cursor.array::<1>("the payload header")?[0];
    if widths >> 4 != 0 {
        return Err(CodecError(format!("unknown id width bits {widths:#x}")));
    }
    let (obs_width, response_width) = ((widths & 3) + 1, ((widths >> 2) & 3) + 1);
    let [n_obs, n_response, n_logprobs] = counts;
    let mut at = align4(payload.len() - cursor.rest.len()) as u64;
    let mut next = |bytes: u64, align: bool| {
        let start = at;
        at = start.saturating_add(bytes);
        let end = at;
        if align {
            at = at.saturating_add(3) & !3;
        }
        [start, end]
    };
    let logprobs = next(n_logprobs.saturating_mul(4), false);
    let obs = next(n_obs.saturating_mul(obs_width.into()), true);
    let response = next(n_response.saturating_mul(response_width.into()), false);
    if at > payload.len() as u64 {
        return Err(CodecError(format!(
            "payload header counts ({n_obs} obs, {n_response} response, {n_logprobs} logprob) run past its {} bytes",
            payload.len()
        )));
    }
    let narrow = |[start, end]: [u64; 2]| [start as u32, end as u32];
    Ok(PayloadLayout {
        ordinal,
        traj_id,
        group_id,
        step_index,
        context_len,
        obs: narrow(obs),
        obs_width,
        response: narrow(response),
        response_width,
        logprobs: narrow(logprobs),
        meta: [at as u32, payload.len() as u32],
    })
}

fn parse_legacy_layout(payload: &[u8]) -> Result<PayloadLayout, CodecError> {
    if payload.len() < LEGACY_HEADER_LEN {
        return Err(CodecError(format!(
            "payload of {} bytes is shorter than its {LEGACY_HEADER_LEN}-byte header",
            payload.len()
        )));
    }
    let [n_obs, n_response, n_logprobs, meta_len] =
        [24, 28, 32, 36].map(|at| read_u32(payload, at) as u64);
    let arrays = 4 * (n_obs + n_response + n_logprobs);
    let expected = LEGACY_HEADER_LEN as u64 + arrays + meta_len;
    let padded = (expected + 3) & !3;
    if padded != payload.len() as u64 || meta_len as usize > MAX_META_LEN {
        return Err(CodecError(format!(
            "payload header counts ({n_obs} obs, {n_response} response, {n_logprobs} logprob, {meta_len} meta bytes) do not match its {} bytes",
            payload.len()
        )));
    }
    let mut at = LEGACY_HEADER_LEN as u32;
    let mut next = |bytes: u64| {
        let start = at;
        at += bytes as u32;
        [start, at]
    };
    Ok(PayloadLayout {
        ordinal: 0,
        traj_id: read_u64(payload, 0),
        group_id: read_u64(payload, 8),
        step_index: read_u32(payload, 16),
        context_len: read_u32(payload, 20),
        obs: next(4 * n_obs),
        obs_width: 4,
        response: next(4 * n_response),
        response_width: 4,
        logprobs: next(4 * n_logprobs),
        meta: next(meta_len),
    })
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

/// The texts a payload of the current format version stores inline (`None` for references),
/// indexed like [`TextField::ALL`]; used to rebuild a writer's text table when it resumes a
/// segment.
pub fn inline_texts<'a>(
    payload: &'a [u8],
    layout: &PayloadLayout,
) -> Result<[Option<&'a str>; 2], CodecError> {
    let meta = &payload[layout.meta_range()];
    let mut texts = [None; 2];
    for (slot, field) in texts.iter_mut().zip(TextField::ALL) {
        if let StoredText::Inline(bytes) = text_entry(FORMAT_VERSION, meta, field)? {
            *slot = Some(utf8(bytes, field)?);
        }
    }
    Ok(texts)
}

/// A record read in place: ids, token arrays and (through [`StepView::meta_view`]) texts
/// borrowed from the mapped segment; owned copies with [`StepView::meta`] or
/// [`StepView::to_record`].
#[derive(Clone, Debug)]
pub struct StepView<'a> {
    /// Unique id of the trajectory within a dataset.
    pub traj_id: u64,
    /// Id of the GRPO group of same-config, same-seed trajectories.
    pub group_id: u64,
    /// 0-based index of this step in its trajectory.
    pub step_index: u32,
    /// Number of context tokens before this step's `obs_ids` (0 in the window layout).
    pub context_len: u32,
    /// Tokens new at this step (template fragment, observation, generation prompt).
    pub obs_ids: TokenIds<'a>,
    /// The tokens the policy sampled in this step.
    pub response_ids: TokenIds<'a>,
    /// Behaviour-policy log-probabilities of `response_ids` (borrowed unless misaligned or on
    /// a big-endian host).
    pub response_logprobs: Cow<'a, [f32]>,
    /// Segment file and frame offset the record was read from (empty path, 0 for a bare payload).
    pub path: &'a Path,
    /// Byte offset of the record's frame in `path` (0 for a bare payload).
    pub offset: u64,
    meta_bytes: &'a [u8],
    format_version: u32,
    /// Bytes of the whole segment, its validated frames and this frame's position among them
    /// (empty for a bare payload): where text references are resolved.
    segment: &'a [u8],
    frames: &'a [Frame],
    index: usize,
}

impl<'a> StepView<'a> {
    /// Views a payload whose `layout` came from [`parse_layout`] on the same bytes.
    pub fn new(payload: &'a [u8], layout: &PayloadLayout, format_version: u32) -> Self {
        let ids =
            |at, width: u8| TokenIds::new(&payload[range(at)], width.into()).unwrap_or_default();
        Self {
            path: Path::new(""),
            offset: 0,
            traj_id: layout.traj_id,
            group_id: layout.group_id,
            step_index: layout.step_index,
            context_len: layout.context_len,
            obs_ids: ids(layout.obs, layout.obs_width),
            response_ids: ids(layout.response, layout.response_width),
            response_logprobs: view_f32(&payload[range(layout.logprobs)]),
            meta_bytes: &payload[layout.meta_range()],
            format_version,
            segment: &[],
            frames: &[],
            index: 0,
        }
    }

    /// Validates and views a payload in one call.
    pub fn parse(payload: &'a [u8], format_version: u32) -> Result<Self, CodecError> {
        let layout = parse_layout(payload, format_version)?;
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
    /// order, this frame's position among them): needed to resolve text references.
    pub(crate) fn in_segment(self, segment: &'a [u8], frames: &'a [Frame], index: usize) -> Self {
        Self {
            segment,
            frames,
            index,
            offset: frames.get(index).map_or(self.offset, |f| f.offset),
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

    /// Decodes the metadata block in place (env tag, seed, rewards, flags, texts), resolving
    /// text references against earlier frames of the segment; allocates nothing.
    pub fn meta_view(&self) -> Result<StepMetaView<'a>, StoreError> {
        match self.format_version {
            1 => self.meta_v1(),
            2 => self.meta_v2(),
            3..=FORMAT_VERSION => self.meta_v3(),
            other => Err(self.corrupt(format!(
                "segment format version {other} is not supported by this build"
            ))),
        }
    }

    /// Decodes the metadata block into an owned [`StepMeta`].
    pub fn meta(&self) -> Result<StepMeta, StoreError> {
        self.meta_view().map(|m| m.to_meta())
    }

    fn meta_v1(&self) -> Result<StepMetaView<'a>, StoreError> {
        let m: MetaV1<'a> = decode_exact(self.meta_bytes).map_err(|e| self.corrupt(e.0))?;
        Ok(StepMetaView {
            env_tag: m.env_tag,
            seed: m.seed,
            policy_version: m.policy_version,
            reward: m.reward,
            terminated: m.terminated,
            truncated: m.truncated,
            state_hash: m.state_hash,
            success: m.info.success,
            action_is_valid: m.info.action_is_valid,
            action_is_effective: m.info.action_is_effective,
            format_penalty: m.info.format_penalty,
            num_actions: m.info.num_actions,
            observation_text: m.info.observation_text,
            action_text: m.info.action_text,
            critic_state: &[],
            tool_call_error: false,
            context_rebuilt: false,
            admissible_actions: &[],
        })
    }

    fn meta_v2(&self) -> Result<StepMetaView<'a>, StoreError> {
        self.decode_v2().map_err(|e| self.corrupt(e.0))
    }

    fn decode_v2(&self) -> Result<StepMetaView<'a>, CodecError> {
        let mut cursor = Cursor {
            rest: self.meta_bytes,
        };
        let mut texts = [""; 2];
        for (text, field) in texts.iter_mut().zip(TextField::ALL) {
            let stored = cursor.text(field)?;
            *text = self.resolve(stored, field)?;
        }
        let m: FieldsV2<'a> = decode_exact(cursor.rest)?;
        Ok(StepMetaView {
            env_tag: m.env_tag,
            seed: m.seed,
            policy_version: m.policy_version,
            reward: m.reward,
            terminated: m.terminated,
            truncated: m.truncated,
            state_hash: m.state_hash,
            success: m.success,
            action_is_valid: m.action_is_valid,
            action_is_effective: m.action_is_effective,
            format_penalty: m.format_penalty,
            num_actions: m.num_actions,
            observation_text: texts[0],
            action_text: texts[1],
            critic_state: &[],
            tool_call_error: false,
            context_rebuilt: false,
            admissible_actions: &[],
        })
    }

    /// Versions 3 to 6 (4 adds the critic state behind flag bit 7, 5 the second flag byte, 6 the
    /// admissible actions behind its bit 2).
    fn meta_v3(&self) -> Result<StepMetaView<'a>, StoreError> {
        self.decode_v3().map_err(|e| self.corrupt(e.0))
    }

    fn decode_v3(&self) -> Result<StepMetaView<'a>, CodecError> {
        let mut cursor = Cursor {
            rest: self.meta_bytes,
        };
        let [flags] = cursor.array::<1>("the flags")?;
        if flags & FLAG_CRITIC_STATE != 0 && self.format_version == 3 {
            return Err(CodecError(format!("unknown flag bits {flags:#x}")));
        }
        let flags2 = match self.format_version {
            ..=4 => 0,
            _ => cursor.array::<1>("the second flag byte")?[0],
        };
        let known = flags2_known(self.format_version);
        if flags2 & !known != 0 {
            let unknown = flags2 & !known;
            return Err(CodecError(format!(
                "unknown flag bits {unknown:#x} in the second flag byte"
            )));
        }
        let mut texts = [""; 2];
        for (text, field) in texts.iter_mut().zip(TextField::ALL) {
            let stored = cursor.text(field)?;
            *text = self.resolve(stored, field)?;
        }
        let env_tag = cursor.str("env_tag")?;
        let seed = u64::from_le_bytes(cursor.array("seed")?);
        let state_hash = u64::from_le_bytes(cursor.array("state_hash")?);
        let policy_version = cursor.varint("policy_version")?;
        let num_actions = cursor.varint_u32("num_actions")?;
        let mut float = |bit: u8, what: &str| -> Result<f32, CodecError> {
            match flags & bit {
                0 => Ok(0.0),
                _ => Ok(f32::from_le_bytes(cursor.array(what)?)),
            }
        };
        let reward = float(FLAG_REWARD, "reward")?;
        let format_penalty = float(FLAG_PENALTY, "format_penalty")?;
        let critic_state = match flags & FLAG_CRITIC_STATE {
            0 => &[][..],
            _ => {
                let n = cursor.varint("the critic state's length")?;
                let bytes = usize::try_from(n).ok().and_then(|n| n.checked_mul(4));
                cursor.take(bytes.unwrap_or(usize::MAX), "critic_state")?
            }
        };
        let admissible_actions = match flags2 & FLAG2_ADMISSIBLE_ACTIONS {
            0 => &[][..],
            _ => cursor.admissible_actions()?,
        };
        if cursor.rest.len() > 3 || cursor.rest.iter().any(|&b| b != 0) {
            let n = cursor.rest.len();
            return Err(CodecError(format!("metadata has {n} trailing bytes")));
        }
        let set = |bit: u8| flags & bit != 0;
        Ok(StepMetaView {
            env_tag,
            seed,
            policy_version,
            reward,
            terminated: set(FLAG_TERMINATED),
            truncated: set(FLAG_TRUNCATED),
            state_hash,
            success: set(FLAG_SUCCESS),
            action_is_valid: set(FLAG_VALID),
            action_is_effective: set(FLAG_EFFECTIVE),
            format_penalty,
            num_actions,
            observation_text: texts[0],
            action_text: texts[1],
            critic_state,
            tool_call_error: flags2 & FLAG2_TOOL_CALL_ERROR != 0,
            context_rebuilt: flags2 & FLAG2_CONTEXT_REBUILT != 0,
            admissible_actions,
        })
    }

    /// The validated frame before this one that a reference points at: format 2 by byte offset,
    /// formats 3 to 6 by frame number (`earlier` numbers back; found at once when no damaged
    /// frame was skipped in between, else by binary search).
    fn referenced_frame(&self, earlier: u64) -> Option<&'a Frame> {
        let before = self.frames.get(..self.index)?;
        let found = if self.format_version == 2 {
            before.binary_search_by_key(&earlier, |f| f.offset)
        } else {
            let this = self.frames.get(self.index)?.layout.ordinal;
            let target = this.checked_sub(earlier).filter(|_| earlier > 0)?;
            let back = usize::try_from(earlier).ok()?;
            match self.index.checked_sub(back).map(|i| (i, &self.frames[i])) {
                Some((i, frame)) if frame.layout.ordinal == target => Ok(i),
                _ => before.binary_search_by_key(&target, |f| f.layout.ordinal),
            }
        };
        before.get(found.ok()?)
    }

    /// The text `stored` stands for: itself when inline, else the same field of the earlier frame.
    fn resolve(&self, stored: StoredText<'a>, field: TextField) -> Result<&'a str, CodecError> {
        let earlier = match stored {
            StoredText::Inline(bytes) => return utf8(bytes, field),
            StoredText::Earlier(earlier) => earlier,
        };
        let broken = |why: &str| {
            let target = match self.format_version {
                2 => format!("the record at byte {earlier}"),
                _ => format!("the record {earlier} frames back"),
            };
            CodecError(format!("{} refers to {target}, which {why}", field.name()))
        };
        let frame = self
            .referenced_frame(earlier)
            .ok_or_else(|| broken("is not a valid earlier record of this segment"))?;
        let meta = &frame.payload(self.segment)[frame.layout.meta_range()];
        match text_entry(self.format_version, meta, field).map_err(|e| broken(&e.0))? {
            StoredText::Inline(bytes) => utf8(bytes, field).map_err(|e| broken(&e.0)),
            StoredText::Earlier(_) => Err(broken("holds a reference, not the text")),
        }
    }

    /// Copies everything into an owned [`StepRecord`].
    pub fn to_record(&self) -> Result<StepRecord, StoreError> {
        let view = self.meta_view()?;
        let critic_state = view.critic_state();
        let admissible_actions = view.admissible_actions();
        let meta = view.to_meta();
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
            critic_state,
            admissible_actions,
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
            obs_ids: vec![1, 2, 151_643],
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
                tool_call_error: false,
                context_rebuilt: false,
            },
            critic_state: Vec::new(),
            admissible_actions: Vec::new(),
        }
    }

    /// Where the metadata of a payload of the current version starts.
    fn meta_start(payload: &[u8]) -> usize {
        let layout = parse_layout(payload, FORMAT_VERSION).unwrap();
        layout.meta_range().start
    }

    fn encoded(record: &StepRecord, refs: TextRefs) -> Vec<u8> {
        let mut bytes = Vec::new();
        encode_payload(record, 20, refs, &mut bytes).unwrap();
        bytes
    }

    #[test]
    fn payload_round_trips_at_the_narrowest_widths_and_is_aligned() {
        let bytes = encoded(&sample(), [None; 2]);
        assert_eq!(bytes.len() % 4, 0);
        let view = StepView::parse(&bytes, FORMAT_VERSION).unwrap();
        assert_eq!((view.obs_ids.width(), view.response_ids.width()), (3, 1));
        assert_eq!(view.obs_ids, vec![1, 2, 151_643]);
        assert!(matches!(view.response_logprobs, Cow::Borrowed(_)));
        assert_eq!(view.to_record().unwrap(), sample());
        let meta = view.meta_view().unwrap();
        assert_eq!(
            (meta.env_tag, meta.action_text),
            ("frozen_lake", "<answer>Left</answer>")
        );
    }

    #[test]
    fn floats_keep_their_exact_bits_and_zero_floats_take_no_bytes() {
        let mut record = sample();
        let with_floats = encoded(&record, [None; 2]).len();
        record.reward = -0.0;
        record.info.format_penalty = f32::from_bits(1);
        let bytes = encoded(&record, [None; 2]);
        let back = StepView::parse(&bytes, FORMAT_VERSION)
            .unwrap()
            .to_record()
            .unwrap();
        assert_eq!(back.reward.to_bits(), (-0.0f32).to_bits());
        assert_eq!(back.info.format_penalty.to_bits(), 1);
        record.reward = 0.0;
        record.info.format_penalty = 0.0;
        let zeros = encoded(&record, [None; 2]);
        assert_eq!(zeros.len() + 8, with_floats);
        let back = StepView::parse(&zeros, FORMAT_VERSION).unwrap();
        assert_eq!(back.to_record().unwrap(), record);
    }

    #[test]
    fn a_critic_state_round_trips_and_is_unknown_to_version_3() {
        let mut record = sample();
        record.critic_state = vec![1.0, -0.0, f32::from_bits(1)];
        let bytes = encoded(&record, [None; 2]);
        let view = StepView::parse(&bytes, FORMAT_VERSION).unwrap();
        let back = view.to_record().unwrap();
        let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.critic_state), bits(&record.critic_state));
        assert_eq!(back, record);
        let v3 = StepView::parse(&bytes, 3).unwrap();
        let error = v3.to_record().unwrap_err().to_string();
        assert!(error.contains("unknown flag bits 0x"), "{error}");
        // A count past the end of the metadata is an error, never a huge allocation.
        let mut cut = encoded(&record, [None; 2]);
        let mut meta = Vec::new();
        encode_meta(&record, [None; 2], &mut meta).unwrap();
        let count_at = meta_start(&cut) + meta.len() - 4 * 3 - 1;
        cut[count_at] = 0x7f;
        let error = StepView::parse(&cut, FORMAT_VERSION)
            .unwrap()
            .to_record()
            .unwrap_err()
            .to_string();
        assert!(error.contains("critic_state"), "{error}");
    }

    #[test]
    fn admissible_actions_round_trip_and_are_unknown_to_version_5() {
        let mut record = sample();
        record.admissible_actions = vec!["go east".into(), "take café key".into(), "".into()];
        let bytes = encoded(&record, [None; 2]);
        let view = StepView::parse(&bytes, FORMAT_VERSION).unwrap();
        assert_eq!(view.to_record().unwrap(), record);
        let v5 = StepView::parse(&bytes, 5).unwrap();
        let error = v5.to_record().unwrap_err().to_string();
        assert!(error.contains("unknown flag bits 0x4"), "{error}");
        // A length past the end of the metadata is an error naming the action (the last one is
        // empty: its length is the metadata's last byte).
        let mut cut = bytes.clone();
        let mut meta = Vec::new();
        encode_meta(&record, [None; 2], &mut meta).unwrap();
        cut[meta_start(&bytes) + meta.len() - 1] = 0x7f;
        let error = StepView::parse(&cut, FORMAT_VERSION)
            .unwrap()
            .to_record()
            .unwrap_err()
            .to_string();
        assert!(error.contains("admissible action (action 2)"), "{error}");
    }

    /// The payload of `record` as format version 4 wrote it: that of the current version
    /// without the second flag byte.
    fn as_version_4(record: &StepRecord) -> Vec<u8> {
        let bytes = encoded(record, [None; 2]);
        let mut v4 = bytes[..meta_start(&bytes)].to_vec();
        let mut meta = Vec::new();
        encode_meta(record, [None; 2], &mut meta).unwrap();
        meta.remove(1);
        v4.extend_from_slice(&meta);
        pad4(&mut v4, 0);
        v4
    }

    #[test]
    fn both_flags_of_the_second_flag_byte_round_trip() {
        for (tool_call_error, context_rebuilt) in [(true, false), (false, true), (true, true)] {
            let mut record = sample();
            record.info.tool_call_error = tool_call_error;
            record.info.context_rebuilt = context_rebuilt;
            record.critic_state = vec![0.5];
            let bytes = encoded(&record, [None; 2]);
            let view = StepView::parse(&bytes, FORMAT_VERSION).unwrap();
            assert_eq!(view.to_record().unwrap(), record);
            let meta = view.meta_view().unwrap();
            assert_eq!(
                (meta.tool_call_error, meta.context_rebuilt),
                (tool_call_error, context_rebuilt)
            );
            let flags2 = bytes[meta_start(&bytes) + 1];
            assert_eq!(flags2, tool_call_error as u8 | (context_rebuilt as u8) << 1);
        }
    }

    #[test]
    fn a_version_4_payload_reads_with_both_flags_false() {
        let mut record = sample();
        record.critic_state = vec![1.0, -2.0];
        let v4 = as_version_4(&record);
        let back = StepView::parse(&v4, 4).unwrap().to_record().unwrap();
        assert_eq!(back, record);
        assert!(!back.info.tool_call_error && !back.info.context_rebuilt);
        // A version-4 payload is not a version-5 one (its first text entry is no flag byte).
        assert!(StepView::parse(&v4, FORMAT_VERSION)
            .unwrap()
            .meta()
            .is_err());
        // Text references of version 4 skip one flag byte, of version 5 two.
        let meta = &v4[parse_layout(&v4, 4).unwrap().meta_range()];
        let entry = text_entry(4, meta, TextField::Action).unwrap();
        assert_eq!(entry, StoredText::Inline(b"<answer>Left</answer>"));
    }

    #[test]
    fn unknown_bits_of_the_second_flag_byte_are_an_error_naming_them() {
        let mut bytes = encoded(&sample(), [None; 2]);
        let at = meta_start(&bytes) + 1;
        for (byte, named) in [(0x08, "0x8"), (0x83, "0x80"), (0xff, "0xf8")] {
            bytes[at] = byte;
            let error = StepView::parse(&bytes, FORMAT_VERSION)
                .unwrap()
                .to_record()
                .unwrap_err()
                .to_string();
            let expected = format!("unknown flag bits {named} in the second flag byte");
            assert!(error.contains(&expected), "{error}");
        }
    }

    #[test]
    fn inconsistent_counts_are_rejected() {
        let mut bytes = encoded(&sample(), [None; 2]);
        bytes[5] = 120; // n_obs
        assert!(parse_layout(&bytes, FORMAT_VERSION).is_err());
        assert!(parse_layout(&bytes[..3], FORMAT_VERSION).is_err());
        assert!(parse_layout(&bytes[..10], 2).is_err());
    }

    #[test]
    fn texts_are_checked_ascii_first_then_as_utf8() {
        assert_eq!(as_text(b"Left: hole"), Ok("Left: hole"));
        assert_eq!(as_text("P √ G".as_bytes()), Ok("P √ G"));
        assert!(as_text(b"ok\xFF").is_err());
        let e = utf8(b"\xC3", TextField::ALL[0]).unwrap_err();
        assert!(e.0.contains("is not UTF-8"), "{}", e.0);
    }

    #[test]
    fn garbage_metadata_is_an_error() {
        let view = StepView::parse(&[0xFF; 44], 1);
        assert!(view.is_err() || view.unwrap().meta().is_err());
        let bytes = encoded(&sample(), [None; 2]);
        assert!(StepView::parse(&bytes, FORMAT_VERSION + 1)
            .unwrap()
            .meta()
            .is_err());
        let mut trailing = bytes.clone();
        trailing.extend_from_slice(&[0, 0, 0, 7]);
        let view = StepView::parse(&trailing, FORMAT_VERSION).unwrap();
        assert!(view.meta().unwrap_err().to_string().contains("trailing"));
    }

    #[test]
    fn a_reference_without_its_segment_is_an_error_naming_the_record() {
        let bytes = encoded(&sample(), [None, Some(16)]);
        let layout = parse_layout(&bytes, FORMAT_VERSION).unwrap();
        assert_eq!(layout.ordinal, 20);
        let inline = inline_texts(&bytes, &layout).unwrap();
        assert_eq!(inline, [Some("_P_\nG__"), None]);
        let view = StepView::parse(&bytes, FORMAT_VERSION)
            .unwrap()
            .at(Path::new("s.stp"), 96);
        let err = view.to_record().unwrap_err().to_string();
        assert!(
            err.contains("s.stp at byte 96")
                && err.contains("action_text refers to the record 16 frames back"),
            "{err}"
        );
    }

    #[test]
    fn misaligned_bytes_are_copied() {
        let mut bytes = vec![0u8];
        encode_payload(&sample(), 0, [None; 2], &mut bytes).unwrap();
        let view = StepView::parse(&bytes[1..], FORMAT_VERSION).unwrap();
        assert!(matches!(view.response_logprobs, Cow::Owned(_)));
        assert_eq!(view.to_record().unwrap(), sample());
    }
}
