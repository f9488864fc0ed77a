//! Mutations of valid JSON documents and of flag values: the inputs a user, a bad copy or a
//! broken tool could hand autotune.

use proptest::prelude::*;
use serde_json::Value;

/// Numbers and values at and past every bound and type the readers know.
pub fn edge_value() -> impl Strategy<Value = Value> {
    let numbers: Vec<Value> = [
        "0",
        "1",
        "-1",
        "2",
        "3",
        "7",
        "64",
        "1048576",
        "1048577",
        "16777217",
        "2147483648",
        "4294967296",
        "9007199254740993",
        "9223372036854775808",
        "18446744073709551615",
        "-9223372036854775808",
        "0.5",
        "-0.5",
        "1e308",
        "-1e308",
        "1e-308",
        "0.0",
    ]
    .iter()
    .map(|n| serde_json::from_str(n).expect("a JSON number"))
    .collect();
    let others: Vec<Value> = vec![
        Value::Null,
        Value::Bool(true),
        Value::Bool(false),
        Value::String(String::new()),
        Value::String("x".into()),
        Value::String("NaN".into()),
        Value::String("1".into()),
        serde_json::json!([]),
        serde_json::json!([1]),
        serde_json::json!({}),
        serde_json::json!({"a": 1}),
    ];
    prop_oneof![
        3 => prop::sample::select(numbers),
        1 => prop::sample::select(others),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_filter("JSON has no NaN or inf", |f| f.is_finite()).prop_map(Value::from),
    ]
}

/// One change to a document.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// The value at the `n`-th path (modulo their count) becomes another.
    Replace(usize, Value),
    /// The key at the `n`-th path is removed.
    Remove(usize),
    /// An unknown key is added to the `n`-th object.
    Insert(usize, String, Value),
    /// The `n`-th key of the top-level object is given a second time, with another value
    /// (JSON readers disagree on which of the two counts).
    Duplicate(usize, Value),
    /// The text is cut at a fraction of its length.
    Truncate(f64),
    /// One byte of the text, at a fraction of its length, is flipped.
    FlipByte(f64, u8),
}

/// One to three mutations.
pub fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        6 => (any::<usize>(), edge_value()).prop_map(|(n, v)| Mutation::Replace(n, v)),
        2 => any::<usize>().prop_map(Mutation::Remove),
        1 => (any::<usize>(), "[a-z_]{1,8}", edge_value()).prop_map(|(n, k, v)| Mutation::Insert(n, k, v)),
        1 => (any::<usize>(), edge_value()).prop_map(|(n, v)| Mutation::Duplicate(n, v)),
        1 => (0.0..1.0f64).prop_map(Mutation::Truncate),
        1 => (0.0..1.0f64, 1..=255u8).prop_map(|(at, bit)| Mutation::FlipByte(at, bit)),
    ];
    prop::collection::vec(one, 1..=3)
}

/// Every path in `value` to an object member or array element (`/a/0/b`, JSON-pointer style).
fn paths(value: &Value, prefix: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let path = format!("{prefix}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(path.clone());
                paths(v, &path, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let path = format!("{prefix}/{i}");
                out.push(path.clone());
                paths(v, &path, out);
            }
        }
        _ => {}
    }
}

