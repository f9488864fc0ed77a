//! A spec's errors in the terms of the config it was read from: [`ModelSpec::validate`] names
//! our fields (`d_model`, `positions.rotary.theta`), and a user who wrote `hidden_size` must
//! be told about `hidden_size`.
//!
//! [`ModelSpec::validate`]: crate::spec::model::ModelSpec::validate

use serde_json::{Map, Value};

use super::{Family, WHAT};
use crate::Error;

/// Our field and the key a decoder's config (Llama, Qwen 2, Mistral) sets it with.
const DECODER: [(&str, &str); 8] = [
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("n_layers", "num_hidden_layers"),
    ("d_ff", "intermediate_size"),
    ("seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"),
];

/// Our field and the key a GPT-2 config sets it with.
const GPT2: [(&str, &str); 7] = [
    ("vocab_size", "vocab_size"),
    ("d_model", "n_embd"),
    ("n_heads", "n_head"),
    ("n_layers", "n_layer"),
    ("d_ff", "n_inner"),
    ("seq_len", "n_positions"),
    ("norm_eps", "layer_norm_epsilon"),
];

/// `error` (from validating the spec read from `config`, of `family`) with our field names,
/// in its field and its text, replaced by the config's keys.
pub(super) fn in_config_terms(error: Error, family: Family, config: &Map<String, Value>) -> Error {
    let Error::InvalidSpec { field, problem, .. } = error else {
        return error;
    };
    let mut terms: Vec<(&str, &str)> = match family {
        Family::Gpt2 => GPT2.to_vec(),
        Family::Llama | Family::Qwen2 | Family::Mistral => DECODER.to_vec(),
    };
    let parameters = config.get("rope_parameters").filter(|p| !p.is_null());
    let theta = match parameters {
        Some(p) if p.get("rope_theta").is_some() => "rope_parameters.rope_theta",
        _ => "rope_theta",
    };
    let scaling = match parameters {
        Some(_) => "rope_parameters",
        None => "rope_scaling",
    };
    terms.extend([
        ("positions.rotary.theta", theta),
        ("positions.rotary.scaling", scaling),
        // The only rotary check of the whole: the head width, hidden_size / num_attention_heads.
        ("positions.rotary", "head_dim"),
        ("dropout", "resid_pdrop"),
        ("name", "_name_or_path"),
    ]);
    let key = terms
        .iter()
        .find(|(ours, _)| *ours == field)
        .map_or(field.as_str(), |(_, theirs)| theirs);
    Error::invalid(WHAT, key, rename_words(&problem, &terms))
}

/// `text` with every word (a run of letters, digits, `_` and `.`) that is one of `terms`' first
/// names replaced by its second.
fn rename_words(text: &str, terms: &[(&str, &str)]) -> String {
    let is_word = |c: char| c.is_alphanumeric() || c == '_' || c == '.';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(is_word) {
        out.push_str(&rest[..start]);
        let len = rest[start..]
            .find(|c| !is_word(c))
            .unwrap_or(rest.len() - start);
        let word = &rest[start..start + len];
        // A sentence's full stop is no part of the word before it.
        let bare = word.trim_end_matches('.');
        match terms.iter().find(|(ours, _)| *ours == bare) {
            Some((_, theirs)) => {
                out.push_str(theirs);
                out.push_str(&word[bare.len()..]);
            }
            None => out.push_str(word),
        }
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_field_names_become_the_configs_keys_in_the_field_and_the_text() {
        let error = Error::invalid(
            "model spec",
            "n_heads",
            "(7) must divide d_model (64); try 8. Not d_model_x",
        );
        match in_config_terms(error, Family::Llama, &Map::new()) {
            Error::InvalidSpec {
                what,
                field,
                problem,
            } => {
                assert_eq!(what, WHAT);
                assert_eq!(field, "num_attention_heads");
                assert_eq!(
                    problem,
                    "(7) must divide hidden_size (64); try 8. Not d_model_x"
                );
            }
            other => panic!("{other:?}"),
        }
        let error = Error::invalid("model spec", "d_model", "d_model.");
        match in_config_terms(error, Family::Gpt2, &Map::new()) {
            Error::InvalidSpec { field, problem, .. } => {
                assert_eq!((field.as_str(), problem.as_str()), ("n_embd", "n_embd."))
            }
            other => panic!("{other:?}"),
        }
    }
}
