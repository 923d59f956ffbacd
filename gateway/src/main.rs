//! The `im-gateway` command line (SPEC 2b): `serve`, `migrate`, `admin …`, `version`, `bugs`
//! (the deliberate bugs `IM_BUG` selects in the controls build) and `faults` (the fault
//! points and actions of `IM_FAULT`). Parsed by clap: `--help` on any command prints and
//! exits 0 without touching a socket or a database, and lists every `IM_*` variable with its
//! default (from `config::ENV`); a usage error prints clap's message and exits 2.

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use im_gateway::bugs::{self, Bug};
use im_gateway::config::SyncCommit;
use im_gateway::{admin, config, dbconnect, fanout, faults, migrate, server, store};
use std::io::Write;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// Instant-messaging gateway (WebSocket + PostgreSQL). Configured by environment variables
/// (below); the database comes from IM_DATABASE_URL.
#[derive(Parser, Debug)]
#[command(
    name = "im-gateway",
    disable_version_flag = true,
    arg_required_else_help = true
)]
struct Cli {
    /// Print the version line (as `im-gateway version`) and exit.
    #[arg(short = 'V', long = "version")]
    version: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the gateway: bind IM_LISTEN, print one line `listening on ADDR` on stdout when
    /// ready, shut down gracefully on SIGTERM or SIGINT. Refuses an unmigrated schema.
    Serve,
    /// Apply the embedded migrations (idempotent).
    Migrate,
    /// Provisioning: users, devices, conversations, membership periods (one transaction
    /// each).
    #[command(subcommand, arg_required_else_help = true)]
    Admin(admin::Command),
    /// Print the version and whether fault points and deliberate bugs are compiled in.
    Version,
    /// List the deliberate bugs IM_BUG selects (the controls build only).
    Bugs,
    /// List the fault points IM_FAULT arms, what each does and where, and the actions.
    Faults,
}

fn version_line() -> String {
    format!(
        "im-gateway {} faults={} bugs={}",
        env!("CARGO_PKG_VERSION"),
        if faults::ENABLED { "on" } else { "off" },
        if bugs::ENABLED { "on" } else { "off" }
    )
}

/// The clap command with the environment table after every command's help.
fn command() -> clap::Command {
    fn with_env(cmd: clap::Command, text: &str) -> clap::Command {
        cmd.after_help(text.to_string())
            .mut_subcommands(|sub| with_env(sub, text))
    }
    with_env(Cli::command(), &config::env_help())
}

fn parse() -> Result<Cli, ExitCode> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let parsed = command()
        .try_get_matches_from(&args)
        .and_then(|m| Cli::from_arg_matches(&m));
    match parsed {
        Ok(cli) => Ok(cli),
        Err(e) => {
            use clap::error::ErrorKind;
            let usage = !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
            // An admin usage error says so in words scripts (and the suite) look for.
            if usage && args.get(1).is_some_and(|a| a == "admin") && args.len() > 2 {
                let words: Vec<String> = args[2..]
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect();
                eprintln!(
                    "im-gateway: unknown or malformed admin command: {}",
                    words.join(" ")
                );
            }
            let _ = e.print();
            Err(ExitCode::from(e.exit_code() as u8))
        }
    }
}

