//! The measurement behind keeping the record metadata's hand-written layout (tests only): the
//! same fields as format version 5 through serde's derive and bincode (`config::standard`,
//! varint integers; texts as an `Inline`/`Earlier` enum, the floats a record may omit as
//! `Option`s, the critic state as length-prefixed bytes), checked to round-trip, and an ignored
//! test that prints both layouts' metadata bytes and decode time over the same segments of
//! `collect`ed random-agent episodes (`cargo test --release --lib store::derive_probe --
//! --ignored --nocapture`; figures in ARCHITECTURE.md and `docs/experiments/store.md`).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::blast_radius::{collected, encode};
use super::codec::{self, CodecError, TextField};
use super::record::StepRecord;
use super::segment::{scan, SegmentScan};

/// A text as the derived layout stores it: inline, or how many frames back it is inline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
enum DerivedText<'a> {
    Inline(&'a [u8]),
    Earlier(u64),
}

/// Version 5's metadata fields, laid out by serde's derive.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct DerivedMeta<'a> {
    /// terminated, truncated, success, action_is_valid, action_is_effective, tool_call_error,
    /// context_rebuilt: bits 0 to 6.
    flags: u8,
    #[serde(borrow)]
    observation_text: DerivedText<'a>,
    #[serde(borrow)]
    action_text: DerivedText<'a>,
    env_tag: &'a str,
    seed: u64,
    state_hash: u64,
    policy_version: u64,
    num_actions: u32,
    /// `None` for +0.0, as version 5 omits it.
    reward: Option<f32>,
    format_penalty: Option<f32>,
    critic_state: &'a [u8],
}

/// The leading fields a reference resolves through (the rest is not decoded).
#[derive(Deserialize)]
struct DerivedTexts<'a> {
    _flags: u8,
    #[serde(borrow)]
    observation_text: DerivedText<'a>,
    #[serde(borrow)]
    action_text: DerivedText<'a>,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
}

fn derived_text(text: &str, back: Option<u64>) -> DerivedText<'_> {
    back.map_or(DerivedText::Inline(text.as_bytes()), DerivedText::Earlier)
}

fn encode_derived(record: &StepRecord, refs: codec::TextRefs, out: &mut Vec<u8>) {
    let info = &record.info;
    let bits = [
        record.terminated,
        record.truncated,
        info.success,
        info.action_is_valid,
        info.action_is_effective,
        info.tool_call_error,
        info.context_rebuilt,
    ];
    let kept = |x: f32| (x.to_bits() != 0).then_some(x);
    let meta = DerivedMeta {
        flags: bits.iter().rev().fold(0, |acc, &b| acc << 1 | b as u8),
        observation_text: derived_text(&info.observation_text, refs[0]),
        action_text: derived_text(&info.action_text, refs[1]),
        env_tag: &record.env_tag,
        seed: record.seed,
        state_hash: record.state_hash,
        policy_version: record.policy_version,
        num_actions: info.num_actions,
        reward: kept(record.reward),
        format_penalty: kept(info.format_penalty),
        critic_state: bytemuck::cast_slice(&record.critic_state),
    };
    bincode::serde::encode_into_std_write(&meta, out, config()).unwrap();
}

fn decode_derived(bytes: &[u8]) -> Result<DerivedMeta<'_>, CodecError> {
    let (meta, _) = bincode::serde::borrow_decode_from_slice(bytes, config())
        .map_err(|e| CodecError(e.to_string()))?;
    Ok(meta)
}

