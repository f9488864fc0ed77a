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
use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value};

use crate::{Error, Result};
use python::{python_formatter, raise_exception, tojson, Raised};
use time::strftime_now;

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
            let source =
                crate::input_file::read_to_string(&jinja, crate::input_file::DOCUMENT_LIMIT)
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
    let text = crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT)
        .map_err(|e| Error::file("cannot read", path, e))?;
    match serde_json::from_str(&text).map_err(|e| Error::file("cannot parse", path, e))? {
        serde_json::Value::Object(map) => Ok(Some(map)),
        _ => Err(Error::file("cannot use", path, "it is not a JSON object")),
    }
}

mod python;
mod time;

#[cfg(test)]
mod tests;
