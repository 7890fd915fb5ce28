//! `stepppo view`: argument parsing over `stepppo::view`; prints the address and serves until
//! interrupted.

use std::path::PathBuf;

use clap::Args;
use stepppo::view::{self, ViewOptions};

#[derive(Args, Debug)]
pub struct ViewArgs {
    /// A run directory (dataset + metrics.jsonl) or a dataset directory.
    pub path: PathBuf,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, default_value_t = 8321)]
    pub port: u16,
    /// Address to bind. The default serves this machine only; another address exposes every
    /// observation and response of the run to whoever can reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
}

pub fn view(a: ViewArgs) -> anyhow::Result<()> {
    let viewer = view::start(&ViewOptions {
        path: a.path,
        host: a.host,
        port: a.port,
    })?;
    println!("stepppo view: http://{}/ (Ctrl-C stops)", viewer.addr());
    Ok(viewer.wait()?)
}
