//! A model's own tokenizer, read from its Hugging Face files: `tokenizer.json` and, beside it,
//! `tokenizer_config.json`. A text becomes the ids `transformers`' fast tokenizer gives it, and a
//! document starts and ends with the special tokens the model was pretrained with.
//!
//! The special tokens are read as `transformers` reads them: `bos_token`, `eos_token` and
//! `pad_token` of the config (a string, or an object with `content`), looked up in the
//! tokenizer's vocabulary and added tokens. Whether a text starts with BOS is the choice of the
//! tokenizer's own post-processor, or of `add_bos_token: true` in the config.
//!
//! Decoding is the tokenizer's own decoder, as `transformers` decodes BPE models; the space
//! clean-up it applies to other models (`clean_up_tokenization_spaces`) is not done here.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// The config file `transformers` reads beside `tokenizer.json`.
const CONFIG_FILE: &str = "tokenizer_config.json";

/// A special token of the model: its text and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    /// The token as written in texts and in the config (`<s>`, `<|begin_of_text|>`).
    pub text: String,
    /// Its id in the vocabulary.
    pub id: u32,
}

/// A text as ids, with where each token came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoding {
    /// The token ids.
    pub ids: Vec<u32>,
    /// For each id, the byte range of the encoded text it stands for; a token that the text
    /// does not hold (an added BOS or EOS) has an empty range where it stands.
    pub offsets: Vec<(usize, usize)>,
}

/// A model's tokenizer, with its special tokens.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The `tokenizer.json` it was read from, for messages.
    path: PathBuf,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    pad: Option<SpecialToken>,
    adds_bos: bool,
    vocab_size: usize,
}

/// What `tokenizer_config.json` says about special tokens.
#[derive(Debug, Default, PartialEq)]
struct Config {
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    add_bos_token: bool,
    split_special_tokens: bool,
}

impl Tokenizer {
    /// Reads `tokenizer_json`, and the `tokenizer_config.json` beside it when there is one (without
    /// it, the tokenizer has no special tokens). A file that cannot be read or parsed, or a
    /// special token the config names that the vocabulary lacks, is an error naming the file.
    pub fn from_file(tokenizer_json: &Path) -> Result<Self> {
        let mut inner = read_tokenizer(tokenizer_json)?;
        let config_path = tokenizer_json.with_file_name(CONFIG_FILE);
        let config = read_config(&config_path)?;
        // `transformers` encodes whole texts unless a call asks otherwise, whatever truncation
        // or padding the file was saved with, and splits special tokens only when told to.
        inner
            .with_truncation(None)
            .map_err(|e| Error::file("cannot use tokenizer", tokenizer_json, e))?;
        inner.with_padding(None);
        inner.set_encode_special_tokens(config.split_special_tokens);
        let resolve = |field: &str, text: Option<String>| {
            text.map(|text| match inner.token_to_id(&text) {
                Some(id) => Ok(SpecialToken { text, id }),
                None => Err(Error::Usage(format!(
                    "tokenizer config `{}`: `{field}` is `{text}`, which is not in the \
                     vocabulary of `{}`",
                    config_path.display(),
                    tokenizer_json.display()
                ))),
            })
            .transpose()
        };
        let bos = resolve("bos_token", config.bos_token)?;
        let eos = resolve("eos_token", config.eos_token)?;
        let pad = resolve("pad_token", config.pad_token)?;
        let adds_bos = match &bos {
            Some(bos) => config.add_bos_token || post_processor_starts_with(&inner, bos.id)?,
            None => false,
        };
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().max().map_or(0, |&id| id as usize + 1);
        Ok(Self {
            inner,
            path: tokenizer_json.to_path_buf(),
            bos,
            eos,
            pad,
            adds_bos,
            vocab_size,
        })
    }

    /// Reads the tokenizer of a Hugging Face model folder: its `tokenizer.json` and
    /// `tokenizer_config.json`.
    pub fn from_folder(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// How many ids the tokenizer can produce: its largest id + 1, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token that begins a sequence, if the model has one.
    pub fn bos(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    /// The token that ends a sequence, if the config names one.
    pub fn eos(&self) -> Option<&SpecialToken> {
        self.eos.as_ref()
    }

    /// The padding token, if the config names one.
    pub fn pad(&self) -> Option<&SpecialToken> {
        self.pad.as_ref()
    }

    /// Whether this tokenizer starts a text with BOS, as `transformers` does with
    /// `add_special_tokens=True`.
    pub fn adds_bos(&self) -> bool {
        self.adds_bos
    }

    /// The ids of `text` as it is: special-token strings in it become their ids, and nothing is
    /// added.
    pub fn encode(&self, text: &str) -> Result<Encoding> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::file("cannot encode a text with tokenizer", &self.path, e))?;
        Ok(Encoding {
            ids: encoding.get_ids().to_vec(),
            offsets: encoding.get_offsets().to_vec(),
        })
    }

