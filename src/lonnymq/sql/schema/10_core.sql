-- Core: the clock, argument checks, events and settings.
--
-- The installer runs every file of this folder with `search_path` set to the target schema
-- (quoted by the installer, never spelled here), so unqualified names land in that schema and
-- each function pins the same path with `SET search_path FROM CURRENT` (secure_functions()
-- then makes it explicit, with pg_temp last). Times are BIGINT milliseconds since the Unix
-- epoch, read from the database clock through epoch(). Our refusals use SQLSTATE class LQ:
--   LQ001 message not found          LQ002 stale message (lock lost or never held)
--   LQ003 invalid argument           LQ004 invalid channel policy
--   LQ005 invalid channel name       LQ006 payload too large
-- Argument checks cost nothing when the arguments are good: a hot function first tests all its
-- arguments in one plain expression and calls the named checks below only when that test fails,
-- to say what is wrong (a plpgsql call or format() costs 15 to 40 microseconds).


-- epoch(): the queue clock in ms. floor(epoch * 1000) keeps sub-second precision without
-- counting the seconds twice. now() is fixed for a transaction, so within one transaction time
-- does not move and order is decided by id.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION epoch() RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    RETURN (SELECT floor(extract(epoch FROM now()) * 1000)::BIGINT + c.clock_offset_ms
        FROM config c);
END;
$$;


-- arg_check(): raise p_message with p_errcode unless p_ok is true. Only ever raises a queue
-- SQLSTATE (LQ000-LQ999, else LQ003), whatever a direct caller passes.
-- Locks: none. Raises: LQ003 or the given LQ code.
CREATE OR REPLACE FUNCTION arg_check(p_ok BOOLEAN, p_message TEXT, p_errcode TEXT DEFAULT 'LQ003')
RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_ok IS NOT TRUE THEN
        IF p_errcode IS NULL OR p_errcode !~ '^LQ[0-9]{3}$' THEN
            p_errcode := 'LQ003';
        END IF;
        RAISE EXCEPTION '%', coalesce(p_message, 'invalid argument') USING ERRCODE = p_errcode;
    END IF;
END;
$$;


-- arg_check_range(): argument p_name (its name, for the message) is p_min to p_max, not
-- NULL. Returns at once for a good value.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_range(
    p_name TEXT, p_value BIGINT, p_min BIGINT, p_max BIGINT
) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_value BETWEEN p_min AND p_max THEN
        RETURN;
    END IF;
    PERFORM arg_check(FALSE, format('%s must be between %s and %s, got %s',
        p_name, p_min, p_max, coalesce(p_value::TEXT, 'NULL')));
END;
$$;


-- arg_check_channel(): a channel name is 1 to 255 characters.
-- Locks: none. Raises: LQ005.
CREATE OR REPLACE FUNCTION arg_check_channel(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_channel IS NOT NULL AND char_length(p_channel) BETWEEN 1 AND 255,
            format('channel name must be 1 to 255 characters, got %s',
                coalesce(char_length(p_channel)::TEXT || ' characters', 'NULL')),
            'LQ005');
END;
$$;


-- arg_check_lock_ms(): a lock lasts 1 ms to 7 days. Returns at once for a good value.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_lock_ms(p_lock_ms BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_lock_ms BETWEEN 1 AND 604800000 THEN
        RETURN;
    END IF;
    PERFORM arg_check(
            FALSE,
            format('lock_ms must be between 1 and 604800000 (7 days), got %s',
                coalesce(p_lock_ms::TEXT, 'NULL')));
END;
$$;


-- arg_check_time(): a time argument (p_name, for the message) is NULL or within +/-10^15 ms.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_time(p_name TEXT, p_value BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_value IS NULL OR p_value BETWEEN -1000000000000000 AND 1000000000000000,
            format('%s must be within +/-10^15 ms, got %s', p_name, p_value));
END;
$$;


-- arg_check_payload(): content or state is at most 64 MiB.
-- Locks: none. Raises: LQ006.
CREATE OR REPLACE FUNCTION arg_check_payload(p_name TEXT, p_value BYTEA) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_value IS NULL OR octet_length(p_value) <= 67108864,
            format('%s must be at most 64 MiB, got %s bytes', p_name, octet_length(p_value)),
            'LQ006');
