//! Chat templates: a model's Jinja template rendered byte for byte as `transformers`'
//! `apply_chat_template` renders it, and the spans of the assistant's replies in the result (the
//! text the loss trains on).
//!
//! A template sees what `transformers` passes it: `messages`, `add_generation_prompt`, `tools`
//! and `documents` (none), the tokenizer's special tokens (`bos_token`, `eos_token`, …), and what
//! `transformers` adds to Jinja: `raise_exception`, `strftime_now`, loop controls, and its own
//! `tojson` (Python's `json.dumps`, without Jinja's HTML escaping). Python's string and dict
//! methods (`.strip()`, `.split()`, `.items()`) come from `minijinja-contrib`. Whitespace follows
//! `transformers`' settings (`trim_blocks`, `lstrip_blocks`), and values print as Python prints
//! them (`None`, `True`, `1e+16`). `strftime_now` formats the current instant in UTC
//! (`transformers` uses the machine's local time: the same on machines that run in UTC).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, UndefinedBehavior, Value};

use crate::{Error, Result};

/// The context key holding the render's instant for `strftime_now`: not an identifier, so no
/// template can read or shadow it.
const NOW: &str = "autotune:now";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// Who speaks: `system`, `user` or `assistant` (a template may accept others, such as `tool`).
    pub role: String,
    /// What they say.
    pub content: String,
}

impl Message {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template, parsed and ready to render conversations.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    tokens: BTreeMap<String, String>,
    clock: Option<SystemTime>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("tokens", &self.tokens)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The folder's template as `transformers` finds it: `chat_template.jinja` beside the
    /// tokenizer wins, else `chat_template` in `tokenizer_config.json` (a string, or a list of
    /// `{name, template}`: the `default` one); `None` when the folder has none. The config's
    /// special tokens (`bos_token`, `eos_token`, …, strings or objects with `content`) are the
    /// template's variables as `transformers` passes them.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_object(&config_path)?;
        let tokens = special_tokens(dir, config.as_ref())?;
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .map_err(|e| Error::file("cannot read", &jinja, e))?;
            return Self::build(&source, jinja.display().to_string(), tokens).map(Some);
        }
        let found = config.as_ref().and_then(|c| c.get("chat_template"));
        let Some(found) = found.filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let origin = format!("{} (its chat_template)", config_path.display());
        let source = config_template(found, &origin)?;
        Self::build(&source, origin, tokens).map(Some)
    }

    /// A template from its text, with the special tokens it sees (`bos_token` → `<s>`, …).
    pub fn from_source(source: &str, tokens: BTreeMap<String, String>) -> Result<Self> {
        Self::build(source, "the given chat template".into(), tokens)
    }

    /// The same template with `strftime_now` reading `now` instead of the system clock.
    pub fn with_clock(mut self, now: SystemTime) -> Self {
        self.clock = Some(now);
        self
    }

    /// Where the template came from (its file), as errors name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The special tokens the template sees, by name.
    pub fn tokens(&self) -> &BTreeMap<String, String> {
        &self.tokens
    }

    /// The conversation as the model reads it; with `add_generation_prompt`, followed by what
    /// opens the assistant's next turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_at(messages, add_generation_prompt, self.now())
    }

    /// The rendered conversation and, for each assistant message, the byte range of the text
    /// that message adds after the prompt for it (its content and its end-of-turn token: what
    /// the loss trains on), found by rendering the conversation up to each assistant turn with
    /// and without it (the prefix must be a prefix of the whole; a template for which it is
    /// not is an error naming why).
    pub fn render_with_assistant_spans(
        &self,
        messages: &[Message],
    ) -> Result<(String, Vec<Range<usize>>)> {
        // One instant for every rendering, so that a date in the template cannot change between
        // the prefixes and the whole.
        let now = self.now();
        let whole = self.render_at(messages, false, now)?;
        let mut spans = Vec::new();
        for (i, _) in messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.role == "assistant")
        {
            let prompt = self.render_at(&messages[..i], true, now)?;
            let turn = self.render_at(&messages[..=i], false, now)?;
            if !turn.starts_with(&prompt) {
                return Err(self.error(format!(
                    "cannot find the span of message {i} (assistant): the conversation before it, \
                     rendered with the generation prompt, is not how the conversation with it \
                     begins; the template renders the turns before a reply differently once the \
                     reply follows (as templates that put the system message into the last user \
                     turn do), or opens a reply otherwise than its generation prompt does"
                )));
            }
            if !whole.starts_with(&turn) {
                return Err(self.error(format!(
                    "cannot find the span of message {i} (assistant): the conversation up to it \
                     is not how the whole conversation begins; the template renders earlier \
                     turns differently once later ones follow (as templates that put the system \
                     message into the last user turn do)"
                )));
            }
            spans.push(prompt.len()..turn.len());
        }
        Ok((whole, spans))
    }

    fn build(source: &str, origin: String, tokens: BTreeMap<String, String>) -> Result<Self> {
        let mut env = environment();
        env.add_template_owned(origin.clone(), without_generation_tags(source).into_owned())
            .map_err(|e| {
                template_error(
                    &origin,
                    format!("the chat template does not parse: {}", describe(&e)),
                )
            })?;
        Ok(Self {
            env,
            origin,
            tokens,
            clock: None,
        })
    }

    fn now(&self) -> i64 {
        let now = self.clock.unwrap_or_else(SystemTime::now);
        match now.duration_since(UNIX_EPOCH) {
            Ok(after) => after.as_secs() as i64,
            Err(before) => -(before.duration().as_secs() as i64),
        }
    }

    fn render_at(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        now: i64,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(&self.origin)
            .map_err(|e| self.error(describe(&e)))?;
        template
            .render(self.context(messages, add_generation_prompt, now))
            .map_err(|e| match raised(&e) {
                Some(message) => {
                    self.error(format!("the chat template raised an error: {message}"))
                }
                None => self.error(format!(
                    "the chat template cannot render the conversation: {}",
                    describe(&e)
                )),
            })
    }

    /// What `transformers` passes: the special tokens, then the conversation and the options.
    fn context(&self, messages: &[Message], add_generation_prompt: bool, now: i64) -> Value {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())])
            })
            .collect();
        let mut pairs: Vec<(&str, Value)> = self
            .tokens
            .iter()
            .map(|(name, token)| (name.as_str(), Value::from(token.as_str())))
            .collect();
        pairs.extend([
            ("messages", Value::from(messages)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            (NOW, Value::from(now)),
        ]);
        Value::from_pairs(pairs)
    }

    fn error(&self, problem: String) -> Error {
        template_error(&self.origin, problem)
    }
}

