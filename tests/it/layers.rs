//! The layering the file tree promises: no import cycle between the top-level modules of the
//! runtime (`src/`) or of the core (`crates/core/src/`).
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
