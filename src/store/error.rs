//! Errors of the store API and the problems a scan finds in a dataset (each with file and offset).

use std::fmt;
use std::path::{Path, PathBuf};

/// Failure of a store operation; every variant names the file and, where it applies, the byte offset.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// An env failed while an episode was played (it names the env and the request).
    #[error(transparent)]
    Env(#[from] crate::env::EnvError),
    #[error("{path}: {source}", path = .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} at byte {offset}: {reason}", path = .path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("{path}: {reason}", path = .path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error("{path}: record (traj {traj_id}, step {step_index}) cannot be stored: {reason}", path = .path.display())]
    Encode {
        path: PathBuf,
        traj_id: u64,
        step_index: u32,
        reason: String,
    },
    #[error("{problem}; run `stepppo dataset repair` first")]
    Damaged { problem: Problem },
}

impl StoreError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
        move |source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What is wrong at one place of a dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// An incomplete record at the end of an unsealed segment (a crash mid-write); `repair` truncates it.
    TornTail,
    /// Bytes that are not a valid record (bad framing or crc); the next valid record starts `skipped` bytes later.
    CorruptFrame { skipped: u64 },
    /// The segment header names a format version or flags this build does not read (a newer
    /// format, as far as it can tell): none of the segment's records is read, and `repair`
    /// leaves the segment alone.
    BadHeader(String),
    /// A damaged header field (magic, format version or flags; the offset says which): the
    /// records were read under the version the manifest lists or the frames decode as, and
    /// `repair` rewrites the header.
    DamagedHeader(String),
    /// The footer of a sealed segment is damaged; its records are still read by scanning.
    BadFooter(String),
    /// A frame's crc holds but its metadata does not decode.
    Undecodable(String),
    /// The manifest disagrees with the segment files.
    Manifest(String),
    /// A second record with the same (traj_id, step_index) key; `repair` removes it and keeps
    /// the first (at `first_path`, byte `first_offset`).
    DuplicateKey {
        traj_id: u64,
        step_index: u32,
        first_path: PathBuf,
        first_offset: u64,
    },
}

/// One problem found by opening or verifying a dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub path: PathBuf,
    pub offset: u64,
    pub kind: ProblemKind,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (path, offset) = (self.path.display(), self.offset);
        match &self.kind {
            ProblemKind::TornTail => {
                write!(f, "{path} at byte {offset}: torn tail (incomplete record)")
            }
            ProblemKind::CorruptFrame { skipped } => {
                write!(
                    f,
                    "{path} at byte {offset}: corrupt record ({skipped} bytes skipped)"
                )
            }
            ProblemKind::BadHeader(why) => {
                write!(f, "{path} at byte {offset}: bad segment header: {why}")
            }
            ProblemKind::DamagedHeader(why) => {
                write!(f, "{path} at byte {offset}: damaged segment header: {why}")
            }
            ProblemKind::BadFooter(why) => write!(f, "{path} at byte {offset}: bad footer: {why}"),
            ProblemKind::Undecodable(why) => {
                write!(f, "{path} at byte {offset}: record does not decode: {why}")
            }
            ProblemKind::Manifest(why) => write!(f, "{path}: manifest: {why}"),
            ProblemKind::DuplicateKey {
                traj_id,
                step_index,
                first_path,
                first_offset,
            } => write!(
                f,
                "{path} at byte {offset}: record (traj {traj_id}, step {step_index}) repeats \
                 the one at {} byte {first_offset}",
                first_path.display()
            ),
        }
    }
}
