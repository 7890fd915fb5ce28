//! Errors of the store API and the problems a scan finds in a dataset (each with file and offset).

use std::fmt;
use std::path::{Path, PathBuf};

/// Failure of a store operation; every variant names the file and, where it applies, the byte offset.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Tokenizing an episode's text failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// An env failed while an episode was played (it names the env and the request).
    #[error(transparent)]
    Env(#[from] crate::env::EnvError),
    /// A file operation failed.
    #[error("{path}: {source}", path = .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// Bytes of a file do not decode.
    #[error("{path} at byte {offset}: {reason}", path = .path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// Byte offset of the damage in the file.
        offset: u64,
        /// What does not decode.
        reason: String,
    },
    /// An operation the dataset's state does not allow, or an inconsistent dataset.
    #[error("{path}: {reason}", path = .path.display())]
    Invalid {
        /// The dataset directory or file concerned.
        path: PathBuf,
        /// Why the operation was refused.
        reason: String,
    },
    /// A record could not be encoded into a segment.
    #[error("{path}: record (traj {traj_id}, step {step_index}) cannot be stored: {reason}", path = .path.display())]
    Encode {
        /// The segment being written.
        path: PathBuf,
        /// Trajectory id of the record.
        traj_id: u64,
        /// Step index of the record.
        step_index: u32,
        /// Why it does not encode.
        reason: String,
    },
    /// Appending was refused because the dataset has a problem that `repair` must fix first.
    #[error("{problem}; run `stepppo dataset repair` first")]
    Damaged {
        /// The first problem found.
        problem: Problem,
    },
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
    CorruptFrame {
        /// Bytes from the problem's offset to the next valid record.
        skipped: u64,
    },
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
        /// Trajectory id of the duplicated key.
        traj_id: u64,
        /// Step index of the duplicated key.
        step_index: u32,
        /// Segment file holding the first record with this key.
        first_path: PathBuf,
        /// Byte offset of that first record.
        first_offset: u64,
    },
}

/// One problem found by opening or verifying a dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The file the problem is in (a segment, or the manifest).
    pub path: PathBuf,
    /// Byte offset of the problem in that file.
    pub offset: u64,
    /// What is wrong there.
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
