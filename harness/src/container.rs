//! The container backend of [`crate::pg::Cluster`] (`IMFAULT_PG=container`, issue 9).
//!
//! Owns: one PostgreSQL container per cluster, started through `testcontainers` from a
//! local image (`IMFAULT_PG_IMAGE`, default [`DEFAULT_IMAGE`], built from Debian's packages
//! by `scripts/containers.sh image`: nothing is pulled), its crash (`docker kill -s KILL`:
//! the postmaster is the container's PID 1, so every backend dies with it and nothing is
//! checkpointed), its start again (crash recovery replays the WAL) and its removal; and a
//! harness [`Proxy`] in front of it, because docker gives the container a new host port on
//! every start while the gateway keeps the one database address it was started with.
//!
//! Must not: know the gateway's schema, or block a tokio worker (every docker command runs
//! under `spawn_blocking`).
//!
//! Why testcontainers 0.15: its `Cli` client drives the `docker` command, which negotiates
//! the engine's API version. Later releases speak the Docker Engine API through bollard at
//! a fixed version (1.52 in 0.27) and Debian 12's `docker.io` (20.10) answers "client version
//! 1.52 is too new. Maximum supported API version is 1.41" (measured here).
//!
//! What the backend cannot do (it says so, never silently): the LazyFS power-cut layer,
//! standbys and `kill_all` (they need the data directory and the process group on this
//! machine).

use anyhow::bail;

#[cfg(feature = "container")]
pub use engine::PgContainer;
#[cfg(not(feature = "container"))]
pub use stub::PgContainer;

/// The image `scripts/containers.sh image` builds (PostgreSQL 15 from Debian 12's packages).
pub const DEFAULT_IMAGE: &str = "imfault/postgres:15";
/// `IMFAULT_PG`: which backend runs PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The server programs on this machine, the postmaster our child process (default).
    Local,
    /// A container from a local image, through testcontainers.
    Container,
}

impl Backend {
    /// Reads `IMFAULT_PG` (`local`, the default, or `container`); anything else is an error
    /// naming the variable and the two values.
    pub fn from_env() -> anyhow::Result<Backend> {
        Backend::parse(std::env::var("IMFAULT_PG").ok().as_deref())
    }

    fn parse(v: Option<&str>) -> anyhow::Result<Backend> {
        match v.map(str::trim) {
            None | Some("") | Some("local") => Ok(Backend::Local),
            Some("container") => Ok(Backend::Container),
            Some(other) => {
                bail!("IMFAULT_PG={other:?}: expected `local` (the default) or `container`")
            }
        }
    }
}

/// The image `IMFAULT_PG_IMAGE` names, [`DEFAULT_IMAGE`] when unset.
pub fn image_from_env() -> String {
    std::env::var("IMFAULT_PG_IMAGE")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_IMAGE.to_string())
}

#[cfg_attr(not(feature = "container"), allow(dead_code))]
/// `name:tag` → (`name`, `tag`), `latest` when no tag is given.
fn split_image(image: &str) -> (String, String) {
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name.to_string(), tag.to_string()),
        _ => (image.to_string(), "latest".to_string()),
    }
}

