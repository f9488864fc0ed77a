//! The fields of a config that say nothing about what is computed: token ids, provenance, the
//! dtype the weights were stored in (the precision is a knob of ours), inference caches, and
//! generation and fine-tuning-head settings that a causal language model's training step never
//! reads. They are not used, but each must still hold the kind of value `transformers` writes
//! there: one that does not is a damaged or hand-edited config, and says so early.

use serde_json::Value;

use super::invalid;
use crate::Result;

/// The kind of value a descriptive field holds (or `null`, which `transformers` writes for
/// any unset field).
#[derive(Debug, Clone, Copy)]
enum Holds {
    /// A string.
    Text,
    /// `true` or `false`.
    Flag,
    /// A whole number.
    Count,
    /// A finite number, at least 0.
    Number,
    /// A token id or a list of them.
    TokenIds,
    /// A list of strings.
    Texts,
    /// An object (its contents are another tool's).
    Object,
}

/// The descriptive fields ([`super::family`] reads `architectures` and `model_type`).
const DESCRIPTIVE: [(&str, Holds); 22] = [
    ("architectures", Holds::Texts),
    ("model_type", Holds::Text),
    ("_name_or_path", Holds::Text),
    ("transformers_version", Holds::Text),
    ("torch_dtype", Holds::Text),
    ("dtype", Holds::Text),
    ("bos_token_id", Holds::TokenIds),
    ("eos_token_id", Holds::TokenIds),
    ("pad_token_id", Holds::TokenIds),
    ("use_cache", Holds::Flag),
    ("initializer_range", Holds::Number),
    ("task_specific_params", Holds::Object),
    ("summary_type", Holds::Text),
    ("summary_use_proj", Holds::Flag),
    ("summary_activation", Holds::Text),
    ("summary_proj_to_labels", Holds::Flag),
    ("summary_first_dropout", Holds::Number),
    ("n_ctx", Holds::Count),
    ("max_window_layers", Holds::Count),
    ("is_llama_config", Holds::Flag),
    ("keys_to_ignore_at_inference", Holds::Texts),
    ("id2label", Holds::Object),
];

/// Whether `key` is a descriptive field.
pub(super) fn is_descriptive(key: &str) -> bool {
    DESCRIPTIVE.iter().any(|(k, _)| *k == key)
}

/// Checks descriptive field `key`'s `value` is of its kind; any other key passes.
pub(super) fn check(key: &str, value: &Value) -> Result<()> {
    let Some((_, holds)) = DESCRIPTIVE.iter().find(|(k, _)| *k == key) else {
        return Ok(());
    };
    let count = |v: &Value| v.as_u64().is_some();
    let ok = value.is_null()
        || match holds {
            Holds::Text => value.is_string(),
            Holds::Flag => value.is_boolean(),
            Holds::Count => count(value),
            Holds::Number => value.as_f64().is_some_and(|x| x >= 0.0 && x.is_finite()),
            Holds::TokenIds => {
                count(value) || value.as_array().is_some_and(|ids| ids.iter().all(count))
            }
            Holds::Texts => value
                .as_array()
                .is_some_and(|items| items.iter().all(Value::is_string)),
            Holds::Object => value.is_object(),
        };
    if ok {
        return Ok(());
    }
    let kind = match holds {
        Holds::Text => "a string",
        Holds::Flag => "true or false",
        Holds::Count => "a whole number",
        Holds::Number => "a number, at least 0",
        Holds::TokenIds => "a token id (a whole number) or a list of them",
        Holds::Texts => "a list of strings",
        Holds::Object => "an object",
    };
    Err(invalid(key, format!("({value}) must be {kind}, or null")))
}
