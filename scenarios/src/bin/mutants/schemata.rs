//! Mutant schemata: every mutant of a file written into one copy of it, each behind a
//! switch that reads [`VAR`] at run time, so that one build serves every mutant and a
//! mutant's run is its tests alone (Untch, Offutt and Harrold, "Mutation analysis using
//! mutant schemata", 1993).
//!
//! A mutant is placed where cargo-mutants' list says it is (its genre, its span and its
//! replacement; the spans are 1-based lines and columns, the end exclusive):
//! - `FnValue` (the body replaced by a value): `if ON { return VALUE; }` before the body's
//!   first statement;
//! - `BinaryOperator` (one operator for another): `(if ON { l NEW r } else { l OLD r })`;
//! - `UnaryOperator` (`!` or `-` deleted): `(if ON { (e) } else { !e })`;
//! - `MatchArmGuard` (a guard replaced by `true` or `false`): the guard becomes
//!   `(if ON { VALUE } else { GUARD })`;
//! - `MatchArm` (an arm deleted; cargo-mutants deletes only arms a later one covers): the arm
//!   gains the guard `!ON` (or `(if ON { false } else { GUARD })`).
//!
//! `ON` is a block with a static of its own, `__IMFAULT_MUTANT_<id>`, true when [`VAR`] is
//! the mutant's id: with [`VAR`] unset the file behaves as the unmutated one. The name is
//! also how a build error is blamed on a mutant ([`blame`]): a mutant that does not build
//! in the schema (an unviable one, or one whose `return` gives an `impl Trait` function a
//! second type) is taken out and run the usual way, its diff applied and built alone.
//!
//! Must not: change what a file does when no mutant is switched on.

use proc_macro2::{LineColumn, Span};
use quote::{format_ident, ToTokens};
use std::collections::BTreeSet;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote, Expr};

/// The variable that switches one mutant of a schema build on: its id (the mutant's index
/// in the list), as decimal digits.
pub const VAR: &str = "IMFAULT_MUTANT";

/// The prefix of the static each placed mutant's switch declares.
const STATIC_PREFIX: &str = "__IMFAULT_MUTANT_";

/// One mutant to place: its id, where the list says it is, what it does.
#[derive(Debug, Clone)]
pub struct Want {
    pub id: usize,
    pub genre: String,
    /// 1-based line and column of the span's start.
    pub start: (usize, usize),
    /// 1-based line and column just past the span's end.
    pub end: (usize, usize),
    pub replacement: String,
}

/// `source` with every mutant of `wants` it could place; the ids it placed. A mutant whose
/// span it does not find (one inside a macro call, say) is left out, to be run the usual
/// way. An error when the file does not parse or a replacement is not Rust.
pub fn schema(source: &str, wants: &[Want]) -> anyhow::Result<(String, BTreeSet<usize>)> {
    let mut file = syn::parse_file(source)?;
    let mut p = Placer {
        wants: wants.to_vec(),
        placed: BTreeSet::new(),
        error: None,
    };
    p.visit_file_mut(&mut file);
    if let Some(e) = p.error {
        return Err(e);
    }
    Ok((file.into_token_stream().to_string(), p.placed))
}

