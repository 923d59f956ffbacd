//! The real `im-gateway` binary as a child process (SPEC sections 2b and 5).
//!
//! Owns: finding the binary (and refusing a missing or stale one), the admin and
//! `migrate` commands, and `serve` processes: a cleared environment plus an allow-list
//! (and `PATH`, `LLVM_PROFILE_FILE` and `IMFAULT_MUTANT`, [`crate::util::inherit_allowed`]),
//! port 0 with the bound address read back from the `listening on ADDR` line, one log
//! file per process (stderr, plus every stdout line), the recorded exit status, and
//! SIGKILL on drop.
//!
//! Must not: speak the WebSocket protocol (that is `crate::client`) or touch the
//! database directly (that is `crate::pg` and the tests). Waits are polling loops of
//! short async sleeps with a deadline; only `require_faults` (a sync API that runs
//! `im-gateway version`) and `Drop` block, briefly and boundedly.

use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use nix::sys::signal::Signal;

use crate::util::{poll, wait_until};

use crate::pg::{Cluster, ClusterOpts};
use crate::process::{describe, log_tail, send_signal, set_parent_death_signal};

/// How long `serve` may take to print `listening on ADDR`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long an admin command, `migrate` or `version` may run.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long we wait for the stdout reader thread to copy the last lines after an exit.
const READER_DRAIN: Duration = Duration::from_secs(1);
/// Lines of a gateway log quoted in errors.
const LOG_TAIL_LINES: usize = 40;
/// The readiness line `serve` prints on stdout, followed by the bound address.
const READY_PREFIX: &str = "listening on ";

/// Numbers gateway log files (`gateway-<n>.log`) within this process.
static GATEWAY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The workspace root: the harness crate's parent directory.
pub fn workspace_dir() -> PathBuf {
    let raw = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    fs::canonicalize(raw).unwrap_or_else(|_| raw.to_path_buf())
}

/// The `im-gateway` binary: `$IM_GATEWAY_BIN` if set (taken as is), else
/// `<target>/debug/im-gateway` where `<target>` is `$CARGO_TARGET_DIR` (relative paths
/// are taken from the workspace root) or `<workspace>/target`. The latter must not be
/// older than any file of `gateway/src`, `gateway/Cargo.toml`, `gateway/build.rs` or
/// `migrations/`. Decided once per process.
pub fn gateway_bin() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| find_gateway_bin().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn find_gateway_bin() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("IM_GATEWAY_BIN") {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!(
                "IM_GATEWAY_BIN={} is not a file: unset it and run `make build`",
                bin.display()
            );
        }
        return Ok(bin);
    }
    let bin = target_dir().join("debug").join("im-gateway");
    let built = fs::metadata(&bin)
        .and_then(|meta| meta.modified())
        .map_err(|e| {
            anyhow::anyhow!(
                "gateway binary {} not found ({e}): run `make build`",
                bin.display()
            )
        })?;
    let newest = newest_source()?;
    if let Some((modified, source)) = newest {
        if modified > built {
            let lag = modified.duration_since(built).unwrap_or_default();
            bail!(
                "gateway binary {} is stale: {} is {:.1} s newer: run `make build` \
                 (if it is up to date and cargo rebuilt nothing, touch gateway/src/main.rs)",
                bin.display(),
                source.display(),
                lag.as_secs_f64()
            );
        }
    }
    Ok(bin)
}

/// Where cargo puts what it builds: `$CARGO_TARGET_DIR` (relative paths taken from the
/// workspace root) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    let workspace = workspace_dir();
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if Path::new(&dir).is_absolute() => PathBuf::from(dir),
        Some(dir) => workspace.join(dir),
        None => workspace.join("target"),
    }
}

