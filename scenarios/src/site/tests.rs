use super::*;

/// The small evidence the site's tests render (also what the browser test opens).
fn fixture() -> Vec<Loaded> {
    load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/site"))
}

fn prov() -> Vec<Provenance> {
    vec![
        Provenance {
            commit: Some("aaaaaaaaaaaa".into()),
            recorded: true,
            newer_code: Some("bbbbbbbbbbbb".into()),
            ..Provenance::default()
        },
        Provenance {
            commit: Some("cccccccccccc".into()),
            ..Provenance::default()
        },
    ]
    .into_iter()
    .chain(std::iter::repeat(Provenance::default()))
    .take(PARTS.len())
    .collect()
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
            "nemesis-3-gateways.html",
            "durability.html",
            "mutants.html",
            "proof.html",
            "mutants-in-diff.html"
        ]
    );
    let index = &site[0].1;
    let rows: Vec<&str> = index.split("<tr>").skip(2).collect();
    assert_eq!(rows.len(), PARTS.len(), "{index}");
    assert!(
        rows[0].contains("class=\"FAIL\"") && rows[0].contains("STALE"),
        "{}",
        rows[0]
    );
    assert!(rows[0].contains("aaaaaaaaaa") && rows[0].contains("2026-12-03T10:00:00Z"));
    assert!(rows[1].contains("class=\"FAIL\"") && rows[1].contains(">current<"));
    assert!(rows[2].contains("class=\"PASS\""), "{}", rows[2]);
    assert!(rows[3].contains("class=\"PASS\"") && rows[3].contains("targets FAIL"));
    assert!(rows[4].contains("class=\"PASS\""), "{}", rows[4]);
    assert!(
        rows[5].contains("class=\"FAIL\"") && rows[5].contains("4 cells: 3 PASS, 1 FAIL"),
        "{}",
        rows[5]
    );
    assert!(
        rows[6].contains("class=\"FAIL\"") && rows[6].contains("shard 0/3 only"),
        "{}",
        rows[6]
    );
    assert!(
        rows[7].contains("class=\"FAIL\"")
            && rows[7].contains("4 parts: 2 PASS, 1 FAIL, 1 NOT_RUN; 3600 s"),
        "{}",
        rows[7]
    );
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
    parts[1] = Err(NotRead::Invalid(
        "evidence/nemesis/result.json: not JSON: x".into(),
    ));
    parts.truncate(2);
    let site = render(&parts, &[]);
    let index = &site[0].1;
    assert!(index.contains("class=\"ERROR\"") && index.contains("not JSON"));
    assert!(index.contains("class=\"NOT_RUN\""), "{index}");
    assert!(site[4].1.contains("Not given"));
}

/// The page of `part` in a rendered site.
fn page_of<'a>(site: &'a [(String, String)], part: &str) -> &'a str {
    &site.iter().find(|(n, _)| n == part).expect(part).1
}

#[test]
fn the_durability_page_is_the_matrix_with_each_cells_loss_and_verdict() {
    let site = render(&fixture(), &prov());
    let d = page_of(&site, "durability.html");
    // Rows are settings, columns topology and fault, in the file's order.
    let table = d.split("</table>").next().unwrap();
    let head_row = table.split("</tr>").next().unwrap();
    assert_eq!(head_row.matches("<th>").count(), 1 + 3, "{head_row}");
    assert!(table.contains("<th>standalone<br>pg-crash</th><th>standalone<br>failover</th><th>sync-standby<br>failover</th>"));
    let off = table
        .split("<tr>")
        .find(|r| r.contains("<code>off</code>"))
        .unwrap();
    assert!(
        off.contains("<b>13</b> of 645 lost") && off.contains("26 held wrong (0 after the epoch)")
    );
    assert!(off.contains("n/a: a failover needs a standby"), "{off}");
    assert!(off.contains("may lose"));
    let on = table
        .split("<tr>")
        .find(|r| r.contains("<code>on</code>"))
        .unwrap();
    assert!(on.contains("<b>0</b> of 652 lost") && on.contains("promises no loss"));
    assert!(
        on.contains("<b>3</b> of 616 lost") && on.contains("class=\"FAIL\""),
        "{on}"
    );
    // Each applicable cell's summary, with its runs.
    assert_eq!(
        d.split("<h2>Each cell</h2>")
            .nth(1)
            .unwrap()
            .matches("<details>")
            .count(),
        4
    );
}

#[test]
fn the_mutants_page_shows_totals_files_timing_and_every_missed_mutant_with_its_diff() {
    let site = render(&fixture(), &prov());
    let m = page_of(&site, "mutants.html");
    assert!(m.contains("Verdict <span class=\"FAIL\">FAIL</span> (1 missed mutant outside"));
    assert!(m.contains("shard 0/3 only"), "a shard says it is one");
    assert!(m.contains("<td><code>gateway/src/store.rs</code></td>"));
    assert!(m.contains("<td class=\"MISSED\" style=\"text-align:right\">1</td>"));
    assert!(m.contains("500.0 s for 14 mutants (35.7 s each)"));
    assert!(m.contains("Missed (1)") && m.contains("+    0 &lt;b&gt;"));
    assert!(m.contains("Timed out (counted as caught) (1)"));
    assert!(m.contains("Equivalent (not run) (1)") && m.contains("no bug hook outside"));
    assert!(m.contains("match no mutant any more (1)") && m.contains("delete ! in gone"));
}

