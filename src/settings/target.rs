//! The model and the machine planned for: the flags `tune`, `run` and `estimate` share.

use clap::Args;

use super::flags;
use super::model::ModelName;
use crate::spec::device::DeviceSpec;
use crate::Result;

/// A training sequence length: a number of tokens, or `auto`, the longest the target fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqLen {
    /// This many tokens.
    Tokens(usize),
    /// The longest sequence the target fits, found by trials (`tune` and `run`).
    Auto,
}

/// Parses `--seq-len`: `auto`, or a number of tokens from 1 to 2^20.
pub fn parse_seq_len(text: &str) -> std::result::Result<SeqLen, String> {
    if text == "auto" {
        return Ok(SeqLen::Auto);
    }
    match text.parse::<usize>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(SeqLen::Tokens(n)),
        _ => Err(format!(
            "`{text}` is no sequence length: give a number of tokens from 1 to 1048576, or auto"
        )),
    }
}

/// `--model` and `--target` (and `--target`'s earlier name).
#[derive(Debug, Clone, Args)]
pub struct TargetArgs {
    /// Model: a preset, a JSON spec file, a Hugging Face `config.json`, or a Hugging Face model
    /// folder (its config, and its weights to start from).
    #[arg(long, default_value = "tiny", value_parser = ModelName)]
    pub model: String,
    /// Train on sequences of N tokens (default: the model's length: its preset's, or its
    /// config's `max_position_embeddings` up to 2048). With --data, the longest a sequence may
    /// be: longer examples are cut or dropped (--truncate). `auto` (tune and run): the longest
    /// sequence the target fits, found by trials, then the fastest plan at that length.
    #[arg(long, value_name = "N|auto", value_parser = parse_seq_len)]
    pub seq_len: Option<SeqLen>,
    /// Target machine: auto (this machine's GPU, else the CPU), a built-in profile
    /// (rtx4090-32g, h200, cpu) or a JSON profile file. A smaller GPU is emulated on a larger one.
    #[arg(long, default_value = "auto")]
    pub target: String,
    /// The target machine, by its earlier name (now `--target`; `--device` names the device
    /// to run on in `train`, `probe` and `check`).
    #[arg(long, hide = true, conflicts_with = "target")]
    pub device: Option<String>,
}

impl TargetArgs {
    /// The model, at the sequence length asked for (`auto`: the model's own, where the search
    /// for the longest starts).
    pub fn model_spec(&self) -> Result<crate::spec::model::ModelSpec> {
        let tokens = match self.seq_len {
            Some(SeqLen::Tokens(n)) => Some(n),
            Some(SeqLen::Auto) | None => None,
        };
        super::model::resolve_model(&self.model, tokens)
    }

    /// Whether `--seq-len auto` asks for the longest sequence the target fits.
    pub fn longest_asked(&self) -> bool {
        self.seq_len == Some(SeqLen::Auto)
    }

    /// The target machine, under its new name or its old one.
    pub fn name(&self) -> &str {
        self.device.as_deref().unwrap_or(&self.target)
    }

    /// The target machine's spec: `auto` (the local GPU, or the built-in CPU profile), a
    /// built-in name, or a JSON file.
    pub fn spec(&self) -> Result<DeviceSpec> {
        let name = self.name();
        if name != "auto" {
            return Ok(DeviceSpec::resolve(name)?);
        }
        match crate::backend::detect_gpu_profile()? {
            Some(profile) => Ok(profile),
            None => Ok(DeviceSpec::builtin("cpu")?),
        }
    }

    /// The note the old name leaves, when it was used.
    pub fn note(&self) -> Option<String> {
        self.device
            .as_ref()
            .map(|_| flags::renamed("--device", "--target"))
    }
}
