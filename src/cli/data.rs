//! `autotune data`: what training would see of a dataset. Examples as text with the trained
//! spans marked, and the counts; or, with `--json`, one line per example in dataset order,
//! `{"input_ids": [...], "labels": [...]}` with -100 where the loss is masked.

use serde::Serialize;

use autotune::data::table::ExampleTokens;
use autotune::data::tokenizer::Tokenizer;
use autotune::plan::LengthBucket;
use autotune::session::data::{inspect, Inspection};
use autotune::settings::data::{DataArgs, DataSettings};

use super::printer::Printer;
use super::reporters::train::with_load_progress;
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
    let inspection = with_load_progress(printer, |events| inspect(&settings, events));
    let inspection = inspection?;
    let table = &inspection.examples;
    for i in 0..table.len() {
        let tokens = table.get(i)?;
        let (ids, trained) = (&*tokens.ids, &*tokens.trained);
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
            marked(&inspection.tokenizer, &table.get(i)?)?
        ));
    }
    printer.data_text(counts(
        &inspection,
        settings.micro_batch,
        settings.model.seq_len,
    ));
    Ok(Status::Success)
}

/// The example as text, the trained spans between `⟦` and `⟧`.
fn marked(tokenizer: &Tokenizer, tokens: &ExampleTokens) -> anyhow::Result<String> {
    let (ids, trained) = (&*tokens.ids, &*tokens.trained);
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

fn counts(inspection: &Inspection, micro_batch: usize, seq_len: usize) -> String {
    let cut = &inspection.cut;
    let mut text = format!(
        "{} examples: {} kept, {} cut to the sequence length of {seq_len}, {} longer than it \
         dropped (--truncate drop), {} dropped with nothing to train on; {} tokens kept, {} \
         trained on ({:.1}%)\npadding: {:.1}% of padded micro-batches of {micro_batch}, {:.1}% \
         packed into sequences of {seq_len}\nlengths (tokens): ",
        inspection.examples.len(),
        cut.kept,
        cut.truncated,
        cut.too_long,
        cut.dropped,
        cut.tokens,
        cut.trained_tokens,
        100.0 * cut.trained_tokens as f64 / cut.tokens.max(1) as f64,
        100.0 * inspection.padding,
        100.0 * inspection.packing,
    );
    text.push_str(&histogram(&inspection.lengths));
    text
}

/// The length histogram on one line: `≤64: 10 · ≤128: 3`.
pub fn histogram(buckets: &[LengthBucket]) -> String {
    let parts: Vec<String> = buckets
        .iter()
        .map(|b| format!("≤{}: {}", b.up_to, b.examples))
        .collect();
    parts.join(" · ")
}
