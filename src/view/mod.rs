//! `stepppo view`: a read-only local web server to see what an agent did. PATH is a run
//! directory (its `dataset/`, `metrics.jsonl`, `config.json`, checkpoints) or a bare dataset.
//! Pages: the run (learning curves drawn in the browser from `metrics.jsonl`, each point
//! linking to the trajectories of its training step), the trajectory list (filter, sort,
//! pages, served from a per-trajectory summary index built in one pass at open) and one
//! trajectory (steps, tokens coloured by log-prob or advantage, scores from any estimator,
//! its group beside it). A live dataset is re-opened when its segment files grow.
//!
//! Layout: `source` (what PATH holds), `index` (the summary index and snapshot), `query`
//! (strict parameter parsing), `trajectory` (gathering one trajectory), `html` (escaping and
//! the page shell), `pages` (the pages), `server` (routes, live rescans, headers). The
//! page's script and stylesheet are in `assets/`, compiled into the binary.
//!
//! Safety: binds 127.0.0.1 unless told otherwise; every text from a model or an environment is
//! escaped; no route reads a file named by the request; nothing is ever written.

mod error;
mod html;
mod index;
mod pages;
mod query;
mod server;
mod source;
mod trajectory;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use error::ViewError;
pub use index::{Filter, Snapshot, SortKey, TrajIndex, TrajSummary};
pub use source::Source;

/// Where to serve what.
#[derive(Clone, Debug)]
pub struct ViewOptions {
    /// A run directory or a dataset directory.
    pub path: PathBuf,
    /// Address to bind (127.0.0.1 by default).
    pub host: String,
    /// Port; 0 picks a free one.
    pub port: u16,
}

/// A running viewer: its address, and the thread that serves until the process ends.
#[derive(Debug)]
pub struct Viewer {
    addr: SocketAddr,
    thread: JoinHandle<Result<(), ViewError>>,
}

impl Viewer {
    /// The address it listens on (the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks while the server runs; returns why it stopped.
    pub fn wait(self) -> Result<(), ViewError> {
        self.thread.join().unwrap_or_else(|_| {
            Err(ViewError::Server(std::io::Error::other(
                "server thread panicked",
            )))
        })
    }
}

/// Opens PATH, binds the socket and serves on a background thread.
pub fn start(opts: &ViewOptions) -> Result<Viewer, ViewError> {
    let shown = format!("{}:{}", opts.host, opts.port);
    let bind = |source| ViewError::Bind {
        addr: shown.clone(),
        source,
    };
    let listener = TcpListener::bind((opts.host.as_str(), opts.port)).map_err(bind)?;
    listener.set_nonblocking(true).map_err(bind)?;
    let addr = listener.local_addr().map_err(bind)?;
    let app = Arc::new(server::AppState::open(
        &opts.path,
        addr.port(),
        addr.ip().is_loopback(),
    )?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(ViewError::Server)?;
    let thread = std::thread::spawn(move || {
        runtime.block_on(async move {
            let listener =
                tokio::net::TcpListener::from_std(listener).map_err(ViewError::Server)?;
            tokio::spawn(server::rescan_forever(app.clone()));
            axum::serve(listener, server::router(app))
                .await
                .map_err(ViewError::Server)
        })
    });
    Ok(Viewer { addr, thread })
}
