//! `stepppo bench prefix`.

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefix-reuse workloads over the four cache arms.
    Prefix,
}

pub fn run(_c: BenchCommand) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo bench` is not built yet (issue 5)")
}
