//! im-gateway: an instant-messaging gateway (WebSocket + PostgreSQL) whose delivery
//! guarantees are the invariants D1–D6, P1 and S1 of SPEC section 1, with named fault points
//! (SPEC section 4) compiled in by the `faults` feature, and deliberate bugs (negative
//! controls, [`bugs`]) compiled in only by the `bugs` feature.
//!
//! Where each invariant is enforced:
//! - D1, D2, P1: [`store::send`] (and the reply order in `conn`).
//! - D3, D4: [`store::ack`], the only writer of `device_cursors`.
//! - D5: [`sweep`] and the LISTEN-loss path of [`fanout`].
//! - D6: PostgreSQL with `fsync=on`, `synchronous_commit=on`, and D1's reply-after-commit.
//! - S1: the visibility predicates in [`store`] and `im_visible_head` in `migrations/`.
//!
//! A broken invariant ends the process ([`invariant`]): D4 after the ack upsert, D3 on every
//! sync page ([`store::sync`]), P1's order of fan-out per conversation ([`fanout`]).
//!
//! Hostile peers (issue #8): a byte budget per connection ([`hub::Budget`]), connections per
//! device ([`hub::Hub::register`]) and per source address ([`limits`]), a separate pool and
//! deadline for handshakes ([`server`]), a failed-hello throttle ([`limits`]), stale installs
//! closed on their reinstall ([`fanout`], [`sweep`]), a close that keeps replies and a
//! read-idle timeout ([`conn`]).

pub mod admin;
pub mod batch;
pub mod bugs;
pub mod changes;
pub mod config;
pub mod conn;
pub mod dbconnect;
pub mod error;
pub mod fanout;
pub mod fault_control;
pub mod faults;
pub mod hub;
pub mod invariant;
pub mod limits;
pub mod lineage;
pub mod migrate;
pub mod observer;
pub mod protocol;
pub mod server;
pub mod state;
pub mod store;
pub mod sweep;
