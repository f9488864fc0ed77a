//! Command-line interface: argument types, dispatch, and the exit-code policy.
//!
//! Exit codes: 0 success, 1 a negative answer (no feasible plan, a regression found),
//! 2 an error (bad input, I/O, backend failure), 130 interrupted by Ctrl-C after saving.

mod args;
mod check;
mod completions;
mod data;
mod device;
mod estimate;
mod export;
mod export_weights;
mod interrupt;
mod links;
mod printer;
mod probe;

mod report;
mod reporters;
mod run;
mod train;
mod tune;

use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command};
use printer::Printer;

/// What a command concluded, mapped to the process exit code.
pub enum Status {
    /// The command did what was asked.
    Success,
    /// A well-formed negative answer.
    Negative,
    /// Stopped by Ctrl-C after saving its state.
    Interrupted,
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // clap's help and version are successes; usage errors are input errors (2).
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_tracing(cli.global.verbose, cli.global.quiet);
    let mut command = cli.command;
    if cli.global.follow_symlinks {
        if let Err(err) = links::follow_output_links(&mut command) {
            print_error(&anyhow::Error::from(err));
            return ExitCode::from(2);
        }
    }
    let printer = Printer::new(
        cli.global.quiet,
        cli.global.verbose > 0,
        command.wants_json(),
    );
    match run(command, &printer) {
        Ok(Status::Success) => ExitCode::SUCCESS,
        Ok(Status::Negative) => ExitCode::from(1),
        Ok(Status::Interrupted) => ExitCode::from(130),
        Err(err) => {
            print_error(&err);
            ExitCode::from(2)
        }
    }
}

fn run(command: Command, printer: &Printer) -> anyhow::Result<Status> {
    match command {
        Command::Train(args) => train::run(*args, printer),
        Command::Probe(args) => probe::run(args, printer),
        Command::ProbeOne => probe::run_child(),
        Command::ProbeServe => probe::run_worker(),
        Command::RunnerWatchdog => {
            autotune::probe::watchdog::serve();
            Ok(Status::Success)
        }
        Command::Tune(args) => tune::run(*args, printer),
        Command::Run(args) => run::run(*args, printer),
        Command::Data(args) => data::run(args, printer),
        Command::Export(args) => export::run(args, printer),
        Command::ExportWeights(args) => export_weights::run(args, printer),
        Command::Check(args) => check::run(args, printer),
        Command::Estimate(args) => estimate::run(args, printer),
        Command::Device(args) => device::run(args, printer),
        Command::Completions(args) => completions::run(args, printer),
        Command::Report(args) => report::run(args, printer),
    }
}

/// `error: …` then one `caused by: …` line per source, as people read chains top-down. Errors
/// quote files, keys and names from others' files: whatever in them would act on the terminal
/// is escaped (line breaks kept: the readers escape those in what they quote).
fn print_error(err: &anyhow::Error) {
    let safe =
        |message: String| autotune_core::text::escape_controls_keeping_lines(&message).into_owned();
    let mut text = format!("error: {}", safe(err.to_string()));
    for cause in err.chain().skip(1) {
        text.push_str(&format!("\n  caused by: {}", safe(cause.to_string())));
    }
    eprintln!("{text}");
}

/// `-v` sets `autotune=debug`, `-vv` `autotune=trace`; `RUST_LOG` overrides both.
fn init_tracing(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "autotune=debug,warn",
        (false, _) => "autotune=trace,debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for people: a parent process reading a worker's log wants plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
