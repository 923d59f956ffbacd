//! No module cycle in any crate (issue 43), kept true here. Each crate's module tree is read
//! from its `mod name;` declarations (from `lib.rs`, `main.rs` or a binary's root), each
//! module's references (`use crate::…`, `super::…`, `self::…`, in `use` statements and in
//! code) are resolved to the module that holds them, and every reference between two
//! modules that are not one inside the other is lifted to the pair of siblings that hold
//! them (`world::admin` → `checker` is `world` → `checker` at the crate's top). At every
//! level of every tree the siblings must form no ring, however long: that is the test.
//! A child's `super::` to its parent is the nesting itself, not a cycle; `mod tests;` files
//! are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

/// The crate roots of the workspace: each library and each binary.
fn crate_roots(root: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for krate in [
        "protocol",
        "check",
        "gateway",
        "harness",
        "scenarios",
        "bench",
    ] {
        let src = root.join(krate).join("src");
        for f in ["lib.rs", "main.rs"] {
            if src.join(f).is_file() {
                roots.push(src.join(f));
            }
        }
        let Ok(bins) = std::fs::read_dir(src.join("bin")) else {
            continue;
        };
        for e in bins.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "rs") {
                roots.push(p);
            } else if p.join("main.rs").is_file() {
                roots.push(p.join("main.rs"));
            }
        }
    }
    roots.sort();
    roots
}

/// The names of the `mod name;` declarations of a file (not inline `mod name { … }`).
fn declared_mods(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            // `#[cfg(test)] mod tests;` on one line.
            let l = match l.strip_prefix("#[") {
                Some(r) => r.split_once("] ").map_or(l, |(_, r)| r.trim()),
                None => l,
            };
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            let l = l.strip_prefix("pub(super) ").unwrap_or(l);
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let name = l.strip_prefix("mod ")?.strip_suffix(';')?.trim();
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
                .then(|| name.to_string())
        })
        .collect()
}

/// A crate's module tree: module path → its file.
fn module_tree(root_file: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut tree = BTreeMap::new();
    let mut todo = vec![(Vec::new(), root_file.to_path_buf())];
    while let Some((path, file)) = todo.pop() {
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let owns_dir = file == root_file || file.file_name().is_some_and(|n| n == "mod.rs");
        let dir = if owns_dir {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        // Test modules are left out (as tests are from every count of issue 43): a test's
        // fixtures may come from any module beside the one it tests.
        for name in declared_mods(&text).into_iter().filter(|n| n != "tests") {
            let child = [
                dir.join(format!("{name}.rs")),
                dir.join(&name).join("mod.rs"),
            ]
            .into_iter()
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{}: mod {name}; has no file", file.display()));
            let mut p = path.clone();
            p.push(name);
            todo.push((p, child));
        }
        tree.insert(path, file);
    }
    tree
}

/// Expands `a::{b, c::{d, e}}` into `a::b`, `a::c::d`, `a::c::e`.
fn expand(path: &str) -> Vec<String> {
    let path = path.trim();
    let Some(open) = path.find('{') else {
        return vec![path.to_string()];
    };
    let head = &path[..open];
    let body = &path[open + 1..path.rfind('}').unwrap_or(path.len())];
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(&format!("{head}{}", p.trim())))
        .collect()
}

