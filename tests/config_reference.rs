//! `docs/reference/config.md` is the config reference rendered from the doc comments of the
//! config types (`stepppo::config::reference`). These tests fail when a key or value has no
//! doc comment, when the committed page differs from the rendered one, or when the page's list
//! of ready configs misses a file of `configs/`. `STEPPPO_BLESS=1` rewrites the page.

use std::path::Path;

use stepppo::config::reference::{render, BLESS_COMMAND, PAGE_PATH, READY_CONFIGS};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The rendered page; fails naming every undocumented key or value.
fn rendered() -> String {
    render().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_key_and_value_is_documented() {
    rendered();
}

#[test]
fn the_committed_page_is_the_rendered_one() {
    let page = rendered();
    let path = repo().join(PAGE_PATH);
    if std::env::var_os("STEPPPO_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &page).unwrap_or_else(|e| panic!("writing {PAGE_PATH}: {e}"));
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != page {
        let line = committed
            .lines()
            .zip(page.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(page.lines().count()));
        panic!(
            "{PAGE_PATH} is not what the config types' doc comments render (first difference at \
             line {}); run `{BLESS_COMMAND}` to rewrite it, then commit it",
            line + 1
        );
    }
}

#[test]
fn the_ready_configs_listed_are_those_of_configs() {
    let mut on_disk: Vec<String> = std::fs::read_dir(repo().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = READY_CONFIGS.iter().map(|(f, _)| f.to_string()).collect();
    listed.sort();
    assert_eq!(
        listed, on_disk,
        "READY_CONFIGS (src/config/reference.rs) must list every configs/*.yaml with a phrase"
    );
}

#[test]
fn every_question_template_is_named() {
    let page = rendered();
    for name in stepppo::env::hotpotqa::world::template_names() {
        assert!(
            page.contains(&format!("`{name}`")),
            "the doc comment of HotpotQaConfig::templates does not name `{name}`"
        );
    }
}
