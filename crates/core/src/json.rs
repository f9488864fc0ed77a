//! Reading typed documents from JSON with errors that name the field by its path.
//!
//! serde's own messages name a field only for unknown, missing and duplicate keys, and never
//! say where in the document it sits; a wrong type ("invalid type: string, expected usize")
//! names nothing. [`serde_path_to_error`] tracks the path down to the failing value, so every
//! error here names it (`optimizer.lr`, `probes[3].request.knobs.micro_batch`).

use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// The field named when the document as a whole is wrong (not JSON, not an object).
pub const DOCUMENT: &str = "(document)";

/// Deserializes `value` as a `T`, or an [`Error::InvalidSpec`] of `what` naming the field.
pub fn from_value<T: DeserializeOwned>(what: &'static str, value: serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| invalid(what, e))
}

/// Parses `text` as a `T`, or an [`Error::InvalidSpec`] of `what` naming the field.
pub fn from_str<T: DeserializeOwned>(what: &'static str, text: &str) -> Result<T> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value: T =
        serde_path_to_error::deserialize(&mut deserializer).map_err(|e| invalid(what, e))?;
    deserializer
        .end()
        .map_err(|e| Error::invalid(what, DOCUMENT, format!("has trailing characters: {e}")))?;
    Ok(value)
}

/// Parses `text` as JSON, naming a truncated document as such.
pub fn parse_value(what: &'static str, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| {
        let problem = if e.is_eof() {
            format!("ends before the JSON document does (a truncated file?): {e}")
        } else {
            format!("is not valid JSON: {e}")
        };
        Error::invalid(what, DOCUMENT, problem)
    })
}

fn invalid<E: std::fmt::Display>(what: &'static str, e: serde_path_to_error::Error<E>) -> Error {
    let message = e.inner().to_string();
    Error::invalid(what, field_path(&e.path().to_string(), &message), message)
}

/// The failing field's path: where the deserializer stood, plus the key serde's message names
/// for missing and duplicate fields (which are reported at their parent object; an unknown
/// key's path already ends with it).
pub fn field_path(path: &str, message: &str) -> String {
    let parent = if path == "." || path.is_empty() {
        None
    } else {
        Some(path)
    };
    match (parent, named_key(message)) {
        (Some(parent), Some(key)) if parent == key || parent.ends_with(&format!(".{key}")) => {
            parent.to_string()
        }
        (Some(parent), Some(key)) => format!("{parent}.{key}"),
        (None, Some(key)) => key,
        (Some(parent), None) => parent.to_string(),
        (None, None) => DOCUMENT.to_string(),
    }
}

/// The key serde names in "unknown field `x`", "missing field `x`" or "duplicate field `x`".
fn named_key(message: &str) -> Option<String> {
    let names_a_field = ["unknown field", "missing field", "duplicate field"]
        .iter()
        .any(|p| message.starts_with(p));
    if !names_a_field {
        return None;
    }
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        lr: f64,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        optimizer: Inner,
        layers: Vec<usize>,
    }

    fn field(text: &str) -> String {
        match from_str::<Outer>("test", text) {
            Err(Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected an invalid document, got {other:?}"),
        }
    }

    #[test]
    fn errors_name_the_field_by_its_path() {
        assert_eq!(
            field(r#"{"optimizer": {"lr": "fast"}, "layers": []}"#),
            "optimizer.lr"
        );
        assert_eq!(
            field(r#"{"optimizer": {"lr": 1, "beta": 2}, "layers": []}"#),
            "optimizer.beta"
        );
        assert_eq!(
            field(r#"{"optimizer": {"lr": 1}, "layers": [1, -2]}"#),
            "layers[1]"
        );
        assert_eq!(field(r#"{"layers": []}"#), "optimizer");
        assert_eq!(field(r#""x""#), DOCUMENT);
        assert_eq!(
            field(r#"{"optimizer": {"lr": 1}, "layers": []} x"#),
            DOCUMENT
        );
    }
}
