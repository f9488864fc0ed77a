//! What an interrupt does while a trial runner runs: the runner is in a process group of its
//! own, which the terminal's Ctrl-C does not reach, so autotune stops it and exits with 130.

use autotune::probe::runner::RunningGroup;

use super::printer::Printer;

/// Stops the trial runner running in `group`, and everything it started, when autotune is
/// interrupted (Ctrl-C, SIGTERM, SIGHUP), then exits with 130.
pub fn stop_runner_on_interrupt(group: RunningGroup, printer: &Printer) {
    let quiet = *printer;
    let installed = ctrlc::set_handler(move || {
        group.stop();
        quiet.status("\ninterrupt: the trial runner was stopped; no plan written");
        std::process::exit(130);
    });
    if let Err(e) = installed {
        printer.warn(format!(
            "cannot install the interrupt handler ({e}); an interrupt may leave the trial \
             runner running"
        ));
    }
}
