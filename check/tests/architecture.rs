//! `docs/architecture.md` stays true (issue 43): every repository path it names (a word
//! with a `/` ending in `.rs`, `.md` or `.sql`) exists in the tree, so a file renamed or
//! moved without the guide fails here, naming the path. It also holds its pictures: the
//! crates and the send path are Mermaid diagrams.

use std::path::Path;

/// The words of `text` that look like repository paths: runs of `[A-Za-z0-9_./-]` holding a
/// `/` and ending in `.rs`, `.md` or `.sql`.
fn paths_named(text: &str) -> Vec<&str> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    text.split(|c: char| !is_path_char(c))
        .map(|w| w.trim_end_matches('.'))
        .filter(|w| w.contains('/') && [".rs", ".md", ".sql"].iter().any(|x| w.ends_with(x)))
        .collect()
}

#[test]
fn every_path_the_architecture_guide_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = root.join("docs/architecture.md");
    let text = std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
    let named = paths_named(&text);
    assert!(named.len() > 20, "too few paths found: {named:?}");
    let missing: Vec<&&str> = named.iter().filter(|p| !root.join(p).is_file()).collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md names paths that do not exist: {missing:?}"
    );
    assert!(
        text.matches("```mermaid").count() >= 2,
        "the crates and the send path are Mermaid diagrams"
    );
    // The send path crosses these files of the gateway: the guide must name each.
    for f in [
        "gateway/src/conn.rs",
        "gateway/src/batch.rs",
        "gateway/src/store.rs",
        "gateway/src/fanout.rs",
        "gateway/src/hub.rs",
        "gateway/src/sweep.rs",
    ] {
        assert!(named.contains(&f), "the send path does not name {f}");
    }
}

/// The path finder itself: a path at the end of a sentence, in backticks or in a table
/// cell is found; a crate name or a bare file name is not.
#[test]
fn paths_are_found_in_prose_and_code() {
    let t = "see `gateway/src/conn.rs`, then check/src/lib.rs. Not lib.rs, nor im_check::check; \
             evidence/README.md| migrations/0004_send_batch.sql";
    assert_eq!(
        paths_named(t),
        [
            "gateway/src/conn.rs",
            "check/src/lib.rs",
            "evidence/README.md",
            "migrations/0004_send_batch.sql"
        ]
    );
}
