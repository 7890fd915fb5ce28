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
//! | then | `meta_len` bytes of bincode (`config::standard`, serde) holding every other field ([`StepMeta`]) |
//! | then | zero padding to a multiple of 4 |
//!
//! Ids and counts come first so that readers can index and group records without decoding the
//! metadata; the arrays are viewed in place (`bytemuck`) and copied only when the bytes are
//! misaligned or the host is big-endian. The metadata layout is fixed per segment format
//! version: a later version adds a new metadata struct and a branch in [`decode_meta`], so older
//! segments stay readable.

use std::borrow::Cow;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::StoreError;
use super::record::{StepInfo, StepRecord};

/// Bytes of the fixed header at the start of every payload.
pub const PAYLOAD_HEADER_LEN: usize = 40;
/// Largest metadata block accepted on write and on read (guards allocations from bad bytes).
pub const MAX_META_LEN: usize = 64 << 20;
/// Segment format versions whose payloads this build decodes.
pub const SUPPORTED_VERSIONS: std::ops::RangeInclusive<u32> = 1..=1;

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

/// Borrowing twin of [`StepMeta`] for encoding without cloning strings (same field order).
#[derive(Serialize)]
struct StepMetaRef<'a> {
    env_tag: &'a str,
    seed: u64,
    policy_version: u64,
    reward: f32,
    terminated: bool,
    truncated: bool,
    state_hash: u64,
    info: &'a StepInfo,
}

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

/// Appends the payload of `record` (padded to a multiple of 4) to `out`.
pub fn encode_payload(record: &StepRecord, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let meta = StepMetaRef {
        env_tag: &record.env_tag,
        seed: record.seed,
        policy_version: record.policy_version,
        reward: record.reward,
        terminated: record.terminated,
        truncated: record.truncated,
        state_hash: record.state_hash,
        info: &record.info,
    };
    let meta_bytes = bincode::serde::encode_to_vec(&meta, meta_config())
        .map_err(|e| CodecError(format!("metadata does not encode: {e}")))?;
    if meta_bytes.len() > MAX_META_LEN {
        return Err(CodecError(format!(
            "metadata is {} bytes, more than the {MAX_META_LEN} allowed",
            meta_bytes.len()
        )));
    }
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
    out.extend_from_slice(&count(meta_bytes.len(), "metadata")?.to_le_bytes());
    extend_le_u32(out, &record.obs_ids);
    extend_le_u32(out, &record.response_ids);
    extend_le_f32(out, &record.response_logprobs);
    out.extend_from_slice(&meta_bytes);
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

/// Decodes the metadata block written under segment format `version`.
pub fn decode_meta(version: u32, bytes: &[u8]) -> Result<StepMeta, CodecError> {
    match version {
        1 => {
            let (meta, used): (StepMeta, usize) =
                bincode::serde::decode_from_slice(bytes, meta_config())
                    .map_err(|e| CodecError(format!("metadata does not decode: {e}")))?;
            if used != bytes.len() {
                return Err(CodecError(format!(
                    "metadata has {} trailing bytes",
                    bytes.len() - used
                )));
            }
            Ok(meta)
        }
        other => Err(CodecError(format!(
            "segment format version {other} is not supported by this build"
        ))),
    }
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

    /// Decodes the metadata block (env tag, seed, rewards, flags, texts).
    pub fn meta(&self) -> Result<StepMeta, StoreError> {
        decode_meta(self.format_version, self.meta_bytes).map_err(|e| StoreError::Corrupt {
            path: self.path.to_path_buf(),
            offset: self.offset,
            reason: e.0,
        })
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
        encode_payload(&sample(), &mut bytes).unwrap();
        assert_eq!(bytes.len() % 4, 0);
        let view = StepView::parse(&bytes, 1).unwrap();
        assert_eq!(&*view.obs_ids, &[1, 2, 3]);
        assert_eq!(view.to_record().unwrap(), sample());
    }

    #[test]
    fn inconsistent_counts_are_rejected() {
        let mut bytes = Vec::new();
        encode_payload(&sample(), &mut bytes).unwrap();
        bytes[24] = 200;
        assert!(parse_layout(&bytes).is_err());
        assert!(parse_layout(&bytes[..10]).is_err());
    }

    #[test]
    fn garbage_metadata_is_an_error() {
        assert!(decode_meta(1, &[0xFF; 9]).is_err());
        assert!(decode_meta(2, &[]).is_err());
    }

    #[test]
    fn misaligned_bytes_are_copied() {
        let mut bytes = vec![0u8];
        encode_payload(&sample(), &mut bytes).unwrap();
        let view = StepView::parse(&bytes[1..], 1).unwrap();
        assert_eq!(view.to_record().unwrap(), sample());
    }
}
