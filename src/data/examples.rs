//! Records become examples: the token ids the model reads and which of them the loss trains
//! on. What is trained on follows the record's schema unless `--train-on` says otherwise: a
//! document whole, a completion without its prompt, an instruction's response, a conversation's
//! assistant turns. Masks come from the token offsets of the one text that is encoded, never
//! from encoding a prompt apart, so a token merged across the prompt's end cannot move the
//! boundary: a token is trained on when it starts inside the trained part.

use std::ops::Range;

use super::dataset::Example;
use super::records::{Message, Record};
use super::template::ChatTemplate;
use super::tokenizer::{Encoding, Tokenizer};
use crate::Result;

/// What the loss trains on (`--train-on`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TrainOn {
    /// Every token.
    All,
    /// A completion's (a response's) tokens, not its prompt's.
    Completion,
    /// A conversation's assistant turns.
    Assistant,
}

impl TrainOn {
    /// What a record of `record`'s schema trains on by default.
    pub fn default_for(record: &Record) -> Self {
        match record {
            Record::Text(_) => TrainOn::All,
            Record::Completion { .. } | Record::Instruction { .. } => TrainOn::Completion,
            Record::Chat(_) => TrainOn::Assistant,
        }
    }
}

/// The prompt Stanford Alpaca trained with, for an instruction (and its input) without a chat
/// template to render it.
fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately \
             completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides \
             further context. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}

/// The example of a text, one document (BOS once, EOS last), trained on the tokens that start
/// at a byte `inside` says is trained (the EOS follows the text's last byte).
pub fn document(
    tokenizer: &Tokenizer,
    text: &str,
    inside: &dyn Fn(usize) -> bool,
) -> Result<Example> {
    let encoding = tokenizer.encode_document(text)?;
    Ok(masked(encoding, inside, text.len()))
}

/// Whether a byte lies in one of `spans`.
pub fn in_spans(spans: &[Range<usize>]) -> impl Fn(usize) -> bool + '_ {
    move |at| spans.iter().any(|r| r.contains(&at))
}

/// `encoding` of a text of `len` bytes with each token trained on when it starts at a byte
/// `inside` says is trained; a token past the text (an added EOS) follows the text's last byte.
pub fn masked(encoding: Encoding, inside: &dyn Fn(usize) -> bool, len: usize) -> Example {
    let trained = encoding
        .offsets
        .iter()
        .map(|&(start, end)| {
            if start >= len && start == end {
                len > 0 && inside(len - 1)
            } else {
                inside(start)
            }
        })
        .collect();
    Example {
        ids: encoding.ids,
        trained,
    }
}

/// The example of a record that needs no chat template: a document, a completion, or an
/// instruction in Alpaca's prompt. `None` for a conversation.
pub fn plain(tokenizer: &Tokenizer, record: &Record, train_on: TrainOn) -> Result<Option<Example>> {
    let (text, prompt_len) = match record {
        Record::Text(text) => (text.clone(), 0),
        Record::Completion { prompt, completion } => {
            (format!("{prompt}{completion}"), prompt.len())
        }
        Record::Instruction {
            instruction,
            input,
            output,
        } => {
            let prompt = alpaca_prompt(instruction, input);
            (format!("{prompt}{output}"), prompt.len())
        }
        Record::Chat(_) => return Ok(None),
    };
    let from = match train_on {
        TrainOn::All => 0,
        TrainOn::Completion | TrainOn::Assistant => prompt_len,
    };
    document(tokenizer, &text, &|at| at >= from).map(Some)
}

/// The example of a record rendered by the model's chat template: a conversation, or an
/// instruction as a user's message and the assistant's reply; `None` for the others. The text is
/// encoded as the template wrote it (its BOS, if any, and each turn's end-of-turn token), as
/// `transformers` encodes a rendered chat; the trained tokens start in an assistant's turn.
pub fn templated(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    record: &Record,
    train_on: TrainOn,
) -> Result<Option<Example>> {
    let messages = match record {
        Record::Chat(messages) => messages.clone(),
        Record::Instruction {
            instruction,
            input,
            output,
        } => {
            let asked = if input.is_empty() {
                instruction.clone()
            } else {
                format!("{instruction}\n\n{input}")
            };
            vec![
                Message::new("user", asked),
                Message::new("assistant", output),
            ]
        }
        Record::Text(_) | Record::Completion { .. } => return Ok(None),
    };
    let (text, spans) = template.render_with_assistant_spans(&messages)?;
    let encoding = tokenizer.encode(&text)?;
    Ok(Some(match train_on {
        TrainOn::All => masked(encoding, &|_| true, text.len()),
        TrainOn::Completion | TrainOn::Assistant => masked(encoding, &in_spans(&spans), text.len()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/data/tokenizers/llama3");
        Tokenizer::from_folder(&dir).unwrap()
    }

    /// The text of the trained tokens, in order.
    fn trained_text(t: &Tokenizer, example: &Example) -> String {
        let ids: Vec<u32> = example
            .ids
            .iter()
            .zip(&example.trained)
            .filter(|(_, &t)| t)
            .map(|(&id, _)| id)
            .collect();
        t.decode(&ids).unwrap()
    }

    #[test]
    fn a_completion_trains_on_itself_and_the_eos_and_a_document_on_everything() {
        let t = tokenizer();
        let eos = t.eos().unwrap().clone();
        let record = Record::Completion {
            prompt: "Question: what is two and two?\nAnswer:".into(),
            completion: " four".into(),
        };
        let example = plain(&t, &record, TrainOn::Completion).unwrap().unwrap();
        assert_eq!(example.ids.last(), Some(&eos.id), "EOS ends the example");
        assert_eq!(example.trained.last(), Some(&true), "and is trained on");
        let text = trained_text(&t, &example);
        assert!(
            text.starts_with(" four") && !text.contains("Answer"),
            "{text:?}"
        );
        let all = plain(&t, &record, TrainOn::All).unwrap().unwrap();
        assert!(
            all.trained[1..].iter().all(|&x| x),
            "every target of --train-on all"
        );
        assert_eq!(all.ids, example.ids, "what is trained on changes no id");
        let bos = t.bos().map(|b| b.id);
        assert_eq!(example.ids.first().copied(), bos, "BOS once, first");
        assert_eq!(example.ids.iter().filter(|&&id| Some(id) == bos).count(), 1);
    }

    #[test]
    fn an_instruction_without_a_template_trains_on_its_response_in_alpacas_prompt() {
        let t = tokenizer();
        let record = Record::Instruction {
            instruction: "Add the numbers.".into(),
            input: "2, 3".into(),
            output: "5".into(),
        };
        let example = plain(&t, &record, TrainOn::Completion).unwrap().unwrap();
        let text = trained_text(&t, &example);
        assert!(
            text.starts_with('5') && !text.contains("Response"),
            "{text:?}"
        );
        let chat = Record::Chat(Vec::new());
        assert!(plain(&t, &chat, TrainOn::Assistant).unwrap().is_none());
    }

    #[test]
    fn a_token_is_trained_on_when_it_starts_inside_the_trained_part() {
        let encoding = Encoding {
            ids: vec![1, 2, 3, 4, 9],
            offsets: vec![(0, 0), (0, 4), (4, 7), (7, 10), (10, 10)],
        };
        let example = masked(encoding, &in_spans(&[5..10, 20..30]), 10);
        assert_eq!(example.trained, vec![false, false, false, true, true]);
    }
}
