//! `autotune completions SHELL`: the completion script for a shell, generated from the
//! command-line definition so it always knows every command and flag.

use autotune::settings::show::CompletionsArgs;
use clap::CommandFactory;

use super::args::Cli;
use super::printer::Printer;
use super::Status;

pub fn run(args: CompletionsArgs, printer: &Printer) -> anyhow::Result<Status> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "autotune", &mut script);
    printer.document(String::from_utf8_lossy(&script).trim_end());
    Ok(Status::Success)
}
