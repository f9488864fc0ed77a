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

/// Parses `text` as JSON, naming a truncated document as such and refusing an object that
/// gives a key twice: serde_json keeps the last of them silently, while other readers keep the
/// first, so the document means different things to different tools.
pub fn parse_value(what: &'static str, text: &str) -> Result<serde_json::Value> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let parsed = serde_path_to_error::deserialize(&mut deserializer);
    let Distinct(value) = parsed.map_err(|e| {
        if e.inner().is_data() {
            let key = field_path(&e.path().to_string(), &e.inner().to_string());
            let line = e.inner().line();
            Error::invalid(
                what,
                key,
                format!("is given twice (line {line}); keep one of them"),
            )
        } else {
            not_json(what, e.inner())
        }
    })?;
    deserializer.end().map_err(|e| not_json(what, &e))?;
    Ok(value)
}

/// A syntax error: a truncated document named as such.
fn not_json(what: &'static str, e: &serde_json::Error) -> Error {
    let problem = if e.is_eof() {
        format!("ends before the JSON document does (a truncated file?): {e}")
    } else {
        format!("is not valid JSON: {e}")
    };
    Error::invalid(what, DOCUMENT, problem)
}

/// A JSON value whose objects were each checked to name every key once.
struct Distinct(serde_json::Value);

impl<'de> serde::Deserialize<'de> for Distinct {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(DistinctVisitor).map(Distinct)
    }
}

/// Builds a [`serde_json::Value`] as serde_json's own visitor does, but fails on a repeated
/// key (with serde's "duplicate field" wording, which [`field_path`] reads the key from).
struct DistinctVisitor;

impl<'de> serde::de::Visitor<'de> for DistinctVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Distinct(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate field `{key}`"
                )));
            }
            let Distinct(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
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

    fn parsed_field(text: &str) -> String {
        match parse_value("test", text) {
            Err(Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected an invalid document, got {other:?}"),
        }
    }

    #[test]
    fn a_key_given_twice_is_refused_naming_it_by_its_path() {
        assert_eq!(parsed_field(r#"{"a": 1, "a": 2}"#), "a");
        assert_eq!(parsed_field(r#"{"a": {"b": 1, "c": 2, "b": 1}}"#), "a.b");
        assert_eq!(parsed_field(r#"[{"x": 1}, {"y": 1, "y": 1}]"#), "[1].y");
        assert_eq!(parsed_field(r#"{"a": 1"#), DOCUMENT);
        assert_eq!(parsed_field(r#"{"a": 1} 2"#), DOCUMENT);
        let same = r#"{"a": [1, -2, 0.5, "s", null, true], "b": {"a": {}}}"#;
        assert_eq!(
            parse_value("test", same).unwrap(),
            serde_json::from_str::<serde_json::Value>(same).unwrap()
        );
    }
}
