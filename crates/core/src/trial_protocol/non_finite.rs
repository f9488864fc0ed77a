//! Replies that carry `NaN` or `Infinity`: not JSON, but what Python's `json.dumps` writes for
//! a float that is not finite. Such a line fails to parse, and would be taken for the runner's
//! own output while autotune waits for a reply until the trial's time limit; it is found here
//! instead, so that the reply is refused at once, naming the field.

use serde_json::Value;

/// The tokens JSON lacks that Python writes for floats that are not finite.
const TOKENS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];

/// What a non-finite token becomes, before the token, to be read: a string no runner writes.
const MARK: char = '\u{1}';

/// A reply line that would be a JSON object but for non-finite numbers: the object (with
/// each such number as a marked string) and the path of one of them (`step_times_s[1]`), with
/// the token found there. `None` when the line is not such an object.
pub(super) fn read_marked(line: &str) -> Option<(serde_json::Map<String, Value>, String, String)> {
    let Ok(Value::Object(object)) = serde_json::from_str(&mark_tokens(line)) else {
        return None;
    };
    let (path, token) = object.iter().find_map(|(key, value)| {
        marked_path(value).map(|(rest, token)| (format!("{key}{rest}"), token))
    })?;
    Some((object, path, token))
}

/// `line` with every non-finite token outside a string made a string of the marker and the
/// token.
fn mark_tokens(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            in_string = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if c == '"' {
            in_string = true;
        } else if let Some(token) = TOKENS.iter().find(|t| rest.starts_with(**t)) {
            // Escaped: JSON strings hold no raw control characters.
            out.push_str("\"\\u0001");
            out.push_str(token);
            out.push('"');
            rest = &rest[token.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Where in `value` a marked token sits (`""` for `value` itself, `[i]` or `.key` below), and
/// the token.
fn marked_path(value: &Value) -> Option<(String, String)> {
    match value {
        Value::String(s) => s
            .strip_prefix(MARK)
            .filter(|token| TOKENS.contains(token))
            .map(|token| (String::new(), token.to_string())),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| marked_path(v).map(|(rest, token)| (format!("[{i}]{rest}"), token))),
        Value::Object(fields) => fields
            .iter()
            .find_map(|(k, v)| marked_path(v).map(|(rest, token)| (format!(".{k}{rest}"), token))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_non_finite_number_is_named_by_its_path() {
        let line = r#"{"protocol": 2, "id": 7, "reason": "NaN \"Infinity\"",
                       "step_times_s": [0.1, NaN, -Infinity]}"#;
        let (object, path, token) = read_marked(line).expect("a marked object");
        assert_eq!((path.as_str(), token.as_str()), ("step_times_s[1]", "NaN"));
        assert_eq!(object["id"], 7);
        assert_eq!(
            object["reason"], "NaN \"Infinity\"",
            "strings are left alone"
        );
        let (_, path, token) = read_marked(r#"{"a": {"b": [Infinity]}}"#).unwrap();
        assert_eq!((path.as_str(), token.as_str()), ("a.b[0]", "Infinity"));
    }

    #[test]
    fn lines_without_non_finite_numbers_or_not_objects_are_not_marked() {
        for line in [
            r#"{"protocol": 2, "reason": "NaN"}"#,
            "{not json NaN",
            "[NaN]",
            "loss NaN",
        ] {
            assert!(read_marked(line).is_none(), "{line}");
        }
    }
}
