//! Records: the examples of a dataset as the user wrote them, before any tokenizer: a
//! document's text, a conversation, a prompt and its completion, or an instruction and its
//! response. Read from text files (documents split at blank lines), JSON lines, and JSON arrays
//! (and, through [`super::columnar`], Parquet and Arrow rows), each record's fields mapped
//! (`--columns`) and matched against the schemas in turn.
//!
//! A record that matches no schema, a line that is no JSON object, or a record whose schema
//! differs from the first one's is an error naming the file, the line (or the array's element),
//! the field, and the fix.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use super::template::Message;
use crate::{Error, Result};

/// One example, as its schema reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A document (`text`): trained on whole.
    Text(String),
    /// A conversation (`messages`, or ShareGPT's `conversations`): trained on the assistant's
    /// turns by default.
    Chat(Vec<Message>),
    /// A prompt and its completion (`prompt`, `completion`): trained on the completion.
    Completion {
        /// The prompt.
        prompt: String,
        /// What follows it.
        completion: String,
    },
    /// An Alpaca-style instruction (`instruction`, optional `input`, `output`): trained on the
    /// response.
    Instruction {
        /// The task.
        instruction: String,
        /// Its input, empty when there is none.
        input: String,
        /// The response.
        output: String,
    },
}

/// The schemas a record may have, by the fields that mark them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// `text`.
    Text,
    /// `messages` (or `conversations`).
    Chat,
    /// `prompt` and `completion`.
    Completion,
    /// `instruction` and `output` (and `input`).
    Instruction,
}

impl Schema {
    fn name(self) -> &'static str {
        match self {
            Schema::Text => "text",
            Schema::Chat => "messages",
            Schema::Completion => "prompt/completion",
            Schema::Instruction => "instruction/output",
        }
    }
}

/// Where a record sits, for errors: the file and its line (JSON lines, text) or element (a
/// JSON array), counted from 1.
#[derive(Debug, Clone)]
pub struct Origin {
    /// The file.
    pub file: PathBuf,
    /// What the number counts: `line` or `record`.
    pub unit: &'static str,
    /// The line or record.
    pub number: usize,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {} {}", self.file.display(), self.unit, self.number)
    }
}

/// Renames of fields (`--columns source=target`): the user's names for the schemas' fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Columns(BTreeMap<String, String>);

impl Columns {
    /// Parses `--columns`: `target=source` pairs separated by commas, e.g.
    /// `prompt=question,completion=answer` (the schema's field first, as the user's data names
    /// it second).
    pub fn parse(text: &str) -> Result<Self> {
        let mut map = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((target, source)) = pair.split_once('=') else {
                return Err(bad_columns(pair, "is not `field=column`"));
            };
            let (target, source) = (target.trim(), source.trim());
            let known = [
                "text",
                "messages",
                "prompt",
                "completion",
                "instruction",
                "input",
                "output",
                "role",
                "content",
            ];
            if !known.contains(&target) {
                return Err(bad_columns(
                    pair,
                    &format!(
                        "names no field autotune reads; the fields are {}",
                        known.join(", ")
                    ),
                ));
            }
            if source.is_empty() || map.insert(target.to_string(), source.to_string()).is_some() {
                return Err(bad_columns(pair, "maps a field twice, or to nothing"));
            }
        }
        Ok(Self(map))
    }

    /// The renames from pairs of `field → column`.
    pub fn from_pairs(pairs: BTreeMap<String, String>) -> Self {
        Self(pairs)
    }

    /// The renames as pairs of `field → column`.
    pub fn pairs(&self) -> &BTreeMap<String, String> {
        &self.0
    }

    /// The column holding `field` in the user's data.
    fn column<'a>(&'a self, field: &'a str) -> &'a str {
        self.0.get(field).map_or(field, String::as_str)
    }
}

fn bad_columns(pair: &str, problem: &str) -> Error {
    autotune_core::Error::InvalidFlag {
        flag: format!("--columns {pair}"),
        problem: format!("{problem} (e.g. --columns prompt=question,completion=answer)"),
    }
    .into()
}

/// Reads one record from a JSON object, naming `origin` in errors.
pub fn record(object: &Map<String, Value>, columns: &Columns, origin: &Origin) -> Result<Record> {
    let field = |name: &str| object.get(columns.column(name));
    if let Some(messages) = field("messages").or_else(|| object.get("conversations")) {
        return chat(messages, columns, origin).map(Record::Chat);
    }
    if let (Some(prompt), Some(completion)) = (field("prompt"), field("completion")) {
        return Ok(Record::Completion {
            prompt: string(prompt, columns.column("prompt"), origin)?,
            completion: string(completion, columns.column("completion"), origin)?,
        });
    }
    if let (Some(instruction), Some(output)) = (field("instruction"), field("output")) {
        let input = match field("input") {
            Some(Value::Null) | None => String::new(),
            Some(input) => string(input, columns.column("input"), origin)?,
        };
        return Ok(Record::Instruction {
            instruction: string(instruction, columns.column("instruction"), origin)?,
            input,
            output: string(output, columns.column("output"), origin)?,
        });
    }
    if let Some(text) = field("text") {
        return Ok(Record::Text(string(text, columns.column("text"), origin)?));
    }
    let fields: Vec<&str> = object.keys().map(String::as_str).collect();
    Err(Error::Usage(format!(
        "{origin}: a record with the fields [{}] matches no schema; a record needs `text`, \
         `messages`, `prompt` and `completion`, or `instruction` and `output` (name other \
         columns with --columns, e.g. --columns text={})",
        fields.join(", "),
        fields.first().copied().unwrap_or("body")
    )))
}