/// Every path the text refers to from `crate`, `super` or `self`: whole `use` statements
/// (their groups expanded) and paths in code.
fn references(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("use ") {
        let starts_word = i == 0 || !rest[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        let after = &rest[i + 4..];
        let end = after.find(';').unwrap_or(after.len());
        if starts_word {
            out.extend(expand(&after[..end].replace(char::is_whitespace, "")));
        }
        rest = &after[end.min(after.len())..];
    }
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    for w in code.split(|c: char| !is_path_char(c)) {
        // `super::{a, b}` in code is a group the `use` reading above expanded.
        if !w.ends_with("::")
            && ["crate::", "super::", "self::"]
                .iter()
                .any(|p| w.starts_with(p))
        {
            out.push(w.to_string());
        }
    }
    out
}

/// The module a reference from `from` lands in: the longest known module its path names.
fn resolve(from: &ModPath, reference: &str, tree: &BTreeMap<ModPath, PathBuf>) -> Option<ModPath> {
    let mut segs = reference.split("::").filter(|s| !s.is_empty()).peekable();
    let mut base: ModPath = match segs.peek().copied() {
        Some("crate") => {
            segs.next();
            Vec::new()
        }
        Some("self") => {
            segs.next();
            from.clone()
        }
        Some("super") => {
            let mut b = from.clone();
            while segs.peek() == Some(&"super") {
                segs.next();
                b.pop()?;
            }
            b
        }
        _ => return None,
    };
    for s in segs {
        let mut next = base.clone();
        next.push(s.to_string());
        if !tree.contains_key(&next) {
            break;
        }
        base = next;
    }
    Some(base)
}

/// Edges between siblings, by parent: a reference from `a` to `b` where neither holds the
/// other becomes one between the two children of their common parent that hold them.
fn sibling_edges(
    tree: &BTreeMap<ModPath, PathBuf>,
) -> BTreeMap<ModPath, BTreeSet<(String, String)>> {
    let mut edges: BTreeMap<ModPath, BTreeSet<(String, String)>> = BTreeMap::new();
    for (from, file) in tree {
        let text = std::fs::read_to_string(file).unwrap();
        for r in references(&text) {
            let Some(to) = resolve(from, &r, tree) else {
                continue;
            };
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue;
            }
            edges
                .entry(from[..common].to_vec())
                .or_default()
                .insert((from[common].clone(), to[common].clone()));
        }
    }
    edges
}

/// The strongly connected components of more than one node (Tarjan).
fn rings(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    struct T<'a> {
        adj: BTreeMap<&'a str, Vec<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.adj.get(v).cloned().unwrap_or_default() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut ring = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                ring.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if ring.len() > 1 {
                ring.sort();
                t.out.push(ring);
            }
        }
    }
    let mut t = T {
        adj: BTreeMap::new(),
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for (a, b) in edges {
        t.adj.entry(a.as_str()).or_default().push(b.as_str());
        t.adj.entry(b.as_str()).or_default();
    }
    let nodes: Vec<&str> = t.adj.keys().copied().collect();
    for v in nodes {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_crate_has_a_module_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let (mut modules, mut lifted, mut found) = (0, 0, Vec::new());
    for krate in crate_roots(&root) {
        let tree = module_tree(&krate);
        modules += tree.len();
        for (parent, edges) in sibling_edges(&tree) {
            lifted += edges.len();
            for ring in rings(&edges) {
                let at = krate
                    .strip_prefix(&root)
                    .unwrap_or(&krate)
                    .display()
                    .to_string();
                found.push(format!("{at}: under `{}`: {ring:?}", parent.join("::")));
            }
        }
    }
    // The reader must have read the workspace, or the test proves nothing.
    assert!(modules > 100, "only {modules} modules read");
    assert!(
        lifted > 100,
        "only {lifted} references between siblings read"
    );
    assert!(found.is_empty(), "module cycles: {found:#?}");
}

/// The reader and the ring finder, on made-up code: a ring of three is found, a child's
/// `super::` and a parent's use of its child are not rings, grouped imports expand.
#[test]
fn rings_are_found_however_long_and_nesting_is_not_one() {
    let e = |v: &[(&str, &str)]| -> BTreeSet<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    assert_eq!(
        rings(&e(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
        vec![vec!["a", "b", "c"]]
    );
    assert!(rings(&e(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    assert_eq!(
        expand("crate::{history::History,world::{admin::Admin,World}}"),
        [
            "crate::history::History",
            "crate::world::admin::Admin",
            "crate::world::World"
        ]
    );
    let tree: BTreeMap<ModPath, PathBuf> = [
        vec![],
        vec!["a".into()],
        vec!["a".into(), "x".into()],
        vec!["b".into()],
    ]
    .into_iter()
    .map(|p| (p, PathBuf::new()))
    .collect();
    let from: ModPath = vec!["a".into(), "x".into()];
    assert_eq!(
        resolve(&from, "super::super::b::f", &tree),
        Some(vec!["b".to_string()])
    );
    assert_eq!(
        resolve(&from, "super::Thing", &tree),
        Some(vec!["a".to_string()])
    );
    assert_eq!(resolve(&from, "crate::a::x::y", &tree), Some(from.clone()));
    assert_eq!(
        references("use super::{pump, transport::Received};\nlet x = crate::b::f(); // crate::c"),
        ["super::pump", "super::transport::Received", "crate::b::f"]
    );
    assert_eq!(
        declared_mods("pub mod a;\nmod b;\n#[cfg(test)]\nmod tests;\nmod c {\n#[cfg(x)] mod d;"),
        ["a", "b", "tests", "d"]
    );
}
