//! `stepppo train`, `eval`, `sft`, `plot`.

use clap::Args;

#[derive(Args, Debug)]
pub struct TrainArgs {}

#[derive(Args, Debug)]
pub struct EvalArgs {}

#[derive(Args, Debug)]
pub struct SftArgs {}

#[derive(Args, Debug)]
pub struct PlotArgs {}

pub fn train(_a: TrainArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo train` is not built yet (issue 7)")
}

pub fn eval(_a: EvalArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo eval` is not built yet (issue 7)")
}

pub fn sft(_a: SftArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo sft` is not built yet (issue 7)")
}

pub fn plot(_a: PlotArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo plot` is not built yet (issue 7)")
}
