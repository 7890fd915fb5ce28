//! Errors of the viewer: opening what PATH names (dataset, metrics, config, tokenizer) and
//! binding the listening socket. Each names the file or address involved.

use std::path::PathBuf;

use crate::store::StoreError;
use crate::tokenizer::TokenizerError;
use crate::train::run::metrics::MetricsError;

/// Why the viewer could not start or read what it serves.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error(
        "{}: neither a dataset (no manifest.json) nor a run directory (no dataset/manifest.json)",
        path.display()
    )]
    NotADataset { path: PathBuf },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("tokenizer of {}: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        source: TokenizerError,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("the server stopped: {0}")]
    Server(std::io::Error),
}
