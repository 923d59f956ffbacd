//! Admission limits that span connections: handshakes plus connections per source address
//! (`IM_CONNS_PER_ADDR_MAX`) and the failed-hello buckets per source address and per device
//! id (`IM_HELLO_FAILS_PER_ADDR_PER_MIN`, `IM_HELLO_FAILS_PER_DEVICE_PER_MIN`). A leaf: it
//! knows no sockets, frames or SQL, only counts and clocks.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Most keys a bucket map keeps. Past it, full buckets (nobody failing lately) are dropped;
/// if it is still full, a new key is not tracked (fails open: the other bucket and the
/// per-address cap still apply, and a 256-bit token is not guessed by brute force anyway).
const BUCKET_KEYS_MAX: usize = 100_000;

/// Handshakes plus connections per source address.
pub struct AddrCounts {
    max: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

/// One place counted against an address; given back on drop.
pub struct AddrSlot {
    counts: Arc<AddrCounts>,
    ip: IpAddr,
}

impl Drop for AddrSlot {
    fn drop(&mut self) {
        let mut m = self.counts.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl AddrCounts {
    pub fn new(max: usize) -> Arc<AddrCounts> {
        Arc::new(AddrCounts {
            max,
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// A place for one more handshake or connection from `ip`, or `None` at the cap.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<AddrSlot> {
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(AddrSlot {
            counts: self.clone(),
            ip,
        })
    }
}

/// A token bucket per key: `per_min` tokens, refilled evenly over a minute.
struct Buckets<K> {
    per_min: f64,
    map: HashMap<K, (f64, Instant)>,
    /// Most keys tracked ([`BUCKET_KEYS_MAX`]).
    cap: usize,
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    fn new(per_min: u32) -> Self {
        Buckets::with_cap(per_min, BUCKET_KEYS_MAX)
    }

    fn with_cap(per_min: u32, cap: usize) -> Self {
        Buckets {
            per_min: f64::from(per_min),
            map: HashMap::new(),
            cap,
        }
    }

    fn level(&self, tokens: f64, at: Instant, now: Instant) -> f64 {
        let refill = now.saturating_duration_since(at).as_secs_f64() * self.per_min / 60.0;
        (tokens + refill).min(self.per_min)
    }

    /// Takes one token; false if there is none.
    fn take(&mut self, key: &K, now: Instant) -> bool {
        if !self.map.contains_key(key) && self.map.len() >= self.cap {
            // Full buckets carry no state (a key not tracked holds a full bucket): drop them.
            let map = std::mem::take(&mut self.map);
            let kept = map
                .into_iter()
                .filter(|(_, (t, at))| self.level(*t, *at, now) < self.per_min)
                .collect();
            self.map = kept;
            if self.map.len() >= self.cap {
                return true;
            }
        }
        let (tokens, at) = self.map.get(key).copied().unwrap_or((self.per_min, now));
        let level = self.level(tokens, at, now);
        if level < 1.0 {
            self.map.insert(key.clone(), (level, now));
            return false;
        }
        self.map.insert(key.clone(), (level - 1.0, now));
        true
    }

    /// Whether `key` holds at least one token (a key never seen holds a full bucket).
    fn allows(&self, key: &K, now: Instant) -> bool {
        self.map
            .get(key)
            .is_none_or(|&(tokens, at)| self.level(tokens, at, now) >= 1.0)
    }

    /// Takes one token even when there is none: the bucket may owe up to one minute's
    /// worth (`-per_min`), which the refill pays back.
    fn charge(&mut self, key: &K, now: Instant) {
        if !self.take(key, now) {
            let (tokens, at) = self.map.get(key).copied().unwrap_or((self.per_min, now));
            let level = (self.level(tokens, at, now) - 1.0).max(-self.per_min);
            self.map.insert(key.clone(), (level, now));
        }
    }
}

/// The failed-hello throttle. A `hello` is refused (UNAVAILABLE) without touching the
/// database while its source address's bucket or its device id's bucket holds less than one
/// token; a hello that FAILED (UNAUTHENTICATED or STALE_INSTALL) then takes a token from
/// both. Hellos that succeed cost nothing, so any number of concurrent good hellos from one
/// address (many devices behind one NAT, a bench's 32 senders) pass: the earlier design took
/// a token from every hello before the check and gave it back after, and 32 concurrent good
/// hellos from one address emptied a bucket of 30 (measured: `make bench` refused sender 28).
/// Concurrent failures may drive a bucket below zero (a debt of at most one minute's worth,
/// paid back by the refill), so the average stays at the limit whatever the concurrency.
/// Device ids are counted whether or not they exist, so the throttle itself reveals nothing.
/// The price: failures for a device id hold back that device's own hellos until its bucket
/// refills (at most two minutes).
pub struct HelloThrottle {
    by_addr: Mutex<Buckets<IpAddr>>,
    by_device: Mutex<Buckets<String>>,
}

impl HelloThrottle {
    pub fn new(per_addr_per_min: u32, per_device_per_min: u32) -> HelloThrottle {
        HelloThrottle {
            by_addr: Mutex::new(Buckets::new(per_addr_per_min)),
            by_device: Mutex::new(Buckets::new(per_device_per_min)),
        }
    }

    /// Whether a hello from `(ip, device)` may be checked now; false: throttled. Takes
    /// nothing.
    pub fn attempt(&self, ip: IpAddr, device: &str) -> bool {
        let now = Instant::now();
        let a = self.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        if !a.allows(&ip, now) {
            return false;
        }
        let d = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
        d.allows(&device.to_string(), now)
    }

    /// The hello failed (UNAUTHENTICATED or STALE_INSTALL): one token from each bucket.
    pub fn failed(&self, ip: IpAddr, device: &str) {
        let now = Instant::now();
        self.by_addr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .charge(&ip, now);
        self.by_device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .charge(&device.to_string(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn addr_slots_are_counted_and_given_back() {
        let c = AddrCounts::new(2);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let a = c.admit(ip).unwrap();
        let _b = c.admit(ip).unwrap();
        assert!(c.admit(ip).is_none());
        assert!(c.admit("10.0.0.2".parse().unwrap()).is_some());
        drop(a);
        assert!(c.admit(ip).is_some());
    }

    #[test]
    fn buckets_empty_then_refill() {
        let mut b = Buckets::new(3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(b.take(&1u8, t0));
        }
        assert!(!b.take(&1u8, t0));
        assert!(b.take(&2u8, t0), "keys are separate");
        // One token comes back every 20 s at 3 per minute.
        assert!(b.take(&1u8, t0 + Duration::from_secs(21)));
        assert!(!b.take(&1u8, t0 + Duration::from_secs(22)));
        assert!(!b.allows(&1u8, t0 + Duration::from_secs(22)));
        b.charge(&1u8, t0 + Duration::from_secs(22));
        assert!(
            !b.allows(&1u8, t0 + Duration::from_secs(41)),
            "a charge past empty is a debt the refill pays first"
        );
    }

    #[test]
    fn throttle_counts_addresses_and_devices() {
        let t = HelloThrottle::new(100, 2);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..50 {
            assert!(t.attempt(ip, "d"), "hellos that did not fail cost nothing");
        }
        t.failed(ip, "d");
        assert!(t.attempt(ip, "d"));
        t.failed(ip, "d");
        assert!(!t.attempt(ip, "d"), "the device's bucket is empty");
        assert!(t.attempt(ip, "e"), "another device from the same address");
        let t = HelloThrottle::new(3, 100);
        for i in 0..3 {
            t.failed(ip, &format!("x{i}"));
        }
        assert!(!t.attempt(ip, "y"), "the address's bucket is empty");
        assert!(t.attempt("10.0.0.2".parse().unwrap(), "y"));
    }

    /// At its key limit a bucket map forgets only full buckets (nobody failing lately): a
    /// key that used up its tokens a second ago stays throttled however many other keys
    /// failed since, and a new key it cannot track is let through (fails open); once a
    /// bucket refills its place is reused.
    #[test]
    fn at_its_key_limit_the_map_keeps_every_bucket_that_is_not_full() {
        let mut b = Buckets::with_cap(3, 4);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(b.take(&0u32, t0));
        }
        for k in 1..4u32 {
            assert!(b.take(&k, t0));
        }
        let t1 = t0 + Duration::from_secs(1);
        assert!(
            b.take(&99u32, t1),
            "a key the map cannot track is let through"
        );
        assert!(!b.take(&0u32, t1), "key 0 still owes its tokens");
        assert!(b.map.contains_key(&0) && !b.map.contains_key(&99));
        // A minute on, every bucket refilled: the next new key takes a freed place.
        let t2 = t0 + Duration::from_secs(61);
        assert!(b.take(&100u32, t2));
        assert!(b.map.contains_key(&100) && b.map.len() == 1);
        assert_eq!(Buckets::<u32>::new(3).cap, BUCKET_KEYS_MAX);
    }
}
