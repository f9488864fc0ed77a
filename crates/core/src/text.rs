//! Text that came from someone else's file (a model config's `_name_or_path`, its keys, a
//! folder's name) made safe to print and to store.
//!
//! Such text may hold terminal escape sequences, carriage returns or bidirectional overrides
//! that rewrite what a terminal shows, or newlines that forge lines of our own output. Every
//! such character is written as its Rust escape (`\u{1b}`), so the text stays readable and
//! nothing it holds acts on the terminal. This is the one place that decides which characters
//! those are.

use std::borrow::Cow;

/// Whether `c` changes how a terminal lays out or renders the text around it: the C0 and C1
/// control characters, and the Unicode marks that reorder text (bidirectional embeddings,
/// overrides and isolates).
fn acts_on_the_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character that acts on a terminal escaped (`\u{1b}`); borrowed when there
/// is none.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    escape_except(text, |_| false)
}

/// As [`escape_controls`], but keeping line breaks: for our own multi-line messages, which
/// quote others' text only through [`escape_controls`].
pub fn escape_controls_keeping_lines(text: &str) -> Cow<'_, str> {
    escape_except(text, |c| c == '\n')
}

/// Whether `text` holds a character that [`escape_controls`] escapes.
pub fn has_controls(text: &str) -> bool {
    text.chars().any(acts_on_the_terminal)
}

fn escape_except(text: &str, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(|c| acts_on_the_terminal(c) && !keep(c)) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if acts_on_the_terminal(c) && !keep(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_that_act_on_a_terminal_are_escaped_and_others_kept() {
        assert_eq!(
            escape_controls("a\u{1b}[2Jb\r\nc\u{9b}d"),
            "a\\u{1b}[2Jb\\u{d}\\u{a}c\\u{9b}d"
        );
        assert_eq!(escape_controls("evil\u{202e}txt"), "evil\\u{202e}txt");
        assert!(matches!(
            escape_controls("Llama-3.2-1B é 中"),
            Cow::Borrowed("Llama-3.2-1B é 中")
        ));
        assert_eq!(
            escape_controls_keeping_lines("one\ntwo\u{1b}"),
            "one\ntwo\\u{1b}"
        );
        assert!(has_controls("x\u{7}") && !has_controls("x y"));
    }
}
