-- Issue 18: the commit feed. Every event records the transaction that inserted it, so a
-- gateway can ask "which events committed since my last look?" exactly: the rows whose
-- transaction was not yet visible in the snapshot it took then (`pg_visible_in_snapshot`),
-- found through this index from that snapshot's xmin on. A notification that never came
-- (its NOTIFY failed or was never sent, the committing gateway died between COMMIT and
-- NOTIFY) is thereby found by every gateway within one sweep interval (D5). Applied after
-- 0001 and 0002 (which are never edited).
ALTER TABLE events ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX events_xid_idx ON events (xid);