#[test]
fn the_proof_page_lists_each_part_and_a_missing_proof_is_not_given_not_an_error() {
    let site = render(&fixture(), &prov());
    let p = page_of(&site, "proof.html");
    assert!(p.contains("verdict <span class=\"FAIL\">FAIL</span> in 3600 s"));
    assert!(p.contains("<b>suite</b></td><td><span class=\"FAIL\">FAIL</span></td><td style=\"text-align:right\">900</td><td>100</td><td><code>target/proof/suite.log</code>"));
    assert!(p.contains("no whole mutation run on record</td><td><a href=\"mutants.html\">"));
    assert!(p.contains("<a href=\"nemesis-3-gateways.html\">"));
    // Before the first `make proof`: no file.
    let mut parts = fixture();
    let i = PARTS.iter().position(|p| p.kind == Kind::Proof).unwrap();
    parts[i] = Err(NotRead::Missing(
        "evidence/proof/result.json: No such file".into(),
    ));
    let site = render(&parts, &prov());
    let row = site[0].1.split("<tr>").nth(2 + i).unwrap();
    assert!(
        row.contains("class=\"NOT_RUN\"") && row.contains("not given"),
        "{row}"
    );
    assert!(page_of(&site, "proof.html").contains("Not given: there is no"));
    assert_eq!(status(&PARTS[i], parts.get(i), &prov()[i]), "not given");
    // A required part with no file is an error, not "not given".
    parts[0] = Err(NotRead::Missing(
        "evidence/im-06/result.json: No such file".into(),
    ));
    assert!(status(&PARTS[0], parts.first(), &prov()[0]).starts_with("unreadable: "));
}

#[test]
fn the_recorded_commit_is_read_from_each_format() {
    let parts = fixture();
    let at = |k: Kind| {
        recorded(
            parts[PARTS.iter().position(|p| p.kind == k).unwrap()]
                .as_ref()
                .unwrap(),
        )
    };
    // environment.git_commit and environment.git_dirty (durability).
    let d = at(Kind::Durability);
    assert_eq!(
        d.commit.as_deref(),
        Some("dddddddddddddddddddddddddddddddddddddddd")
    );
    assert!(d.dirty && d.nested.is_empty());
    // Top-level commit and dirty (mutants).
    let m = at(Kind::Mutants);
    assert_eq!(
        m.commit.as_deref(),
        Some("eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee")
    );
    assert!(!m.dirty);
    // Top-level git_commit (proof).
    assert_eq!(
        at(Kind::Proof).commit.as_deref(),
        Some("ffffffffffffffffffffffffffffffffffffffff")
    );
    assert_eq!(
        at(Kind::Checks),
        Recorded::default(),
        "the fixture records none"
    );
    let dirty = serde_json::json!({"git_commit": "abc", "dirty": true});
    assert!(recorded(&dirty).dirty);
}

#[test]
fn entries_of_other_commits_make_a_patchwork() {
    let mut c = fixture()[2].clone().unwrap();
    c["environment"]["git_commit"] = "1111111111".into();
    c["controls"][0]["git_commit"] = "1111111111".into();
    c["controls"][1]["git_commit"] = "2222222222".into();
    c["controls"][1]["nemesis"]["git_commit"] = "3333333333".into();
    c["environment"]["partial_runs"] =
        serde_json::json!([{"bugs": ["sneaky-bug"], "git_commit": "2222222222"}]);
    let r = recorded(&c);
    assert_eq!(r.commit.as_deref(), Some("1111111111"));
    let nested: Vec<(&str, &str)> = r
        .nested
        .iter()
        .map(|(c, a)| (c.as_str(), a.as_str()))
        .collect();
    assert_eq!(
        nested,
        [
            ("2222222222", "/controls/1/git_commit (sneaky-bug)"),
            ("3333333333", "/controls/1/nemesis/git_commit"),
            (
                "2222222222",
                "/environment/partial_runs/0/git_commit (sneaky-bug)"
            ),
        ]
    );
    let p = Provenance {
        commit: r.commit,
        recorded: true,
        patchwork: r.nested,
        ..Provenance::default()
    };
    assert_eq!(
        p.flags(),
        ["PATCHWORK (entries from 3 commits, partial runs from 1)"]
    );
    let mut parts = fixture();
    let mut prov = prov();
    parts[2] = Ok(c);
    prov[2] = p;
    let site = render(&parts, &prov);
    let page = page_of(&site, "controls.html");
    assert!(page
        .contains("PATCHWORK: 2 other commits than <code>1111111111</code> recorded in the file"));
    assert!(page.contains(
        "<code>2222222222</code> at <code>/controls/1/git_commit (sneaky-bug); \
         /environment/partial_runs/0/git_commit (sneaky-bug)</code>"
    ));
    assert!(page.contains("<code>3333333333</code> at <code>/controls/1/nemesis/git_commit</code>"));
    // Entries that all record the top-level commit are no patchwork.
    let mut same = fixture()[2].clone().unwrap();
    same["git_commit"] = "1111111111".into();
    same["controls"][0]["git_commit"] = "1111111111".into();
    assert!(recorded(&same).nested.is_empty());
}

