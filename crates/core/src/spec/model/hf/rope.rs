//! A decoder config's rotary settings: `rope_theta` and `rope_scaling`, or `rope_parameters`
//! (the newer spelling of both in one object).
//!
//! Every key of the settings is read or refused: a `rope_type` autotune does not compute, a
//! key it would not honour, or settings of the wrong type would otherwise train with other
//! frequencies than the model's own.

use serde_json::{Map, Value};

use super::{invalid, Fields};
use crate::spec::model::{Rope, RopeScaling};
use crate::text::escape_controls;
use crate::Result;

/// The base `transformers` uses when a config gives none.
const DEFAULT_THETA: f64 = 10_000.0;

/// Llama 3's keys, each required (as `transformers`' `_validate_llama3_parameters` has them).
const LLAMA3_KEYS: [&str; 4] = [
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];

/// The rotary settings of a decoder's config.
pub(super) fn rope(f: &mut Fields<'_>) -> Result<Rope> {
    let top_theta = f.opt_f64("rope_theta")?;
    let settings = match (f.value("rope_scaling"), f.value("rope_parameters")) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "rope_parameters",
                "is given beside rope_scaling; both spell the same settings, so keep one",
            ))
        }
        (Some(s), None) => Some(("rope_scaling", s)),
        (None, Some(p)) => Some(("rope_parameters", p)),
        (None, None) => None,
    };
    let Some((key, settings)) = settings else {
        return Ok(Rope {
            theta: top_theta.unwrap_or(DEFAULT_THETA),
            scaling: None,
        });
    };
    let object = settings.as_object().ok_or_else(|| {
        invalid(
            key,
            format!(
                "({settings}) must be an object such as {{\"rope_type\": \"default\"}}, or null"
            ),
        )
    })?;
    let theta = match (key, object.get("rope_theta")) {
        ("rope_parameters", Some(t)) => Some(nested_theta(t, top_theta)?),
        _ => top_theta,
    };
    Ok(Rope {
        theta: theta.unwrap_or(DEFAULT_THETA),
        scaling: scaling(key, object)?,
    })
}

/// `rope_parameters.rope_theta`: a number, and the same as a `rope_theta` beside it.
fn nested_theta(value: &Value, top: Option<f64>) -> Result<f64> {
    let field = "rope_parameters.rope_theta";
    let theta = value
        .as_f64()
        .ok_or_else(|| invalid(field, format!("({value}) must be a number")))?;
    match top {
        Some(t) if t != theta => Err(invalid(
            field,
            format!("({theta}) differs from rope_theta ({t}); keep one of them"),
        )),
        _ => Ok(theta),
    }
}

/// The frequency scaling the settings at `key` name: none for `default`, Llama 3's for
/// `llama3`; any other type, or a key the type does not take, is refused.
fn scaling(key: &str, object: &Map<String, Value>) -> Result<Option<RopeScaling>> {
    let kind = rope_type(key, object)?;
    let takes: &[&str] = match kind {
        "default" => &[],
        "llama3" => &LLAMA3_KEYS,
        other => {
            return Err(invalid(
                format!("{key}.rope_type"),
                format!(
                    "(`{}`) is not supported; autotune applies `default` and `llama3`",
                    escape_controls(other)
                ),
            ))
        }
    };
    // The base is read from `rope_parameters` only: in `rope_scaling` it would be ignored.
    let known = |k: &str| {
        takes.contains(&k)
            || matches!(k, "rope_type" | "type")
            || (k == "rope_theta" && key == "rope_parameters")
    };
    if let Some(unknown) = object.keys().find(|k| !known(k)) {
        return Err(invalid(
            format!("{key}.{}", escape_controls(unknown)),
            format!(
                "is not a setting of rope_type `{kind}`, which takes {}; remove it",
                if takes.is_empty() {
                    "none".to_string()
                } else {
                    takes.join(", ")
                }
            ),
        ));
    }
    if kind == "default" {
        return Ok(None);
    }
    let number = |name: &str| -> Result<f64> {
        let field = format!("{key}.{name}");
        match object.get(name) {
            None | Some(Value::Null) => Err(invalid(
                field,
                format!(
                    "is missing; rope_type `llama3` needs {}",
                    LLAMA3_KEYS.join(", ")
                ),
            )),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| invalid(field, format!("({v}) must be a number"))),
        }
    };
    let original = number("original_max_position_embeddings")?;
    let original = whole(original).ok_or_else(|| {
        invalid(
            format!("{key}.original_max_position_embeddings"),
            format!("({original}) must be a whole number of positions"),
        )
    })?;
    Ok(Some(RopeScaling {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_max_position_embeddings: original,
    }))
}

/// The settings' `rope_type` (or its older name `type`): a string, the same in both where both
/// are given.
fn rope_type<'a>(key: &str, object: &'a Map<String, Value>) -> Result<&'a str> {
    let as_text = |name: &str| -> Result<Option<&'a str>> {
        match object.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(invalid(
                format!("{key}.{name}"),
                format!("({v}) must be a string such as \"llama3\""),
            )),
        }
    };
    match (as_text("rope_type")?, as_text("type")?) {
        (Some(a), Some(b)) if a != b => Err(invalid(
            format!("{key}.type"),
            format!(
                "(`{}`) differs from rope_type (`{}`); keep one of them",
                escape_controls(b),
                escape_controls(a)
            ),
        )),
        (Some(t), _) | (None, Some(t)) => Ok(t),
        (None, None) => Err(invalid(
            format!("{key}.rope_type"),
            "is missing; give \"default\" or \"llama3\"",
        )),
    }
}

/// `x` as a count when it is a whole, non-negative number that fits one.
fn whole(x: f64) -> Option<usize> {
    (x.fract() == 0.0 && x >= 0.0 && x < u64::MAX as f64)
        .then(|| usize::try_from(x as u64).ok())
        .flatten()
}
