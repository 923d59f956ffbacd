use super::*;

/// The small evidence the site's tests render (also what the browser test opens).
fn fixture() -> Vec<Loaded> {
    load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/site"))
}

fn prov() -> Vec<Provenance> {
    vec![
        Provenance {
            commit: Some("aaaaaaaaaaaa".into()),
            newer_code: Some("bbbbbbbbbbbb".into()),
        },
        Provenance {
            commit: Some("cccccccccccc".into()),
            newer_code: None,
        },
        Provenance::default(),
        Provenance::default(),
        Provenance::default(),
    ]
}

#[test]
fn the_index_gives_each_part_its_verdict_provenance_and_staleness() {
    let site = render(&fixture(), &prov());
    let names: Vec<&str> = site.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "index.html",
            "checks.html",
            "nemesis.html",
            "controls.html",
            "bench.html",
            "nemesis-3-gateways.html"
        ]
    );
    let index = &site[0].1;
    let rows: Vec<&str> = index.split("<tr>").skip(2).collect();
    assert_eq!(rows.len(), 5, "{index}");
    assert!(
        rows[0].contains("class=\"FAIL\"") && rows[0].contains("STALE"),
        "{}",
        rows[0]
    );
    assert!(rows[0].contains("aaaaaaaaaa") && rows[0].contains("2026-12-03T10:00:00Z"));
    assert!(rows[1].contains("class=\"FAIL\"") && !rows[1].contains("STALE"));
    assert!(rows[2].contains("class=\"PASS\""), "{}", rows[2]);
    assert!(rows[3].contains("class=\"PASS\"") && rows[3].contains("targets FAIL"));
    assert!(rows[4].contains("class=\"PASS\""), "{}", rows[4]);
    assert!(
        site[5].1.contains("&quot;gateways&quot;:3") && site[5].1.contains("Nemesis, 3 gateways"),
        "the three-gateway series is its own page"
    );
    // The two questions a reader brings, answered on the index.
    assert!(
        index.contains("only the nemesis caught: sneaky-bug"),
        "{index}"
    );
    assert!(
        index.contains("Push p99 passes 50 ms between 18k and 27k frames/s offered"),
        "{index}"
    );
}

#[test]
fn pages_are_self_contained_and_escape_what_they_show() {
    for (name, html) in render(&fixture(), &prov()) {
        assert!(html.starts_with("<!doctype html>"), "{name}");
        for needle in ["<script", "src=", "href=\"http", "@import", "url("] {
            assert!(!html.contains(needle), "{name} has {needle}");
        }
        assert!(!html.contains("w <b>"), "{name}: unescaped text");
    }
}

#[test]
fn the_bench_page_draws_the_ceilings_limits_and_the_notes_load() {
    let site = render(&fixture(), &prov());
    let bench = &site[4].1;
    assert_eq!(bench.matches("<svg").count(), 5, "five plots");
    for label in [
        "pgbench: the send's SQL",
        "pgbench: with pg_notify",
        ">50 ms</text>",
        ">the note's load</text>",
        "D5 bound",
    ] {
        assert!(bench.contains(label), "no {label}");
    }
    assert!(bench.contains("class=\"MISSED\"") && bench.contains("class=\"MET\""));
    assert!(bench.contains("not selected"), "a part not run says why");
}

#[test]
fn the_controls_and_nemesis_pages_show_the_matrix_and_the_runs_that_failed() {
    let site = render(&fixture(), &prov());
    let controls = &site[3].1;
    assert!(controls.contains("Only the nemesis caught: <b>sneaky-bug</b>"));
    assert!(controls.contains("at seed 4") && controls.contains("after 20 seeds"));
    // The matrix: a row per catching test, a mark under the bug it caught, the nemesis row.
    let m = controls
        .split("Which check caught which bug")
        .nth(1)
        .unwrap();
    let m = m.split("</table>").next().unwrap();
    let row = |name: &str| {
        m.split("<tr>")
            .find(|r| r.starts_with(&format!("<td>{name} ")))
            .unwrap_or_else(|| panic!("no row {name}: {m}"))
            .to_string()
    };
    assert_eq!(row("im06_a").matches("●").count(), 1);
    assert!(row("im06_a").contains("<td class=\"CAUGHT\">●</td><td></td>"));
    assert!(
        m.contains("<td class=\"MISSED\">✗</td><td class=\"CAUGHT\">4</td>"),
        "{m}"
    );
    let nemesis = &site[2].1;
    assert!(nemesis.contains("Runs that did not pass (1)"));
    assert!(nemesis.contains("runs/seed-3/report.html"));
    assert!(nemesis.contains(">gw-kill</td>"));
}

#[test]
fn a_missing_or_unreadable_part_says_so() {
    let mut parts = fixture();
    parts[1] = Err("evidence/nemesis/result.json: not JSON: x".into());
    parts.truncate(2);
    let site = render(&parts, &[]);
    let index = &site[0].1;
    assert!(index.contains("class=\"ERROR\"") && index.contains("not JSON"));
    assert!(index.contains("class=\"NOT_RUN\""), "{index}");
    assert!(site[4].1.contains("Not given."));
}
