//! Step-native storage (issue 3): every interaction round as a [`StepRecord`] in append-only,
//! memory-mapped segment files with crc-framed records, a footer index by trajectory, readers
//! for records / trajectories / groups, verify and repair, replay rendering and statistics.
//!
//! Layout: `codec` (record bytes, the only bincode user), `segment` (one file), `dataset`
//! (directory + manifest, writer and readers), `verify` (verify / repair).
//!
//! Format version 2 (written since store2) stores an observation or action text that already
//! appeared in the same segment as a backward reference to the earlier frame; version 1
//! segments stay readable. `WriterOptions::durable` (default true) decides whether sealing and
//! manifest replacement fsync.
//!
//! Fuzzing: `fuzz/` is a cargo-fuzz crate (its own workspace); `framed_payloads` wraps arbitrary
//! payloads in valid frames (past the crc gate); `segment_reader` feeds
//! arbitrary bytes to the segment scanner and every view and record decode over it (references
//! included). cargo-fuzz needs nightly flags; on stable, `RUSTC_BOOTSTRAP=1` enables them:
//!
//! ```text
//! cargo install cargo-fuzz --locked
//! RUSTC_BOOTSTRAP=1 cargo fuzz run segment_reader fuzz/corpus/segment_reader fuzz/seeds/segment_reader -- -max_total_time=120
//! RUSTC_BOOTSTRAP=1 cargo fuzz run framed_payloads fuzz/corpus/framed_payloads -- -max_total_time=120
//! ```
//!
//! (`fuzz/seeds/segment_reader` holds the pinned v1 and v2 segments of `tests/store_format.rs`;
//! new inputs go to the git-ignored `fuzz/corpus`.) What was run and found: BENCHMARKS.md, STORE.

mod codec;
mod collect;
mod dataset;
mod error;
mod record;
mod replay;
mod segment;
mod verify;

pub use codec::{StepMeta, StepView};
pub use collect::{agent_episode, collect, CollectConfig, CollectSummary, EpisodeIds};
pub use dataset::{
    Dataset, DatasetWriter, Group, Manifest, RecordLocation, SegmentEntry, Trajectory,
    WriterOptions, DEFAULT_ROLL_BYTES, MANIFEST_FILE,
};
pub use error::{Problem, ProblemKind, StoreError};
pub use record::{StepInfo, StepRecord};
pub use replay::{decode_trajectory, jsonl_line, transcript, DatasetStats, Stats, Summary};
pub use segment::{scan as scan_segment, SegmentScan, FORMAT_VERSION, SEGMENT_MAGIC};
pub use verify::{repair, verify, RepairReport, VerifyReport};