END;
$$;


-- arg_check_dedup_key(): a dedup key is NULL or 1 to 255 characters.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_dedup_key(p_dedup_key TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255,
            format('dedup_key must be 1 to 255 characters, got %s characters',
                char_length(p_dedup_key)));
END;
$$;


-- arg_check_claim(): a claim on a held message names an id and the attempt count (at least 1)
-- that dequeue returned. Returns at once for a good claim.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_claim(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_id IS NOT NULL AND p_num_attempts >= 1 THEN
        RETURN;
    END IF;
    PERFORM arg_check(p_id IS NOT NULL, 'message id must not be NULL'),
               arg_check(p_num_attempts IS NOT NULL AND p_num_attempts >= 1,
                   format('num_attempts must be at least 1 (the value dequeue returned), got %s',
                       coalesce(p_num_attempts::TEXT, 'NULL')));
END;
$$;


-- event_publish(): wake listeners with a NOTIFY on config.event_channel. A transaction that
-- notifies takes a global lock at commit, so callers only publish when a channel can be served
-- sooner than before, and a transaction publishes again only for an earlier time than it
-- already announced (tracked in a transaction-local setting).
-- Locks: none of ours (NOTIFY's commit lock). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION event_publish(
    p_type TEXT, p_id BIGINT, p_channel TEXT, p_dequeue_at BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_event_channel TEXT;
    v_announced TEXT;
    v_parts TEXT[];
BEGIN
    SELECT c.event_channel INTO v_event_channel FROM config c;
    IF v_event_channel IS NULL THEN
        RETURN;
    END IF;
    v_announced := current_setting('lonnymq.announced', TRUE);
    IF v_announced IS NOT NULL AND v_announced <> '' THEN
        v_parts := string_to_array(v_announced, E'\x1f');
        IF v_parts[1] = v_event_channel AND v_parts[2]::BIGINT <= p_dequeue_at THEN
            RETURN;
        END IF;
    END IF;
    PERFORM set_config('lonnymq.announced', v_event_channel || E'\x1f' || p_dequeue_at, TRUE);
    PERFORM pg_notify(v_event_channel, json_build_object(
        'type', p_type, 'id', p_id, 'channel', p_channel, 'dequeue_at', p_dequeue_at)::TEXT);
END;
$$;


-- config_get(): the installation's settings.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION config_get() RETURNS TABLE (event_channel TEXT, archive BOOLEAN)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.event_channel, c.archive FROM config c
$$;


-- config_set(): change the installation's settings. p_event_channel '' turns events off;
-- NULL arguments leave a setting as it is.
-- Locks: the config row. Raises: LQ003 (an event channel longer than 63 characters).
CREATE OR REPLACE FUNCTION config_set(p_event_channel TEXT DEFAULT NULL, p_archive BOOLEAN DEFAULT NULL)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_event_channel IS NULL OR char_length(p_event_channel) <= 63,
        'event_channel must be at most 63 characters');
    UPDATE config c SET
        event_channel = CASE
            WHEN p_event_channel IS NULL THEN c.event_channel
            ELSE nullif(p_event_channel, '') END,
        archive = coalesce(p_archive, c.archive);
END;
$$;


-- clock_offset_set(): move the queue clock (tests only: expiry and schedules without sleeping).
-- Locks: the config row. Raises: LQ003.
CREATE OR REPLACE FUNCTION clock_offset_set(p_offset_ms BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_time('offset_ms', p_offset_ms);
    UPDATE config c SET clock_offset_ms = coalesce(p_offset_ms, 0);
    RETURN epoch();
END;
$$;


-- schema_version(): what was applied to this schema: the latest migration, the first one's
-- name, and the function layer's recorded checksum. A role granted a kind has no right on the
-- bookkeeping tables (nor CREATE on the schema): install() asks this instead, so that an
-- application that installs at every start still starts when it runs as such a role, and is
-- told when the schema needs an install by its owner.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION schema_version()
RETURNS TABLE (version INTEGER, baseline TEXT, functions_sha256 TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT (SELECT coalesce(max(m.version), 0) FROM migration m),
           (SELECT m.name FROM migration m WHERE m.version = 1),
           (SELECT f.sha256 FROM function_source f)
$$;
