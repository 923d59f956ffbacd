-- Issue 19 (review): `im_send_batch` no longer waits for a conversation that another
-- transaction holds. Before, one locked conversation (a long transaction, another gateway's
-- batch or a paused gateway inside one) held every other row of the batch, and every batch
-- queued behind it on its slot, past the requests' deadline: innocent sends answered
-- UNAVAILABLE. Now a row whose conversation is locked is skipped and returned as busy
-- (`seq` NULL); the caller commits the rest and sends each busy row on its own, where it
-- waits for that lock under its own deadline, without holding up anyone else.
--
-- The lock is also `FOR NO KEY UPDATE` (was `FOR UPDATE`): what the single send's `UPDATE`
-- takes. It excludes other senders and `admin leave` as before, but no longer blocks the
-- foreign-key check (`FOR KEY SHARE`) of a device's first ack in the conversation.
--
-- Per row, exactly the single send's rules (store::send), unchanged from migration 0004:
-- P1: the conversation row is locked before anything else, and `next_seq` moves only after
--     the row's event was inserted, so a row that inserts nothing takes no seq; the batch's
--     rollback gives back every seq it took. Two rows of one conversation get consecutive
--     seqs in their order (the batch's own lock never makes a row busy).
-- S1: membership is tested after the row lock (`admin leave` takes the same lock).
-- D2: `ON CONFLICT (sender_user, cmid) DO NOTHING`: a resend (in this batch or a later one)
--     inserts nothing; the caller answers it with the original's seq after COMMIT.
-- It returns one row per inserted event (k, seq, mid, conv_epoch) and one per busy row
-- (k, NULL, NULL, NULL); rows it does not return inserted nothing and are answered by the
-- caller (dup, CMID_CONFLICT, NOT_MEMBER, STALE_INSTALL) after COMMIT.
CREATE OR REPLACE FUNCTION im_send_batch(
    p_conv text[], p_user text[], p_device text[], p_epoch bigint[], p_cmid text[],
    p_body text[])
RETURNS TABLE (k integer, seq bigint, mid text, conv_epoch bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_next  bigint;
    v_epoch bigint;
    v_mid   text;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_conv, 1), 0) LOOP
        SELECT c.next_seq, c.epoch INTO v_next, v_epoch
        FROM conversations c WHERE c.conv_id = p_conv[i] FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            -- Locked by another transaction (busy), or no such conversation (inserts
            -- nothing: NOT_MEMBER after COMMIT).
            IF EXISTS (SELECT 1 FROM conversations c WHERE c.conv_id = p_conv[i]) THEN
                k := i; seq := NULL; mid := NULL; conv_epoch := NULL;
                RETURN NEXT;
            END IF;
            CONTINUE;
        END IF;
        v_mid := NULL;
        INSERT INTO events (conv_id, seq, sender_user, sender_device, cmid, body)
        SELECT p_conv[i], v_next, p_user[i], p_device[i], p_cmid[i], p_body[i]
        WHERE EXISTS (SELECT 1 FROM memberships m
                      WHERE m.conv_id = p_conv[i] AND m.user_id = p_user[i]
                        AND m.to_seq IS NULL)
          AND EXISTS (SELECT 1 FROM devices d
                      WHERE d.device_id = p_device[i] AND d.install_epoch = p_epoch[i])
        ON CONFLICT (sender_user, cmid) DO NOTHING
        RETURNING events.mid INTO v_mid;
        CONTINUE WHEN v_mid IS NULL;
        UPDATE conversations SET next_seq = v_next + 1 WHERE conv_id = p_conv[i];
        k := i; seq := v_next; mid := v_mid; conv_epoch := v_epoch;
        RETURN NEXT;
    END LOOP;
END
$$;
