//! The `stepppo` command line: parse arguments, call the library, print. No logic lives here
//! or in `cli/`; each command group has one file under `cli/`.

mod cli;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    cli::Cli::parse().run()
}
