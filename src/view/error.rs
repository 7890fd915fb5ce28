//! Errors of the viewer: opening what PATH names (dataset, metrics, config, tokenizer) and
//! binding the listening socket. Each names the file or address involved.

use std::path::PathBuf;

use crate::store::StoreError;
use crate::tokenizer::TokenizerError;
use crate::train::run::metrics::MetricsError;

/// Why the viewer could not start or read what it serves.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// PATH holds no `manifest.json`, directly or under `dataset/`.
    #[error(
        "{}: neither a dataset (no manifest.json) nor a run directory (no dataset/manifest.json)",
        path.display()
    )]
    NotADataset {
        /// The path given to the viewer.
        path: PathBuf,
    },
    /// The dataset could not be opened or read.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The run's metric files could not be read.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The tokenizer the records were tokenised with could not be loaded.
    #[error("tokenizer of {}: {source}", path.display())]
    Tokenizer {
        /// Directory holding it (a checkpoint's `policy/`, or the one the manifest names).
        path: PathBuf,
        /// What loading it reported.
        source: TokenizerError,
    },
    /// Reading the dataset directory failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The directory being read.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address as shown to the user.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The server runtime could not start, or the server failed or panicked.
    #[error("the server stopped: {0}")]
    Server(std::io::Error),
}
