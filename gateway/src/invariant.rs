//! A broken invariant ends the process. The gateway asserts its invariants (D4 in
//! `store::ack`, the sync page's order in `store::sync`, fan-out's per-conversation order in
//! `fanout`) with `assert!`; a panic is a bug, never an operating error (bad input and an
//! unavailable database are `Result`s). Without a hook, a panic inside a spawned task only
//! ends that task: tokio turns it into a `JoinError`, the client gets INTERNAL, and the
//! gateway goes on serving with a broken invariant. [`install_hook`] makes every panic,
//! on any thread or task, write one unbuffered `invariant broken` line to stderr and abort
//! the process (SIGABRT, status 134), the way a crash does.
//!
//! A hook, not `panic = "abort"` in the profiles: cargo ignores `panic` for tests and the
//! profile would also apply to every binary of the workspace (the fuzz target catches
//! panics on purpose); the hook applies to the `im-gateway` binary only, which calls it
//! first thing in `main`. The library's own tests keep unwinding (`#[should_panic]`).

use std::io::Write;

/// Makes every panic in this process log `invariant broken: …` and abort (see the module).
pub fn install_hook() {
    std::panic::set_hook(Box::new(|info| {
        let line = format!("im-gateway: invariant broken, aborting: {info}\n");
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
        std::process::abort();
    }));
}