/// The newest file a gateway build depends on (`gateway/src`, `gateway/Cargo.toml`,
/// `gateway/build.rs`, `migrations/`) with its mtime: a binary older than it is stale.
/// `None` when none of them exists.
pub fn newest_source() -> anyhow::Result<Option<(SystemTime, PathBuf)>> {
    let workspace = workspace_dir();
    let mut sources = Vec::new();
    let gateway = workspace.join("gateway");
    collect_files(&gateway.join("src"), &mut sources)?;
    sources.push(gateway.join("Cargo.toml"));
    sources.push(gateway.join("build.rs"));
    collect_files(&workspace.join("migrations"), &mut sources)?;
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    for source in sources {
        let modified = match fs::metadata(&source) {
            Ok(meta) => meta
                .modified()
                .with_context(|| format!("mtime of {}", source.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("stat {}", source.display())),
        };
        if newest.as_ref().is_none_or(|(time, _)| modified > *time) {
            newest = Some((modified, source));
        }
    }
    Ok(newest)
}

/// Every file below `dir` (recursively), skipping hidden names and editor backups.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("list {}", dir.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("list {}", dir.display()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name.ends_with('~') {
            continue;
        }
        let kind = entry
            .file_type()
            .with_context(|| format!("stat {}", entry.path().display()))?;
        if kind.is_dir() {
            collect_files(&entry.path(), out)?;
        } else {
            out.push(entry.path());
        }
    }
    Ok(())
}

