//! Wire types of SPEC 2: the protocol crate's ([`im_protocol::wire`]), re-exported so the
//! gateway's modules keep saying `crate::protocol`. Parsing inbound frames, the typed
//! outbound frames and their one renderer live there, with their tests.

pub use im_protocol::wire::*;