fn template_error(origin: &str, problem: String) -> Error {
    Error::Data {
        source_name: origin.to_string(),
        problem,
    }
}

/// The message of the template's own `raise_exception`, if that is what `err` is.
fn raised(err: &minijinja::Error) -> Option<&str> {
    use std::error::Error as _;
    let from_template = err.source().is_some_and(|s| s.is::<Raised>());
    from_template.then(|| err.detail().unwrap_or(""))
}

/// An engine error for people: what is wrong, and on which line of the template.
fn describe(err: &minijinja::Error) -> String {
    use std::error::Error as _;
    let mut text = err.kind().to_string();
    if let Some(detail) = err.detail() {
        text = format!("{text}: {detail}");
    }
    if let Some(line) = err.line() {
        text = format!("{text} (line {line})");
    }
    if let Some(cause) = err.source() {
        text = format!("{text}: {cause}");
    }
    text
}

/// Jinja as `transformers` configures it for chat templates.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    // Rendered text is model input, never HTML, whatever the template's file is called.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_formatter(python_formatter);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// Marks an error as the template's own `raise_exception`.
#[derive(Debug)]
struct Raised;

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("raised by the chat template")
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.to_string()).with_source(Raised))
}

/// `datetime.now().strftime(format)`, at the render's instant (UTC).
fn strftime_now(state: &State, format: &str) -> Result<String, minijinja::Error> {
    let now = state.lookup(NOW).and_then(|v| v.as_i64()).unwrap_or(0);
    strftime(format, &Moment::utc(now))
        .map_err(|problem| minijinja::Error::new(ErrorKind::InvalidOperation, problem))
}