fn main() -> ExitCode {
    im_gateway::invariant::install_hook();
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let cmd = match cli.cmd {
        _ if cli.version => {
            println!("{}", version_line());
            return ExitCode::SUCCESS;
        }
        Some(cmd) => cmd,
        None => {
            let _ = command().print_help();
            return ExitCode::from(2);
        }
    };
    if let Some(code) = answer_at_once(&cmd) {
        return code;
    }
    // The fail crate's own variable arms nothing here (faults are armed from IM_FAULT only):
    // refuse it rather than let a run believe a fault is armed.
    if std::env::var_os("FAILPOINTS").is_some() {
        eprintln!(
            "im-gateway: FAILPOINTS is set, but im-gateway does not read it: arm fault points \
             with IM_FAULT=point:action[:skip[:count]] (see `im-gateway faults`); unset FAILPOINTS"
        );
        return ExitCode::from(2);
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn")),
        )
        .init();
    if matches!(cmd, Cmd::Serve) {
        if let Err(e) = arm() {
            eprintln!("im-gateway: {e}");
            return ExitCode::from(2);
        }
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    match config::worker_threads() {
        Ok(Some(n)) => {
            builder.worker_threads(n);
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("im-gateway: {e}");
            return ExitCode::from(2);
        }
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("im-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cmd)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("im-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The commands that only print (`version`, `bugs`, `faults`): their exit code.
fn answer_at_once(cmd: &Cmd) -> Option<ExitCode> {
    match cmd {
        Cmd::Version => println!("{}", version_line()),
        Cmd::Bugs => {
            for bug in Bug::ALL {
                println!("{:<20} {}", bug.name(), bug.describe());
            }
            if !bugs::ENABLED {
                eprintln!("im-gateway: this build has no `bugs` feature: IM_BUG is refused");
            }
        }
        Cmd::Faults => print_faults(),
        Cmd::Serve | Cmd::Migrate | Cmd::Admin(_) => return None,
    }
    Some(ExitCode::SUCCESS)
}

/// Arms what `serve` is asked to arm, before anything else (a typo never reaches a bound
/// socket): IM_FAULT's fault points (announced on stderr), the fault-control variable,
/// then IM_BUG (the controls build's deliberate bugs).
fn arm() -> Result<(), String> {
    let spec = std::env::var("IM_FAULT").unwrap_or_default();
    let armed = faults::install(&spec).map_err(|e| e.to_string())?;
    if !armed.is_empty() {
        eprintln!("im-gateway: fault points armed: {spec}");
    }
    im_gateway::fault_control::validate(
        std::env::var(im_gateway::fault_control::ENV)
            .ok()
            .as_deref(),
    )
    .map_err(|e| e.to_string())?;
    if let Some(bug) =
        bugs::install(&std::env::var("IM_BUG").unwrap_or_default()).map_err(|e| e.to_string())?
    {
        eprintln!("deliberate bug active: {bug}");
    }
    Ok(())
}

fn print_faults() {
    println!(
        "Fault points (IM_FAULT={}; this build: fault points {}):",
        faults::SYNTAX,
        if faults::ENABLED {
            "compiled in"
        } else {
            "NOT compiled in, IM_FAULT is refused (build with --features faults, as `make build` does)"
        }
    );
    let w = faults::POINT_DOCS
        .iter()
        .map(|(p, _, _)| p.len())
        .max()
        .unwrap_or(0);
    for (point, place, what) in faults::POINT_DOCS {
        println!("  {point:<w$}  {what}  [{place}]");
    }
    println!("Actions:");
    for (action, what) in faults::ACTION_DOCS {
        println!("  {action:<w$}  {what}");
    }
    println!(
        "skip: hits that pass before the action first fires (default 0); count: how many times \
         it fires (default: every hit after the skipped ones).\n\
         Example: IM_FAULT='gw.reply.send:drop:0:1,gw.push:delay(25)'. Each firing prints one \
         line `fault fired: point=… action=… hit=N` on stderr."
    );
}

async fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Migrate => {
            let url = config::database_url()?;
            let timeout = config::db_timeout()?;
            dbconnect::probe(&url, timeout).await?;
            let pool = store::connect(&url, 2, timeout, None, SyncCommit::On, None).await?;
            let applied = migrate::run(&pool).await?;
            eprintln!("im-gateway: migrations applied: {applied:?} (none means up to date)");
            Ok(())
        }
        Cmd::Admin(command) => {
            let url = config::database_url()?;
            let timeout = config::db_timeout()?;
            dbconnect::probe(&url, timeout).await?;
            let pool = store::connect(&url, 2, timeout, None, SyncCommit::On, None).await?;
            migrate::check(&pool).await?;
            if let Some(out) = admin::run(&pool, &command).await? {
                println!("{out}");
            }
            Ok(())
        }
        Cmd::Serve => serve().await,
        Cmd::Version | Cmd::Bugs | Cmd::Faults => unreachable!("answered in main"),
    }
}

async fn serve() -> anyhow::Result<()> {
    let cfg = config::Config::from_env()?;
    dbconnect::probe(&cfg.database_url, cfg.db_timeout()).await?;
    let lineage = std::sync::Arc::new(im_gateway::lineage::Lineage::default());
    // One more than IM_DB_POOL_MAX: the LISTEN connection is taken from the pool.
    let pool = store::connect(
        &cfg.database_url,
        cfg.db_pool_max + 1,
        cfg.db_work_deadline(),
        Some(cfg.db_timeout()),
        cfg.synchronous_commit,
        Some(lineage.clone()),
    )
    .await?;
    migrate::check(&pool).await?;
    let (synchronous_commit, fsync, full_page_writes) = store::session_durability(&pool).await?;
    tracing::info!(
        %synchronous_commit,
        %fsync,
        %full_page_writes,
        "database session durability"
    );
    if !cfg.synchronous_commit.keeps_d6() {
        tracing::warn!(
            synchronous_commit = cfg.synchronous_commit.as_str(),
            "IM_SYNCHRONOUS_COMMIT is weaker than on: a reply may leave before its commit is \
             on every disk D6 counts on (the durability matrix in the README says what each \
             setting loses under which fault)"
        );
    }
    if bugs::active(Bug::NoDedup) {
        store::drop_dedup_constraint(&pool).await?;
    }
    let pg_listener = fanout::listen(&pool)
        .await
        .context("open the LISTEN connection")?;
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("bind IM_LISTEN={}", cfg.listen))?;
    let addr = listener.local_addr().context("read the bound address")?;
    // Handlers go in before the readiness line: a SIGTERM sent the moment the line appears
    // is a graceful shutdown, never death by signal.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        c.cancel();
    });
    if let Some(path) = std::env::var_os(im_gateway::fault_control::ENV) {
        im_gateway::fault_control::start(std::path::Path::new(&path))?;
    }
    {
        // The readiness signal: exactly one line on stdout.
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {addr}").context("write the readiness line")?;
        out.flush().context("flush the readiness line")?;
    }
    tracing::info!(%addr, sweep_ms = cfg.sweep_interval_ms, "serving");
    server::serve(listener, cfg, pool, pg_listener, lineage, cancel).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn faults_lists_every_point_in_order() {
        let listed: Vec<&str> = faults::POINT_DOCS.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(listed, faults::points::ALL);
    }

    #[test]
    fn flags_in_any_order() {
        let parse = |args: &[&str]| {
            let m = command().try_get_matches_from(args).expect("parses");
            Cli::from_arg_matches(&m).expect("matches")
        };
        for args in [
            &["im-gateway", "admin", "add-device", "d1", "--user", "u1"][..],
            &["im-gateway", "admin", "add-device", "--user", "u1", "d1"][..],
        ] {
            match parse(args).cmd {
                Some(Cmd::Admin(admin::Command::AddDevice { device, user })) => {
                    assert_eq!((device.as_str(), user.as_str()), ("d1", "u1"))
                }
                other => panic!("{args:?}: {other:?}"),
            }
        }
    }
}
