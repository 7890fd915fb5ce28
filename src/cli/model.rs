//! `stepppo generate`, `stepppo init-model`.

use clap::Args;

#[derive(Args, Debug)]
pub struct GenerateArgs {}

#[derive(Args, Debug)]
pub struct InitModelArgs {}

pub fn generate(_a: GenerateArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo generate` is not built yet (issue 4)")
}

pub fn init_model(_a: InitModelArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo init-model` is not built yet (issue 4)")
}