/// The text of `base` with `mutations` applied.
pub fn apply(base: &Value, mutations: &[Mutation]) -> Vec<u8> {
    let mut doc = base.clone();
    let mut text: Option<Vec<u8>> = None;
    for m in mutations {
        let mut all = Vec::new();
        paths(&doc, "", &mut all);
        let pick = |n: usize| all.get(n % all.len().max(1)).cloned();
        match m {
            Mutation::Replace(n, v) => {
                if let Some(slot) = pick(*n).and_then(|p| doc.pointer_mut(&p)) {
                    *slot = v.clone();
                }
            }
            Mutation::Remove(n) => {
                if let Some(path) = pick(*n) {
                    let (parent, key) = path.rsplit_once('/').unwrap_or(("", &path));
                    match doc.pointer_mut(parent) {
                        Some(Value::Object(map)) => {
                            map.remove(&key.replace("~1", "/").replace("~0", "~"));
                        }
                        Some(Value::Array(items)) => {
                            if let Ok(i) = key.parse::<usize>() {
                                if i < items.len() {
                                    items.remove(i);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            Mutation::Insert(n, key, v) => {
                let target = pick(*n).unwrap_or_default();
                let parent = target.rsplit_once('/').map_or("", |(p, _)| p).to_string();
                if let Some(Value::Object(map)) = doc.pointer_mut(&parent) {
                    map.insert(key.clone(), v.clone());
                }
            }
            Mutation::Duplicate(n, v) => {
                let bytes = text.take().unwrap_or_else(|| doc.to_string().into_bytes());
                text = Some(duplicated(&doc, bytes, *n, v));
            }
            Mutation::Truncate(at) => {
                let bytes = text.take().unwrap_or_else(|| doc.to_string().into_bytes());
                let cut = ((bytes.len() as f64) * at) as usize;
                text = Some(bytes[..cut.min(bytes.len())].to_vec());
            }
            Mutation::FlipByte(at, bit) => {
                let mut bytes = text.take().unwrap_or_else(|| doc.to_string().into_bytes());
                if !bytes.is_empty() {
                    let i = (((bytes.len() as f64) * at) as usize).min(bytes.len() - 1);
                    bytes[i] ^= bit;
                }
                text = Some(bytes);
            }
        }
    }
    text.unwrap_or_else(|| doc.to_string().into_bytes())
}

/// `bytes` (the text of `doc`, or a mutation of it) with the `n`-th top-level key of `doc`
/// written once more, holding `value`, at the start of the top-level object.
fn duplicated(doc: &Value, bytes: Vec<u8>, n: usize, value: &Value) -> Vec<u8> {
    let Some(map) = doc.as_object().filter(|m| !m.is_empty()) else {
        return bytes;
    };
    let Some(brace) = bytes.iter().position(|&b| b == b'{') else {
        return bytes;
    };
    let key = map.keys().nth(n % map.len()).cloned().unwrap_or_default();
    let member = format!("{}: {value}, ", Value::String(key));
    let mut out = bytes[..=brace].to_vec();
    out.extend_from_slice(member.as_bytes());
    out.extend_from_slice(&bytes[brace + 1..]);
    out
}

/// How far a flag's accepted values can make a command run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagKind {
    /// Any value ends quickly: refused, or bounded by the rest of the command (a trial time
    /// limit, a tiny model).
    Any,
    /// A count of steps with no bound but the user's: 10^12 steps is a valid, endless run.
    Steps,
    /// A batch size or accumulation bounded at 2^20: valid values near the bound are hours of
    /// CPU work in one process.
    Batch,
    /// A count of processes: valid values up to 64 CPU ranks overload a small host.
    Ranks,
}

/// A value for a numeric flag: at and past the bounds, negative, fractional, malformed, or
/// small. Values a command accepts and then spends a long time on by design (a run of 10^12
/// steps, 2^20 accumulated micro-batches) are left out for the flags whose kind says so: they
/// would not end within a case's time limit by being right.
pub fn flag_value(kind: FlagKind) -> BoxedStrategy<String> {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let malformed = strings(&[
        "-1",
        "-0",
        "18446744073709551616",
        "99999999999999999999999",
        "1.5",
        "-2.5",
        "1e3",
        "NaN",
        "nan",
        "inf",
        "-inf",
        "",
        " ",
        "x",
        "0x10",
        "1_000",
        "\u{ff11}",
        "--",
        "1 2",
    ]);
    let past_the_bounds = strings(&[
        "1048577",
        "2147483648",
        "4294967296",
        "9223372036854775808",
        "18446744073709551615",
    ]);
    let small = strings(&["0", "1", "2", "3", "+3", "0.05", "0.5"]);
    let large = strings(&[
        "1048576", "16777216", "65536", "4096", "1e6", "1e308", "0.999",
    ]);
    match kind {
        FlagKind::Any => prop_oneof![
            3 => prop::sample::select(malformed),
            2 => prop::sample::select(past_the_bounds),
            2 => prop::sample::select(small),
            2 => prop::sample::select(large),
            1 => any::<u64>().prop_map(|n| n.to_string()),
            1 => any::<i64>().prop_map(|n| n.to_string()),
            1 => any::<f64>().prop_map(|f| f.to_string()),
        ]
        .boxed(),
        FlagKind::Steps => prop_oneof![
            3 => prop::sample::select(malformed),
            2 => prop::sample::select(small),
        ]
        .boxed(),
        FlagKind::Batch => prop_oneof![
            3 => prop::sample::select(malformed),
            2 => prop::sample::select(past_the_bounds),
            2 => prop::sample::select(small),
        ]
        .boxed(),
        FlagKind::Ranks => prop_oneof![
            3 => prop::sample::select(malformed),
            2 => prop::sample::select(past_the_bounds),
            1 => prop::sample::select(strings(&["0", "1", "65", "4097"])),
        ]
        .boxed(),
    }
}
