//! The public surface: every `pub` item reachable from the crate root (through `pub mod`s and
//! `pub use`s), its public fields, variants, trait items and methods, one line each with the
//! `cfg` it needs.

use std::collections::{BTreeMap, BTreeSet};

use quote::ToTokens;

use super::{ApiItem, ImplBlock, Module, Modules, absolute, resolve};

/// The `cfg(...)` attributes among `attrs`, rendered.
pub fn cfgs(attrs: &[syn::Attribute]) -> Vec<String> {
    attrs.iter().filter(|a| a.path().is_ident("cfg")).map(|a| tidy(&a.meta.to_token_stream().to_string())).collect()
}

/// Token text with the spaces a person would not write taken out.
fn tidy(text: &str) -> String {
    let mut s = text.to_string();
    for (from, to) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" ::", "::"),
        (" < ", "<"),
        ("< ", "<"),
        (" <", "<"),
        (" >", ">"),
        (" ,", ","),
        ("( ", "("),
        (" )", ")"),
        (" (", "("),
        ("& ", "&"),
        ("[ ", "["),
        (" ]", "]"),
        (" ;", ";"),
        (" :", ":"),
        ("' ", "'"),
        (" !", "!"),
        (" ?", "?"),
    ] {
        while s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s.replace("->", " -> ").replace("  ", " ").replace("=>", " => ").replace("  ", " ")
}

fn render(tokens: impl ToTokens) -> String {
    tidy(&tokens.to_token_stream().to_string())
}

fn is_pub(vis: &syn::Visibility) -> bool {
    matches!(vis, syn::Visibility::Public(_))
}

fn hidden(attrs: &[syn::Attribute]) -> bool {
    super::is_hidden(attrs) || super::is_cfg_test(attrs)
}

fn signature(sig: &syn::Signature) -> String {
    render(sig)
}

/// The traits a type derives, one line.
fn derives(attrs: &[syn::Attribute]) -> Option<String> {
    let mut names: Vec<String> = attrs
        .iter()
        .filter(|a| a.path().is_ident("derive"))
        .filter_map(|a| a.meta.require_list().ok().map(|l| tidy(&l.tokens.to_string())))
        .flat_map(|list| list.split(',').map(|n| n.trim().to_string()).collect::<Vec<_>>())
        .filter(|n| !n.is_empty())
        .collect();
    names.sort();
    (!names.is_empty()).then(|| format!(": derive({})", names.join(", ")))
}

fn fields(fields: &syn::Fields, public_only: bool) -> Vec<String> {
    fields
        .iter()
        .enumerate()
        .filter(|(_, f)| !public_only || is_pub(&f.vis))
        .map(|(i, f)| {
            let name = f.ident.as_ref().map(|i| i.to_string()).unwrap_or_else(|| i.to_string());
            format!("{name}: {}", render(&f.ty))
        })
        .collect()
}