/// Prints floats as Python's `str` does (`1e+16`, `1e-05`); the engine already prints `None`,
/// `True` and the rest as Python does.
fn python_formatter(
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

fn as_f64(value: &Value) -> f64 {
    f64::try_from(value.clone()).unwrap_or(f64::NAN)
}

/// Python's `repr` of a float: the shortest digits that read back, in positional notation for
/// exponents from -4 to 15 and scientific (`1e+16`, `1e-05`) outside.
fn python_float(x: f64) -> String {
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
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// `transformers`' `tojson` filter: Python's `json.dumps`, not Jinja's HTML-safe one.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<String, minijinja::Error> {
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

fn invalid(problem: impl Into<String>) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, problem.into())
}

/// `indent` as Python takes it: none, a number of spaces (a bool counts as 0 or 1), or a string.
fn json_indent(indent: &Value) -> Result<Option<String>, minijinja::Error> {
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

fn write_json(
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
fn write_json_container(
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
fn json_key(key: &Value) -> Result<String, minijinja::Error> {
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

fn json_float(x: f64) -> String {
    match python_float(x).as_str() {
        "nan" => "NaN".into(),
        "inf" => "Infinity".into(),
        "-inf" => "-Infinity".into(),
        other => other.into(),
    }
}

/// A JSON string as Python writes it: control characters escaped (lowercase hex), and with
/// `ensure_ascii` everything outside printable ASCII as `\uXXXX` (surrogate pairs above U+FFFF).
fn write_json_string(out: &mut String, text: &str, ensure_ascii: bool) {
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

/// `transformers` adds a `{% generation %}` block that marks assistant text and renders its
/// body unchanged; an `{% if true %}` block renders the same, with the same whitespace control.
fn without_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}").map(|e| e + 2) else {
            break;
        };
        let inner = &tag[2..end - 2];
        let open = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let close = inner
            .strip_suffix(['-', '+'])
            .map_or("", |_| &inner[inner.len() - 1..]);
        let word = inner[open.len()..inner.len() - close.len()].trim();
        match word {
            "generation" => out.push_str(&format!("{{%{open} if true {close}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open} endif {close}%}}")),
            _ => out.push_str(&tag[..end]),
        }
        rest = &tag[end..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// The template in a config's `chat_template`: a string, or the `default` of a named list.
fn config_template(found: &serde_json::Value, origin: &str) -> Result<String> {
    if let Some(source) = found.as_str() {
        return Ok(source.to_string());
    }
    let Some(list) = found.as_array() else {
        return Err(template_error(
            origin,
            "chat_template is neither a string nor a list of {name, template}".into(),
        ));
    };
    let name =
        |entry: &serde_json::Value| entry.get("name").and_then(|n| n.as_str()).map(String::from);
    let default = list
        .iter()
        .find(|entry| name(entry).as_deref() == Some("default"));
    match default
        .and_then(|entry| entry.get("template"))
        .and_then(|t| t.as_str())
    {
        Some(source) => Ok(source.to_string()),
        None => {
            let names: Vec<String> = list.iter().filter_map(name).collect();
            Err(template_error(
                origin,
                format!(
                    "chat_template names templates ({}) but none `default` with a template, \
                     which transformers would use",
                    names.join(", ")
                ),
            ))
        }
    }
}

/// The special tokens `transformers` passes a template: the config's `*_token` entries (the
/// standard ones and a model's own, such as `image_token`) and its `extra_special_tokens`; the
/// older `special_tokens_map.json` overrides them when the config has no `added_tokens_decoder`,
/// as `transformers` reads it then.
fn special_tokens(
    dir: &Path,
    config: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<BTreeMap<String, String>> {
    let mut tokens = BTreeMap::new();
    if let Some(config) = config {
        collect_tokens(config, &mut tokens);
    }
    if config.is_none_or(|c| !c.contains_key("added_tokens_decoder")) {
        if let Some(legacy) = read_json_object(&dir.join("special_tokens_map.json"))? {
            collect_tokens(&legacy, &mut tokens);
        }
    }
    Ok(tokens)
}

fn collect_tokens(
    entries: &serde_json::Map<String, serde_json::Value>,
    tokens: &mut BTreeMap<String, String>,
) {
    let extra = entries
        .get("extra_special_tokens")
        .and_then(|e| e.as_object());
    let named = entries.iter().filter(|(key, _)| key.ends_with("_token"));
    for (key, value) in named.chain(extra.into_iter().flatten()) {
        // A token is a string or an `AddedToken` object; `null` unsets it.
        let content = value
            .as_str()
            .or_else(|| value.get("content").and_then(|c| c.as_str()));
        match content {
            Some(content) => {
                tokens.insert(key.clone(), content.to_string());
            }
            None if value.is_null() => {
                tokens.remove(key);
            }
            None => {}
        }
    }
}

fn read_json_object(path: &Path) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::file("cannot read", path, e))?;
    match serde_json::from_str(&text).map_err(|e| Error::file("cannot parse", path, e))? {
        serde_json::Value::Object(map) => Ok(Some(map)),
        _ => Err(Error::file("cannot use", path, "it is not a JSON object")),
    }
}

/// A UTC calendar instant, for `strftime_now`.
struct Moment {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// Monday is 0.
    weekday: usize,
    /// January 1st is 1.
    year_day: u32,
}

impl Moment {
    fn utc(unix_seconds: i64) -> Self {
        let days = unix_seconds.div_euclid(86_400);
        let seconds = unix_seconds.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        Self {
            year,
            month,
            day,
            hour: seconds / 3600,
            minute: seconds / 60 % 60,
            second: seconds % 60,
            // 1970-01-01 was a Thursday.
            weekday: (days + 3).rem_euclid(7) as usize,
            year_day: (days - days_from_civil(year, 1, 1) + 1) as u32,
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (i64::from(month) + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date `days` after 1970-01-01, as (year, month, day).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month as u32, day)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C's `strftime` in the C locale, for the directives dates in templates use; glibc's `-` flag
/// (`%-d`) drops the padding.
fn strftime(format: &str, t: &Moment) -> std::result::Result<String, String> {
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let unpadded = directive == Some('-');
        if unpadded {
            directive = chars.next();
        }
        let Some(directive) = directive else {
            return Err(format!("strftime_now's format `{format}` ends in `%`"));
        };
        match directive {
            'F' => out.push_str(&strftime("%Y-%m-%d", t)?),
            'T' => out.push_str(&strftime("%H:%M:%S", t)?),
            '%' => out.push('%'),
            'a' => out.push_str(&WEEKDAYS[t.weekday][..3]),
            'A' => out.push_str(WEEKDAYS[t.weekday]),
            'b' | 'h' => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            'B' => out.push_str(MONTHS[t.month as usize - 1]),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'Y' => out.push_str(&t.year.to_string()),
            other => {
                let (number, width, pad) = strftime_number(other, t)
                    .ok_or_else(|| format!("strftime_now does not support `%{other}`"))?;
                if unpadded {
                    out.push_str(&number.to_string());
                } else {
                    out.push_str(&format!("{number:>width$}").replace(' ', pad));
                }
            }
        }
    }
    Ok(out)
}

/// A numeric directive's value, width and padding.
fn strftime_number(directive: char, t: &Moment) -> Option<(i64, usize, &'static str)> {
    let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
    Some(match directive {
        'd' => (i64::from(t.day), 2, "0"),
        'e' => (i64::from(t.day), 2, " "),
        'm' => (i64::from(t.month), 2, "0"),
        'y' => (t.year.rem_euclid(100), 2, "0"),
        'H' => (i64::from(t.hour), 2, "0"),
        'I' => (i64::from(hour12), 2, "0"),
        'M' => (i64::from(t.minute), 2, "0"),
        'S' => (i64::from(t.second), 2, "0"),
        'j' => (i64::from(t.year_day), 3, "0"),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let tokens = BTreeMap::from([
            ("bos_token".to_string(), "<s>".to_string()),
            ("eos_token".to_string(), "</s>".to_string()),
        ]);
        ChatTemplate::from_source(source, tokens).unwrap()
    }

    fn render(source: &str) -> String {
        template(source)
            .render(&[Message::new("user", "hi")], false)
            .unwrap()
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (x, python) in cases {
            assert_eq!(python_float(x), python, "{x}");
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let source = r#"{{ {"b": [1, 2.0, none, true], "a": "é\"\n<"} | tojson }}"#;
        assert_eq!(
            render(source),
            r#"{"b": [1, 2.0, null, true], "a": "é\"\n<"}"#
        );
        let sorted = r#"{{ {"b": 1, "a": {"c": []}} | tojson(indent=2, sort_keys=true) }}"#;
        assert_eq!(
            render(sorted),
            "{\n  \"a\": {\n    \"c\": []\n  },\n  \"b\": 1\n}"
        );
        let ascii = r#"{{ "é😀\u007f" | tojson(ensure_ascii=true) }}"#;
        assert_eq!(render(ascii), r#""\u00e9\ud83d\ude00\u007f""#);
        let compact = r#"{{ [1, {"a": 2}] | tojson(separators=(",", ":")) }}"#;
        assert_eq!(render(compact), r#"[1,{"a":2}]"#);
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let printed =
            render("{{ none }} {{ true }} {{ false }} {{ 2.5 }} {{ 3 }} {{ 1e16 }} {{ 0.00001 }}");
        assert_eq!(printed, "None True False 2.5 3 1e+16 1e-05");
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let source = "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}\
                      {{ m.content.strip().title() }}|{{ m.content.split(',')[1] }}\
                      {% if m.content.startswith(' x') %}!{% endif %}{% break %}{% endfor %}";
        let t = template(source);
        let messages = [Message::new("user", "skip"), Message::new("user", " x, y ")];
        assert_eq!(t.render(&messages, false).unwrap(), "X, Y| y !");
    }

    #[test]
    fn strftime_now_reads_the_injected_clock() {
        // 2025-03-05 14:30:07 UTC, a Wednesday.
        let now = UNIX_EPOCH + std::time::Duration::from_secs(1_741_185_007);
        let t =
            template(r#"{{ strftime_now("%d %b %Y|%-d %B %y|%A %a %j|%I:%M:%S %p|%F %T %e%%") }}"#)
                .with_clock(now);
        let out = t.render(&[], false).unwrap();
        assert_eq!(
            out,
            "05 Mar 2025|5 March 25|Wednesday Wed 064|02:30:07 PM|2025-03-05 14:30:07  5%"
        );
        assert!(template("{{ strftime_now('%Q') }}")
            .render(&[], false)
            .is_err());
    }

    #[test]
    fn civil_dates_round_trip() {
        for days in [-719_468, -1, 0, 59, 10_957, 11_016, 20_152, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let source = "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}\n{% endfor %}";
        assert_eq!(render(source), "[hi]");
        assert_eq!(
            without_generation_tags("{% if generation %}x{% endif %}"),
            "{% if generation %}x{% endif %}"
        );
    }

    #[test]
    fn special_tokens_come_from_strings_objects_and_extras() {
        let config = serde_json::json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>"},
            "eos_token": "</s>",
            "pad_token": null,
            "add_bos_token": true,
            "image_token": "<image>",
            "extra_special_tokens": {"video_token": "<video>"},
        });
        let mut tokens = BTreeMap::new();
        collect_tokens(config.as_object().unwrap(), &mut tokens);
        let names: Vec<_> = tokens.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(
            names,
            [
                "bos_token=<s>",
                "eos_token=</s>",
                "image_token=<image>",
                "video_token=<video>"
            ]
        );
    }

    #[test]
    fn a_template_that_moves_earlier_turns_has_no_spans() {
        // Mistral's later templates put the system message into the last user turn.
        let source = "{% for m in messages %}{% if m.role == 'user' %}[INST] \
                      {% if loop.last and messages[0].role == 'system' %}{{ messages[0].content }} {% endif %}\
                      {{ m.content }}[/INST]{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}";
        let messages = [
            Message::new("system", "sys"),
            Message::new("user", "a"),
            Message::new("assistant", "b"),
            Message::new("user", "c"),
            Message::new("assistant", "d"),
        ];
        let err = template(source)
            .render_with_assistant_spans(&messages)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("message 2 (assistant)") && err.contains("system message"),
            "{err}"
        );
    }

    #[test]
    fn a_config_list_without_default_is_refused() {
        let list = serde_json::json!([{"name": "tool_use", "template": "x"}]);
        let err = config_template(&list, "cfg").unwrap_err().to_string();
        assert!(err.contains("tool_use") && err.contains("default"), "{err}");
    }
}
