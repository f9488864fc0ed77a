//! What Jinja lacks of Python that chat templates rely on: `raise_exception`, values printed
//! as Python prints them, and `tojson` as Python's `json.dumps` writes it.

use std::fmt;

use minijinja::value::{Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{ErrorKind, Output, State, Value};

/// Marks an error as the template's own `raise_exception`.
#[derive(Debug)]
pub(super) struct Raised;

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("raised by the chat template")
    }
}

impl std::error::Error for Raised {}

pub(super) fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.to_string()).with_source(Raised))
}

/// Prints floats as Python's `str` does (`1e+16`, `1e-05`); the engine already prints `None`,
/// `True` and the rest as Python does.
pub(super) fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    if value.kind() != ValueKind::Number || value.is_integer() {
        return minijinja::escape_formatter(out, state, value);
    }
    out.write_str(&python_float(as_f64(value)))
        .map_err(|e| minijinja::Error::new(ErrorKind::WriteFailure, "cannot write").with_source(e))
}

pub(super) fn as_f64(value: &Value) -> f64 {
    f64::try_from(value.clone()).unwrap_or(f64::NAN)
}

/// Python's `repr` of a float: the shortest digits that read back, in positional notation for
/// exponents from -4 to 15 and scientific (`1e+16`, `1e-05`) outside.
pub(super) fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if mantissa.starts_with('-') { "-" } else { "" };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        if point <= 0 {
            return format!("{sign}0.{}{digits}", "0".repeat((-point) as usize));
        }
        let point = point as usize;
        if digits.len() <= point {
            return format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()));
        }
        return format!("{sign}{}.{}", &digits[..point], &digits[point..]);
    }
    let (first, rest) = digits.split_at(1);
    let fraction = if rest.is_empty() {
        String::new()
    } else {
        format!(".{rest}")
    };
    let exponent_sign = if exponent < 0 { '-' } else { '+' };
    format!(
        "{sign}{first}{fraction}e{exponent_sign}{:02}",
        exponent.abs()
    )
}

/// How `json.dumps` writes: `transformers`' `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
pub(super) struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// `transformers`' `tojson` filter: Python's `json.dumps`, not Jinja's HTML-safe one.
pub(super) fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<String, minijinja::Error> {
    let args = args.into_values();
    let (kwargs, positional): (Vec<&Value>, Vec<&Value>) = args.iter().partition(|v| v.is_kwargs());
    let kwargs = match kwargs.first() {
        Some(v) => Kwargs::try_from((*v).clone())?,
        None => Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
    };
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > names.len() {
        return Err(invalid("tojson takes at most 4 arguments after the value"));
    }
    let arg = |i: usize| -> Result<Value, minijinja::Error> {
        match positional.get(i) {
            Some(v) => Ok((*v).clone()),
            None => Ok(kwargs.get::<Option<Value>>(names[i])?.unwrap_or_default()),
        }
    };
    let indent = json_indent(&arg(1)?)?;
    let separators = arg(2)?;
    let (item_separator, key_separator) = if separators.is_none() || separators.is_undefined() {
        (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        )
    } else {
        let part = |i| {
            separators
                .get_item_by_index(i)
                .map(|v| v.as_str().map(str::to_string))
        };
        match (part(0)?, part(1)?) {
            (Some(item), Some(key)) => (item, key),
            _ => return Err(invalid("tojson's separators must be two strings")),
        }
    };
    let style = JsonStyle {
        ensure_ascii: arg(0)?.is_true(),
        indent,
        item_separator,
        key_separator,
        sort_keys: arg(3)?.is_true(),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

pub(super) fn invalid(problem: impl Into<String>) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, problem.into())
}

/// `indent` as Python takes it: none, a number of spaces (a bool counts as 0 or 1), or a string.
pub(super) fn json_indent(indent: &Value) -> Result<Option<String>, minijinja::Error> {
    match indent.kind() {
        ValueKind::None | ValueKind::Undefined => Ok(None),
        ValueKind::String => Ok(Some(indent.as_str().unwrap_or("").to_string())),
        ValueKind::Bool => Ok(Some(if indent.is_true() { " " } else { "" }.to_string())),
        ValueKind::Number if indent.is_integer() => {
            let spaces = indent.as_i64().unwrap_or(0).max(0) as usize;
            Ok(Some(" ".repeat(spaces)))
        }
        _ => Err(invalid(format!("tojson's indent cannot be {indent}"))),
    }
}

pub(super) fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&json_float(as_f64(value))),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or(""), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_container(out, ('[', ']'), items.len(), style, depth, |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                entries.push((json_key(&key)?, value.get_item(&key)?));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_json_container(out, ('{', '}'), entries.len(), style, depth, |out, i| {
                write_json_string(out, &entries[i].0, style.ensure_ascii);
                out.push_str(&style.key_separator);
                write_json(out, &entries[i].1, style, depth + 1)
            })?;
        }
        kind => {
            return Err(invalid(format!(
                "Object of type {kind} is not JSON serializable"
            )))
        }
    }
    Ok(())
}

/// Brackets around `len` items, laid out as `json.dumps` does with and without `indent`.
pub(super) fn write_json_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &JsonStyle,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), minijinja::Error>,
) -> Result<(), minijinja::Error> {
    out.push(open);
    if len > 0 {
        let newline = |level: usize| {
            style
                .indent
                .as_ref()
                .map(|unit| format!("\n{}", unit.repeat(level)))
        };
        let inner = newline(depth + 1).unwrap_or_default();
        out.push_str(&inner);
        for i in 0..len {
            if i > 0 {
                out.push_str(&style.item_separator);
                out.push_str(&inner);
            }
            item(out, i)?;
        }
        out.push_str(&newline(depth).unwrap_or_default());
    }
    out.push(close);
    Ok(())
}

/// A key as `json.dumps` turns it into a string.
pub(super) fn json_key(key: &Value) -> Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(json_float(as_f64(key))),
        kind => Err(invalid(format!(
            "keys must be str, int, float, bool or None, not {kind}"
        ))),
    }
}

pub(super) fn json_float(x: f64) -> String {
    match python_float(x).as_str() {
        "nan" => "NaN".into(),
        "inf" => "Infinity".into(),
        "-inf" => "-Infinity".into(),
        other => other.into(),
    }
}

/// A JSON string as Python writes it: control characters escaped (lowercase hex), and with
/// `ensure_ascii` everything outside printable ASCII as `\uXXXX` (surrogate pairs above U+FFFF).
pub(super) fn write_json_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