/// Records `item` in `module` if it is `pub` (or an `impl` block, whose `pub` methods count when
/// its type is public).
pub fn collect(item: &syn::Item, attrs: &[syn::Attribute], module: &mut Module) {
    if hidden(attrs) {
        return;
    }
    let cfg = cfgs(attrs);
    let mut push = |name: String, lines: Vec<String>| module.api.push(ApiItem { name, lines, cfg: cfg.clone() });
    match item {
        syn::Item::Fn(i) if is_pub(&i.vis) => push(i.sig.ident.to_string(), vec![signature(&i.sig)]),
        syn::Item::Const(i) if is_pub(&i.vis) => {
            push(i.ident.to_string(), vec![format!("const {}: {}", i.ident, render(&i.ty))])
        }
        syn::Item::Static(i) if is_pub(&i.vis) => {
            push(i.ident.to_string(), vec![format!("static {}: {}", i.ident, render(&i.ty))])
        }
        syn::Item::Type(i) if is_pub(&i.vis) => {
            push(i.ident.to_string(), vec![format!("type {}{} = {}", i.ident, render(&i.generics), render(&i.ty))])
        }
        syn::Item::Struct(i) if is_pub(&i.vis) => {
            let mut lines = vec![format!("struct {}{}", i.ident, render(&i.generics))];
            lines.extend(fields(&i.fields, true).into_iter().map(|f| format!(".{f}")));
            if i.fields.iter().any(|f| !is_pub(&f.vis)) && !i.fields.is_empty() {
                lines.push(": has private fields".to_string());
            }
            lines.extend(derives(&i.attrs));
            push(i.ident.to_string(), lines)
        }
        syn::Item::Enum(i) if is_pub(&i.vis) => {
            let non_exhaustive = i.attrs.iter().any(|a| a.path().is_ident("non_exhaustive"));
            let mut lines = vec![format!(
                "enum {}{}{}",
                i.ident,
                render(&i.generics),
                if non_exhaustive { " (non_exhaustive)" } else { "" }
            )];
            for v in i.variants.iter().filter(|v| !hidden(&v.attrs)) {
                let f = fields(&v.fields, false);
                lines.push(if f.is_empty() {
                    format!("::{}", v.ident)
                } else {
                    format!("::{}({})", v.ident, f.join(", "))
                });
            }
            lines.extend(derives(&i.attrs));
            push(i.ident.to_string(), lines)
        }
        syn::Item::Trait(i) if is_pub(&i.vis) => {
            let supertraits =
                if i.supertraits.is_empty() { String::new() } else { format!(": {}", render(&i.supertraits)) };
            let mut lines = vec![format!("trait {}{}{supertraits}", i.ident, render(&i.generics))];
            for t in &i.items {
                match t {
                    syn::TraitItem::Fn(f) if !hidden(&f.attrs) => {
                        let default = if f.default.is_some() { " (provided)" } else { "" };
                        lines.push(format!("::{}{default}", signature(&f.sig)));
                    }
                    syn::TraitItem::Type(t) => lines.push(format!("::type {}: {}", t.ident, render(&t.bounds))),
                    syn::TraitItem::Const(c) => lines.push(format!("::const {}: {}", c.ident, render(&c.ty))),
                    _ => {}
                }
            }
            push(i.ident.to_string(), lines)
        }
        syn::Item::Macro(i) if i.attrs.iter().any(|a| a.path().is_ident("macro_export")) => {
            if let Some(name) = &i.ident {
                push(name.to_string(), vec![format!("macro {name}!")]);
            }
        }
        syn::Item::Use(u) if is_pub(&u.vis) => pub_uses(&[], &u.tree, &cfg, module),
        syn::Item::Impl(i) => {
            let syn::Type::Path(ty) = &*i.self_ty else { return };
            let self_ty: Vec<String> = ty.path.segments.iter().map(|s| s.ident.to_string()).collect();
            let of_trait = i
                .trait_
                .as_ref()
                .map(|(bang, path, _)| format!("{}{}", if bang.is_some() { "!" } else { "" }, render(path)));
            let methods = i
                .items
                .iter()
                .filter_map(|m| match m {
                    syn::ImplItem::Fn(f) if is_pub(&f.vis) && !hidden(&f.attrs) => Some(signature(&f.sig)),
                    syn::ImplItem::Const(c) if is_pub(&c.vis) && !hidden(&c.attrs) => {
                        Some(format!("const {}: {}", c.ident, render(&c.ty)))
                    }
                    _ => None,
                })
                .collect();
            module.impls.push(ImplBlock { self_ty, of_trait, methods, cfg });
        }
        _ => {}
    }
}

fn pub_uses(prefix: &[String], tree: &syn::UseTree, cfg: &[String], module: &mut Module) {
    match tree {
        syn::UseTree::Path(p) => {
            let mut next = prefix.to_vec();
            next.push(p.ident.to_string());
            pub_uses(&next, &p.tree, cfg, module);
        }
        syn::UseTree::Name(n) => {
            let mut full = prefix.to_vec();
            full.push(n.ident.to_string());
            module.pub_uses.push((n.ident.to_string(), full, cfg.to_vec()));
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.to_vec();
            full.push(r.ident.to_string());
            module.pub_uses.push((r.rename.to_string(), full, cfg.to_vec()));
        }
        syn::UseTree::Glob(_) => module.pub_globs.push((prefix.to_vec(), cfg.to_vec())),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| pub_uses(prefix, t, cfg, module)),
    }
}