/// The part that needs docker and testcontainers (cargo feature `container`).
#[cfg(feature = "container")]
mod engine {
    use std::net::SocketAddr;
    use std::process::{Command, Stdio};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context};
    use testcontainers::clients::Cli;
    use testcontainers::core::WaitFor;
    use testcontainers::{Container, GenericImage, RunnableImage};

    use super::split_image;
    use crate::proxy::Proxy;

    /// The port PostgreSQL listens on inside the container.
    const PG_PORT: u16 = 5432;
    /// How long the container's postmaster may take to accept connections after a start.
    const READY_TIMEOUT: Duration = Duration::from_secs(30);
    /// How long `docker kill` may take to leave the container stopped.
    const KILL_TIMEOUT: Duration = Duration::from_secs(10);

    /// The docker client every container of this process uses (testcontainers ties a
    /// container's lifetime to its client's).
    fn cli() -> &'static Cli {
        static CLI: OnceLock<Cli> = OnceLock::new();
        CLI.get_or_init(Cli::default)
    }

    /// One PostgreSQL container and the proxy that is its fixed address.
    pub struct PgContainer {
        /// `None` only while being dropped.
        container: Option<Container<'static, GenericImage>>,
        image: String,
        proxy: Proxy,
    }

    impl PgContainer {
        /// Starts a container of `image` with `settings` as `-c name=value` arguments (the
        /// image's entry point passes them to `postgres`), waits until it accepts connections
        /// on its host port, and puts a proxy in front of it.
        pub async fn start(image: &str, settings: Vec<(String, String)>) -> anyhow::Result<Self> {
            let image_name = image.to_string();
            let check = image_name.clone();
            tokio::task::spawn_blocking(move || image_present(&check))
                .await
                .context("join the image check")??;
            let container = tokio::task::spawn_blocking(move || {
                let (name, tag) = split_image(&image_name);
                let generic = GenericImage::new(name, tag)
                    .with_exposed_port(PG_PORT)
                    .with_wait_for(WaitFor::message_on_stderr(
                        "database system is ready to accept connections",
                    ));
                let args: Vec<String> = settings
                    .iter()
                    .flat_map(|(k, v)| ["-c".to_string(), format!("{k}={v}")])
                    .collect();
                // testcontainers panics when docker fails: catch it and say what failed.
                std::panic::catch_unwind(|| cli().run(RunnableImage::from((generic, args))))
                    .map_err(|p| anyhow::anyhow!("docker run {image_name}: {}", panic_text(&p)))
            })
            .await
            .context("join docker run")??;
            let port = container.get_host_port_ipv4(PG_PORT);
            let upstream = SocketAddr::from(([127, 0, 0, 1], port));
            let proxy = Proxy::start(upstream, Duration::ZERO)?;
            let me = PgContainer {
                container: Some(container),
                image: image.to_string(),
                proxy,
            };
            me.wait_ready(upstream).await?;
            Ok(me)
        }

        /// The address the gateway and the harness use: the proxy's, the same for the
        /// container's whole life.
        pub fn addr(&self) -> SocketAddr {
            self.proxy.addr()
        }

        /// The image this container runs.
        pub fn image(&self) -> &str {
            &self.image
        }

        /// The container's id.
        pub fn id(&self) -> &str {
            self.container().id()
        }

        fn container(&self) -> &Container<'static, GenericImage> {
            self.container
                .as_ref()
                .expect("container present until drop")
        }

        /// Crashes PostgreSQL: `docker kill -s KILL` (PID 1 is the postmaster; the kernel ends
        /// every process of the container with it), then waits until docker reports it stopped.
        pub async fn kill(&self) -> anyhow::Result<()> {
            self.kill_with("KILL").await
        }

        /// Fast shutdown: SIGINT to the postmaster, waits until the container stopped.
        pub async fn stop(&self) -> anyhow::Result<()> {
            self.kill_with("INT").await
        }

        async fn kill_with(&self, signal: &'static str) -> anyhow::Result<()> {
            let id = self.id().to_string();
            tokio::task::spawn_blocking(move || {
                docker(&["kill", "-s", signal, &id])?;
                let deadline = Instant::now() + KILL_TIMEOUT;
                while running(&id)? {
                    if Instant::now() >= deadline {
                        bail!("container {id} still running {KILL_TIMEOUT:?} after SIG{signal}");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(())
            })
            .await
            .context("join docker kill")?
        }

        /// Starts the stopped container again (crash recovery runs), points the proxy at its
        /// new host port and waits until it accepts connections there.
        pub async fn start_again(&self) -> anyhow::Result<()> {
            let id = self.id().to_string();
            let port = tokio::task::spawn_blocking(move || -> anyhow::Result<u16> {
                docker(&["start", &id])?;
                host_port(&id)
            })
            .await
            .context("join docker start")??;
            let upstream = SocketAddr::from(([127, 0, 0, 1], port));
            self.proxy.switch(upstream);
            self.wait_ready(upstream).await
        }

        /// Whether docker reports the container running.
        pub async fn is_running(&self) -> bool {
            let id = self.id().to_string();
            tokio::task::spawn_blocking(move || running(&id).unwrap_or(false))
                .await
                .unwrap_or(false)
        }

        /// Whether docker reports the container running (blocking; for `Drop` and sync callers).
        pub fn is_running_blocking(&self) -> bool {
            running(self.id()).unwrap_or(false)
        }

        /// `docker logs` of the container (the postmaster's stderr since the first start).
        pub fn logs(&self) -> String {
            match Command::new("docker")
                .args(["logs", self.id()])
                .stdin(Stdio::null())
                .output()
            {
                Ok(out) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(e) => format!("(docker logs failed: {e})"),
            }
        }

        async fn wait_ready(&self, upstream: SocketAddr) -> anyhow::Result<()> {
            let url = format!("postgres://postgres@{}/postgres", self.addr());
            let deadline = Instant::now() + READY_TIMEOUT;
            loop {
                let attempt = tokio::time::timeout(
                    Duration::from_secs(2),
                    <sqlx::PgConnection as sqlx::Connection>::connect(&url),
                )
                .await;
                if let Ok(Ok(conn)) = attempt {
                    let _ = sqlx::Connection::close(conn).await;
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    bail!(
                        "container {} ({}, host {upstream}) not accepting connections within \
                     {READY_TIMEOUT:?}; its log:\n{}",
                        self.id(),
                        self.image,
                        tail(&self.logs(), 30)
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    impl Drop for PgContainer {
        fn drop(&mut self) {
            // testcontainers' own drop removes the container (`docker rm -f -v`); it panics
            // when docker fails, which must not turn a drop into an abort.
            if let Some(c) = self.container.take() {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(c)));
            }
        }
    }

    /// Refuses a missing image with the command that builds it (nothing is ever pulled).
    fn image_present(image: &str) -> anyhow::Result<()> {
        let out = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .stdin(Stdio::null())
        .output()
        .context("run `docker image inspect` (is the docker CLI installed? `make test-containers` installs it)")?;
        if !out.status.success() {
            bail!(
                "IMFAULT_PG=container: image {image} is not on this machine or the docker engine \
             does not answer ({}): `scripts/containers.sh image` builds it from Debian's \
             packages (`make test-containers` does all of it)",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Runs `docker ARGS`, failing with its stderr.
    fn docker(args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("docker")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("run docker {}", args.join(" ")))?;
        if !out.status.success() {
            bail!(
                "docker {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    fn running(id: &str) -> anyhow::Result<bool> {
        Ok(docker(&["inspect", "--format", "{{.State.Running}}", id])? == "true")
    }

    /// The host port docker mapped to the container's 5432 (new on every start).
    fn host_port(id: &str) -> anyhow::Result<u16> {
        let out = docker(&["port", id, &format!("{PG_PORT}/tcp")])?;
        out.lines()
            .filter_map(|l| l.rsplit_once(':'))
            .find_map(|(host, port)| (!host.contains("::")).then(|| port.parse().ok()).flatten())
            .with_context(|| {
                format!("no IPv4 host port for {PG_PORT}/tcp in `docker port`: {out:?}")
            })
    }

    fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "testcontainers panicked".to_string())
    }

    fn tail(text: &str, lines: usize) -> String {
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// A harness built without the `container` feature: the backend is refused with the
/// command that builds it. The type cannot be constructed, so no other method can run.
#[cfg(not(feature = "container"))]
mod stub {
    use std::net::SocketAddr;

    enum Never {}

    /// Stands for the container of a harness built with `--features harness/container`.
    pub struct PgContainer(Never);

    impl PgContainer {
        pub async fn start(image: &str, _: Vec<(String, String)>) -> anyhow::Result<Self> {
            anyhow::bail!(
                "IMFAULT_PG=container (image {image}): this harness was built without the \
                 container backend; `make test-containers` builds it (cargo feature \
                 `harness/container`) and runs the crash scenarios on it"
            )
        }
        pub fn addr(&self) -> SocketAddr {
            match self.0 {}
        }
        pub fn image(&self) -> &str {
            match self.0 {}
        }
        pub fn id(&self) -> &str {
            match self.0 {}
        }
        pub async fn kill(&self) -> anyhow::Result<()> {
            match self.0 {}
        }
        pub async fn stop(&self) -> anyhow::Result<()> {
            match self.0 {}
        }
        pub async fn start_again(&self) -> anyhow::Result<()> {
            match self.0 {}
        }
        pub async fn is_running(&self) -> bool {
            match self.0 {}
        }
        pub fn is_running_blocking(&self) -> bool {
            match self.0 {}
        }
        pub fn logs(&self) -> String {
            match self.0 {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_parses_local_container_and_refuses_the_rest() {
        assert_eq!(Backend::parse(None).unwrap(), Backend::Local);
        assert_eq!(Backend::parse(Some("")).unwrap(), Backend::Local);
        assert_eq!(Backend::parse(Some("local")).unwrap(), Backend::Local);
        assert_eq!(
            Backend::parse(Some("container")).unwrap(),
            Backend::Container
        );
        let e = Backend::parse(Some("docker")).unwrap_err().to_string();
        assert!(e.contains("IMFAULT_PG") && e.contains("container"), "{e}");
    }

    #[test]
    fn image_names_split_into_name_and_tag() {
        assert_eq!(
            split_image("imfault/postgres:15"),
            ("imfault/postgres".into(), "15".into())
        );
        assert_eq!(
            split_image("localhost:5000/pg"),
            ("localhost:5000/pg".into(), "latest".into())
        );
        assert_eq!(split_image("pg"), ("pg".into(), "latest".into()));
    }

    /// A harness built without the feature refuses the backend and names the make target.
    #[cfg(not(feature = "container"))]
    #[tokio::test]
    async fn without_the_feature_the_backend_is_refused_with_the_way_to_get_it() {
        let Err(e) = PgContainer::start(DEFAULT_IMAGE, vec![]).await else {
            panic!("the stub started a container");
        };
        let e = e.to_string();
        assert!(
            e.contains("make test-containers") && e.contains(DEFAULT_IMAGE),
            "{e}"
        );
    }
}
