//! Rebuilds the gateway when a file of `migrations/` changes: `sqlx::migrate!` embeds
//! them (src/migrate.rs) but, unlike `include_str!`, does not tell cargo on stable Rust.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
