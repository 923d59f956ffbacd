//! `imfault-check DIR`: judges one scenario run again from its files. DIR holds
//! `history.jsonl` and `final.json`; the report (`im_check::Report`) goes to stdout
//! as pretty JSON, one summary line to stderr. Exit status: 0 PASS, 1 anomalies, 2 usage error
//! or ERROR (the files cannot be read or a history line does not parse).

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use im_check::{judge_dir, Verdict};

/// Judge one scenario run again from its files: DIR holds history.jsonl and final.json.
/// Prints the report as JSON on stdout and one summary line on stderr.
#[derive(clap::Parser, Debug)]
#[command(
    name = "imfault-check",
    after_help = "Reads no environment variables.\n\
                  Exit status: 0 PASS, 1 anomalies found, 2 usage error or ERROR (unreadable files,\n\
                  a history line that does not parse)."
)]
struct Args {
    /// A kept run directory (e.g. the work directory a failed check printed).
    dir: std::path::PathBuf,
}

fn main() -> ExitCode {
    let args: Args = clap::Parser::parse();
    let dir: &Path = &args.dir;
    // A history or final read that cannot be read is judged ERROR (printed like any
    // report), never skipped.
    let report = judge_dir(dir);
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
        // The checker never says NOT_RUN; were it to, nothing was judged: not a pass.
        Verdict::Error | Verdict::NotRun => ExitCode::from(2),
    }
}
