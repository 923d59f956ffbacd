//! The fault control socket (issue 10, the nemesis): `IM_FAULT_CONTROL=PATH` makes `serve`
//! listen on a Unix socket at PATH where fault points are armed and disarmed while the
//! gateway runs, so one gateway process can live through many faults (as neon's failpoint
//! endpoint does). Faults build only: without the `faults` feature the variable is refused
//! at start (exit 2), like `IM_FAULT`.
//!
//! Protocol: one command per line, one reply line each (`ok …` or `err …`):
//! - `arm SPEC`: SPEC in `IM_FAULT` syntax; each named point replaces its arming, its hit
//!   count starts again (so `send.before_commit:halt:2:1` halts on the 3rd hit from now);
//! - `disarm POINT` or `disarm all`;
//! - `list`: the armed points with their hits since armed (`ok point:action:skip[:count]=hits …`).
//!
//! Every accepted command is logged to stderr (`fault control: …`), so the gateway log shows
//! when each fault was switched. The socket is created mode 0600 (only its owner may arm a
//! crash); a stale socket at PATH (a killed gateway's) is replaced, any other file refused.
//! Limits: lines of at most [`LINE_MAX`] bytes, [`CLIENTS_MAX`] clients at once.

use crate::faults;
use anyhow::{bail, Context};
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

/// Longest command line accepted; a longer one closes the connection.
pub const LINE_MAX: usize = 4096;
/// Control connections served at once; more wait in the kernel's backlog.
pub const CLIENTS_MAX: usize = 8;

/// The variable that names the socket.
pub const ENV: &str = "IM_FAULT_CONTROL";

/// Refuses `IM_FAULT_CONTROL` in a build without fault points (the caller exits 2).
pub fn validate(path: Option<&str>) -> Result<(), String> {
    match path {
        Some(p) if !p.is_empty() && !faults::ENABLED => Err(format!(
            "{ENV}={p} is set but this im-gateway was built without fault points \
             (build with `--features faults`, as `make build` does)"
        )),
        Some("") => Err(format!("{ENV} is set but empty: give a socket path")),
        _ => Ok(()),
    }
}

/// Binds the socket at `path` and serves it until the process ends.
pub fn start(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!(
                "{ENV}={}: exists and is not a socket (refusing to replace it)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("{ENV}: remove the stale socket {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("{ENV}: bind {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("{ENV}: chmod 0600 {}", path.display()))?;
    tracing::info!(path = %path.display(), "fault control socket listening");
    let slots = Arc::new(Semaphore::new(CLIENTS_MAX));
    tokio::spawn(async move {
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(async move {
                        serve_one(stream).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fault control accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    Ok(())
}

async fn serve_one(stream: UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut r)
            .take(LINE_MAX as u64 + 1)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(n) => n,
            Err(_) => return,
        };
        if n == 0 {
            return;
        }
        if line.last() != Some(&b'\n') {
            let _ = w
                .write_all(format!("err line longer than {LINE_MAX} bytes\n").as_bytes())
                .await;
            return;
        }
        let reply = match std::str::from_utf8(&line) {
            Ok(text) => command(text.trim()),
            Err(_) => "err not UTF-8".to_string(),
        };
        if w.write_all(format!("{reply}\n").as_bytes()).await.is_err() {
            return;
        }
    }
}

/// One command, answered with one line.
pub fn command(text: &str) -> String {
    let (verb, arg) = match text.split_once(char::is_whitespace) {
        Some((v, a)) => (v, a.trim()),
        None => (text, ""),
    };
    let r: Result<String, String> = match verb {
        "arm" if !arg.is_empty() => faults::arm(arg).map(|specs| {
            let names: Vec<String> = specs
                .iter()
                .map(|s| format!("{}:{}", s.point, s.action))
                .collect();
            format!("armed {}", names.join(","))
        }),
        "disarm" if arg == "all" => faults::disarm(None).map(|()| "disarmed all".to_string()),
        "disarm" if !arg.is_empty() => {
            faults::disarm(Some(arg)).map(|()| format!("disarmed {arg}"))
        }
        "list" if arg.is_empty() => Ok(faults::armed()
            .iter()
            .map(|(spec, hits)| format!("{spec}={hits}"))
            .collect::<Vec<_>>()
            .join(" ")),
        _ => Err(format!(
            "unknown command {text:?}: arm SPEC | disarm POINT | disarm all | list"
        )),
    };
    match r {
        Ok(msg) => {
            if verb != "list" {
                eprintln!("fault control: {text} -> {msg}");
            }
            format!("ok {msg}")
        }
        Err(e) => format!("err {}", e.replace('\n', "; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_commands_with_the_usage() {
        assert!(command("explode").starts_with("err unknown command"));
        assert!(command("arm").starts_with("err unknown command"));
        assert!(command("disarm no.such.point").starts_with("err unknown fault point"));
        let e = command("arm gw.push:explode");
        assert!(e.starts_with("err ") && !e.contains('\n'), "{e}");
    }

    #[cfg(not(feature = "faults"))]
    #[test]
    fn refused_without_fault_points() {
        assert!(validate(Some("/tmp/x.sock")).is_err());
        assert!(validate(None).is_ok());
        assert!(command("arm gw.push:drop").starts_with("err "));
    }

    /// Arms, lists with hits, disarms (the fail crate's registry is process-wide: this is
    /// the only test of this module that arms anything).
    #[cfg(feature = "faults")]
    #[tokio::test]
    async fn arms_counts_and_disarms_at_runtime() {
        use crate::faults::points;
        use std::ops::ControlFlow;
        assert_eq!(
            command("arm gw.recv.ack:drop:1:1"),
            "ok armed gw.recv.ack:drop"
        );
        assert!(matches!(
            faults::gate(points::GW_RECV_ACK, 1, 2).await,
            ControlFlow::Continue(())
        ));
        assert!(matches!(
            faults::gate(points::GW_RECV_ACK, 1, 2).await,
            ControlFlow::Break(1)
        ));
        assert!(matches!(
            faults::gate(points::GW_RECV_ACK, 1, 2).await,
            ControlFlow::Continue(())
        ));
        assert_eq!(command("list"), "ok gw.recv.ack:drop:1:1=3");
        assert_eq!(command("disarm all"), "ok disarmed all");
        assert_eq!(command("list"), "ok ");
        assert!(matches!(
            faults::gate(points::GW_RECV_ACK, 1, 2).await,
            ControlFlow::Continue(())
        ));
    }
}
