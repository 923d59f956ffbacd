//! A server frame as the client received it: the leaf type that the transport hands to the
//! pump and the observer, so neither needs the other's module.

use serde_json::Value;

use im_protocol::wire::Reply;
use im_protocol::{FrameError, ServerFrame};

/// A server frame as received: its JSON as it came (what [`super::Client`]'s methods return, and
/// what a hostile test inspects) and its typed reading ([`ServerFrame::parse`]), from which
/// the client acts and the history records.
#[derive(Debug)]
pub(super) struct Received {
    pub(super) value: Value,
    pub(super) frame: Result<ServerFrame, FrameError>,
}

impl Received {
    /// The typed reply, when the frame is one that parsed.
    pub(super) fn reply(&self) -> Option<&Reply> {
        match &self.frame {
            Ok(ServerFrame::Reply { reply, .. }) => Some(reply),
            _ => None,
        }
    }
}
