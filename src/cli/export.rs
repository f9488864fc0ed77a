//! `autotune export`: a plan's setting in the configuration language of other trainers. The
//! document goes to stdout as the tool loads it; what it cannot carry goes to stderr.

use autotune::plan::exports::{self, ExportFormat};
use autotune::settings::export::{ExportArgs, ExportSettings};

use super::printer::Printer;
use super::Status;

pub fn run(args: ExportArgs, printer: &Printer) -> anyhow::Result<Status> {
    let settings = ExportSettings::from_args(&args)?;
    for warning in &settings.warnings {
        printer.warn(warning);
    }
    let knobs = &settings.plan.knobs;
    let optimizer = &settings.plan.model.optimizer;
    let environment = exports::environment_line(settings.plan.provenance.as_ref());
    let notes = match settings.format {
        ExportFormat::DeepSpeed => {
            let (config, notes) = exports::deepspeed_config(knobs, optimizer, settings.world_size);
            printer.data_json(&config);
            notes
        }
        ExportFormat::Trainer => {
            let (config, notes) = exports::trainer_args(knobs, optimizer);
            printer.data_json(&config);
            notes
        }
        ExportFormat::Accelerate => {
            let (yaml, notes) = exports::accelerate_config(knobs);
            let mut stated = settings.lossy.as_ref().map_or(String::new(), |what| {
                format!("# autotune: exported with changes to the plan: {what}\n")
            });
            if let Some(line) = &environment {
                stated.push_str(&format!(
                    "# autotune: start `accelerate launch` with this in its environment: {line}\n"
                ));
            }
            printer.document(format!("{stated}{}", yaml.trim_end()).as_str());
            notes
        }
        ExportFormat::Lightning => {
            let (config, notes) = exports::lightning_args(knobs, optimizer.grad_clip);
            printer.data_json(&config);
            notes
        }
    };
    let environment = environment.map(|line| exports::environment_note(&line, settings.format));
    for note in notes.into_iter().chain(environment) {
        printer.note(note);
    }
    Ok(Status::Success)
}
