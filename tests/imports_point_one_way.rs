//! Imports point one way: no two files of the library import each other, directly or around a
//! circle, and no production file imports the testkit.
//!
//! The check reads the crate the way the compiler lays it out: from `src/lib.rs` along its
//! `mod` declarations (with `#[path]`), leaving out `#[cfg(test)]` items. Every path that
//! names an item of the crate (`use` lists and paths in code, through `crate::`, `super::`,
//! `self::`, a child module or an imported name) is followed through re-exports to the file that
//! defines the item: an arrow from the file that names it to that file. A module named on its
//! own draws no arrow (its items do), and neither does an item a module takes from its own
//! ancestors (`super::`, its folder's `mod.rs`): that is the module tree, not a layer running
//! backwards. Paths inside macro calls are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// One module: the file it lives in, the items it defines and the names it imports.
#[derive(Debug, Default)]
struct Module {
    file: String,
    items: BTreeSet<String>,
    children: BTreeSet<String>,
    /// Imported name → the absolute path it stands for.
    imports: BTreeMap<String, Vec<String>>,
    /// Modules whose every item is imported (`use x::*`).
    globs: Vec<Vec<String>>,
    /// Paths named in the module (use lists and code), as written.
    named: Vec<Vec<String>>,
}

/// The crate's modules by absolute path (`["crate", "sharding", "shard"]`).
type Modules = BTreeMap<Vec<String>, Module>;

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.meta.require_list().map(|l| l.tokens.to_string() == "test").unwrap_or(false)
    })
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find(|a| a.path().is_ident("path")).and_then(|a| match &a.meta {
        syn::Meta::NameValue(nv) => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// Collects the paths named in code.
struct Named<'a>(&'a mut Vec<Vec<String>>);

impl<'ast> Visit<'ast> for Named<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.0.push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, p);
    }
    fn visit_item(&mut self, _: &'ast syn::Item) {
        // Nested items are read as items of their module by `read_items`.
    }
}

fn use_tree(prefix: &[String], tree: &syn::UseTree, module: &mut Module) {
    match tree {
        syn::UseTree::Path(p) => {
            let mut next = prefix.to_vec();
            next.push(p.ident.to_string());
            use_tree(&next, &p.tree, module);
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            let (alias, full) = if name == "self" {
                (prefix.last().cloned().unwrap_or_default(), prefix.to_vec())
            } else {
                let mut full = prefix.to_vec();
                full.push(name.clone());
                (name, full)
            };
            module.named.push(full.clone());
            module.imports.insert(alias, full);
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.to_vec();
            full.push(r.ident.to_string());
            module.named.push(full.clone());
            module.imports.insert(r.rename.to_string(), full);
        }
        syn::UseTree::Glob(_) => module.globs.push(prefix.to_vec()),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| use_tree(prefix, t, module)),
    }
}

