//! Chat templates against `transformers`: `tests/fixtures/data/templates/` (written by its
//! `generate.py`) holds real models' templates as their folders have them, and what
//! `apply_chat_template` renders for a set of conversations. Every one renders byte-identical
//! here, with the same assistant spans; templates that raise fail here too, naming the message.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use autotune::data::template::{ChatTemplate, Message};
use serde_json::Value;

/// Every fixture folder: a model's template each, one that exercises what templates use, and two
/// that check how a folder's template is found.
const FOLDERS: [&str; 10] = [
    "llama-3.1",
    "llama-3.2",
    "qwen-2.5",
    "mistral-v0.1",
    "mistral-v0.3",
    "smollm2",
    "zephyr",
    "features",
    "jinja-file",
    "named-list",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/templates")
}

fn expected(folder: &str) -> Value {
    let path = fixtures().join(folder).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The fixtures' pinned `strftime_now` instant.
fn pinned_clock(expected: &Value) -> SystemTime {
    assert_eq!(
        expected["date"], "2025-03-05T14:30:00",
        "generate.py's DATE moved"
    );
    UNIX_EPOCH + Duration::from_secs(1_741_185_000)
}

fn load(folder: &str) -> ChatTemplate {
    let template = ChatTemplate::from_folder(&fixtures().join(folder)).unwrap();
    template.unwrap_or_else(|| panic!("{folder} has no chat template"))
}

fn messages(case: &Value) -> Vec<Message> {
    serde_json::from_value(case["messages"].clone()).unwrap()
}

/// Every case of every fixture, as (folder, case name, case, the folder's expected.json).
fn cases() -> Vec<(&'static str, String, Value, Value)> {
    let mut all = Vec::new();
    for folder in FOLDERS {
        let expected = expected(folder);
        for (name, case) in expected["cases"].as_object().unwrap() {
            all.push((folder, name.clone(), case.clone(), expected.clone()));
        }
    }
    all
}

#[test]
fn every_fixture_renders_byte_identical_to_transformers() {
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (folder, name, case, expected) in cases() {
        let template = load(folder).with_clock(pinned_clock(&expected));
        let tokens = serde_json::to_value(template.tokens()).unwrap();
        assert_eq!(
            tokens, expected["special_tokens"],
            "{folder}: the special tokens"
        );
        for add_generation_prompt in [false, true] {
            let got = template.render(&messages(&case), add_generation_prompt);
            checked += 1;
            match (&case["error"], got) {
                (Value::String(raised), Err(e)) if e.to_string().contains(raised.as_str()) => {}
                (Value::String(raised), got) => {
                    wrong.push(format!("{folder}/{name}: expected `{raised}`, got {got:?}"));
                }
                (_, got) => {
                    let want = &case["rendered"][add_generation_prompt.to_string()];
                    if got.as_ref().ok().map(String::as_str) != want.as_str() {
                        wrong.push(format!(
                            "{folder}/{name} (add_generation_prompt={add_generation_prompt}):\n \
                             want {want}\n  got {got:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(checked >= 60, "only {checked} renderings checked");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn assistant_spans_hold_each_reply_and_its_end_of_turn_and_no_user_text() {
    let mut with_spans = 0;
    for (folder, name, case, expected) in cases() {
        if case["error"].is_string() || case["spans"].is_null() {
            continue;
        }
        let template = load(folder).with_clock(pinned_clock(&expected));
        let messages = messages(&case);
        let (whole, spans) = template.render_with_assistant_spans(&messages).unwrap();
        assert_eq!(
            whole,
            case["rendered"]["false"].as_str().unwrap(),
            "{folder}/{name}"
        );
        let want: Vec<[usize; 2]> = serde_json::from_value(case["spans"].clone()).unwrap();
        let got: Vec<[usize; 2]> = spans.iter().map(|s| [s.start, s.end]).collect();
        assert_eq!(got, want, "{folder}/{name}: spans");

        let end_of_turn = expected["end_of_turn"].as_str().unwrap();
        let replies = messages.iter().filter(|m| m.role == "assistant");
        let others: Vec<&str> = messages
            .iter()
            .filter(|m| m.role != "assistant")
            .map(|m| m.content.trim())
            .collect();
        for (reply, span) in replies.zip(&spans) {
            let text = &whole[span.clone()];
            assert!(
                text.contains(reply.content.trim()),
                "{folder}/{name}: {text:?}"
            );
            assert!(text.contains(end_of_turn), "{folder}/{name}: {text:?}");
            assert!(
                !others.iter().any(|o| text.contains(o)),
                "{folder}/{name}: {text:?}"
            );
            with_spans += 1;
        }
    }
    assert!(with_spans >= 40, "only {with_spans} spans checked");
}

#[test]
fn raise_exception_is_an_error_naming_the_templates_message_and_file() {
    let template = load("mistral-v0.1");
    let expected = expected("mistral-v0.1");
    let case = &expected["cases"]["not-alternating"];
    let raised = case["error"].as_str().unwrap();
    assert!(
        raised.contains("Conversation roles must alternate"),
        "{raised}"
    );
    for error in [
        template.render(&messages(case), true).unwrap_err(),
        template
            .render_with_assistant_spans(&messages(case))
            .unwrap_err(),
    ] {
        let error = error.to_string();
        assert!(error.contains(raised), "{error}");
        assert!(error.contains("raised"), "{error}");
        assert!(
            error.contains("mistral-v0.1/tokenizer_config.json"),
            "{error}"
        );
    }
}

#[test]
fn a_chat_template_jinja_file_wins_over_the_configs_template() {
    let from_file = load("jinja-file");
    assert!(
        from_file.origin().ends_with("chat_template.jinja"),
        "{}",
        from_file.origin()
    );

    let dir = tempfile::tempdir().unwrap();
    let config = r#"{"eos_token": "</s>", "chat_template": "config{{ eos_token }}"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let render = |dir: &Path| {
        let template = ChatTemplate::from_folder(dir).unwrap().unwrap();
        template
            .render(&[Message::new("user", "hi")], false)
            .unwrap()
    };
    assert_eq!(render(dir.path()), "config</s>");
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "file{{ eos_token }}\n",
    )
    .unwrap();
    assert_eq!(render(dir.path()), "file</s>");
}

#[test]
fn a_folder_without_a_template_has_none() {
    let dir = tempfile::tempdir().unwrap();
    assert!(ChatTemplate::from_folder(dir.path()).unwrap().is_none());
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    assert!(ChatTemplate::from_folder(dir.path()).unwrap().is_none());
}

#[test]
fn a_broken_template_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let jinja = dir.path().join("chat_template.jinja");
    std::fs::write(&jinja, "{% for m in messages %}{{ m.content }").unwrap();
    let error = ChatTemplate::from_folder(dir.path())
        .unwrap_err()
        .to_string();
    assert!(error.contains(&jinja.display().to_string()), "{error}");
    assert!(error.contains("does not parse"), "{error}");

    std::fs::remove_file(&jinja).unwrap();
    let config = dir.path().join("tokenizer_config.json");
    std::fs::write(&config, r#"{"chat_template": "{% if messages %}unclosed"}"#).unwrap();
    let error = ChatTemplate::from_folder(dir.path())
        .unwrap_err()
        .to_string();
    assert!(error.contains(&config.display().to_string()), "{error}");
    assert!(error.contains("does not parse"), "{error}");

    std::fs::write(&config, "{not json").unwrap();
    let error = ChatTemplate::from_folder(dir.path())
        .unwrap_err()
        .to_string();
    assert!(error.contains(&config.display().to_string()), "{error}");
}

#[test]
fn strftime_now_reads_todays_date_without_a_clock() {
    let today = std::process::Command::new("date")
        .args(["-u", "+%d %b %Y"])
        .output()
        .unwrap();
    let today = String::from_utf8(today.stdout).unwrap();
    let rendered = load("llama-3.2")
        .render(&[Message::new("user", "hi")], true)
        .unwrap();
    assert!(
        rendered.contains(&format!("Today Date: {}\n", today.trim())),
        "{rendered}"
    );
}
