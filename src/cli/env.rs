//! `stepppo env list | play`.

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum EnvCommand {
    /// List registered environments.
    List,
}

pub fn run(_cmd: EnvCommand) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo env` is not built yet (issue 2)")
}
