//! Imports point one way: no two files of the library import each other, directly or around a
//! circle, and no production file imports the testkit. And one module layout: no `#[path]`.
//!
//! The check reads the crate the way the compiler lays it out: from `src/lib.rs` along its
//! `mod` declarations (with `#[path]`), leaving out `#[cfg(test)]` items. Every path that
//! names an item of the crate (`use` lists and paths in code, through `crate::`, `super::`,
//! `self::`, a child module or an imported name) is followed through re-exports to the file that
//! defines the item: an arrow from the file that names it to that file. A module named on its
//! own draws no arrow (its items do), and neither does an item a module takes from its own
//! ancestors (`super::`, its folder's `mod.rs`): that is the module tree, not a layer running
//! backwards. Paths inside macro calls are not read.

mod source;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use source::{Modules, absolute, defining_file, disk, read_crate};

/// Every arrow between two files: (from, to) → the names that draw it.
fn arrows(modules: &Modules) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut arrows: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for (at, module) in modules {
        for named in &module.named {
            let Some(full) = absolute(modules, at, named) else { continue };
            let Some(to) = defining_file(modules, &full, 0) else { continue };
            // A module may take items from its own ancestors (`super::`, the folder's
            // `mod.rs`): that is the module tree, not a layer running backwards.
            let to_module = modules.iter().find(|(_, m)| m.file == to).map(|(p, _)| p);
            let up = to_module.is_some_and(|p| at.starts_with(p) && p.len() < at.len());
            if to != module.file && !up {
                let name = full.last().cloned().unwrap_or_default();
                arrows.entry((module.file.clone(), to)).or_default().insert(name);
            }
        }
    }
    arrows
}

/// The circles: strongly connected sets of more than one file (Tarjan's algorithm).
fn circles(arrows: &BTreeMap<(String, String), BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in arrows.keys() {
        next.entry(from).or_default().push(to);
        next.entry(to).or_default();
    }
    struct Walk<'a> {
        next: &'a BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for &w in &self.next[v] {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut circle = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    circle.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if circle.len() > 1 {
                    circle.sort();
                    self.found.push(circle);
                }
            }
        }
    }
    let mut walk = Walk {
        next: &next,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for &v in next.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.found
}

fn describe(circle: &[String], arrows: &BTreeMap<(String, String), BTreeSet<String>>) -> String {
    let mut lines = vec![format!("circle of {} files:", circle.len())];
    for ((from, to), names) in arrows {
        if circle.contains(from) && circle.contains(to) {
            lines.push(format!("  {from} -> {to}: {}", names.iter().cloned().collect::<Vec<_>>().join(", ")));
        }
    }
    lines.join("\n")
}

#[test]
fn no_two_files_of_the_library_import_each_other_around_a_circle() {
    let modules = read_crate(&disk, Path::new("src/lib.rs"));
    assert!(modules.len() > 50, "the crate was read: {} modules", modules.len());
    let arrows = arrows(&modules);
    assert!(arrows.len() > 100, "arrows were found: {}", arrows.len());
    let found = circles(&arrows);
    let report: Vec<String> = found.iter().map(|c| describe(c, &arrows)).collect();
    assert!(found.is_empty(), "imports must point one way; move a shared item down a layer:\n{}", report.join("\n"));
}

#[test]
fn no_production_file_imports_the_testkit() {
    let modules = read_crate(&disk, Path::new("src/lib.rs"));
    let testkit = |file: &str| file.starts_with("src/testkit/") || file == "src/testkit.rs";
    assert!(modules.values().any(|m| testkit(&m.file)), "the testkit was read");
    let wrong: Vec<String> = arrows(&modules)
        .into_iter()
        .filter(|((from, to), _)| !testkit(from) && testkit(to))
        .map(|((from, to), names)| format!("{from} -> {to}: {names:?}"))
        .collect();
    assert!(wrong.is_empty(), "production code must not depend on the testkit:\n{}", wrong.join("\n"));
}

/// One module layout: a module of one file keeps its tests inline; a module that spans files
/// is a folder (`x/mod.rs`), with its tests in `x/tests.rs` or `x/tests/`. A `#[path]`
/// attribute would mount a file somewhere its name does not say, so none is allowed.
#[test]
fn every_module_sits_where_its_name_says_without_a_path_attribute() {
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    rust_files(Path::new("src"), &mut files);
    assert!(files.len() > 50, "the library's files were found");
    let mounted: Vec<String> = files
        .iter()
        .filter(|f| std::fs::read_to_string(f).expect("a source file").contains("#[path"))
        .map(|f| f.display().to_string())
        .collect();
    assert!(mounted.is_empty(), "move these modules into folders instead of #[path]: {mounted:?}");
}

/// The check itself: a circle through a re-export and a `super::` path is found, and the
/// arrows name what ties it.
#[test]
fn a_circle_through_a_re_export_is_found_and_a_test_module_draws_no_arrow() {
    let files: BTreeMap<PathBuf, &str> = [
        ("x/lib.rs", "mod a;\nmod b;\npub use a::Alpha;\n"),
        ("x/a.rs", "pub struct Alpha;\nfn f() -> crate::b::Beta { todo!() }\n"),
        ("x/b/mod.rs", "mod inner;\npub use inner::Beta;\n#[cfg(test)]\nmod tests { use crate::a::Alpha; }\n"),
        ("x/b/inner.rs", "pub struct Beta;\nfn g(_: super::super::Alpha) {}\n"),
        ("x/c.rs", "this file is not part of the crate"),
    ]
    .into_iter()
    .map(|(p, t)| (PathBuf::from(p), t))
    .collect();
    let load = |p: &Path| files.get(p).map(|t| t.to_string());
    let modules = read_crate(&load, Path::new("x/lib.rs"));
    let arrows = arrows(&modules);
    let pairs: BTreeSet<(String, String)> = arrows.keys().cloned().collect();
    let expected: BTreeSet<(String, String)> = [
        ("x/a.rs", "x/b/inner.rs"),
        ("x/b/inner.rs", "x/a.rs"),
        ("x/b/mod.rs", "x/b/inner.rs"),
        ("x/lib.rs", "x/a.rs"),
    ]
    .map(|(a, b)| (a.into(), b.into()))
    .into();
    assert_eq!(pairs, expected, "{arrows:?}");
    assert_eq!(circles(&arrows), vec![vec!["x/a.rs".to_string(), "x/b/inner.rs".to_string()]]);
}
