//! The `--model` flag of every command: a preset name from the core's one registry
//! ([`PRESETS`]), which its help and the shell completions list, or a path to a spec file.

use std::ffi::OsStr;

use clap::builder::{PossibleValue, TypedValueParser};

use crate::spec::model::PRESETS;

/// Parses `--model`: any name or path is taken as it is (a path is only read when the
/// command resolves it), while the presets are offered as its possible values, so that
/// `--help` and the completion scripts list every one of them.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelName;

impl TypedValueParser for ModelName {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<String, clap::Error> {
        clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(PRESETS.iter().map(PossibleValue::new)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_offered_and_any_path_is_taken() {
        let offered: Vec<String> = ModelName
            .possible_values()
            .unwrap()
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(offered, PRESETS.map(String::from).to_vec());
        let cmd = clap::Command::new("t");
        let parsed = ModelName
            .parse_ref(&cmd, None, OsStr::new("models/llama/config.json"))
            .unwrap();
        assert_eq!(parsed, "models/llama/config.json");
    }
}
