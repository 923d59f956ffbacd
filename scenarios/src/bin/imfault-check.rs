//! `imfault-check DIR`: judges one scenario run again from its files. DIR holds
//! `history.jsonl` and `final.json`; the report (`harness::checker::Report`) goes to stdout
//! as pretty JSON, one summary line to stderr. Exit status: 0 PASS, 1 anomalies, 2 usage or
//! read errors.

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use harness::checker::{check, load_dir, Verdict};

const USAGE: &str = "usage: imfault-check DIR

Judges one scenario run: DIR holds history.jsonl and final.json. Prints the report as
JSON on stdout and one summary line on stderr.
Exit status: 0 PASS, 1 anomalies found, 2 usage or read error.";

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let dir = match args.as_slice() {
        [a] if a == "--help" || a == "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        [a] if !a.to_string_lossy().starts_with('-') => Path::new(a),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let (history, fin) = match load_dir(dir) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("imfault-check: {e:#}");
            return ExitCode::from(2);
        }
    };
    let report = check(&history, &fin);
    let written = serde_json::to_string_pretty(&report)
        .map_err(std::io::Error::from)
        .and_then(|json| writeln!(std::io::stdout().lock(), "{json}"));
    if let Err(e) = written {
        eprintln!("imfault-check: write the report: {e}");
        return ExitCode::from(2);
    }
    eprintln!("imfault-check: {}", report.summary());
    match report.verdict {
        Verdict::Pass => ExitCode::SUCCESS,
        Verdict::Fail => ExitCode::from(1),
    }
}
