-- Issue 21, item 3: epochs that mean something. The database's lineage is the server's
-- system identifier and its current WAL timeline. A promoted standby starts a new timeline;
-- a cluster restored or rebuilt elsewhere has another system identifier. Either may have
-- lost history that devices already hold (an asynchronous standby is behind its primary),
-- and which conversations lost what cannot be known from the survivor. So when the lineage
-- a connection finds differs from the one recorded here, every conversation's sequence
-- epoch moves by one (`conversations.epoch`, reported in `sent`, in every event and in
-- `subbed`), in the transaction that records the new lineage: a device that sees a new
-- epoch discards what it holds of that conversation and syncs again.
--
-- The gateway calls `im_check_lineage()` on every new database connection, before the
-- connection serves anything, so no reply is read from a new lineage under the old epoch.
-- Several gateways race on the first connections after a failover: the row lock makes one
-- of them move the epochs, the others find the lineage already recorded.
CREATE TABLE db_lineage (
    id                integer PRIMARY KEY CHECK (id = 1),
    system_identifier text NOT NULL,
    timeline          integer NOT NULL,
    moves             integer NOT NULL DEFAULT 0,
    changed_at        timestamptz NOT NULL DEFAULT now()
);

-- The lineage of the server this session is on: `(system_identifier, timeline)`. The
-- timeline is read off the current WAL file's name, which changes at promotion
-- (`pg_control_checkpoint()` reports it only after the next checkpoint). Fails on a
-- standby (no current WAL position during recovery): a gateway cannot write there anyway.
CREATE FUNCTION im_current_lineage(OUT system_identifier text, OUT timeline integer)
LANGUAGE sql VOLATILE AS $$
    SELECT (pg_control_system()).system_identifier::text,
           ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int
$$;

-- Records the lineage on first use; when it changed, moves every conversation's epoch and
-- records the new one. Returns the current lineage and whether this call moved the epochs.
CREATE FUNCTION im_check_lineage(OUT system_identifier text, OUT timeline integer,
                                 OUT moved boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r db_lineage%ROWTYPE;
BEGIN
    SELECT l.system_identifier, l.timeline INTO system_identifier, timeline
    FROM im_current_lineage() l;
    moved := false;
    -- The common case, without a lock: nothing changed.
    SELECT * INTO r FROM db_lineage WHERE id = 1;
    IF FOUND AND r.system_identifier = im_check_lineage.system_identifier
             AND r.timeline = im_check_lineage.timeline THEN
        RETURN;
    END IF;
    INSERT INTO db_lineage (id, system_identifier, timeline)
    VALUES (1, im_check_lineage.system_identifier, im_check_lineage.timeline)
    ON CONFLICT (id) DO NOTHING;
    IF FOUND THEN
        RETURN; -- the first lineage this database records: nothing to compare with
    END IF;
    SELECT * INTO r FROM db_lineage WHERE id = 1 FOR UPDATE;
    IF r.system_identifier = im_check_lineage.system_identifier
       AND r.timeline = im_check_lineage.timeline THEN
        RETURN; -- another session recorded it first
    END IF;
    UPDATE conversations SET epoch = epoch + 1;
    UPDATE db_lineage
    SET system_identifier = im_check_lineage.system_identifier,
        timeline = im_check_lineage.timeline,
        moves = moves + 1,
        changed_at = now()
    WHERE id = 1;
    moved := true;
END
$$;

-- The lineage this database was migrated on.
INSERT INTO db_lineage (id, system_identifier, timeline)
SELECT 1, l.system_identifier, l.timeline FROM im_current_lineage() l;
