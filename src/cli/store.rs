//! `stepppo collect`, `stepppo replay`, `stepppo dataset verify|repair`.

use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct CollectArgs {}

#[derive(Args, Debug)]
pub struct ReplayArgs {}

#[derive(Subcommand, Debug)]
pub enum DatasetCommand {
    /// Check every segment of a dataset.
    Verify,
}

pub fn collect(_a: CollectArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo collect` is not built yet (issue 3)")
}

pub fn replay(_a: ReplayArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo replay` is not built yet (issue 3)")
}

pub fn dataset(_c: DatasetCommand) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo dataset` is not built yet (issue 3)")
}
