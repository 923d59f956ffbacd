-- Issue 21, item 5's finding: with `synchronous_commit = off` (or `fsync = off`) the server
-- acknowledges a commit before its WAL is flushed, so a crash or a power cut may lose
-- commits already acknowledged and pushed, on the same system identifier and timeline:
-- migration 0006's lineage does not change and no epoch moves, and a device keeps what the
-- database lost (`make durability` measured it: standalone power cut, 46 of 637 lost, 92
-- held wrong). The lineage gains a third part, the incarnation: the postmaster's start
-- time, recorded only while the session checking it runs without durable commits. A new
-- incarnation (a restart after which commits may be missing) moves every epoch like a new
-- timeline. With durable commits the incarnation is not part of the lineage (NULL): a
-- restart loses nothing acknowledged, and no epoch moves.
--
-- A clean restart is not told from a crash: it moves the epochs too (the devices sync
-- again; nothing is wrong, only redone). The move itself commits durably (`local`), so a
-- second crash cannot take it back and hand out the same epoch again for other history.
ALTER TABLE db_lineage ADD COLUMN incarnation text;

-- The postmaster's start time when this session's commits may be acknowledged before
-- they are flushed; NULL when they are durable.
CREATE FUNCTION im_current_incarnation() RETURNS text
LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                  OR current_setting('fsync') = 'off'
                THEN pg_postmaster_start_time()::text END
$$;

DROP FUNCTION im_check_lineage();

-- As in 0006, with the incarnation: the epochs move when the system identifier or the
-- timeline changed, or when both the recorded and the current incarnation are known and
-- differ. A first incarnation (durability just turned off) is recorded without a move; a
-- NULL one (durability back on) clears the record.
CREATE FUNCTION im_check_lineage(OUT system_identifier text, OUT timeline integer,
                                 OUT incarnation text, OUT moved boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r db_lineage%ROWTYPE;
BEGIN
    SELECT l.system_identifier, l.timeline INTO system_identifier, timeline
    FROM im_current_lineage() l;
    incarnation := im_current_incarnation();
    moved := false;
    -- The common case, without a lock: nothing changed.
    SELECT * INTO r FROM db_lineage WHERE id = 1;
    IF FOUND AND r.system_identifier = im_check_lineage.system_identifier
             AND r.timeline = im_check_lineage.timeline
             AND r.incarnation IS NOT DISTINCT FROM im_check_lineage.incarnation THEN
        RETURN;
    END IF;
    -- What follows writes: durably, whatever this session's setting.
    PERFORM set_config('synchronous_commit', 'local', true);
    INSERT INTO db_lineage (id, system_identifier, timeline, incarnation)
    VALUES (1, im_check_lineage.system_identifier, im_check_lineage.timeline,
            im_check_lineage.incarnation)
    ON CONFLICT (id) DO NOTHING;
    IF FOUND THEN
        RETURN; -- the first lineage this database records: nothing to compare with
    END IF;
    SELECT * INTO r FROM db_lineage WHERE id = 1 FOR UPDATE;
    IF r.system_identifier = im_check_lineage.system_identifier
       AND r.timeline = im_check_lineage.timeline
       AND (r.incarnation IS NULL OR im_check_lineage.incarnation IS NULL
            OR r.incarnation = im_check_lineage.incarnation) THEN
        -- Another session recorded it first, or only durability changed: no move.
        IF r.incarnation IS DISTINCT FROM im_check_lineage.incarnation THEN
            UPDATE db_lineage SET incarnation = im_check_lineage.incarnation WHERE id = 1;
        END IF;
        RETURN;
    END IF;
    UPDATE conversations SET epoch = epoch + 1;
    UPDATE db_lineage
    SET system_identifier = im_check_lineage.system_identifier,
        timeline = im_check_lineage.timeline,
        incarnation = im_check_lineage.incarnation,
        moves = moves + 1,
        changed_at = now()
    WHERE id = 1;
    moved := true;
END
$$;
