//! `autotune data`: what training would see of a dataset. Examples as text with the trained
//! spans marked, and the counts; or, with `--json`, one line per example in dataset order,
//! `{"input_ids": [...], "labels": [...]}` with -100 where the loss is masked.

use serde::Serialize;

use autotune::data::dataset::Example;
use autotune::data::tokenizer::Tokenizer;
use autotune::session::data::{inspect, Inspection};
use autotune::settings::data::{DataArgs, DataSettings};

use super::printer::Printer;
use super::Status;

/// The label `transformers` ignores.
const IGNORED: i64 = -100;

#[derive(Serialize)]
struct Line<'a> {
    input_ids: &'a [u32],
    labels: Vec<i64>,
}

pub fn run(args: DataArgs, printer: &Printer) -> anyhow::Result<Status> {
    let settings = DataSettings::from_args(&args)?;
    let inspection = inspect(&settings)?;
    for example in &inspection.examples {
        let labels = example
            .ids
            .iter()
            .zip(&example.trained)
            .map(|(&id, &t)| if t { i64::from(id) } else { IGNORED })
            .collect();
        printer.data_json_line(&Line {
            input_ids: &example.ids,
            labels,
        });
    }
    for (i, example) in inspection.examples.iter().take(settings.show).enumerate() {
        printer.data_text(format!(
            "example {}:\n{}\n",
            i + 1,
            marked(&inspection.tokenizer, example)?
        ));
    }
    printer.data_text(counts(&inspection, settings.micro_batch));
    Ok(Status::Success)
}

/// The example as text, the trained spans between `⟦` and `⟧`.
fn marked(tokenizer: &Tokenizer, example: &Example) -> anyhow::Result<String> {
    let mut text = String::new();
    let mut start = 0;
    while start < example.ids.len() {
        let trained = example.trained[start];
        let end = (start..example.ids.len())
            .find(|&i| example.trained[i] != trained)
            .unwrap_or(example.ids.len());
        let part = tokenizer.decode(&example.ids[start..end])?;
        if trained {
            text.push_str(&format!("⟦{part}⟧"));
        } else {
            text.push_str(&part);
        }
        start = end;
    }
    Ok(text)
}

fn counts(inspection: &Inspection, micro_batch: usize) -> String {
    let cut = &inspection.cut;
    format!(
        "{} examples: {} kept, {} cut to the sequence length, {} dropped with nothing to train \
         on; {} tokens kept, {} trained on ({:.1}%); padding {:.1}% of micro-batches of {}",
        inspection.examples.len(),
        cut.kept,
        cut.truncated,
        cut.dropped,
        cut.tokens,
        cut.trained_tokens,
        100.0 * cut.trained_tokens as f64 / cut.tokens.max(1) as f64,
        100.0 * inspection.padding,
        micro_batch
    )
}