/// The mutant a build error at byte `at` of a schema file's `text` is blamed on: the one
/// whose switch comes last before it (an error inside a mutated branch follows its
/// switch, and the original branch, which built before, raises none).
pub fn blame(text: &str, at: usize) -> Option<usize> {
    let head = text.get(..at.min(text.len()))?;
    let pos = head.rfind(STATIC_PREFIX)?;
    let digits: String = head[pos + STATIC_PREFIX.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The mutant an exhaustiveness error (E0004) at byte `at` is blamed on: the first of the
/// switches after it that `is_arm` accepts. rustc places that error at the `match`'s
/// scrutinee, before the arms, and a deleted arm (the guard `!ON`) is what can leave a
/// value uncovered: cargo-mutants deletes an arm beside a wildcard even when the wildcard
/// has a guard, and such a mutant does not build alone either.
pub fn blame_arm(text: &str, at: usize, is_arm: impl Fn(usize) -> bool) -> Option<usize> {
    let mut from = at.min(text.len());
    while let Some(rel) = text.get(from..)?.find(STATIC_PREFIX) {
        let pos = from + rel + STATIC_PREFIX.len();
        let digits: String = text[pos..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if let Ok(id) = digits.parse() {
            if is_arm(id) {
                return Some(id);
            }
        }
        from = pos;
    }
    None
}

/// 1-based (line, column) of a span's start, as cargo-mutants counts.
fn start(s: Span) -> (usize, usize) {
    at(s.start())
}

fn at(lc: LineColumn) -> (usize, usize) {
    (lc.line, lc.column + 1)
}

/// `{ static __IMFAULT_MUTANT_<id>: LazyLock<bool> = …; *__IMFAULT_MUTANT_<id> }`: true when
/// [`VAR`] names mutant `id`, read once per process.
fn switch(id: usize) -> Expr {
    let name = format_ident!("{}{}", STATIC_PREFIX, id);
    let value = id.to_string();
    parse_quote!({
        static #name: ::std::sync::LazyLock<bool> = ::std::sync::LazyLock::new(|| {
            ::std::env::var(#VAR).map_or(false, |v| v == #value)
        });
        *#name
    })
}

/// `(if ON(id) { mutated } else { original })`.
fn either(id: usize, mutated: Expr, original: Expr) -> Expr {
    let on = switch(id);
    parse_quote!((if #on { #mutated } else { #original }))
}

struct Placer {
    wants: Vec<Want>,
    placed: BTreeSet<usize>,
    error: Option<anyhow::Error>,
}

impl Placer {
    /// Takes the wants of `genre` that `matches` accepts.
    fn take(&mut self, genre: &str, matches: impl Fn(&Want) -> bool) -> Vec<Want> {
        let (hit, keep): (Vec<Want>, Vec<Want>) = std::mem::take(&mut self.wants)
            .into_iter()
            .partition(|w| w.genre == genre && matches(w));
        self.wants = keep;
        hit
    }

    fn parse<T: syn::parse::Parse>(&mut self, w: &Want, text: &str) -> Option<T> {
        match syn::parse_str::<T>(text) {
            Ok(t) => Some(t),
            Err(e) => {
                self.error.get_or_insert(anyhow::anyhow!(
                    "mutant {}: its replacement `{text}` does not parse: {e}",
                    w.id
                ));
                None
            }
        }
    }

    /// `if ON { return VALUE; }` first in `block` for each `FnValue` mutant inside it (the
    /// innermost function: nested ones are visited first and take theirs).
    fn body(&mut self, block: &mut syn::Block) {
        let (open, close) = (
            at(block.brace_token.span.open().start()),
            at(block.brace_token.span.close().end()),
        );
        for w in self.take("FnValue", |w| open < w.start && w.end <= close) {
            let Some(value) = self.parse::<Expr>(&w, &w.replacement) else {
                continue;
            };
            let on = switch(w.id);
            block.stmts.insert(
                0,
                parse_quote!(if #on {
                    return #value;
                }),
            );
            self.placed.insert(w.id);
        }
    }
}

impl VisitMut for Placer {
    fn visit_item_fn_mut(&mut self, f: &mut syn::ItemFn) {
        visit_mut::visit_item_fn_mut(self, f);
        self.body(&mut f.block);
    }

    fn visit_impl_item_fn_mut(&mut self, f: &mut syn::ImplItemFn) {
        visit_mut::visit_impl_item_fn_mut(self, f);
        self.body(&mut f.block);
    }

    fn visit_trait_item_fn_mut(&mut self, f: &mut syn::TraitItemFn) {
        visit_mut::visit_trait_item_fn_mut(self, f);
        if let Some(b) = &mut f.default {
            self.body(b);
        }
    }

    fn visit_expr_mut(&mut self, e: &mut Expr) {
        visit_mut::visit_expr_mut(self, e);
        let mut mutants = Vec::new();
        match &*e {
            Expr::Binary(b) => {
                let here = start(b.op.span());
                for w in self.take("BinaryOperator", |w| w.start == here) {
                    if let Some(op) = self.parse::<syn::BinOp>(&w, &w.replacement) {
                        let mut m = b.clone();
                        m.op = op;
                        mutants.push((w.id, Expr::Binary(m)));
                    }
                }
            }
            Expr::Unary(u) => {
                let here = start(u.op.span());
                for w in self.take("UnaryOperator", |w| w.start == here) {
                    let inner = &u.expr;
                    mutants.push((w.id, parse_quote!((#inner))));
                }
            }
            _ => {}
        }
        for (id, m) in mutants {
            let original = e.clone();
            *e = either(id, m, original);
            self.placed.insert(id);
        }
    }

    fn visit_arm_mut(&mut self, arm: &mut syn::Arm) {
        visit_mut::visit_arm_mut(self, arm);
        if let Some((_, guard)) = &mut arm.guard {
            let here = start(guard.span());
            for w in self.take("MatchArmGuard", |w| w.start == here) {
                if let Some(value) = self.parse::<Expr>(&w, &w.replacement) {
                    let original = (**guard).clone();
                    **guard = either(w.id, value, original);
                    self.placed.insert(w.id);
                }
            }
        }
        let here = start(arm.pat.span());
        for w in self.take("MatchArm", |w| w.start == here) {
            let guard: Expr = match &arm.guard {
                Some((_, g)) => either(w.id, parse_quote!(false), (**g).clone()),
                None => {
                    let on = switch(w.id);
                    parse_quote!(!#on)
                }
            };
            arm.guard = Some((Default::default(), Box::new(guard)));
            self.placed.insert(w.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(id: usize, genre: &str, start: (usize, usize), end: (usize, usize), r: &str) -> Want {
        Want {
            id,
            genre: genre.into(),
            start,
            end,
            replacement: r.into(),
        }
    }

    const SOURCE: &str = "fn f(a: u32, b: u32) -> u32 {
    if !(a < b) {
        return a + b * 2;
    }
    match a {
        0 => 1,
        n if n > 5 => n,
        _ => 3,
    }
}
";

    /// Every genre is placed where its span says, and nothing else is touched: each
    /// mutant's switch appears, and a mutant whose span matches nothing is left out.
    #[test]
    fn each_genre_is_placed_at_its_span() {
        let wants = [
            want(1, "FnValue", (2, 5), (9, 6), "0"),
            want(2, "BinaryOperator", (2, 12), (2, 13), "<="),
            want(3, "UnaryOperator", (2, 8), (2, 9), ""),
            want(4, "BinaryOperator", (3, 18), (3, 19), "-"),
            want(5, "BinaryOperator", (3, 22), (3, 23), "+"),
            want(6, "MatchArmGuard", (7, 14), (7, 19), "true"),
            want(7, "MatchArm", (6, 9), (6, 16), ""),
            want(8, "BinaryOperator", (40, 1), (40, 2), "-"),
        ];
        let (text, placed) = schema(SOURCE, &wants).unwrap();
        assert_eq!(placed, (1..=7).collect::<BTreeSet<_>>());
        for id in 1..=7 {
            assert!(
                text.contains(&format!("{STATIC_PREFIX}{id} ")),
                "{id}: {text}"
            );
        }
        // The inner mutant (5: `*` to `+`) is in both branches of the outer one (4).
        assert_eq!(text.matches(&format!("{STATIC_PREFIX}5 ")).count(), 4);
        assert!(syn::parse_file(&text).is_ok());
    }

    /// A build error is blamed on the switch last before it.
    #[test]
    fn an_error_is_blamed_on_the_switch_before_it() {
        let (text, _) =
            schema(SOURCE, &[want(4, "BinaryOperator", (3, 18), (3, 19), "-")]).unwrap();
        let at = text.find("a - b").unwrap();
        assert_eq!(blame(&text, at), Some(4));
        assert_eq!(blame(&text, 3), None);
    }

    /// An exhaustiveness error at a `match`'s scrutinee is blamed on the first deleted arm
    /// after it, not on the switch before it.
    #[test]
    fn an_exhaustiveness_error_is_blamed_on_the_arm_after_it() {
        let wants = [
            want(4, "BinaryOperator", (3, 18), (3, 19), "-"),
            want(6, "MatchArmGuard", (7, 14), (7, 19), "true"),
            want(7, "MatchArm", (6, 9), (6, 16), ""),
        ];
        let (text, _) = schema(SOURCE, &wants).unwrap();
        let at = text.find("match a").unwrap();
        assert_eq!(blame(&text, at), Some(4));
        assert_eq!(blame_arm(&text, at, |id| id == 7), Some(7));
        assert_eq!(blame_arm(&text, at, |_| false), None);
    }
}