/// Fails unless the binary was built with the `faults` feature (`im-gateway version`
/// says `faults=on`). Runs the binary once per process and blocks while it does: from
/// async code call it under `spawn_blocking`.
pub fn require_faults() -> anyhow::Result<()> {
    static FAULTS: OnceLock<Result<(), String>> = OnceLock::new();
    FAULTS
        .get_or_init(|| check_faults().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn check_faults() -> anyhow::Result<()> {
    let bin = gateway_bin()?;
    let stdout = gateway_version()?;
    if stdout.contains("faults=on") {
        Ok(())
    } else if stdout.contains("faults=off") {
        bail!(
            "{} was built without the faults feature ({}): run `make build`",
            bin.display(),
            stdout.trim()
        )
    } else {
        bail!(
            "`{} version` printed {:?}, which says neither faults=on nor faults=off",
            bin.display(),
            stdout.trim()
        )
    }
}

/// The gateway bug `IM_BUG` asks for in this process (a name the test client does not
/// own), forwarded to every gateway this harness starts.
pub fn gateway_bug() -> Option<String> {
    let v = std::env::var("IM_BUG").ok()?;
    let v = v.trim();
    (!v.is_empty() && !crate::client::bugs::ALL.contains(&v)).then(|| v.to_string())
}

/// A binary with deliberate bugs compiled in (`bugs=on`) runs only when a control asks for
/// a gateway bug: `make test` and `make evidence` never judge it.
fn check_bugs_binary() -> anyhow::Result<()> {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let v = gateway_version().map_err(|e| format!("{e:#}"))?;
            match (v.contains("bugs=on"), gateway_bug()) {
                (true, None) => Err(format!(
                    "the gateway binary has deliberate bugs compiled in ({}) but IM_BUG names                      no gateway bug: unset IM_GATEWAY_BIN and run `make build`",
                    v.trim()
                )),
                (false, Some(bug)) => Err(format!(
                    "IM_BUG={bug} needs the controls build (`make controls` builds                      im-gateway-bugs), but the gateway binary says {}",
                    v.trim()
                )),
                _ => Ok(()),
            }
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// `im-gateway version`'s stdout, run once per process (blocking).
fn gateway_version() -> anyhow::Result<String> {
    static VERSION: OnceLock<Result<String, String>> = OnceLock::new();
    VERSION
        .get_or_init(|| run_version().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn run_version() -> anyhow::Result<String> {
    let bin = gateway_bin()?;
    let (out, _) = crate::util::try_run_cleared(&bin, &["version"], &[], COMMAND_TIMEOUT)
        .context("run im-gateway version")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "`{} version` failed ({}): {}{}",
            bin.display(),
            describe(out.status),
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(stdout.into_owned())
}

/// Runs `im-gateway admin ARGS…` against `db_url` with a cleared environment (only
/// `PATH` and `IM_DATABASE_URL`) and returns its trimmed stdout (e.g. a token).
/// `args` are the words after `admin`: `&["add-user", "alice"]`; a leading `"admin"`
/// is accepted too. A non-zero exit is an error that quotes stderr.
pub async fn admin(db_url: &str, args: &[&str]) -> anyhow::Result<String> {
    let args = match args.first() {
        Some(&"admin") => &args[1..],
        _ => args,
    };
    let mut full = vec!["admin"];
    full.extend_from_slice(args);
    run_command(db_url, &full).await
}

/// Runs `im-gateway migrate` against `db_url` (idempotent).
pub async fn migrate(db_url: &str) -> anyhow::Result<()> {
    run_command(db_url, &["migrate"]).await.map(|_| ())
}

async fn run_command(db_url: &str, args: &[&str]) -> anyhow::Result<String> {
    let bin = gateway_bin()?;
    let shown = format!("im-gateway {}", args.join(" "));
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(args)
        .env_clear()
        .env("IM_DATABASE_URL", db_url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    crate::util::inherit_allowed(cmd.as_std_mut());
    let child = cmd.spawn().with_context(|| format!("spawn `{shown}`"))?;
    let out = match tokio::time::timeout(COMMAND_TIMEOUT, child.wait_with_output()).await {
        Ok(out) => out.with_context(|| format!("wait for `{shown}`"))?,
        Err(_) => bail!("`{shown}` did not exit within {COMMAND_TIMEOUT:?} (killed)"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}{}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim(),
            if stdout.is_empty() {
                String::new()
            } else {
                format!("\nstdout: {stdout}")
            }
        );
    }
    Ok(stdout)
}

/// How to run `im-gateway serve`: `None` leaves the gateway's default.
#[derive(Clone, Debug, Default)]
pub struct GatewayOpts {
    /// `IM_FAULT`, e.g. `gw.reply.send:drop:0:1`.
    pub fault: Option<String>,
    /// `IM_SWEEP_MS`: the sweep interval (D5's repair bound).
    pub sweep_ms: Option<u64>,
    /// `IM_DB_TIMEOUT_MS`: how soon an unreachable database answers `UNAVAILABLE`.
    pub db_timeout_ms: Option<u64>,
    /// Further variables, applied last: names must start with `IM_` (e.g.
    /// `IM_QUEUE_FRAMES_MAX`) or be `RUST_LOG` / `RUST_BACKTRACE`.
    pub env: Vec<(String, String)>,
    /// Serve the fault control socket (`IM_FAULT_CONTROL`, beside the log file), so that
    /// faults can be armed and disarmed while the gateway runs ([`Gateway::control`]).
    pub control: bool,
}

/// `im-gateway serve` with a cleared environment plus the allow-list (and
/// `IM_FAULT_CONTROL=control` when given).
fn serve_command(
    bin: &Path,
    db_url: &str,
    opts: &GatewayOpts,
    control: Option<&Path>,
) -> anyhow::Result<Command> {
    let mut cmd = Command::new(bin);
    cmd.arg("serve").env_clear();
    crate::util::inherit_allowed(&mut cmd);
    cmd.env("RUST_LOG", "info")
        .env("RUST_BACKTRACE", "1")
        .env("IM_DATABASE_URL", db_url)
        .env("IM_LISTEN", "127.0.0.1:0");
    if let Some(ms) = opts.sweep_ms {
        cmd.env("IM_SWEEP_MS", ms.to_string());
    }
    if let Some(fault) = &opts.fault {
        cmd.env("IM_FAULT", fault);
    }
    if let Some(ms) = opts.db_timeout_ms {
        cmd.env("IM_DB_TIMEOUT_MS", ms.to_string());
    }
    if let Some(bug) = gateway_bug() {
        cmd.env("IM_BUG", bug);
    }
    if let Some(path) = control {
        cmd.env("IM_FAULT_CONTROL", path);
    }
    for (name, value) in &opts.env {
        if !(name.starts_with("IM_") || name == "RUST_LOG" || name == "RUST_BACKTRACE") {
            bail!("GatewayOpts.env: {name} is not allowed (only IM_*, RUST_LOG, RUST_BACKTRACE)");
        }
        cmd.env(name, value);
    }
    cmd.stdin(Stdio::null());
    set_parent_death_signal(&mut cmd, Signal::SIGKILL);
    Ok(cmd)
}

/// How long one fault control command may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(1);

/// One command on a gateway's fault control socket at `path`; its reply line, which must
/// start with `ok`.
pub async fn fault_control(path: &Path, cmd: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let r = tokio::time::timeout(CONTROL_TIMEOUT, async {
        let mut s = tokio::net::UnixStream::connect(path)
            .await
            .with_context(|| format!("connect {}", path.display()))?;
        s.write_all(format!("{cmd}\n").as_bytes()).await?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).await?;
        anyhow::Ok(line.trim().to_string())
    })
    .await
    .with_context(|| format!("fault control `{cmd}` timed out"))??;
    anyhow::ensure!(r.starts_with("ok"), "fault control `{cmd}`: {r}");
    Ok(r)
}

/// Whether a frame fault armed on a gateway's control socket (`point:action`) leaves the
/// sweep's pass alone: a drop or error of a push, a reply or a notification does not delay
/// it; a delay does, and so does anything at `gw.reply.ack` (the acks the sweep waits for:
/// a dropped ack reply hides an ack that took effect). Decided here, where frame faults are
/// armed, for the nemesis's `gw-fault` and for a scripted check's alike, and written into
/// the fault's history line (`leaves_the_sweep_alone`), which is all the judge reads.
pub fn frame_fault_leaves_the_sweep_alone(point: im_protocol::FaultPoint, action: &str) -> bool {
    matches!(action, "drop" | "error") && point != im_protocol::FaultPoint::GwReplyAck
}

fn next_log_path(log_dir: &Path) -> anyhow::Result<PathBuf> {
    fs::create_dir_all(log_dir).with_context(|| format!("create {}", log_dir.display()))?;
    let n = GATEWAY_COUNTER.fetch_add(1, Ordering::Relaxed);
    Ok(log_dir.join(format!("gateway-{n}.log")))
}

/// A running (or exited, not yet dropped) `im-gateway serve`. Dropping it SIGKILLs and
/// reaps the process if it still runs.
pub struct Gateway {
    /// The process; reaped once `exit` is set.
    child: Child,
    /// Where it listens, from its `listening on ADDR` line.
    addr: SocketAddr,
    /// Its stderr and every stdout line.
    log_path: PathBuf,
    /// The exit status once observed (it can be reaped only once).
    exit: Option<ExitStatus>,
    /// Copies stdout into the log; finishes at the child's exit.
    stdout_reader: Option<std::thread::JoinHandle<()>>,
    /// Its fault control socket ([`GatewayOpts::control`]).
    control: Option<PathBuf>,
}

impl Gateway {
    /// Spawns `im-gateway serve` against `db_url` on 127.0.0.1 port 0, logging to
    /// `log_dir/gateway-<n>.log`, and waits (20 s at most) for its `listening on ADDR`
    /// line. If it exits first, the error has its exit status and the log tail.
    pub async fn start(
        db_url: &str,
        opts: &GatewayOpts,
        log_dir: &Path,
    ) -> anyhow::Result<Gateway> {
        let bin = gateway_bin()?;
        tokio::task::spawn_blocking(check_bugs_binary)
            .await
            .context("join the bugs-binary check")??;
        let log_path = next_log_path(log_dir)?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        let stderr = log
            .try_clone()
            .with_context(|| format!("dup {}", log_path.display()))?;
        let control = opts.control.then(|| log_path.with_extension("sock"));
        let mut cmd = serve_command(&bin, db_url, opts, control.as_deref())?;
        cmd.stdout(Stdio::piped()).stderr(Stdio::from(stderr));
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {} serve", bin.display()))?;
        // From here on `Drop` kills the child.
        let mut gw = Gateway {
            child,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            log_path,
            exit: None,
            stdout_reader: None,
            control,
        };
        let stdout = gw.child.stdout.take().context("gateway stdout not piped")?;
        let (ready_tx, mut ready_rx) = tokio::sync::oneshot::channel::<String>();
        gw.stdout_reader = Some(
            std::thread::Builder::new()
                .name(format!("gateway-{}-stdout", gw.child.id()))
                .spawn(move || copy_stdout(stdout, log, ready_tx))
                .context("spawn the gateway stdout reader")?,
        );

        let ready = wait_until(
            &format!("the gateway to print `{READY_PREFIX}ADDR`"),
            READY_TIMEOUT,
            async || match ready_rx.try_recv() {
                Ok(text) => Ok(Ok(text)),
                // Stdout closed without the line: the process is (nearly) gone.
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => Ok(Err(None)),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    match gw.try_exit_status() {
                        Some(status) => Ok(Err(Some(status))),
                        None => Err(()),
                    }
                }
            },
        )
        .await;
        match ready {
            Ok(Ok(text)) => {
                gw.addr = text.parse().with_context(|| {
                    format!("gateway printed `{READY_PREFIX}{text}`: not an address")
                })?;
                Ok(gw)
            }
            Ok(Err(None)) => match gw.wait_exit(Duration::from_secs(2)).await {
                Ok(status) => bail!(
                    "gateway exited ({}) before it was ready; {}:\n{}",
                    describe(status),
                    gw.log_path.display(),
                    gw.tail()
                ),
                Err(_) => bail!(
                    "gateway closed stdout before `{READY_PREFIX}ADDR` and still runs; {}:\n{}",
                    gw.log_path.display(),
                    gw.tail()
                ),
            },
            Ok(Err(Some(status))) => {
                gw.drain_reader().await;
                bail!(
                    "gateway exited ({}) before it was ready; {}:\n{}",
                    describe(status),
                    gw.log_path.display(),
                    gw.tail()
                );
            }
            Err(e) => Err(e).with_context(|| format!("{}:\n{}", gw.log_path.display(), gw.tail())),
        }
    }

    /// One command on the gateway's fault control socket (`arm SPEC`, `disarm POINT|all`,
    /// `list`): its `ok …` reply, or an error for any other reply. Needs
    /// [`GatewayOpts::control`].
    pub async fn control(&self, cmd: &str) -> anyhow::Result<String> {
        let path = self
            .control
            .as_deref()
            .context("the gateway was started without GatewayOpts::control")?;
        fault_control(path, cmd).await
    }

    /// The address `serve` bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `ws://ADDR/ws`.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log file (stderr and stdout).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The log as it is now (lossy UTF-8; an unreadable log yields a note saying so).
    pub fn log_text(&self) -> String {
        match fs::read(&self.log_path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("<could not read {}: {e}>", self.log_path.display()),
        }
    }

    /// The durability settings the gateway's database sessions run under, from its log line
    /// `database session durability synchronous_commit=… fsync=… full_page_writes=…`
    /// (written once at start, before `listening on`): name -> value. Empty if absent.
    pub fn session_durability(&self) -> std::collections::BTreeMap<String, String> {
        let text = self.log_text();
        let Some(line) = text
            .lines()
            .find(|l| l.contains("database session durability"))
        else {
            return Default::default();
        };
        ["synchronous_commit", "fsync", "full_page_writes"]
            .iter()
            .filter_map(|k| {
                let at = line.find(&format!("{k}="))? + k.len() + 1;
                let v: String = line[at..]
                    .chars()
                    .take_while(|c| !c.is_whitespace())
                    .collect();
                Some((k.to_string(), v.trim_matches('"').to_string()))
            })
            .collect()
    }

    /// The exit status if the process has exited (recorded), `None` while it runs.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exit = Some(status);
            }
        }
        self.exit
    }

    /// Waits at most `within` for the process to exit and records the status; also
    /// waits (briefly) until its last stdout lines are in the log.
    pub async fn wait_exit(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let pid = self.pid();
        let waited = wait_until(
            &format!("gateway (pid {pid}) to exit"),
            within,
            async || self.try_exit_status().ok_or(()),
        )
        .await;
        match waited {
            Ok(status) => {
                self.drain_reader().await;
                Ok(status)
            }
            Err(e) => {
                Err(e).with_context(|| format!("{}:\n{}", self.log_path.display(), self.tail()))
            }
        }
    }

    /// The recorded exit code: `status.code()`, or 128 + signal when killed by one.
    /// `None` until an exit was observed.
    pub fn exit_code(&self) -> Option<i32> {
        self.exit
            .and_then(|status| status.code().or_else(|| status.signal().map(|s| 128 + s)))
    }

    /// Graceful shutdown: SIGTERM, then waits at most `within` (see `wait_exit`).
    /// If it has exited already, returns the recorded status.
    pub async fn terminate(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        if let Some(status) = self.try_exit_status() {
            return Ok(status);
        }
        send_signal(self.pid(), Signal::SIGTERM).context("SIGTERM the gateway")?;
        self.wait_exit(within).await
    }

    /// SIGKILL and reap, recording the status; nothing if it has exited already.
    pub fn kill(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        // An error means it exited meanwhile; wait() below reaps it either way.
        let _ = self.child.kill();
        if let Ok(status) = self.child.wait() {
            self.exit = Some(status);
        }
    }

    fn tail(&self) -> String {
        log_tail(&self.log_path, 0, LOG_TAIL_LINES)
    }

    /// Gives the stdout reader a moment to copy the last lines into the log.
    async fn drain_reader(&mut self) {
        // Bounded, not an error: the log may then miss the last lines.
        let _ = wait_until("the stdout reader to finish", READER_DRAIN, async || {
            poll(
                self.stdout_reader.as_ref().is_none_or(|r| r.is_finished()),
                (),
            )
            .await
        })
        .await;
        if self.stdout_reader.as_ref().is_some_and(|r| r.is_finished()) {
            self.stdout_reader = None;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The stdout reader thread: appends every line to the log and hands the address of
/// the first `listening on ADDR` line to `start()`.
fn copy_stdout(
    stdout: std::process::ChildStdout,
    mut log: fs::File,
    ready: tokio::sync::oneshot::Sender<String>,
) {
    let mut ready = Some(ready);
    let mut reader = BufReader::new(stdout);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        // A log write error cannot be reported anywhere better than the log itself.
        let _ = writeln!(log, "{text}");
        if let Some(addr) = text.strip_prefix(READY_PREFIX) {
            if let Some(tx) = ready.take() {
                // start() may have given up already; then nobody needs the address.
                let _ = tx.send(addr.trim().to_string());
            }
        }
    }
}

/// Runs `im-gateway serve` where it must refuse to start (e.g. an unmigrated schema or
/// a bad `IM_FAULT`): waits at most `within` for it to exit and returns its status and
/// output (stdout then stderr), also written to `log_dir/gateway-<n>.log`. Still running
/// after `within` (it did start) is an error; the process is then killed.
pub async fn run_serve_expect_exit(
    db_url: &str,
    opts: &GatewayOpts,
    log_dir: &Path,
    within: Duration,
) -> anyhow::Result<(ExitStatus, String)> {
    let bin = gateway_bin()?;
    let log_path = next_log_path(log_dir)?;
    let mut cmd = tokio::process::Command::from(serve_command(&bin, db_url, opts, None)?);
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .with_context(|| format!("spawn {} serve", bin.display()))?;
    let out = match tokio::time::timeout(within, child.wait_with_output()).await {
        Ok(out) => out.context("wait for im-gateway serve")?,
        Err(_) => bail!(
            "`im-gateway serve` was still running after {within:?}: it did not refuse to start"
        ),
    };
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    fs::write(&log_path, &text).with_context(|| format!("write {}", log_path.display()))?;
    Ok((out.status, text))
}

/// A cluster with the gateway's schema: `pg` knows nothing of it, so the constructors that
/// run `im-gateway migrate` on a new cluster live here, beside [`migrate`].
impl Cluster {
    /// [`Cluster::start`], then `im-gateway migrate` against it.
    pub async fn start_migrated() -> anyhow::Result<Cluster> {
        Cluster::start_migrated_with(ClusterOpts::default()).await
    }

    /// [`Cluster::start_with`], then `im-gateway migrate` against it.
    pub async fn start_migrated_with(opts: ClusterOpts) -> anyhow::Result<Cluster> {
        let cluster = Cluster::start_with(opts).await?;
        migrate(&cluster.url())
            .await
            .with_context(|| format!("migrate cluster on port {}", cluster.port()))?;
        Ok(cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sqlx::migrate!` checksums: `migrate` is idempotent, and a migration whose recorded
    /// checksum differs from the embedded file (as after editing an applied migration) is
    /// refused by `migrate` and by the check `admin` and `serve` run, naming the file.
    #[tokio::test]
    async fn an_edited_migration_is_refused_by_name() -> anyhow::Result<()> {
        let pg = crate::pg::Cluster::start_migrated().await?;
        migrate(&pg.url())
            .await
            .context("a second migrate is a no-op")?;
        let pool = pg.pool().await?;
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&pool)
                .await?;
        // Every file of migrations/ was applied, by its number.
        let mut files: Vec<i64> = std::fs::read_dir(workspace_dir().join("migrations"))?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".sql")?.split('_').next()?.parse().ok()
            })
            .collect();
        files.sort_unstable();
        assert!(files.len() >= 7, "migrations/: {files:?}");
        assert_eq!(versions, files);
        sqlx::query("UPDATE _sqlx_migrations SET checksum = '\\x00'::bytea WHERE version = 2")
            .execute(&pool)
            .await?;
        pool.close().await;
        let e = format!("{:#}", migrate(&pg.url()).await.unwrap_err());
        assert!(
            e.contains("0002_installs.sql") && e.contains("edited"),
            "migrate: {e}"
        );
        let e = format!(
            "{:#}",
            admin(&pg.url(), &["add-user", "alice"]).await.unwrap_err()
        );
        assert!(
            e.contains("0002_installs.sql") && e.contains("edited"),
            "admin: {e}"
        );
        Ok(())
    }
}
