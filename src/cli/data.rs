//! `autotune data`: what training would see of a dataset. Examples as text with the trained
//! spans marked, and the counts; or, with `--json`, one line per example in dataset order,
//! `{"input_ids": [...], "labels": [...]}` with -100 where the loss is masked.

use serde::Serialize;

use autotune::data::load::LoadEvent;
use autotune::data::tokenizer::Tokenizer;
use autotune::session::data::{inspect, Inspection};
use autotune::settings::data::{DataArgs, DataSettings};

use super::printer::Printer;
use super::reporters::train::load_line;
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
    let bar = printer.progress(0, "{bar:30} {pos}/{len} records tokenized  ETA {eta}");
    let inspection = inspect(&settings, &|event| match &event {
        LoadEvent::Tokenizing { total } => {
            bar.set_length(*total as u64);
            bar.suspend(|| printer.status(load_line(&event)));
        }
        LoadEvent::Tokenized { done } => bar.set_position(*done as u64),
        _ => bar.suspend(|| printer.status(load_line(&event))),
    });
    bar.finish_and_clear();
    let inspection = inspection?;
    let table = &inspection.examples;
    for i in 0..table.len() {
        let (ids, trained) = table.get(i);
        let labels = ids
            .iter()
            .zip(trained)
            .map(|(&id, &t)| if t != 0 { i64::from(id) } else { IGNORED })
            .collect();
        printer.data_json_line(&Line {
            input_ids: ids,
            labels,
        });
    }
    for i in 0..table.len().min(settings.show) {
        printer.data_text(format!(
            "example {}:\n{}\n",
            i + 1,
            marked(&inspection.tokenizer, table.get(i))?
        ));
    }
    printer.data_text(counts(&inspection, settings.micro_batch));
    Ok(Status::Success)
}

/// The example as text, the trained spans between `⟦` and `⟧`.
fn marked(tokenizer: &Tokenizer, (ids, trained): (&[u32], &[u8])) -> anyhow::Result<String> {
    let mut text = String::new();
    let mut start = 0;
    while start < ids.len() {
        let flag = trained[start];
        let end = (start..ids.len())
            .find(|&i| trained[i] != flag)
            .unwrap_or(ids.len());
        let part = tokenizer.decode(&ids[start..end])?;
        if flag != 0 {
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
