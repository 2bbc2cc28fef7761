//! The public API is deliberate: `tests/public-api.txt` lists every public item, field,
//! variant, trait item and method (with the features it needs), and this test fails when the
//! surface differs from it. After a deliberate change, regenerate it with
//! `DDSHARD_BLESS=1 cargo test --test public_api` and review the diff.

mod source;

use std::path::Path;

use source::{api, disk, read_crate};

#[test]
fn the_public_api_is_the_one_listed_in_public_api_txt() {
    let modules = read_crate(&disk, Path::new("src/lib.rs"));
    let surface = api::surface(&modules);
    assert!(surface.iter().any(|l| l.starts_with("ddshard::Node::")), "the surface was read");
    let listed_at = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/public-api.txt");
    let now = format!("{}\n", surface.join("\n"));
    if std::env::var_os("DDSHARD_BLESS").is_some() {
        std::fs::write(&listed_at, &now).expect("write the listing");
        return;
    }
    let listed = std::fs::read_to_string(&listed_at).unwrap_or_default();
    if listed != now {
        let old: std::collections::BTreeSet<&str> = listed.lines().collect();
        let new: std::collections::BTreeSet<&str> = now.lines().collect();
        let gone: Vec<_> = old.difference(&new).map(|l| format!("- {l}")).collect();
        let added: Vec<_> = new.difference(&old).map(|l| format!("+ {l}")).collect();
        panic!(
            "the public API changed ({} lines gone, {} added); if that is deliberate, run \
             DDSHARD_BLESS=1 cargo test --test public_api and commit tests/public-api.txt:\n{}\n{}",
            gone.len(),
            added.len(),
            gone.join("\n"),
            added.join("\n")
        );
    }
}
