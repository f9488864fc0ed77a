//! The `autotune` binary: parse arguments, run the command, map the result to an exit code.

mod cli;

use std::process::ExitCode;

/// Counts heap bytes so that trials can measure and budget host memory.
#[global_allocator]
static ALLOCATOR: autotune::backend::host_memory::CountingAlloc =
    autotune::backend::host_memory::CountingAlloc;

fn main() -> ExitCode {
    cli::main()
}
