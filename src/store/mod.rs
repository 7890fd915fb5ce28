//! Step-native storage: records, memory-mapped bincode segments, readers, verify/repair (issue 3).

mod record;

pub use record::{StepInfo, StepRecord};
