//! Dependencies point down: no two modules of `src/` import each other, directly or around a
//! circle. The graph is read from the source: every `crate::…` and `super::…` path outside
//! `#[cfg(test)]` modules is an edge from the file's module to the deepest module the path names.
//! A module may use its ancestors (the folder's shared types and errors) and its children freely;
//! every other edge counts. The same holds one level up: no two top-level modules (`env`, `store`,
//! `model`, `kv`, `rollout`, …) import each other through any of their files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type ModPath = Vec<String>;

/// Every module of `src/` with its source text (test modules cut off).
fn modules(root: &Path) -> BTreeMap<ModPath, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            // A test module of its own file (`#[cfg(test)] mod tests;`) is test code.
            if path.file_stem().is_some_and(|s| s == "tests") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut parts: ModPath = rel.iter().map(|p| p.to_string_lossy().into()).collect();
            if parts
                .last()
                .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
            {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = match text.find("#[cfg(test)]\nmod tests") {
                Some(cut) => text[..cut].to_string(),
                None => text,
            };
            let code: String = code
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(parts, code);
        }
    }
    out
}

/// The paths a source names: `crate::a::b`, `super::a`, and each member of a `{…}` group.
fn named_paths(module: &[String], code: &str) -> Vec<ModPath> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start).map(|i| i + from) {
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |i| i + at);
            let mut segments: Vec<&str> = code[at..end]
                .split("::")
                .filter(|s| !s.is_empty())
                .collect();
            let mut base: ModPath = if segments[0] == "crate" {
                Vec::new()
            } else {
                module[..module.len().saturating_sub(1)].to_vec()
            };
            segments.remove(0);
            while segments.first() == Some(&"super") {
                base.pop();
                segments.remove(0);
            }
            let prefix: ModPath = base
                .into_iter()
                .chain(segments.iter().map(|s| s.to_string()))
                .collect();
            if code[end..].starts_with('{') {
                let group_end = code[end..].find('}').map_or(code.len(), |i| i + end);
                for member in code[end + 1..group_end].split(',') {
                    let member = member.split(" as ").next().unwrap_or("").trim();
                    if member.is_empty() || member == "self" {
                        continue;
                    }
                    let mut path = prefix.clone();
                    path.extend(member.split("::").map(str::to_string));
                    found.push(path);
                }
            }
            found.push(prefix);
        }
    }
    found
}

/// The module a path lands in: its longest prefix that is a module.
fn owner(path: &[String], mods: &BTreeMap<ModPath, String>) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|k| path[..k].to_vec())
        .find(|p| mods.contains_key(p))
}

fn edges(mods: &BTreeMap<ModPath, String>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut out = BTreeMap::new();
    for (module, code) in mods {
        let targets: BTreeSet<ModPath> = named_paths(module, code)
            .iter()
            .filter_map(|p| owner(p, mods))
            .filter(|t| !t.is_empty() && t != module && !module.starts_with(t))
            .collect();
        out.insert(module.clone(), targets);
    }
    out
}

/// A circle of modules, if there is one (depth-first search for a back edge).
fn find_circle(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Option<Vec<ModPath>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &ModPath,
        graph: &BTreeMap<ModPath, BTreeSet<ModPath>>,
        marks: &mut BTreeMap<ModPath, Mark>,
        stack: &mut Vec<ModPath>,
    ) -> Option<Vec<ModPath>> {
        marks.insert(node.clone(), Mark::Open);
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            match marks.get(next) {
                Some(Mark::Open) => {
                    let from = stack.iter().position(|m| m == next).unwrap();
                    return Some(stack[from..].to_vec());
                }
                Some(Mark::Done) => {}
                None => {
                    if let Some(circle) = visit(next, graph, marks, stack) {
                        return Some(circle);
                    }
                }
            }
        }
        stack.pop();
        marks.insert(node.clone(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if !marks.contains_key(node) {
            if let Some(circle) = visit(node, graph, &mut marks, &mut Vec::new()) {
                return Some(circle);
            }
        }
    }
    None
}

#[test]
fn no_two_modules_import_each_other() {
    let mods = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(mods.len() > 50, "found only {} modules", mods.len());
    let graph = edges(&mods);
    if let Some(circle) = find_circle(&graph) {
        let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
        panic!(
            "an import circle: {} → {} (one of them should own the shared item, or move it \
             below both)",
            names.join(" → "),
            names[0]
        );
    }
}

/// The graph between top-level modules: an edge wherever a file of one names another.
fn top_level(graph: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut out: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, targets) in graph {
        let Some(top) = from.first() else { continue };
        for to in targets.iter().filter(|t| t[0] != *top) {
            out.entry(vec![top.clone()])
                .or_default()
                .insert(vec![to[0].clone()]);
        }
    }
    out
}

#[test]
fn no_two_top_level_modules_import_each_other() {
    let mods = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let graph = top_level(&edges(&mods));
    if let Some(circle) = find_circle(&graph) {
        let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
        panic!(
            "the top-level modules {} import each other (move the shared item into the lower one)",
            names.join(" → ")
        );
    }
}

