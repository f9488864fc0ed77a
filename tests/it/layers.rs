//! The layering the file tree promises: no import cycle between the top-level modules of the
//! runtime (`src/`) or of the core (`crates/core/src/`), nor between the modules of any folder of
//! the binary (`src/cli/`, whose commands are adapters that must not lean on each other in a
//! circle).
//!
//! A module depends on another when its code (not its comments) names `crate::other` or
//! imports the crate root's `Error`/`Result` (the `error` module). The core cannot name the
//! runtime at all: it does not depend on it, which the compiler enforces.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → the top-level modules its code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

/// The code of a file without its comments (line comments, doc comments included).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            // `//` inside a string literal is rare enough here to accept.
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules `code` names through `crate::`.
fn named_modules(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|n| n.trim().split("::").next().unwrap_or("").trim())
                .collect()
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            vec![&rest[..end]]
        };
        for name in names {
            let module = match name {
                "Error" | "Result" => "error",
                other => other,
            };
            if modules.contains(module) {
                found.insert(module.to_string());
            }
        }
    }
    found
}

/// The dependency graph between the top-level modules of the crate rooted at `src`.
fn graph(src: &Path) -> Graph {
    let modules: BTreeSet<String> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_string();
            (p.is_dir() || p.extension().is_some_and(|e| e == "rs")).then_some(stem)
        })
        .filter(|m| !["lib", "main", "cli"].contains(&m.as_str()))
        .collect();
    let mut graph: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for file in rust_files(src) {
        let relative = file.strip_prefix(src).unwrap();
        let top = relative
            .components()
            .next()
            .and_then(|c| Path::new(c.as_os_str()).file_stem())
            .and_then(|s| s.to_str())
            .unwrap()
            .to_string();
        let Some(deps) = graph.get_mut(&top) else {
            continue;
        };
        let text = std::fs::read_to_string(&file).unwrap();
        for dep in named_modules(&code(&text), &modules) {
            if dep != top {
                deps.insert(dep);
            }
        }
    }
    graph
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).unwrap();
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for dep in &graph[node] {
            if let Some(cycle) = visit(dep, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

fn assert_acyclic(src: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let graph = graph(&root);
    assert!(graph.len() > 3, "{src}: found only {:?}", graph.keys());
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "{src}: the top-level modules import each other in a cycle: {}\nall edges: {graph:#?}",
            cycle.join(" -> ")
        );
    }
}

/// A file's module path below `root` (`cli/tune/mod.rs` → `[cli, tune]`).
fn module_path(root: &Path, file: &Path) -> Vec<String> {
    let mut path: Vec<String> = file
        .strip_prefix(root)
        .unwrap()
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if path.last().is_some_and(|last| last == "mod") {
        path.pop();
    }
    path
}

/// The absolute module paths `code` (in the module `at`) names through `super::`, `self::`
/// and `crate::`, groups (`super::{a, b}`) spread.
fn named_paths(code: &str, at: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let starts_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let base = if !starts_word {
            None
        } else if rest.starts_with("crate::") {
            Some((Vec::new(), "crate::".len()))
        } else if rest.starts_with("self::") {
            Some((at.to_vec(), "self::".len()))
        } else if rest.starts_with("super::") {
            let mut up = at.to_vec();
            let mut len = 0;
            while code[i + len..].starts_with("super::") {
                up.pop();
                len += "super::".len();
            }
            Some((up, len))
        } else {
            None
        };
        let Some((prefix, len)) = base else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        let tail = &code[i + len..];
        let names: Vec<&str> = if let Some(group) = tail.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end].split(',').map(str::trim).collect()
        } else {
            let end = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            vec![&tail[..end]]
        };
        for name in names {
            let mut path = prefix.clone();
            path.extend(name.split("::").filter(|p| !p.is_empty()).map(String::from));
            found.push(path);
        }
        i += len;
    }
    found
}

/// The dependency graph between the modules of the folder `dir` (below the crate root `root`):
/// an edge from one child module to another when code in the first's files names the second.
fn folder_graph(root: &Path, dir: &Path) -> Graph {
    let folder = module_path(root, &dir.join("mod.rs"));
    // The folder's own modules: its files and subfolders (names that reach items of its
    // `mod.rs`, such as `super::Status`, are no module of it).
    let children: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let stem = path.file_stem()?.to_str()?.to_string();
            (stem != "mod" && (path.is_dir() || path.extension().is_some_and(|x| x == "rs")))
                .then_some(stem)
        })
        .collect();
    let mut graph = Graph::new();
    for file in rust_files(dir) {
        let at = module_path(root, &file);
        let Some(from) = at.get(folder.len()).cloned() else {
            continue;
        };
        graph.entry(from.clone()).or_default();
        let text = std::fs::read_to_string(&file).unwrap();
        for path in named_paths(&code(&text), &at) {
            let inside = path.len() > folder.len()
                && path[..folder.len()] == folder[..]
                && children.contains(&path[folder.len()]);
            if let Some(to) = inside.then(|| path[folder.len()].clone()) {
                if to != from {
                    graph.entry(from.clone()).or_default().insert(to.clone());
                    graph.entry(to).or_default();
                }
            }
        }
    }
    graph
}

#[test]
fn no_folder_of_the_binary_imports_itself_in_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut folders = vec![root.join("cli")];
    let mut seen = 0;
    while let Some(dir) = folders.pop() {
        let graph = folder_graph(&root, &dir);
        seen += 1;
        if let Some(cycle) = find_cycle(&graph) {
            panic!(
                "{}: its modules import each other in a cycle: {}\nall edges: {graph:#?}",
                dir.display(),
                cycle.join(" -> ")
            );
        }
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            }
        }
    }
    assert!(seen >= 2, "src/cli and its folders");
}

#[test]
fn a_cycle_inside_a_folder_is_found() {
    let root = tempfile::tempdir().unwrap();
    let cli = root.path().join("cli");
    std::fs::create_dir_all(cli.join("tune")).unwrap();
    std::fs::write(cli.join("mod.rs"), "mod args;\nmod run;\nmod tune;").unwrap();
    std::fs::write(cli.join("printer.rs"), "").unwrap();
    std::fs::write(cli.join("args.rs"), "use super::run::RunArgs;").unwrap();
    std::fs::write(cli.join("run.rs"), "use super::{tune::search, printer};").unwrap();
    std::fs::write(cli.join("tune/mod.rs"), "use crate::cli::args::Cli;").unwrap();
    let graph = folder_graph(root.path(), &cli);
    let cycle = find_cycle(&graph).expect("args -> run -> tune -> args");
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    std::fs::write(cli.join("tune/mod.rs"), "use super::printer::Printer;").unwrap();
    assert_eq!(find_cycle(&folder_graph(root.path(), &cli)), None);
}

#[test]
fn the_runtime_modules_form_no_cycle() {
    assert_acyclic("src");
}

#[test]
fn the_core_modules_form_no_cycle() {
    assert_acyclic("crates/core/src");
}

#[test]
fn a_cycle_is_found_and_named() {
    let modules: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();
    let named = named_modules(
        &code("use crate::{b::X, Error};\n// crate::c is only a comment\nlet y = crate::a::f();"),
        &modules,
    );
    assert_eq!(named, ["a", "b"].map(String::from).into());
    let graph: Graph = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"])]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(
        find_cycle(&graph).unwrap(),
        ["a", "b", "c", "a"].map(String::from).to_vec()
    );
    let mut acyclic = graph.clone();
    acyclic.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&acyclic), None);
}
