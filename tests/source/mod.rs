//! Reads this crate's `src/` the way the compiler lays it out, for the checks that look at the
//! code itself (`imports_point_one_way`, `public_api`): from `src/lib.rs` along its `mod`
//! declarations (with `#[path]`), leaving out `#[cfg(test)]` items.
#![allow(dead_code)]

pub mod api;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use syn::visit::Visit;

/// One module: the file it lives in, the items it defines and the names it imports.
#[derive(Debug, Default)]
pub struct Module {
    pub file: String,
    pub items: BTreeSet<String>,
    pub children: BTreeSet<String>,
    /// Imported name → the absolute path it stands for.
    pub imports: BTreeMap<String, Vec<String>>,
    /// Modules whose every item is imported (`use x::*`).
    pub globs: Vec<Vec<String>>,
    /// Paths named in the module (use lists and code), as written.
    pub named: Vec<Vec<String>>,
    /// Reachable from the crate root through `pub mod`s.
    pub public: bool,
    /// The `cfg` attributes of the module and the modules around it.
    pub cfg: Vec<String>,
    /// Its `pub` items, rendered.
    pub api: Vec<ApiItem>,
    /// `pub use` re-exports: name → the path it stands for, with the `cfg` of the `use`.
    pub pub_uses: Vec<(String, Vec<String>, Vec<String>)>,
    /// `pub use x::*` re-exports, with their `cfg`.
    pub pub_globs: Vec<(Vec<String>, Vec<String>)>,
    /// Its `impl` blocks (of any visibility: a `pub` method of a public type is public).
    pub impls: Vec<ImplBlock>,
}

/// A `pub` item: its name, its rendered lines (the first names the item, the others its public
/// fields, variants or trait items) and its own `cfg` attributes.
#[derive(Debug, Clone)]
pub struct ApiItem {
    pub name: String,
    pub lines: Vec<String>,
    pub cfg: Vec<String>,
}

/// An `impl` block: its self type as written, the trait it implements (rendered) and its `pub`
/// methods (rendered).
#[derive(Debug, Clone)]
pub struct ImplBlock {
    pub self_ty: Vec<String>,
    pub of_trait: Option<String>,
    pub methods: Vec<String>,
    pub cfg: Vec<String>,
}

/// The crate's modules by absolute path (`["crate", "sharding", "shard"]`).
pub type Modules = BTreeMap<Vec<String>, Module>;

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
/// `public`: reachable from the root through `pub mod`s; `cfg`: the attributes on the way.
#[allow(clippy::too_many_arguments)]
fn read_items(
    modules: &mut Modules,
    load: &dyn Fn(&Path) -> Option<String>,
    path: Vec<String>,
    file: &str,
    dir: &Path,
    items: &[syn::Item],
    public: bool,
    cfg: Vec<String>,
) {
    let mut module = Module { file: file.to_string(), public, cfg: cfg.clone(), ..Module::default() };
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
        if !is_hidden(attrs) {
            api::collect(item, attrs, &mut module);
        }
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
    // A module declared twice under opposite `cfg`s (public with a feature, crate-private
    // without) is read once, as its public declaration.
    nested.sort_by_key(|(_, m)| !matches!(m.vis, syn::Visibility::Public(_)));
    let mut seen = BTreeSet::new();
    nested.retain(|(child, _)| seen.insert(child.clone()));
    for (child, m) in nested {
        let mut child_path = path.clone();
        child_path.push(child.clone());
        let child_public = public && matches!(m.vis, syn::Visibility::Public(_)) && !is_hidden(&m.attrs);
        let mut child_cfg = cfg.clone();
        child_cfg.extend(api::cfgs(&m.attrs));
        if let Some((_, inline)) = &m.content {
            read_items(modules, load, child_path, file, &dir.join(&child), inline, child_public, child_cfg);
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
        let child_file = child_file.display().to_string();
        read_items(modules, load, child_path, &child_file, &child_dir, &parsed.items, child_public, child_cfg);
    }
}

/// `#[doc(hidden)]`, or only for tests and doc tests.
fn is_hidden(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        let tokens = a.meta.require_list().map(|l| l.tokens.to_string()).unwrap_or_default();
        (a.path().is_ident("doc") && tokens == "hidden") || (a.path().is_ident("cfg") && tokens == "doctest")
    })
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
pub fn absolute(modules: &Modules, at: &[String], named: &[String]) -> Option<Vec<String>> {
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
pub fn defining_file(modules: &Modules, path: &[String], depth: usize) -> Option<String> {
    resolve(modules, path, depth).map(|(module, _)| modules[&module].file.clone())
}

/// The module that defines the item `path` names and the item's name there, following
/// re-exports; `None` for a module named on its own or a name not found.
pub fn resolve(modules: &Modules, path: &[String], depth: usize) -> Option<(Vec<String>, String)> {
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
        return Some((module_path.to_vec(), name.clone()));
    }
    if let Some(full) = module.imports.get(name) {
        let mut next = absolute(modules, module_path, full)?;
        next.extend(path[module_len + 1..].iter().cloned());
        return resolve(modules, &next, depth + 1);
    }
    module.globs.iter().find_map(|glob| {
        let mut next = absolute(modules, module_path, glob)?;
        next.extend(path[module_len..].iter().cloned());
        resolve(modules, &next, depth + 1)
    })
}

/// Reads the crate rooted at `root` (`src/lib.rs`).
pub fn read_crate(load: &dyn Fn(&Path) -> Option<String>, root: &Path) -> Modules {
    let text = load(root).unwrap_or_else(|| panic!("no {}", root.display()));
    let parsed = syn::parse_file(&text).expect("lib.rs parses");
    let mut modules = Modules::new();
    let dir = root.parent().unwrap().to_path_buf();
    let root_file = root.display().to_string();
    read_items(&mut modules, load, vec!["crate".to_string()], &root_file, &dir, &parsed.items, true, Vec::new());
    modules
}

/// Reads a file of this crate by its path from the crate's folder.
pub fn disk(path: &Path) -> Option<String> {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).ok()
}
