//! Step-native storage (issue 3): every interaction round as a [`StepRecord`] in append-only,
//! memory-mapped segment files with crc-framed records, a footer index by trajectory, readers
//! for records / trajectories / groups, verify and repair, replay rendering and statistics.
//!
//! Layout: `codec` (record bytes, the only bincode user), `segment` (one file), `dataset`
//! (directory + manifest, writer and readers), `verify` (verify / repair).

mod codec;
mod collect;
mod dataset;
mod error;
mod record;
mod replay;
mod segment;
mod verify;

pub use codec::{StepMeta, StepView};
pub use collect::{collect, CollectConfig, CollectSummary};
pub use dataset::{
    Dataset, DatasetWriter, Group, Manifest, SegmentEntry, Trajectory, WriterOptions,
    DEFAULT_ROLL_BYTES, MANIFEST_FILE,
};
pub use error::{Problem, ProblemKind, StoreError};
pub use record::{StepInfo, StepRecord};
pub use replay::{decode_trajectory, jsonl_line, transcript, DatasetStats, Stats, Summary};
pub use segment::{scan as scan_segment, SegmentScan, FORMAT_VERSION, SEGMENT_MAGIC};
pub use verify::{repair, verify, RepairReport, VerifyReport};