/// The texts of frame `index`, whose own entries are `own`, references resolved by decoding the
/// referenced frame's texts.
fn derived_texts<'a>(metas: &[&'a [u8]], index: usize, own: [DerivedText<'a>; 2]) -> [&'a [u8]; 2] {
    let texts = |i: usize| -> [DerivedText<'a>; 2] {
        let (t, _): (DerivedTexts<'a>, usize) =
            bincode::serde::borrow_decode_from_slice(metas[i], config()).unwrap();
        [t.observation_text, t.action_text]
    };
    std::array::from_fn(|f| match own[f] {
        DerivedText::Inline(bytes) => bytes,
        DerivedText::Earlier(back) => match texts(index - back as usize)[f] {
            DerivedText::Inline(bytes) => bytes,
            DerivedText::Earlier(_) => panic!("a reference to a reference"),
        },
    })
}

/// Per frame of a segment written by this build: its version-5 metadata and text references.
fn frames_of(bytes: &[u8], scan: &SegmentScan) -> Vec<(Vec<u8>, codec::TextRefs)> {
    scan.frames
        .iter()
        .map(|frame| {
            let meta = frame.payload(bytes)[frame.layout.meta_range()].to_vec();
            let refs = TextField::ALL.map(|field| {
                match codec::text_entry(codec::FORMAT_VERSION, &meta, field) {
                    Ok(codec::StoredText::Earlier(back)) => Some(back),
                    _ => None,
                }
            });
            (meta, refs)
        })
        .collect()
}

/// Best of `reps` timings of `f`, in nanoseconds per item of `items`.
fn best_ns(reps: usize, items: usize, mut f: impl FnMut() -> usize) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed().as_nanos() as f64 / items as f64
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn the_derived_layout_round_trips_every_field_and_reference() {
    let records = collected("frozen_lake", 40);
    let bytes = encode(&records, codec::REFERENCE_BLOCK);
    let scanned = scan(&bytes);
    let frames = frames_of(&bytes, &scanned);
    assert!(frames
        .iter()
        .any(|(_, refs)| refs.iter().any(Option::is_some)));
    let derived: Vec<Vec<u8>> = (records.iter().zip(&frames))
        .map(|(record, (_, refs))| {
            let mut out = Vec::new();
            encode_derived(record, *refs, &mut out);
            out
        })
        .collect();
    let metas: Vec<&[u8]> = derived.iter().map(Vec::as_slice).collect();
    for (i, record) in records.iter().enumerate() {
        let meta = decode_derived(metas[i]).unwrap();
        let own = [meta.observation_text, meta.action_text];
        let [observation, action] = derived_texts(&metas, i, own);
        assert_eq!(observation, record.info.observation_text.as_bytes());
        assert_eq!(action, record.info.action_text.as_bytes());
        assert_eq!(
            (meta.seed, meta.state_hash),
            (record.seed, record.state_hash)
        );
        assert_eq!(meta.reward.unwrap_or(0.0), record.reward);
        assert_eq!(meta.flags & 1 != 0, record.terminated);
    }
}

#[test]
#[ignore = "a measurement: run with --release --ignored --nocapture"]
fn metadata_bytes_and_decode_time_hand_written_and_derived() {
    for (env, episodes) in [("frozen_lake", 512), ("sokoban", 512)] {
        let records = collected(env, episodes);
        let bytes = encode(&records, codec::REFERENCE_BLOCK);
        let scanned = scan(&bytes);
        let frames = frames_of(&bytes, &scanned);
        let derived: Vec<Vec<u8>> = (records.iter().zip(&frames))
            .map(|(record, (_, refs))| {
                let mut out = Vec::new();
                encode_derived(record, *refs, &mut out);
                out
            })
            .collect();
        let hand: usize = frames.iter().map(|(meta, _)| meta.len()).sum();
        let ours: usize = derived.iter().map(Vec::len).sum();
        let n = records.len();
        let hand_ns = best_ns(20, n, || {
            let views = scanned.frames.iter().map(|f| scanned.view(&bytes, f));
            views
                .map(|v| v.meta_view().unwrap().action_text.len())
                .sum()
        });
        let metas: Vec<&[u8]> = derived.iter().map(Vec::as_slice).collect();
        let derived_ns = best_ns(20, n, || {
            (0..n)
                .map(|i| {
                    let meta = decode_derived(metas[i]).unwrap();
                    let own = [meta.observation_text, meta.action_text];
                    let texts = derived_texts(&metas, i, own);
                    std::str::from_utf8(texts[1]).unwrap().len() + meta.env_tag.len()
                })
                .sum()
        });
        println!(
            "{env}: {n} records; metadata {:.1} B/record hand-written, {:.1} derived ({:+.2} %); \
             whole segment {} B ({:+.2} % derived); decode {hand_ns:.0} ns/record hand-written \
             (segment view), {derived_ns:.0} derived",
            hand as f64 / n as f64,
            ours as f64 / n as f64,
            100.0 * (ours as f64 / hand as f64 - 1.0),
            bytes.len(),
            100.0 * (ours as f64 - hand as f64) / bytes.len() as f64,
        );
    }
}
