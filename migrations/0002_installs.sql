-- Issue #8: install history and install-change notifications. Applied by `im-gateway migrate`
-- after 0001 (which is never edited).

-- Every install's token digest, so a `hello` with an older epoch is answered STALE_INSTALL
-- only when it proves it held that install (its token); anything else is UNAUTHENTICATED,
-- and a hello reveals neither whether a device exists nor its epoch.
CREATE TABLE device_installs (
    device_id     text NOT NULL REFERENCES devices ON DELETE CASCADE,
    install_epoch integer NOT NULL CHECK (install_epoch >= 1),
    token_sha256  text NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    PRIMARY KEY (device_id, install_epoch)
);
INSERT INTO device_installs (device_id, install_epoch, token_sha256)
SELECT device_id, install_epoch, token_sha256 FROM devices;

-- Kept by the database itself, whoever writes `devices` (admin, or bulk SQL).
CREATE FUNCTION im_record_install() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO device_installs (device_id, install_epoch, token_sha256)
    VALUES (NEW.device_id, NEW.install_epoch, NEW.token_sha256)
    ON CONFLICT (device_id, install_epoch) DO UPDATE SET token_sha256 = EXCLUDED.token_sha256;
    RETURN NULL;
END $$;
CREATE TRIGGER im_record_install AFTER INSERT OR UPDATE OF install_epoch, token_sha256 ON devices
    FOR EACH ROW EXECUTE FUNCTION im_record_install();

-- A reinstall or a removal is announced on `im_admin` in the transaction that commits it;
-- the gateway then closes the device's connections whose install is no longer current.
CREATE FUNCTION im_device_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('im_admin', 'device:' || OLD.device_id);
    RETURN NULL;
END $$;
CREATE TRIGGER im_device_changed AFTER UPDATE OF install_epoch OR DELETE ON devices
    FOR EACH ROW EXECUTE FUNCTION im_device_changed();
