//! The README says what the code does: its table of model presets is the registry's, as
//! `--help` and the completion scripts list them. `AUTOTUNE_BLESS=1` rewrites the table from
//! the registry after a preset is added.

use std::path::Path;

const START: &str = "<!-- presets: the registry's table (tests/it/readme.rs) -->\n";
const END: &str = "<!-- end of presets -->";

#[test]
fn the_readme_lists_every_preset_as_the_registry_does() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let table = autotune::settings::model::presets_table();
    let start = readme
        .find(START)
        .expect("the README marks its presets table")
        + START.len();
    let end = start
        + readme[start..]
            .find(END)
            .expect("the table's end is marked");
    if std::env::var_os("AUTOTUNE_BLESS").is_some() {
        let blessed = format!("{}{table}{}", &readme[..start], &readme[end..]);
        std::fs::write(&path, blessed).unwrap();
        return;
    }
    assert_eq!(
        &readme[start..end],
        table,
        "the README's presets differ from the registry; rerun with AUTOTUNE_BLESS=1"
    );
    for name in autotune::spec::model::PRESETS {
        assert!(table.contains(&format!("| `{name}` |")), "{name}");
    }
}

#[test]
fn help_and_completions_offer_every_preset() {
    let help = crate::util::stdout(&crate::util::autotune(&["train", "--help"]));
    let completion = crate::util::stdout(&crate::util::autotune(&["completions", "bash"]));
    for name in autotune::spec::model::PRESETS {
        assert!(help.contains(name), "train --help lacks {name}");
        assert!(
            completion.contains(name),
            "the bash completion lacks {name}"
        );
    }
}