/// The schema of `record`.
pub fn schema(record: &Record) -> Schema {
    match record {
        Record::Text(_) => Schema::Text,
        Record::Chat(_) => Schema::Chat,
        Record::Completion { .. } => Schema::Completion,
        Record::Instruction { .. } => Schema::Instruction,
    }
}

/// A conversation: an array of `{role, content}` (or ShareGPT's `{from, value}`).
fn chat(messages: &Value, columns: &Columns, origin: &Origin) -> Result<Vec<Message>> {
    let Value::Array(items) = messages else {
        return Err(Error::Usage(format!(
            "{origin}: field `messages` must be a list of {{\"role\", \"content\"}} objects"
        )));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |name: &str| format!("messages[{i}].{name}");
        let Value::Object(message) = item else {
            return Err(Error::Usage(format!(
                "{origin}: field `messages[{i}]` must be an object with `role` and `content`"
            )));
        };
        let role = message
            .get(columns.column("role"))
            .or_else(|| message.get("from"))
            .ok_or_else(|| missing(origin, &at("role")))?;
        let content = message
            .get(columns.column("content"))
            .or_else(|| message.get("value"))
            .ok_or_else(|| missing(origin, &at("content")))?;
        out.push(Message {
            role: share_gpt_role(&string(role, &at("role"), origin)?),
            content: string(content, &at("content"), origin)?,
        });
    }
    if out.is_empty() {
        return Err(Error::Usage(format!(
            "{origin}: field `messages` is empty; a conversation needs at least one message"
        )));
    }
    Ok(out)
}

/// ShareGPT's speakers as the chat templates' roles.
fn share_gpt_role(role: &str) -> String {
    match role {
        "human" => "user".into(),
        "gpt" => "assistant".into(),
        other => other.into(),
    }
}

fn missing(origin: &Origin, field: &str) -> Error {
    Error::Usage(format!("{origin}: field `{field}` is missing"))
}

fn string(value: &Value, field: &str, origin: &Origin) -> Result<String> {
    match value {
        Value::String(s) => Ok(s.clone()),
        other => Err(Error::Usage(format!(
            "{origin}: field `{field}` must be a string, not {}",
            kind(other)
        ))),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Reads the records of a JSON-lines file: one object a line (blank lines skipped).
pub fn json_lines(path: &Path, columns: &Columns) -> Result<Vec<Record>> {
    let text = read(path)?;
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let origin = Origin {
            file: path.to_path_buf(),
            unit: "line",
            number: i + 1,
        };
        let value: Value = serde_json::from_str(line).map_err(|e| {
            Error::Usage(format!(
                "{origin}: not a JSON object ({e}); JSON lines hold one object a line"
            ))
        })?;
        records.push(object_record(&value, columns, &origin)?);
    }
    uniform(records, path)
}

/// Reads the records of a JSON file: an array of objects.
pub fn json_array(path: &Path, columns: &Columns) -> Result<Vec<Record>> {
    let text = read(path)?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Usage(format!("`{}`: not JSON ({e})", path.display())))?;
    let Value::Array(items) = value else {
        return Err(Error::Usage(format!(
            "`{}`: a JSON dataset is an array of records, not {}",
            path.display(),
            kind(&value)
        )));
    };
    let mut records = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let origin = Origin {
            file: path.to_path_buf(),
            unit: "record",
            number: i + 1,
        };
        records.push(object_record(item, columns, &origin)?);
    }
    uniform(records, path)
}

/// The documents of a text file: its parts between blank lines.
pub fn text_documents(path: &Path) -> Result<Vec<Record>> {
    let text = read(path)?;
    let mut documents = Vec::new();
    let mut current = String::new();
    for line in text.split_inclusive('\n') {
        if line.trim().is_empty() {
            if !current.trim().is_empty() {
                documents.push(Record::Text(
                    std::mem::take(&mut current).trim_end().to_string(),
                ));
            }
            current.clear();
        } else {
            current.push_str(line);
        }
    }
    if !current.trim().is_empty() {
        documents.push(Record::Text(current.trim_end().to_string()));
    }
    Ok(documents)
}