    /// The ids of `text` as one training document: BOS first if the tokenizer adds one and the
    /// text does not already begin with it, then the text, then EOS unless the text already
    /// ends with it (a chat template may write either). Without an EOS token this is an error:
    /// documents would run into each other.
    pub fn encode_document(&self, text: &str) -> Result<Encoding> {
        let eos = self.eos.as_ref().ok_or_else(|| {
            Error::Usage(format!(
                "tokenizer `{}` has no EOS token to end documents with: name one as `eos_token` \
                 in the `{CONFIG_FILE}` beside it",
                self.path.display()
            ))
        })?;
        let mut encoding = self.encode(text)?;
        if let Some(bos) = self.bos.as_ref().filter(|_| self.adds_bos) {
            if encoding.ids.first() != Some(&bos.id) {
                encoding.ids.insert(0, bos.id);
                encoding.offsets.insert(0, (0, 0));
            }
        }
        if encoding.ids.last() != Some(&eos.id) {
            encoding.ids.push(eos.id);
            encoding.offsets.push((text.len(), text.len()));
        }
        Ok(encoding)
    }

    /// The text of `ids`, special tokens included, as the tokenizer's decoder writes it.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::file("cannot decode ids with tokenizer", &self.path, e))
    }
}

/// The tokenizer in `path`.
fn read_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    let text = crate::input_file::read_to_string(path, crate::input_file::TOKENIZER_LIMIT)
        .map_err(|e| Error::file("cannot read tokenizer", path, e))?;
    text.parse()
        .map_err(|e| Error::file("cannot parse tokenizer", path, e))
}

/// The special tokens of the config at `path`; none when there is no such file.
fn read_config(path: &Path) -> Result<Config> {
    let text = match crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
        Err(e) => return Err(Error::file("cannot read tokenizer config", path, e)),
    };
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::file("cannot parse tokenizer config", path, e))?;
    parse_config(&value).map_err(|problem| {
        Error::Usage(format!("tokenizer config `{}`: {problem}", path.display()))
    })
}

/// The config's special-token fields, or what is wrong with one of them.
fn parse_config(value: &Value) -> Result<Config, String> {
    let object = value
        .as_object()
        .ok_or_else(|| "is not a JSON object".to_string())?;
    let flag = |field: &str| match object.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("`{field}` must be true or false, not {other}")),
    };
    let token = |field: &str| match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        // A serialized `AddedToken`, as older configs write special tokens.
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(text)) => Ok(Some(text.clone())),
            _ => Err(format!("`{field}` is an object without a `content` string")),
        },
        Some(other) => Err(format!(
            "`{field}` must be a string or an object with `content`, not {other}"
        )),
    };
    Ok(Config {
        bos_token: token("bos_token")?,
        eos_token: token("eos_token")?,
        pad_token: token("pad_token")?,
        add_bos_token: flag("add_bos_token")?,
        split_special_tokens: flag("split_special_tokens")?,
    })
}

/// Whether the tokenizer's post-processor puts `id` first when special tokens are asked for:
/// what it adds to an empty text is exactly what it adds around any text.
fn post_processor_starts_with(inner: &tokenizers::Tokenizer, id: u32) -> Result<bool> {
    let added = inner
        .post_process(tokenizers::Encoding::default(), None, true)
        .map_err(|e| Error::internal(format!("the tokenizer's post-processor failed: {e}")))?;
    Ok(added.get_ids().first() == Some(&id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(style: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/data/tokenizers")
            .join(style)
    }

    #[test]
    fn config_tokens_are_strings_or_objects_with_content() {
        let value = serde_json::json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "pad_token": null,
            "add_bos_token": true,
        });
        let config = parse_config(&value).unwrap();
        let expected = Config {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            pad_token: None,
            add_bos_token: true,
            split_special_tokens: false,
        };
        assert_eq!(config, expected);
    }

    #[test]
    fn a_config_field_of_the_wrong_kind_is_named() {
        for (value, field) in [
            (serde_json::json!({"eos_token": 2}), "`eos_token`"),
            (serde_json::json!({"bos_token": {"id": 1}}), "`bos_token`"),
            (
                serde_json::json!({"add_bos_token": "yes"}),
                "`add_bos_token`",
            ),
        ] {
            let problem = parse_config(&value).unwrap_err();
            assert!(problem.contains(field), "{problem}");
        }
        assert!(parse_config(&serde_json::json!([])).is_err());
    }

    #[test]
    fn without_a_config_there_are_no_special_tokens_and_documents_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("tokenizer.json");
        std::fs::copy(fixture("llama3").join("tokenizer.json"), &json).unwrap();
        let tokenizer = Tokenizer::from_file(&json).unwrap();
        assert_eq!((tokenizer.bos(), tokenizer.eos()), (None, None));
        assert!(!tokenizer.adds_bos());
        let error = tokenizer.encode_document("text").unwrap_err().to_string();
        assert!(
            error.contains("eos_token") && error.contains(&json.display().to_string()),
            "{error}"
        );
    }

    #[test]
    fn a_document_ending_with_eos_gets_no_second_one() {
        let tokenizer = Tokenizer::from_folder(&fixture("sentencepiece")).unwrap();
        let eos = tokenizer.eos().unwrap().clone();
        let once = tokenizer.encode_document("Done.").unwrap();
        let text = format!("Done.{}", eos.text);
        let already = tokenizer.encode_document(&text).unwrap();
        assert_eq!(once.ids.last(), Some(&eos.id));
        assert_eq!(already.ids.iter().filter(|&&id| id == eos.id).count(), 1);
        assert_eq!(already.ids[1..], tokenizer.encode(&text).unwrap().ids[..]);
    }
}
