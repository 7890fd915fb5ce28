//! The `stepppo` command line: parse arguments, call the library, print. No logic lives here
//! or in `cli/`; each command group has one file under `cli/`.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    stepppo::device::prepare_cpu_process();
    match cli::Cli::parse().run() {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`stepppo replay … | head`): stop quietly, as
        // Unix tools do, instead of reporting an error.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