pub(super) fn object_record(value: &Value, columns: &Columns, origin: &Origin) -> Result<Record> {
    match value {
        Value::Object(object) => record(object, columns, origin),
        other => Err(Error::Usage(format!(
            "{origin}: a record must be a JSON object, not {}",
            kind(other)
        ))),
    }
}

/// `records` when they share the first one's schema, else an error naming the first that
/// does not.
pub(super) fn uniform(records: Vec<Record>, path: &Path) -> Result<Vec<Record>> {
    let Some(first) = records.first().map(schema) else {
        return Err(Error::Usage(format!(
            "`{}` holds no records",
            path.display()
        )));
    };
    if let Some(i) = records.iter().position(|r| schema(r) != first) {
        return Err(Error::Usage(format!(
            "`{}` record {}: its schema is {}, but the first record's is {}; a dataset holds \
             one schema",
            path.display(),
            i + 1,
            schema(&records[i]).name(),
            first.name()
        )));
    }
    Ok(records)
}

fn read(path: &Path) -> Result<String> {
    crate::input_file::read_to_string(path, crate::input_file::WHOLE)
        .map_err(|e| Error::file("cannot read training data", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin {
            file: "d.jsonl".into(),
            unit: "line",
            number: 3,
        }
    }

    fn parse(json: &str, columns: &Columns) -> Result<Record> {
        let value: Value = serde_json::from_str(json).unwrap();
        object_record(&value, columns, &origin())
    }

    #[test]
    fn each_schema_reads_its_fields() {
        let none = Columns::default();
        let m = |role: &str, content: &str| Message {
            role: role.into(),
            content: content.into(),
        };
        let table = [
            (r#"{"text": "a doc"}"#, Record::Text("a doc".into())),
            (
                r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#,
                Record::Chat(vec![m("user", "hi"), m("assistant", "yo")]),
            ),
            (
                r#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}"#,
                Record::Chat(vec![m("user", "hi"), m("assistant", "yo")]),
            ),
            (
                r#"{"prompt": "2+2=", "completion": "4"}"#,
                Record::Completion {
                    prompt: "2+2=".into(),
                    completion: "4".into(),
                },
            ),
            (
                r#"{"instruction": "add", "input": null, "output": "4", "extra": 1}"#,
                Record::Instruction {
                    instruction: "add".into(),
                    input: String::new(),
                    output: "4".into(),
                },
            ),
        ];
        for (json, expected) in table {
            assert_eq!(parse(json, &none).unwrap(), expected, "{json}");
        }
    }

    #[test]
    fn columns_map_other_names_and_bad_rows_name_line_field_and_fix() {
        let columns = Columns::parse("prompt=question, completion=answer").unwrap();
        assert_eq!(
            parse(r#"{"question": "q", "answer": "a"}"#, &columns).unwrap(),
            Record::Completion {
                prompt: "q".into(),
                completion: "a".into()
            }
        );
        let table = [
            (r#"{"body": "x"}"#, "matches no schema"),
            (
                r#"{"text": 5}"#,
                "field `text` must be a string, not a number",
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                "field `messages[0].content` is missing",
            ),
            (r#"{"messages": "hi"}"#, "must be a list"),
            (r#"{"messages": []}"#, "is empty"),
        ];
        for (json, why) in table {
            let err = parse(json, &Columns::default()).unwrap_err().to_string();
            assert!(
                err.contains("`d.jsonl` line 3") && err.contains(why),
                "{json}: {err}"
            );
        }
        for bad in ["prompt", "nonsense=x", "text=a,text=b", "text="] {
            assert!(Columns::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn files_read_line_by_line_and_refuse_mixed_schemas() {
        let dir = tempfile::tempdir().unwrap();
        let lines = dir.path().join("d.jsonl");
        std::fs::write(&lines, "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n").unwrap();
        assert_eq!(json_lines(&lines, &Columns::default()).unwrap().len(), 2);
        std::fs::write(
            &lines,
            "{\"text\": \"a\"}\n{\"prompt\": \"p\", \"completion\": \"c\"}\n",
        )
        .unwrap();
        let err = json_lines(&lines, &Columns::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("record 2") && err.contains("prompt/completion"),
            "{err}"
        );
        std::fs::write(&lines, "{\"text\": \"a\"}\nnot json\n").unwrap();
        let err = json_lines(&lines, &Columns::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 2") && err.contains("not a JSON object"),
            "{err}"
        );
        let array = dir.path().join("d.json");
        std::fs::write(&array, r#"[{"text": "a"}, 4]"#).unwrap();
        let err = json_array(&array, &Columns::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("record 2") && err.contains("not a number"),
            "{err}"
        );
        let text = dir.path().join("d.txt");
        std::fs::write(&text, "one\nstill one\n\n\n two \n\n").unwrap();
        assert_eq!(
            text_documents(&text).unwrap(),
            vec![
                Record::Text("one\nstill one".into()),
                Record::Text(" two".into())
            ]
        );
    }
}