#[test]
fn each_provenance_state_is_shown_on_the_index_the_page_and_the_status_line() {
    let states = [
        (Provenance { commit: Some("a".repeat(40)), recorded: true, ..Provenance::default() }, "current"),
        (
            Provenance {
                commit: Some("a".repeat(40)),
                recorded: true,
                newer_code: Some("b".repeat(40)),
                ..Provenance::default()
            },
            "STALE (code changed at bbbbbbbbbb)",
        ),
        (
            Provenance {
                commit: Some("c".repeat(40)),
                recorded: true,
                unknown: vec![("c".repeat(40), "not in this repository's history".into())],
                ..Provenance::default()
            },
            "UNKNOWN COMMIT cccccccccc (not in this repository's history)",
        ),
        (
            Provenance {
                commit: Some("c".repeat(40)),
                recorded: true,
                unknown: vec![("c".repeat(40), "not an ancestor of HEAD".into())],
                ..Provenance::default()
            },
            "UNKNOWN COMMIT cccccccccc (not an ancestor of HEAD)",
        ),
        (
            Provenance { commit: Some("a".repeat(40)), recorded: true, dirty: true, ..Provenance::default() },
            "DIRTY (ran on a tree with uncommitted changes)",
        ),
        (
            Provenance {
                commit: Some("a".repeat(40)),
                recorded: true,
                patchwork: vec![(
                    "e".repeat(40),
                    "/controls/0/whole_run_catchers/git_commit".into(),
                )],
                ..Provenance::default()
            },
            "current",
        ),
        (
            Provenance {
                commit: Some("a".repeat(40)),
                recorded: true,
                patchwork: vec![
                    ("e".repeat(40), "/controls/0/whole_run_catchers/git_commit".into()),
                    ("d".repeat(40), "/controls/1/git_commit".into()),
                ],
                ..Provenance::default()
            },
            "PATCHWORK (entries from 2 commits)",
        ),
        (
            Provenance {
                commit: Some("a".repeat(40)),
                recorded: true,
                covered_by: Some("the diff since it ran".into()),
                ..Provenance::default()
            },
            "current (the diff since it ran)",
        ),
        (
            Provenance {
                commit: Some("a".repeat(40)),
                recorded: true,
                dirty: true,
                newer_code: Some("b".repeat(40)),
                patchwork: vec![("d".repeat(40), "/controls/0/git_commit".into())],
                ..Provenance::default()
            },
            "DIRTY (ran on a tree with uncommitted changes); PATCHWORK (entries from 2 commits); STALE (code changed at bbbbbbbbbb)",
        ),
    ];
    let parts = fixture();
    for (p, line) in states {
        assert_eq!(status(&PARTS[0], parts.first(), &p), line);
        let mut prov = vec![Provenance::default(); PARTS.len()];
        prov[0] = p.clone();
        let site = render(&parts, &prov);
        let row = site[0].1.split("<tr>").nth(2).unwrap();
        let page = page_of(&site, "checks.html");
        for flag in p.flags() {
            let shown = format!("<span class=\"stale\">{}</span>", svg::esc(&flag));
            assert!(row.contains(&shown), "index: {flag}: {row}");
            assert!(page.contains(&shown), "page: {flag}");
        }
        if line == "current" {
            assert!(row.contains(">current<") && page.contains("Current: no code"));
            // A catcher record is listed, never flagged.
            assert!(
                !row.contains("PATCHWORK") && !page.contains("PATCHWORK"),
                "{page}"
            );
        }
        if let Some(by) = &p.covered_by {
            assert!(row.contains(&format!(">current ({by})<")), "index: {row}");
            assert!(page.contains(&format!(
                "Current: code it depends on changed since, and {by}."
            )));
        }
        // The commit shown is the recorded one, never replaced by another.
        assert!(row.contains(&short_commit(p.commit.as_deref())));
    }
    // No commit recorded: the page says the commit shown is the last writer's.
    let p = Provenance {
        commit: Some("9".repeat(40)),
        ..Provenance::default()
    };
    let mut prov = vec![Provenance::default(); PARTS.len()];
    prov[0] = p;
    let site = render(&parts, &prov);
    assert!(page_of(&site, "checks.html")
        .contains("no commit recorded: the commit that last wrote the file"));
}