/// Reads `items` as the module `path` in `file`; `dir` is where its child modules' files are.
fn read_items(
    modules: &mut Modules,
    load: &dyn Fn(&Path) -> Option<String>,
    path: Vec<String>,
    file: &str,
    dir: &Path,
    items: &[syn::Item],
) {
    let mut module = Module { file: file.to_string(), ..Module::default() };
    let mut nested = Vec::new();
    for item in items {
        let attrs = match item {
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Union(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            _ => continue,
        };
        if is_cfg_test(attrs) {
            continue;
        }
        let name = match item {
            syn::Item::Const(i) => Some(i.ident.to_string()),
            syn::Item::Enum(i) => Some(i.ident.to_string()),
            syn::Item::Fn(i) => Some(i.sig.ident.to_string()),
            syn::Item::Static(i) => Some(i.ident.to_string()),
            syn::Item::Struct(i) => Some(i.ident.to_string()),
            syn::Item::Trait(i) => Some(i.ident.to_string()),
            syn::Item::Type(i) => Some(i.ident.to_string()),
            syn::Item::Union(i) => Some(i.ident.to_string()),
            syn::Item::Macro(i) => i.ident.as_ref().map(|i| i.to_string()),
            _ => None,
        };
        module.items.extend(name);
        match item {
            syn::Item::Use(u) => use_tree(&[], &u.tree, &mut module),
            syn::Item::Mod(m) => {
                let child = m.ident.to_string();
                module.children.insert(child.clone());
                nested.push((child, m));
            }
            other => {
                let mut named = std::mem::take(&mut module.named);
                Named(&mut named).visit_item_inner(other);
                module.named = named;
            }
        }
    }
    modules.insert(path.clone(), module);
    for (child, m) in nested {
        let mut child_path = path.clone();
        child_path.push(child.clone());
        if let Some((_, inline)) = &m.content {
            read_items(modules, load, child_path, file, &dir.join(&child), inline);
            continue;
        }
        let candidates = match path_attr(&m.attrs) {
            // Relative to the directory of the file that declares the module.
            Some(p) => vec![Path::new(file).parent().unwrap_or(dir).join(p)],
            None => vec![dir.join(format!("{child}.rs")), dir.join(&child).join("mod.rs")],
        };
        let found = candidates.iter().find_map(|c| load(c).map(|text| (c.clone(), text)));
        let Some((child_file, text)) = found else { panic!("module {child_path:?} has no file among {candidates:?}") };
        let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", child_file.display()));
        let child_dir = if child_file.file_name().is_some_and(|n| n == "mod.rs") {
            child_file.parent().unwrap().to_path_buf()
        } else {
            child_file.with_extension("")
        };
        read_items(modules, load, child_path, &child_file.display().to_string(), &child_dir, &parsed.items);
    }
}

/// Visits what an item holds (not the item as a nested item).
trait VisitInner<'ast> {
    fn visit_item_inner(&mut self, item: &'ast syn::Item);
}

impl<'ast> VisitInner<'ast> for Named<'_> {
    fn visit_item_inner(&mut self, item: &'ast syn::Item) {
        match item {
            syn::Item::Const(i) => syn::visit::visit_item_const(self, i),
            syn::Item::Enum(i) => syn::visit::visit_item_enum(self, i),
            syn::Item::Fn(i) => syn::visit::visit_item_fn(self, i),
            syn::Item::Impl(i) => syn::visit::visit_item_impl(self, i),
            syn::Item::Static(i) => syn::visit::visit_item_static(self, i),
            syn::Item::Struct(i) => syn::visit::visit_item_struct(self, i),
            syn::Item::Trait(i) => syn::visit::visit_item_trait(self, i),
            syn::Item::Type(i) => syn::visit::visit_item_type(self, i),
            syn::Item::Union(i) => syn::visit::visit_item_union(self, i),
            _ => {}
        }
    }
}

/// Makes `named` (as written in module `at`) absolute; `None` for another crate's path.
fn absolute(modules: &Modules, at: &[String], named: &[String]) -> Option<Vec<String>> {
    absolute_within(modules, at, named, 0)
}

fn absolute_within(modules: &Modules, at: &[String], named: &[String], depth: usize) -> Option<Vec<String>> {
    if depth > 16 {
        return None;
    }
    let first = named.first()?;
    let module = modules.get(at)?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => vec!["crate".to_string()],
        "self" => at.to_vec(),
        "super" => {
            let mut base = at.to_vec();
            let mut rest = named;
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            return Some(base);
        }
        _ if module.children.contains(first) || module.items.contains(first) => {
            let mut base = at.to_vec();
            base.push(first.clone());
            base
        }
        _ => match module.imports.get(first) {
            Some(full) if full.first() != Some(first) || full.len() > 1 => {
                absolute_within(modules, at, full, depth + 1)?
            }
            _ => return None,
        },
    };
    base.extend(named[1..].iter().cloned());
    Some(base)
}

/// The file that defines the item `path` names, following re-exports; `None` for a module
/// named on its own or a name not found.
fn defining_file(modules: &Modules, path: &[String], depth: usize) -> Option<String> {
    if depth > 16 || path.first().map(String::as_str) != Some("crate") {
        return None;
    }
    let mut module_len = 1;
    while module_len < path.len() && modules.contains_key(&path[..=module_len].to_vec()) {
        module_len += 1;
    }
    let module_path = &path[..module_len];
    let module = modules.get(module_path)?;
    let name = path.get(module_len)?;
    if module.items.contains(name) {
        return Some(module.file.clone());
    }
    if let Some(full) = module.imports.get(name) {
        let mut next = absolute(modules, module_path, full)?;
        next.extend(path[module_len + 1..].iter().cloned());
        return defining_file(modules, &next, depth + 1);
    }
    module.globs.iter().find_map(|glob| {
        let mut next = absolute(modules, module_path, glob)?;
        next.extend(path[module_len..].iter().cloned());
        defining_file(modules, &next, depth + 1)
    })
}

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

/// Reads the crate rooted at `root` (`src/lib.rs`).
fn read_crate(load: &dyn Fn(&Path) -> Option<String>, root: &Path) -> Modules {
    let text = load(root).unwrap_or_else(|| panic!("no {}", root.display()));
    let parsed = syn::parse_file(&text).expect("lib.rs parses");
    let mut modules = Modules::new();
    let dir = root.parent().unwrap().to_path_buf();
    read_items(&mut modules, load, vec!["crate".to_string()], &root.display().to_string(), &dir, &parsed.items);
    modules
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

/// Reads a file of this crate by its path from the crate's folder.
fn disk(path: &Path) -> Option<String> {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).ok()
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
