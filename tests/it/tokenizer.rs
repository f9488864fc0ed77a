//! The model's tokenizer against `transformers`: `tests/fixtures/data/tokenizers/<style>/` holds a
//! tiny tokenizer of each style and `expected.json`, what `PreTrainedTokenizerFast` made of the
//! same texts (written by `generate.py` there).

use std::path::{Path, PathBuf};

use autotune::data::tokenizer::{SpecialToken, Tokenizer};
use serde::Deserialize;

const STYLES: [&str; 4] = [
    "llama3",
    "qwen2",
    "sentencepiece",
    "sentencepiece-metaspace",
];

/// `expected.json`: the reference's view of one tokenizer.
#[derive(Deserialize)]
struct Expected {
    vocab_size: usize,
    bos: Option<Special>,
    eos: Option<Special>,
    pad: Option<Special>,
    adds_bos: bool,
    cases: Vec<Case>,
}

#[derive(Deserialize, Debug, PartialEq)]
struct Special {
    text: String,
    id: u32,
}

/// One text, encoded without and with special tokens, and the decoded ids.
#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    offsets: Vec<(usize, usize)>,
    ids_with_special: Vec<u32>,
    decoded: String,
    decoded_with_special: String,
}

fn folder(style: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/data/tokenizers")
        .join(style)
}

fn load(style: &str) -> (Tokenizer, Expected) {
    let dir = folder(style);
    let tokenizer = Tokenizer::from_folder(&dir).unwrap();
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    (tokenizer, serde_json::from_str(&text).unwrap())
}

fn special(token: Option<&SpecialToken>) -> Option<Special> {
    token.map(|t| Special {
        text: t.text.clone(),
        id: t.id,
    })
}

/// An error and its causes, as one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line += &format!(": {cause}");
        source = cause.source();
    }
    line
}

#[test]
fn texts_encode_and_decode_as_transformers_does() {
    let mut wrong = Vec::new();
    for style in STYLES {
        let (tokenizer, expected) = load(style);
        for case in &expected.cases {
            let encoding = tokenizer.encode(&case.text).unwrap();
            let what = format!("{style} {:?}", case.text);
            if encoding.ids != case.ids {
                wrong.push(format!(
                    "{what}: ids {:?}, expected {:?}",
                    encoding.ids, case.ids
                ));
            }
            if encoding.offsets != case.offsets {
                let (got, want) = (&encoding.offsets, &case.offsets);
                wrong.push(format!("{what}: offsets {got:?}, expected {want:?}"));
            }
            for (ids, decoded) in [
                (&case.ids, &case.decoded),
                (&case.ids_with_special, &case.decoded_with_special),
            ] {
                let got = tokenizer.decode(ids).unwrap();
                if &got != decoded {
                    wrong.push(format!("{what}: decoded {got:?}, expected {decoded:?}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn special_tokens_and_the_vocabulary_size_are_the_references() {
    for style in STYLES {
        let (tokenizer, expected) = load(style);
        assert_eq!(special(tokenizer.bos()), expected.bos, "{style} bos");
        assert_eq!(special(tokenizer.eos()), expected.eos, "{style} eos");
        assert_eq!(special(tokenizer.pad()), expected.pad, "{style} pad");
        assert_eq!(tokenizer.adds_bos(), expected.adds_bos, "{style} adds_bos");
        assert_eq!(tokenizer.vocab_size(), expected.vocab_size, "{style}");
    }
    // The fixtures cover a tokenizer with BOS, one without, and one with a pad token.
    let all: Vec<Expected> = STYLES.iter().map(|s| load(s).1).collect();
    assert!(all.iter().any(|e| e.adds_bos) && all.iter().any(|e| !e.adds_bos));
    assert!(all.iter().any(|e| e.pad.is_some()));
}

/// A document is the reference's encoding with special tokens, with BOS once: a text that
/// already begins with BOS gets none added. EOS ends it, once.
#[test]
fn documents_begin_with_bos_once_and_end_with_eos() {
    for style in STYLES {
        let (tokenizer, expected) = load(style);
        let eos = expected.eos.as_ref().unwrap().id;
        let bos = expected.bos.as_ref().map(|b| b.id);
        let mut began_with_bos = false;
        for case in &expected.cases {
            let text_begins_with_bos = bos.is_some() && case.ids.first() == bos.as_ref();
            began_with_bos |= text_begins_with_bos;
            let mut ids = if text_begins_with_bos {
                case.ids.clone()
            } else {
                case.ids_with_special.clone()
            };
            let mut offsets = case.offsets.clone();
            if ids.len() > case.ids.len() {
                offsets.insert(0, (0, 0));
            }
            if ids.last() != Some(&eos) {
                ids.push(eos);
                offsets.push((case.text.len(), case.text.len()));
            }
            let document = tokenizer.encode_document(&case.text).unwrap();
            assert_eq!(document.ids, ids, "{style} {:?}", case.text);
            assert_eq!(document.offsets, offsets, "{style} {:?}", case.text);
            let leading_bos = document.ids.iter().take_while(|&&id| Some(id) == bos);
            let expected_leading = usize::from(expected.adds_bos || text_begins_with_bos);
            assert_eq!(
                leading_bos.count(),
                expected_leading,
                "{style} {:?}",
                case.text
            );
            assert_eq!(document.ids.last(), Some(&eos), "{style} {:?}", case.text);
        }
        assert_eq!(
            began_with_bos,
            bos.is_some(),
            "{style}: a text begins with BOS"
        );
    }
}

#[test]
fn an_unreadable_or_broken_tokenizer_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = Tokenizer::from_folder(dir.path()).unwrap_err();
    let json = dir.path().join("tokenizer.json");
    assert!(
        chain(&missing).contains(&json.display().to_string()),
        "{missing}"
    );

    for broken in [
        "{\"model\": ",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": 3}}",
    ] {
        std::fs::write(&json, broken).unwrap();
        let error = chain(&Tokenizer::from_file(&json).unwrap_err());
        assert!(error.contains(&json.display().to_string()), "{error}");
        assert!(error.contains("cannot parse tokenizer"), "{error}");
    }
}

#[test]
fn a_config_naming_a_token_the_vocabulary_lacks_is_an_error_naming_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        folder("qwen2").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let config = dir.path().join("tokenizer_config.json");
    for (field, body) in [
        ("eos_token", r#"{"eos_token": "<|no such token|>"}"#),
        (
            "pad_token",
            r#"{"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}}"#,
        ),
    ] {
        std::fs::write(&config, body).unwrap();
        let error = chain(&Tokenizer::from_folder(dir.path()).unwrap_err());
        assert!(error.contains(&config.display().to_string()), "{error}");
        assert!(error.contains(&format!("`{field}`")), "{error}");
    }

    std::fs::write(&config, "{\"eos_token\": ").unwrap();
    let error = chain(&Tokenizer::from_folder(dir.path()).unwrap_err());
    assert!(error.contains(&config.display().to_string()), "{error}");
}
