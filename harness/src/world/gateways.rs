//! The world's gateway processes ([`Gateways`], `World::gateways`): gateway 0 and any
//! further ones on the same database (issue 12), each with the options it was started
//! with, by index.
//!
//! Owns: the processes and their slots (a slot is empty once its process was taken out).
//! Must not: start a gateway or act on one in a way the history records (killing,
//! restarting, arming faults: `topology.rs`, through [`World`]'s own methods).

use super::*;

/// The gateway processes of a world, by index: 0 is the first ([`World::gw`]), 1.. those
/// [`World::start_gateway`] started.
pub struct Gateways {
    /// Each gateway's process (`None` once taken out and not started again) and the
    /// options it was started with.
    slots: Vec<(Option<Gateway>, GatewayOpts)>,
}

impl Gateways {
    pub(super) fn new(first: Gateway, opts: GatewayOpts) -> Gateways {
        Gateways {
            slots: vec![(Some(first), opts)],
        }
    }

    /// A further gateway, as index [`Gateways::count`] (before it was added).
    pub(super) fn push(&mut self, gw: Gateway, opts: GatewayOpts) -> usize {
        self.slots.push((Some(gw), opts));
        self.slots.len() - 1
    }

    /// Gateway `i` is now `gw`, started with `opts` (the old process was killed and
    /// reaped; dropping it does nothing more).
    pub(super) fn replace(&mut self, i: usize, gw: Gateway, opts: GatewayOpts) {
        self.slots[i] = (Some(gw), opts);
    }

    /// The options each gateway was started with, in index order.
    pub(super) fn all_opts(&self) -> impl Iterator<Item = &GatewayOpts> {
        self.slots.iter().map(|(_, o)| o)
    }

    /// The options gateway `i` was started with.
    pub fn opts_at(&self, i: usize) -> &GatewayOpts {
        &self.slots.get(i).expect("no such gateway").1
    }

    /// How many gateways the world holds (the first one included).
    pub fn count(&self) -> usize {
        self.slots.len()
    }

    /// Gateway `i`'s slot: `None` once taken out ([`Gateways::take_at`]) and not started
    /// again. Panics on an index the world never handed out.
    fn slot(&mut self, i: usize) -> &mut Option<Gateway> {
        &mut self.slots.get_mut(i).expect("no such gateway").0
    }

    fn slot_ref(&self, i: usize) -> Option<&Gateway> {
        self.slots.get(i).expect("no such gateway").0.as_ref()
    }

    /// Whether gateway `i` is there and has not exited.
    pub fn up_at(&mut self, i: usize) -> bool {
        self.slot(i)
            .as_mut()
            .is_some_and(|g| g.try_exit_status().is_none())
    }

    /// Whether gateway `i` is there (it may have exited since it was last looked at).
    pub fn has_at(&self, i: usize) -> bool {
        self.slot_ref(i).is_some()
    }

    /// Gateway `i`'s exit status if it exited; the exited process is then taken out (a
    /// supervisor records the exit and starts another: [`World::restart_gateway_at`]).
    pub fn take_exited_at(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        let slot = self.slot(i);
        let status = slot.as_mut()?.try_exit_status()?;
        *slot = None;
        Some(status)
    }

    /// Takes gateway `i` out of the world (the caller kills it, or it was killed already);
    /// [`World::restart_gateway_at`] starts another in its place.
    pub fn take_at(&mut self, i: usize) -> Option<Gateway> {
        self.slot(i).take()
    }

    /// Gateway `i`'s process id, if it is there.
    pub fn pid_at(&self, i: usize) -> Option<u32> {
        self.slot_ref(i).map(Gateway::pid)
    }

    /// Gateway `i`. Panics on an index the world never handed out, or one taken out.
    pub fn at(&self, i: usize) -> &Gateway {
        self.slot_ref(i)
            .expect("World has no such gateway (taken out)")
    }

    /// Gateway `i`, mutably (see [`Gateways::at`]).
    pub fn at_mut(&mut self, i: usize) -> &mut Gateway {
        self.slot(i)
            .as_mut()
            .expect("World has no such gateway (taken out)")
    }

    /// Gateway `i`'s `ws://ADDR/ws`.
    pub fn ws_url_at(&self, i: usize) -> String {
        self.at(i).ws_url()
    }
}

#[cfg(test)]
mod tests {
    /// Issue 43: `World` keeps to the processes and what acts on them; the admin side
    /// ([`super::Admin`]) and the gateway slots ([`super::Gateways`]) are parts of their
    /// own. At most 40 public methods in `impl World` blocks, over every file of the world.
    #[test]
    fn world_has_at_most_40_public_methods() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/world");
        let mut methods = Vec::new();
        for e in std::fs::read_dir(&dir).expect("src/world") {
            let path = e.expect("an entry").path();
            let text = std::fs::read_to_string(&path).expect("a source file");
            let mut in_world = false;
            for line in text.lines() {
                if line.starts_with("impl ") {
                    in_world = line.starts_with("impl World {");
                } else if line == "}" {
                    in_world = false;
                } else if in_world
                    && (line.starts_with("    pub fn ") || line.starts_with("    pub async fn "))
                {
                    methods.push(line.trim().to_string());
                }
            }
        }
        assert!(methods.len() >= 20, "the scan found too few: {methods:#?}");
        assert!(
            methods.len() <= 40,
            "World has {} public methods: {methods:#?}",
            methods.len()
        );
    }
}
