//! Step-native storage: every interaction round as a [`StepRecord`] in append-only,
//! memory-mapped segment files with crc-framed records, a footer index by trajectory, readers
//! for records / trajectories / groups, verify and repair, replay rendering and statistics.
//! Data-parallel ranks write one dataset: each rank its own segment files (`seg-rSSSS-*.stp` for
//! rank SSSS > 0, `WriterOptions::shard`), the lead (rank 0) the manifest listing them all.
//!
//! Layout: `codec` (record bytes, the only bincode user), `tokens` (id arrays at 1 to 4 bytes
//! per id), `segment` (one file), `io_thread` (the segment writer's background writes: crc and
//! copy into the file overlap the encoding of the next buffer), `manifest` (`manifest.json`, its
//! checksum and what is recovered of it when damaged), `dataset` (directory, segment file names
//! of every shard, writers and readers; opens from the segment files when the manifest is
//! damaged), `verify` (verify / repair).
//!
//! Format version 6 (what the writer writes) stores each token id array at the narrowest
//! width that holds its largest id (3 bytes for a 151k vocabulary; read in place through
//! [`TokenIds`]), varint ids and counts, flags in two bytes (the second, new in version 5, holds
//! the gateway's `tool_call_error` and `context_rebuilt`), and every text (env tag, observation,
//! action) already in the same block of [`REFERENCE_BLOCK`] frames of the segment as a backward
//! reference counted in frames (so one damaged frame costs at most one block), the env's
//! critic state when the record carries one, and (new in version 6) the admissible actions its
//! response was sampled among. Versions 1 to 5 stay readable (records of versions 1 to 4 read
//! with both version-5 flags false; of versions 1 to 5, with no admissible actions).
//! [`StepView::meta_view`] decodes metadata without allocating.
//! `WriterOptions::durable` (default true) decides whether sealing and manifest replacement fsync.
//!
//! Fuzzing: `fuzz/` is a cargo-fuzz crate (its own workspace); `framed_payloads` wraps arbitrary
//! payloads in valid frames (past the crc gate); `segment_reader` feeds
//! arbitrary bytes to the segment scanner and every view and record decode over it (references
//! included); `manifest` loads arbitrary bytes as `manifest.json`; `dataset_open` builds a
//! dataset directory (manifest + one segment) from arbitrary bytes and opens, reads, verifies
//! and repairs it. cargo-fuzz needs nightly flags; on stable, `RUSTC_BOOTSTRAP=1` enables them:
//!
//! ```text
//! cargo install cargo-fuzz --locked
//! RUSTC_BOOTSTRAP=1 cargo fuzz run segment_reader fuzz/corpus/segment_reader fuzz/seeds/segment_reader -- -max_total_time=120
//! RUSTC_BOOTSTRAP=1 cargo fuzz run framed_payloads fuzz/corpus/framed_payloads -- -max_total_time=120
//! RUSTC_BOOTSTRAP=1 cargo fuzz run manifest fuzz/corpus/manifest fuzz/seeds/manifest -- -max_total_time=120
//! RUSTC_BOOTSTRAP=1 cargo fuzz run dataset_open fuzz/corpus/dataset_open fuzz/seeds/dataset_open -- -max_total_time=120
//! ```
//!
//! (`fuzz/seeds/segment_reader` holds the pinned v1 to v5 segments of `tests/store_format.rs`;
//! `fuzz/seeds/manifest` a manifest with and one without a checksum; `fuzz/seeds/dataset_open` a
//! collected FrozenLake dataset; new inputs go to the git-ignored `fuzz/corpus`.) Fuzz runs and their results:
//! `docs/experiments/store.md`; current figures: BENCHMARKS.md, "Store".

#[cfg(test)]
mod blast_radius;
mod codec;
mod collect;
mod dataset;
#[cfg(test)]
mod derive_probe;
mod error;
mod io_thread;
mod manifest;
mod record;
mod replay;
mod segment;
mod tokens;
mod verify;

pub use codec::{StepMeta, StepMetaView, StepView, REFERENCE_BLOCK};
pub use collect::{
    agent_episode, collect, CollectConfig, CollectSummary, EpisodeIds, EXTRA_WORDS_KEY,
    TOKENIZER_DIR_KEY,
};
pub use dataset::{
    rewind, Dataset, DatasetPosition, DatasetWriter, Group, RecordLocation, SegmentId, Trajectory,
    WriterOptions, DEFAULT_ROLL_BYTES,
};
pub use error::{Problem, ProblemKind, StoreError};
pub use manifest::{LoadedManifest, Manifest, ManifestDamage, SegmentEntry, MANIFEST_FILE};
pub use record::StepRecord;
pub use replay::{
    completeness_by_trajectory, decode_trajectory, jsonl_line, transcript, Completeness,
    DatasetStats, Stats, Summary,
};
pub use segment::{scan as scan_segment, SegmentScan, FORMAT_VERSION, SEGMENT_MAGIC};
pub use tokens::{TokenIds, TokenIter};
pub use verify::{repair, verify, RepairReport, VerifyReport};