/// A public path of a defined item: (public path, the `cfg`s on the way).
type PublicPaths = BTreeMap<(Vec<String>, String), BTreeSet<(String, Vec<String>)>>;

fn public_paths(modules: &Modules) -> PublicPaths {
    let mut paths: PublicPaths = BTreeMap::new();
    let show = |m: &[String]| {
        let mut p = vec!["ddshard".to_string()];
        p.extend(m[1..].iter().cloned());
        p.join("::")
    };
    for (at, module) in modules.iter().filter(|(_, m)| m.public) {
        for item in &module.api {
            let mut cfg = module.cfg.clone();
            cfg.extend(item.cfg.iter().cloned());
            paths
                .entry((at.clone(), item.name.clone()))
                .or_default()
                .insert((format!("{}::{}", show(at), item.name), cfg));
        }
        // Re-exports (and globs, by each item of the glob's module).
        let mut named: Vec<(String, Vec<String>, Vec<String>)> = module.pub_uses.clone();
        for (glob, cfg) in &module.pub_globs {
            let Some(target) = absolute(modules, at, glob) else { continue };
            if let Some(m) = modules.get(&target) {
                for item in &m.api {
                    let mut full = glob.clone();
                    full.push(item.name.clone());
                    let mut cfg = cfg.clone();
                    cfg.extend(m.cfg.iter().cloned());
                    named.push((item.name.clone(), full, cfg));
                }
            }
        }
        for (alias, full, use_cfg) in named {
            let Some(target) = absolute(modules, at, &full) else { continue };
            let Some((def_module, name)) = resolve(modules, &target, 0) else { continue };
            let Some(def) = modules.get(&def_module) else { continue };
            let Some(item) = def.api.iter().find(|i| i.name == name) else { continue };
            let mut cfg = module.cfg.clone();
            cfg.extend(use_cfg.iter().cloned());
            cfg.extend(def.cfg.iter().cloned());
            cfg.extend(item.cfg.iter().cloned());
            cfg.sort();
            cfg.dedup();
            paths.entry((def_module, name)).or_default().insert((format!("{}::{alias}", show(at)), cfg));
        }
    }
    paths
}

fn suffix(cfg: &[String]) -> String {
    let mut cfg = cfg.to_vec();
    cfg.sort();
    cfg.dedup();
    if cfg.is_empty() { String::new() } else { format!("  {}", cfg.join(" ")) }
}

/// The public surface, one sorted line per item, field, variant, trait item and method.
pub fn surface(modules: &Modules) -> Vec<String> {
    let paths = public_paths(modules);
    let mut lines = BTreeSet::new();
    let mut first_path: BTreeMap<(Vec<String>, String), (String, Vec<String>)> = BTreeMap::new();
    for ((def_module, name), public) in &paths {
        let item = modules[def_module].api.iter().find(|i| &i.name == name).expect("collected");
        for (path, cfg) in public {
            let (head, rest) = item.lines.split_first().expect("a head line");
            lines.insert(format!("{path}: {head}{}", suffix(cfg)));
            for line in rest {
                lines
                    .insert(format!("{path}{line}{}", if line.starts_with('(') { String::new() } else { suffix(cfg) }));
            }
        }
        // Methods are listed under the shortest public path of their type.
        let shortest = public.iter().min_by_key(|(p, _)| (p.len(), p.clone())).expect("a path").clone();
        first_path.insert((def_module.clone(), name.clone()), shortest);
    }
    for (at, module) in modules {
        for block in &module.impls {
            let Some(full) = absolute(modules, at, &block.self_ty) else { continue };
            let Some(def) = resolve(modules, &full, 0) else { continue };
            let Some((path, cfg)) = first_path.get(&def) else { continue };
            let mut cfg = cfg.clone();
            cfg.extend(block.cfg.iter().cloned());
            match &block.of_trait {
                Some(t) => {
                    lines.insert(format!("{path}: impl {t}{}", suffix(&cfg)));
                }
                None => {
                    for m in &block.methods {
                        lines.insert(format!("{path}::{m}{}", suffix(&cfg)));
                    }
                }
            }
        }
    }
    lines.into_iter().collect()
}
