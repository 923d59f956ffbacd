-- Issue 19: group commit. `im_send_batch` inserts a batch of sends, gathered from any
-- connections of one gateway, in the caller's transaction: one COMMIT, one WAL flush for
-- the batch. Row k is the k-th element of every array. Rows come sorted by conversation
-- (the caller sorts, stably), so two batches lock conversations in one order and cannot
-- deadlock each other.
--
-- Per row, exactly the single send's rules (store::send):
-- P1: the conversation row is locked (FOR UPDATE) before anything else, and `next_seq`
--     moves only after the row's event was inserted, so a row that inserts nothing takes
--     no seq; the batch's rollback gives back every seq it took. Two rows of one
--     conversation get consecutive seqs in their order.
-- S1: membership is tested after the row lock (`admin leave` takes the same lock).
-- D2: `ON CONFLICT (sender_user, cmid) DO NOTHING`: a resend (in this batch or a later one)
--     inserts nothing; the caller answers it with the original's seq after COMMIT.
-- It returns one row per inserted event, with its index k; rows it does not return
-- inserted nothing and are answered by the caller (dup, CMID_CONFLICT, NOT_MEMBER,
-- STALE_INSTALL) after COMMIT.
CREATE FUNCTION im_send_batch(
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
        FROM conversations c WHERE c.conv_id = p_conv[i] FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
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
