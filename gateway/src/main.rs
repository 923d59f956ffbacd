//! The `im-gateway` command line (SPEC 2b): `migrate`, `admin …`, `serve`, `version`, and
//! `bugs` (the deliberate bugs `IM_BUG` selects in the controls build).

use anyhow::Context;
use im_gateway::{admin, bugs, config, fanout, faults, migrate, server, store};
use std::io::Write;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

const USAGE: &str = "\
usage: im-gateway COMMAND   (configured by environment; IM_DATABASE_URL for all commands)
  migrate            apply the embedded migrations (idempotent)
  admin ...          provisioning (see `im-gateway admin help`)
  serve              run the gateway (IM_LISTEN, IM_SWEEP_MS, IM_FAULT, IM_BUG, IM_DB_TIMEOUT_MS, limits)
  version            print the version and whether fault points and bugs are compiled in
  bugs               list the deliberate bugs IM_BUG selects (controls build only)";

fn main() -> ExitCode {
    im_gateway::invariant::install_hook();
    let args: Vec<String> = std::env::args().skip(1).collect();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn")),
        )
        .init();
    let cmd = args.first().map(String::as_str).unwrap_or("");
    match cmd {
        "version" | "--version" => {
            println!(
                "im-gateway {} faults={} bugs={}",
                env!("CARGO_PKG_VERSION"),
                if faults::ENABLED { "on" } else { "off" },
                if bugs::ENABLED { "on" } else { "off" }
            );
            return ExitCode::SUCCESS;
        }
        "bugs" => {
            for (name, what) in bugs::ALL {
                println!("{name:<20} {what}");
            }
            if !bugs::ENABLED {
                eprintln!("im-gateway: this build has no `bugs` feature: IM_BUG is refused");
            }
            return ExitCode::SUCCESS;
        }
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        "admin" if matches!(args.get(1).map(String::as_str), None | Some("help")) => {
            println!("{}", admin::USAGE);
            return ExitCode::SUCCESS;
        }
        "migrate" | "admin" | "serve" => {}
        _ => {
            eprintln!("im-gateway: unknown command {cmd:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    if cmd == "serve" {
        // Validate IM_FAULT before anything else: a typo never reaches a bound socket.
        let spec = std::env::var("IM_FAULT").unwrap_or_default();
        match faults::install(&spec) {
            Ok(armed) if !armed.is_empty() => {
                eprintln!("im-gateway: fault points armed: {spec}");
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("im-gateway: {e}");
                return ExitCode::from(2);
            }
        }
        // Then IM_BUG (the controls build's deliberate bugs), also before any connection.
        match bugs::install(&std::env::var("IM_BUG").unwrap_or_default()) {
            Ok(Some(name)) => eprintln!("deliberate bug active: {name}"),
            Ok(None) => {}
            Err(e) => {
                eprintln!("im-gateway: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("im-gateway: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cmd, &args[1..])) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("im-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cmd: &str, rest: &[String]) -> anyhow::Result<()> {
    match cmd {
        "migrate" => {
            let pool =
                store::connect(&config::database_url()?, 2, config::db_timeout()?, None).await?;
            let applied = migrate::run(&pool).await?;
            eprintln!("im-gateway: migrations applied: {applied:?} (none means up to date)");
            Ok(())
        }
        "admin" => {
            let pool =
                store::connect(&config::database_url()?, 2, config::db_timeout()?, None).await?;
            migrate::check(&pool).await?;
            if let Some(out) = admin::run(&pool, rest).await? {
                println!("{out}");
            }
            Ok(())
        }
        "serve" => serve().await,
        _ => unreachable!("commands are checked in main"),
    }
}

async fn serve() -> anyhow::Result<()> {
    let cfg = config::Config::from_env()?;
    // One more than IM_DB_POOL_MAX: the LISTEN connection is taken from the pool.
    let pool = store::connect(
        &cfg.database_url,
        cfg.db_pool_max + 1,
        cfg.db_work_deadline(),
        Some(cfg.db_timeout()),
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
    if bugs::active(bugs::NO_DEDUP) {
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
    {
        // The readiness signal: exactly one line on stdout.
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {addr}").context("write the readiness line")?;
        out.flush().context("flush the readiness line")?;
    }
    tracing::info!(%addr, sweep_ms = cfg.sweep_interval_ms, "serving");
    server::serve(listener, cfg, pool, pg_listener, cancel).await
}
