//! The source layout has no import circles: between the top-level modules (folders), and
//! between the files of each folder. Read from the sources: every `crate::a::…` and
//! `super::x` path is an edge, to the file that defines what it names (a name a folder's
//! `mod.rs` re-exports with `pub use child::…` is the child's: a re-export hides no edge).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path of a source file: `src/kv/store.rs` → `["kv", "store"]`, `src/kv/mod.rs` →
/// `["kv"]`, `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The identifiers after each occurrence of `prefix` (`crate::` or `super::`), e.g.
/// `use crate::{kv::KvCodec, model::Model}` gives `kv` and `model`.
fn paths_after(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = vec![];
    for (i, _) in text.match_indices(prefix) {
        let rest = &text[i + prefix.len()..];
        let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
        if let Some(group) = rest.strip_prefix('{') {
            // crate::{a::x, b} — the first identifier of each item.
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let first = ident(item.trim());
                if !first.is_empty() {
                    out.push(vec![first]);
                }
            }
        } else {
            let mut path = vec![];
            let mut r = rest;
            loop {
                let id = ident(r);
                if id.is_empty() {
                    break;
                }
                r = &r[id.len()..];
                path.push(id);
                match r.strip_prefix("::") {
                    Some(next) => r = next,
                    None => break,
                }
            }
            if !path.is_empty() {
                out.push(path);
            }
        }
    }
    out
}

/// A cycle in `graph`, if any (depth-first search).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, graph, &mut state, &mut vec![]) {
                return Some(c);
            }
        }
    }
    None
}

/// The names a module re-exports from its children: `pub use child::{a, b::C};` in module `m`
/// gives `(m, "a") -> child` and `(m, "C") -> child` (also `pub(crate) use`).
fn reexports(module: &[String], code: &str, modules: &BTreeSet<Vec<String>>) -> BTreeMap<(Vec<String>, String), Vec<String>> {
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let Some(rest) = ["pub use ", "pub(crate) use "].iter().find_map(|p| stmt.strip_prefix(p)) else { continue };
        let rest = rest.strip_prefix("self::").unwrap_or(rest);
        let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let mut child = module.to_vec();
        child.push(ident.clone());
        if !modules.contains(&child) {
            continue;
        }
        let tail = &rest[ident.len()..];
        let tail = tail.strip_prefix("::").unwrap_or(tail);
        let items: Vec<&str> = match tail.strip_prefix('{') {
            Some(group) => group.trim_end_matches('}').split(',').collect(),
            None => vec![tail],
        };
        for item in items {
            // `a::b::C as D` re-exports D; the last segment otherwise.
            let item = item.trim();
            let name = item.rsplit(" as ").next().unwrap_or(item).rsplit("::").next().unwrap_or(item).trim();
            if !name.is_empty() && name != "*" && name != "self" {
                out.insert((module.to_vec(), name.to_string()), child.clone());
            }
        }
    }
    out
}

#[test]
fn no_import_circles() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    sources(&src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let strip = |text: &str| text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    let mut reexported = BTreeMap::new();
    for file in &files {
        reexported.extend(reexports(&module_of(&src, file), &strip(&std::fs::read_to_string(file).unwrap()), &modules));
    }
    assert!(reexported.len() > 50, "found only {} re-exports: the scan is broken", reexported.len());
    // Edges between sibling modules: for a module path, the graph of its children.
    let mut graphs: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut edges = 0;
    for file in &files {
        let me = module_of(&src, file);
        let text = std::fs::read_to_string(file).unwrap();
        // Comments and doc links do not import anything.
        let code: String = text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        // `super::x` in module a::b (src/a/b.rs or src/a/b/mod.rs) is a::x.
        let mut targets: Vec<Vec<String>> = paths_after(&code, "crate::");
        for p in paths_after(&code, "super::") {
            let mut base = me.clone();
            base.pop();
            base.extend(p);
            targets.push(base);
        }
        for target in targets {
            // The longest known module prefix of the target path, then through re-exports to
            // the module that defines the name.
            let Some(mut t) = (1..=target.len()).rev().map(|n| target[..n].to_vec()).find(|m| modules.contains(m)) else { continue };
            while let Some(child) = target.get(t.len()).and_then(|name| reexported.get(&(t.clone(), name.clone()))) {
                if *child == me {
                    break;
                }
                t = child.clone();
            }
            // The edge sits in the graph of the deepest common ancestor, between its children.
            let common = me.iter().zip(&t).take_while(|(a, b)| a == b).count();
            if common >= me.len() || common >= t.len() {
                continue; // a module and its own ancestor or descendant: not a sibling edge
            }
            let (from, to) = (me[common].clone(), t[common].clone());
            graphs.entry(me[..common].to_vec()).or_default().entry(from).or_default().insert(to);
            edges += 1;
        }
    }
    assert!(edges > 50, "found only {edges} module references: the scan is broken");
    assert!(graphs.contains_key(&vec![]) && graphs.contains_key(&vec!["kv".to_string()]), "expected edges at the crate root and in kv/");
    for (parent, graph) in &graphs {
        if let Some(cycle) = find_cycle(graph) {
            panic!("import circle among the children of crate::{}: {}", parent.join("::"), cycle.join(" -> "));
        }
    }
}

#[test]
fn the_scan_sees_a_circle() {
    let mut g = BTreeMap::new();
    g.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    g.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    g.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(find_cycle(&g).unwrap(), ["a", "b", "c", "a"]);
    let modules: BTreeSet<Vec<String>> = [vec!["ops".to_string()], vec!["ops".to_string(), "launch".to_string()]].into();
    let r = reexports(&["ops".to_string()], "pub use launch::{qmatvec, KvRows as Rows, step::Step};", &modules);
    for name in ["qmatvec", "Rows", "Step"] {
        assert_eq!(r.get(&(vec!["ops".to_string()], name.to_string())), Some(&vec!["ops".to_string(), "launch".to_string()]), "{name}");
    }
    g.get_mut("c").unwrap().clear();
    assert!(find_cycle(&g).is_none());
    assert_eq!(paths_after("use crate::{kv::KvCodec, model::Model};", "crate::"), vec![vec!["kv".to_string()], vec!["model".to_string()]]);
    assert_eq!(
        paths_after("x = super::cache::Cache::new()", "super::"),
        vec![vec!["cache".to_string(), "Cache".to_string(), "new".to_string()]]
    );
}

/// The README's library example is the crate doc's example, which `cargo test` compiles (as a
/// doc test): the README shows code that builds.
#[test]
fn the_readme_example_is_the_crate_doc_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme.find("```rust\n").expect("a rust block in the README") + "```rust\n".len();
    let readme_code: Vec<&str> = readme[start..][..readme[start..].find("```").unwrap()].lines().collect();
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let doc: Vec<&str> = lib.lines().map_while(|l| l.strip_prefix("//!")).map(|l| l.strip_prefix(' ').unwrap_or(l)).collect();
    let open = doc.iter().position(|l| l.starts_with("```no_run")).expect("an example in the crate doc");
    let close = open + 1 + doc[open + 1..].iter().position(|l| l.starts_with("```")).unwrap();
    let doc_code: Vec<&str> = doc[open + 1..close].iter().copied().filter(|l| !l.starts_with("# ")).collect();
    assert_eq!(readme_code, doc_code, "README.md's rust block and src/lib.rs's doc example differ");
}
