//! `--follow-symlinks`: an output named through a symbolic link is written to the file the link
//! points to, and the link stays. Resolved here, once, before a command sees its paths, so that
//! the output policy and every writer see the file that is written.

use std::path::PathBuf;

use autotune::outputs::follow_link;
use autotune::settings::tune::TuneArgs;

use super::args::Command;

/// `command` with each output that is a symbolic link replaced by the file it points to.
pub fn follow_output_links(command: &mut Command) -> autotune::Result<()> {
    match command {
        Command::Tune(args) => tune_outputs(&mut args.tune),
        Command::Run(args) => {
            tune_outputs(&mut args.tune)?;
            follow("--metrics", &mut args.training.metrics)
        }
        Command::Train(args) => follow("--metrics", &mut args.training.metrics),
        Command::Report(args) => follow("--out", &mut args.out),
        _ => Ok(()),
    }
}

fn tune_outputs(args: &mut TuneArgs) -> autotune::Result<()> {
    follow("--out", &mut args.out)?;
    follow("--record", &mut args.record)?;
    follow("--report", &mut args.report)
}

fn follow(flag: &str, path: &mut Option<PathBuf>) -> autotune::Result<()> {
    if let Some(path) = path {
        *path = follow_link(flag, path)?;
    }
    Ok(())
}
