use super::python::python_float;
use super::time::{civil_from_days, days_from_civil};
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
    let t = template(r#"{{ strftime_now("%d %b %Y|%-d %B %y|%A %a %j|%I:%M:%S %p|%F %T %e%%") }}"#)
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