#[test]
fn the_reader_sees_a_circle_it_is_shown() {
    let mut mods = BTreeMap::new();
    mods.insert(vec!["a".to_string()], "use crate::b::Thing;".to_string());
    mods.insert(
        vec!["b".to_string()],
        "fn f() { crate::a::g() }".to_string(),
    );
    mods.insert(vec!["c".to_string()], "use super::{a::X, b};".to_string());
    let graph = edges(&mods);
    assert!(graph[&vec!["c".to_string()]].contains(&vec!["a".to_string()]));
    assert!(find_circle(&graph).is_some());
    mods.insert(vec!["b".to_string()], "fn f() {}".to_string());
    assert!(find_circle(&edges(&mods)).is_none());
    // One level up: a::x uses b, b::y uses a.
    let mut mods = BTreeMap::new();
    let path = |s: &str| s.split("::").map(str::to_string).collect::<ModPath>();
    mods.insert(path("a"), String::new());
    mods.insert(path("b"), String::new());
    mods.insert(path("a::x"), "use crate::b::Y;".to_string());
    mods.insert(path("b::y"), "use crate::a::X;".to_string());
    assert!(find_circle(&edges(&mods)).is_none());
    assert!(find_circle(&top_level(&edges(&mods))).is_some());
}

/// The rooms of `train` point down: cut to `train::run`, `train::warm_start` and
/// `train::learner` (each folder taken as one), the graph has no circle.
#[test]
fn the_training_rooms_point_down() {
    let mods = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let room = |m: &ModPath| m[..m.len().min(2)].to_vec();
    let mut rooms: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (from, targets) in edges(&mods)
        .iter()
        .filter(|(m, _)| m.first().is_some_and(|t| t == "train"))
    {
        for to in targets.iter().filter(|t| t[0] == "train") {
            let (a, b) = (room(from), room(to));
            if a != b && !a.starts_with(&b) && !b.starts_with(&a) {
                rooms.entry(a).or_default().insert(b);
            }
        }
    }
    assert!(rooms.len() >= 2, "found the rooms {rooms:?}");
    if let Some(circle) = find_circle(&rooms) {
        let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
        panic!(
            "the training rooms import each other: {}",
            names.join(" → ")
        );
    }
}

/// The top-level modules each module of ARCHITECTURE.md says it imports: the backticked names
/// after "Imports" in its `### \`name\`` section or its `- \`name.rs\`` line, those inside
/// parentheses (which parts) left out; "nothing" is none.
fn documented_imports(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut imports: Option<String> = None;
    let mut flush = |current: &Option<String>, imports: &mut Option<String>| {
        if let (Some(name), Some(list)) = (current, imports.take()) {
            let mut names = BTreeSet::new();
            let mut depth = 0;
            for (k, part) in list.split('`').enumerate() {
                if k % 2 == 0 {
                    depth += part.matches('(').count() as i32 - part.matches(')').count() as i32;
                } else if depth == 0 {
                    names.insert(part.to_string());
                }
            }
            out.insert(name.clone(), names);
        }
    };
    for line in text.lines() {
        let heading = line.strip_prefix("### `");
        let bullet = line.strip_prefix("- `").filter(|l| l.contains(".rs` —"));
        if let Some(rest) = heading.or(bullet) {
            flush(&current, &mut imports);
            let name = rest.split('`').next().unwrap_or("");
            current = Some(name.trim_end_matches(".rs").to_string());
        } else if line.starts_with("## ") {
            flush(&current, &mut imports);
            current = None;
        }
        if current.is_none() {
            continue;
        }
        if let Some(at) = line.find("Imports") {
            imports = Some(line[at..].to_string());
        } else if let Some(list) = imports.as_mut().filter(|l| !l.trim_end().ends_with('.')) {
            if line.starts_with("Main types") || line.trim().is_empty() {
                list.push('.');
            } else {
                list.push(' ');
                list.push_str(line);
            }
        }
    }
    flush(&current, &mut imports);
    out
}

#[test]
fn architecture_md_lists_each_modules_imports_as_the_code_has_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let documented = documented_imports(&text);
    let mods = modules(&root.join("src"));
    let actual = top_level(&edges(&mods));
    let tops: BTreeSet<String> = mods
        .keys()
        .filter_map(|m| m.first().cloned())
        .filter(|m| m != "cli")
        .collect();
    let mut wrong = Vec::new();
    for top in &tops {
        let have: BTreeSet<String> = actual
            .get(&vec![top.clone()])
            .into_iter()
            .flatten()
            .map(|m| m[0].clone())
            .collect();
        match documented.get(top) {
            None => wrong.push(format!("`{top}` has no Imports line")),
            Some(listed) if *listed != have => wrong.push(format!(
                "`{top}` lists {listed:?}, its code imports {have:?}"
            )),
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "ARCHITECTURE.md: {}", wrong.join("; "));
}

#[test]
fn the_imports_reader_takes_top_level_names_only() {
    let text = "### `view` — x\nImports: `algo`, `train` (`run::checkpoint`,\n`run::metrics`).\nMain types: `V`.\n\n- `seed.rs` — seeds. Imports nothing.\n## Layering\n";
    let got = documented_imports(text);
    let names = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(got["view"], names(&["algo", "train"]));
    assert_eq!(got["seed"], names(&[]));
}
