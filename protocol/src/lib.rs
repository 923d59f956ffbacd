//! im-protocol: the contract between the gateway and everything that talks to it (the
//! harness client, the bench, the fuzzer), as types.
//!
//! Owns: the wire types of SPEC 2 ([`wire`]: requests, replies, pushes, events, limits,
//! rendered to JSON in one place), their wire errors and stable codes ([`error`]), the
//! client's side of the same contract ([`client`]: a typed request rendered with its `rid`,
//! a server frame parsed into a typed [`client::ServerFrame`]), and the names of the fault
//! points and actions of SPEC 4 ([`fault`]).
//!
//! Must not: do I/O, touch a database, hold state, or know where in the gateway a fault
//! point sits. Its only dependencies are serde, serde_json and thiserror.

pub mod client;
pub mod error;
pub mod fault;
pub mod wire;

pub use client::{FrameError, ServerFrame};
pub use error::WireError;
pub use fault::{Action, FaultPoint};
