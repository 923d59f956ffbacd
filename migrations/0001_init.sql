-- imfault data model (SPEC section 3). Applied by `im-gateway migrate`, embedded in the binary.

CREATE TABLE users (
    user_id    text PRIMARY KEY CHECK (user_id ~ '^[A-Za-z0-9._-]{1,64}$'),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE devices (
    device_id     text PRIMARY KEY CHECK (device_id ~ '^[A-Za-z0-9._-]{1,64}$'),
    user_id       text NOT NULL REFERENCES users,
    install_epoch integer NOT NULL DEFAULT 1 CHECK (install_epoch >= 1),
    -- hex SHA-256 of the device token; the token itself is never stored
    token_sha256  text NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$')
);
CREATE INDEX devices_user_idx ON devices (user_id);

CREATE TABLE conversations (
    conv_id  text PRIMARY KEY CHECK (conv_id ~ '^[A-Za-z0-9._-]{1,64}$'),
    -- sequence epoch, reported in every `sent` reply
    epoch    integer NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    -- head = next_seq - 1; P1: only a committed send moves it
    next_seq bigint NOT NULL DEFAULT 1 CHECK (next_seq >= 1)
);

-- A membership period: seq is visible to user_id iff from_seq <= seq AND (to_seq IS NULL OR seq < to_seq).
CREATE TABLE memberships (
    conv_id  text NOT NULL REFERENCES conversations,
    user_id  text NOT NULL REFERENCES users,
    from_seq bigint NOT NULL CHECK (from_seq >= 1),
    to_seq   bigint CHECK (to_seq IS NULL OR to_seq >= from_seq),
    PRIMARY KEY (conv_id, user_id, from_seq)
);
-- at most one open period per (conversation, user)
CREATE UNIQUE INDEX memberships_one_open ON memberships (conv_id, user_id) WHERE to_seq IS NULL;
CREATE INDEX memberships_user_idx ON memberships (user_id);

CREATE TABLE events (
    conv_id       text NOT NULL REFERENCES conversations,
    seq           bigint NOT NULL CHECK (seq >= 1),
    kind          text NOT NULL DEFAULT 'msg',
    mid           text NOT NULL DEFAULT gen_random_uuid()::text,
    sender_user   text NOT NULL REFERENCES users,
    sender_device text NOT NULL REFERENCES devices,
    cmid          text NOT NULL CHECK (length(cmid) BETWEEN 1 AND 128),
    body          text NOT NULL,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (conv_id, seq),
    -- D2: one row per (sender, cmid), whatever device or connection resent it
    UNIQUE (sender_user, cmid),
    UNIQUE (mid)
);

-- D3/D4: one delivery cursor per (device, conversation), exactly as the design note's section 4.
CREATE TABLE device_cursors (
    device_id     text NOT NULL REFERENCES devices,
    conv_id       text NOT NULL REFERENCES conversations,
    install_epoch integer NOT NULL,
    delivered_seq bigint NOT NULL CHECK (delivered_seq >= 0),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (device_id, conv_id)
);

-- S1: the highest seq of conv visible to user (0 when none is), bounded by the current head.
-- A user's view of a conversation ends here: acks above it are CURSOR_AHEAD, sweeps hint up to it.
CREATE FUNCTION im_visible_head(p_conv text, p_user text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT COALESCE(MAX(p.last_seq), 0)
    FROM (
        SELECT LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1, c.next_seq - 1)) AS last_seq, m.from_seq
        FROM memberships m JOIN conversations c ON c.conv_id = m.conv_id
        WHERE m.conv_id = p_conv AND m.user_id = p_user
    ) p
    WHERE p.from_seq <= p.last_seq
$$;
