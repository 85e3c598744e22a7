-- 0001_init: the queue's tables, indexes and functions.
--
-- The installer runs this file with `search_path` set to the target schema (quoted by the
-- installer, never spelled here), so every unqualified name below lands in that schema and
-- every function pins the same path with `SET search_path FROM CURRENT`.
--
-- Times are BIGINT milliseconds since the Unix epoch, read from the database clock through
-- epoch(). Our refusals use SQLSTATE class LQ:
--   LQ001 message not found          LQ002 stale message (lock lost or never held)
--   LQ003 invalid argument           LQ004 invalid channel policy
--   LQ005 invalid channel name       LQ006 payload too large

-- Settings of this installation: one row.
CREATE TABLE config (
    singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    -- NOTIFY channel for wake-up events; NULL turns events off.
    event_channel TEXT,
    -- Keep finished messages in `archive`.
    archive BOOLEAN NOT NULL DEFAULT FALSE,
    -- Added to the database clock by epoch(). Tests move time with it; leave it at 0.
    clock_offset_ms BIGINT NOT NULL DEFAULT 0
);
INSERT INTO config DEFAULT VALUES;

-- One row per message until it is finished (deleted). Rows are updated on every dequeue and
-- defer, so leave room on each page for HOT updates and vacuum the table eagerly.
CREATE TABLE message (
    id BIGSERIAL PRIMARY KEY,
    channel TEXT NOT NULL,
    content BYTEA NOT NULL,
    -- The worker's saved progress (defer with state), handed back on the next dequeue.
    state BYTEA,
    dedup_key TEXT,
    is_locked BOOLEAN NOT NULL DEFAULT FALSE,
    num_attempts INTEGER NOT NULL DEFAULT 0,
    dequeue_at BIGINT NOT NULL,
    unlock_at BIGINT,
    -- When the current (or last) attempt took the lock: the archive's processing time.
    locked_at BIGINT,
    created_at BIGINT NOT NULL,
    CHECK (is_locked = (unlock_at IS NOT NULL))
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- A channel's waiting messages in the order they leave: the head of a channel is the first
-- entry for that channel. Locked messages are left out so that a channel with many messages
-- in flight still finds its head in one probe.
CREATE INDEX message_channel_head_ix ON message (channel, dequeue_at, id) WHERE NOT is_locked;

-- Locked messages by lock expiry: dequeue recovers the oldest expired lock in one probe.
CREATE INDEX message_unlock_ix ON message (unlock_at, id) WHERE is_locked;

-- A dedup key is unique among the live messages of its channel. Finished messages leave the
-- table, so the key can be reused once its message is done.
CREATE UNIQUE INDEX message_dedup_ux ON message (channel, dedup_key) WHERE dedup_key IS NOT NULL;

-- One row per channel that holds messages or has a policy; a policy-free channel's row is
-- deleted with its last message, so per-user channels cost nothing once drained.
CREATE TABLE channel (
    name TEXT PRIMARY KEY,
    has_policy BOOLEAN NOT NULL DEFAULT FALSE,
    max_concurrency INTEGER,
    release_interval_ms BIGINT,
    max_size BIGINT,
    current_size BIGINT NOT NULL DEFAULT 0,
    -- Messages locked now; kept only while max_concurrency is set (0 otherwise), so that
    -- finishing a message of a policy-free channel is a HOT update of its row.
    current_concurrency BIGINT NOT NULL DEFAULT 0,
    -- When the head may next leave: max(head's dequeue_at, last dequeue + release interval).
    -- NULL when the channel has no waiting (unlocked) message.
    next_dequeue_at BIGINT,
    last_dequeue_at BIGINT,
    -- Tie-break among channels with the same next_dequeue_at: every dequeue draws a new turn,
    -- so a channel just served goes behind the others (round robin within one transaction too).
    turn BIGINT NOT NULL DEFAULT 0
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

CREATE SEQUENCE channel_turn_seq;

-- Channels that can give a message now or later, earliest first. Saturated channels (at their
-- concurrency limit) and channels with nothing waiting are not in the index at all, so a probe
-- never walks past them.
CREATE INDEX channel_ready_ix ON channel (next_dequeue_at, turn)
    WHERE next_dequeue_at IS NOT NULL
      AND (max_concurrency IS NULL OR current_concurrency < max_concurrency);

-- Finished messages, when config.archive is on.
CREATE TABLE archive (
    id BIGINT PRIMARY KEY,
    channel TEXT NOT NULL,
    content BYTEA NOT NULL,
    state BYTEA,
    dedup_key TEXT,
    num_attempts INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    error TEXT,
    created_at BIGINT NOT NULL,
    dequeue_at BIGINT NOT NULL,
    locked_at BIGINT,
    finished_at BIGINT NOT NULL
);
CREATE INDEX archive_finished_at_ix ON archive (finished_at);


-- epoch(): the queue clock in ms. floor(epoch * 1000) keeps sub-second precision without
-- counting the seconds twice. now() is fixed for a transaction, so within one transaction time
-- does not move and order is decided by id.
CREATE FUNCTION epoch() RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT floor(extract(epoch FROM now()) * 1000)::BIGINT + c.clock_offset_ms
        FROM config c);
END;
$$;


-- Argument checks shared by every operation. Each raises LQ003 (or a narrower code) with a
-- message that names the argument, before anything is changed.
CREATE FUNCTION arg_check(p_ok BOOLEAN, p_message TEXT, p_errcode TEXT DEFAULT 'LQ003')
RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_ok IS NOT TRUE THEN
        RAISE EXCEPTION '%', p_message USING ERRCODE = p_errcode;
    END IF;
END;
$$;

CREATE FUNCTION arg_check_channel(p_channel TEXT) RETURNS VOID
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

CREATE FUNCTION arg_check_lock_ms(p_lock_ms BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_lock_ms BETWEEN 1 AND 604800000,
            format('lock_ms must be between 1 and 604800000 (7 days), got %s',
                coalesce(p_lock_ms::TEXT, 'NULL')));
END;
$$;

CREATE FUNCTION arg_check_time(p_name TEXT, p_value BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_value IS NULL OR p_value BETWEEN -1000000000000000 AND 1000000000000000,
            format('%s must be within +/-10^15 ms, got %s', p_name, p_value));
END;
$$;

CREATE FUNCTION arg_check_payload(p_name TEXT, p_value BYTEA) RETURNS VOID
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

CREATE FUNCTION arg_check_dedup_key(p_dedup_key TEXT) RETURNS VOID
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

CREATE FUNCTION arg_check_claim(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
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
CREATE FUNCTION event_publish(
    p_type TEXT, p_id BIGINT, p_channel TEXT, p_dequeue_at BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
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


-- channel_next_at(): when the channel's head may next leave, given the earliest time the
-- release interval allows; NULL when nothing waits. One probe of message_channel_head_ix.
CREATE FUNCTION channel_next_at(p_channel TEXT, p_release_at BIGINT) RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT greatest(m.dequeue_at, p_release_at)
        FROM message m
        WHERE m.channel = p_channel AND NOT m.is_locked
        ORDER BY m.dequeue_at, m.id
        LIMIT 1);
END;
$$;


-- channel_lock(): lock a channel's row for update, creating it when missing.
-- Locks: the channel row (FOR UPDATE), held until the transaction ends.
CREATE FUNCTION channel_lock(p_channel TEXT) RETURNS channel
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_channel channel;
BEGIN
    -- Two rounds at most: a concurrent session may insert the row between our probe and our
    -- insert, or drain and delete it again before we lock it.
    FOR v_round IN 1..3 LOOP
        SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
        IF FOUND THEN
            RETURN v_channel;
        END IF;
        INSERT INTO channel (name) VALUES (p_channel) ON CONFLICT (name) DO NOTHING;
    END LOOP;
    RAISE EXCEPTION 'channel % kept disappearing while being locked', p_channel
        USING ERRCODE = '40001';
END;
$$;


-- channel_servable_at(): when a channel can next give a message, or NULL when it cannot
-- (nothing waiting, or saturated until a message finishes).
CREATE FUNCTION channel_servable_at(
    p_next_at BIGINT, p_concurrency BIGINT, p_max_concurrency INTEGER
) RETURNS BIGINT
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT CASE WHEN p_max_concurrency IS NULL OR p_concurrency < p_max_concurrency
                    THEN p_next_at END);
END;
$$;

-- channel_announce(): publish an event when a change made a channel servable sooner than
-- before (the only case where a sleeping worker has a reason to wake).
CREATE FUNCTION channel_announce(
    p_before BIGINT, p_after BIGINT, p_type TEXT, p_id BIGINT, p_channel TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_after IS NOT NULL AND (p_before IS NULL OR p_after < p_before) THEN
        PERFORM event_publish(p_type, p_id, p_channel, p_after);
    END IF;
END;
$$;


-- message_check_new(): refuse a bad new message (LQ003, LQ005, LQ006). The common case (all
-- good) is one expression; the named checks run only to say what is wrong.
CREATE FUNCTION message_check_new(
    p_channel TEXT, p_content BYTEA, p_dequeue_at BIGINT, p_dedup_key TEXT
) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_content IS NOT NULL AND octet_length(p_content) <= 67108864
        AND char_length(p_channel) BETWEEN 1 AND 255
        AND (p_dequeue_at IS NULL
             OR p_dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
        AND (p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255)
    THEN
        RETURN;
    END IF;
    PERFORM arg_check_channel(p_channel),
            arg_check(p_content IS NOT NULL, 'content must not be NULL'),
            arg_check_payload('content', p_content),
            arg_check_time('dequeue_at', p_dequeue_at),
            arg_check_dedup_key(p_dedup_key);
END;
$$;


-- message_create_many(): add messages; results come back in input order.
-- For each message: a live message of the same channel with the same dedup_key (or an earlier
-- item of the batch with that key) makes it 'deduplicated' and returns that message's id; a
-- channel at its max_size makes it 'dropped' (id NULL); otherwise it is 'created'. Ids are
-- drawn in input order. channel_size is the channel's size once the message is counted.
-- The work is set-based, whatever the batch size: one statement decides every item, one
-- inserts, one updates the channels.
-- Locks: each channel row touched, in channel-name order (so batches cannot deadlock).
-- Raises: LQ003 (mismatched arrays, bad time or dedup key), LQ005, LQ006.
CREATE FUNCTION message_create_many(
    p_channels TEXT[],
    p_contents BYTEA[],
    p_dequeue_ats BIGINT[],
    p_dedup_keys TEXT[]
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch();
    v_count INTEGER := cardinality(p_contents);
    v_names TEXT[];
    v_before channel[];
    v_ids BIGINT[];
    v_kind TEXT[];
    v_live BIGINT[];
    v_first BIGINT[];
    v_first_created BOOLEAN[];
    v_sizes BIGINT[];
    v_changed RECORD;
BEGIN
    PERFORM arg_check(v_count IS NOT NULL, 'contents must not be NULL');
    PERFORM arg_check(v_count <= 100000,
        format('at most 100000 messages per call, got %s', v_count));
    PERFORM arg_check(
        coalesce(cardinality(p_channels), v_count) = v_count
        AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
        AND coalesce(cardinality(p_dedup_keys), v_count) = v_count,
        'channels, contents, dequeue_ats and dedup_keys must have the same length');
    -- Validate everything before changing anything.
    PERFORM message_check_new(coalesce(t.channel, 'default'), t.content, t.dequeue_at,
                              t.dedup_key)
    FROM unnest(p_channels, p_contents, p_dequeue_ats, p_dedup_keys)
        AS t(channel, content, dequeue_at, dedup_key);
    IF v_count = 0 THEN
        RETURN;
    END IF;

    -- Lock the channels (creating missing rows), in name order.
    v_names := ARRAY(
        SELECT DISTINCT coalesce(t.channel, 'default')
        FROM unnest(p_channels, p_contents) AS t(channel, content)
        ORDER BY 1);
    INSERT INTO channel (name) SELECT n FROM unnest(v_names) AS n ORDER BY n
    ON CONFLICT (name) DO NOTHING;
    v_before := ARRAY(
        SELECT c FROM channel c WHERE c.name = ANY (v_names) ORDER BY c.name FOR UPDATE);

    -- Ids for every item, in input order (those not created leave gaps, as sequences do).
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));

    -- Decide every item: deduplicated on a live message ('live') or on an earlier item of
    -- the batch ('batch'); otherwise new, and created while its channel has room.
    WITH item AS (
        SELECT t.ord, coalesce(t.channel, 'default') AS channel, t.dedup_key, m.id AS live_id
        FROM unnest(p_channels, p_contents, p_dedup_keys)
            WITH ORDINALITY AS t(channel, content, dedup_key, ord)
        LEFT JOIN message m ON t.dedup_key IS NOT NULL
            AND m.channel = coalesce(t.channel, 'default') AND m.dedup_key = t.dedup_key
    ), flagged AS (
        SELECT i.*,
               CASE WHEN i.dedup_key IS NULL THEN i.ord
                    ELSE min(i.ord) OVER (PARTITION BY i.channel, i.dedup_key) END AS first_ord
        FROM item i
    ), counted AS (
        SELECT f.*, f.live_id IS NULL AND f.first_ord = f.ord AS is_new,
               count(*) FILTER (WHERE f.live_id IS NULL AND f.first_ord = f.ord)
                   OVER (PARTITION BY f.channel ORDER BY f.ord) AS new_so_far
        FROM flagged f
    ), placed AS (
        SELECT c.*, b.current_size,
               c.is_new AND (b.max_size IS NULL OR b.current_size + c.new_so_far <= b.max_size)
                   AS created
        FROM counted c JOIN unnest(v_before) AS b ON b.name = c.channel
    ), sized AS (
        SELECT p.*,
               p.current_size + count(*) FILTER (WHERE p.created)
                   OVER (PARTITION BY p.channel ORDER BY p.ord) AS size_after,
               bool_or(p.created) FILTER (WHERE p.ord = p.first_ord)
                   OVER (PARTITION BY p.channel, p.first_ord) AS first_created
        FROM placed p
    )
    SELECT array_agg(CASE WHEN s.created THEN 'created'
                          WHEN s.live_id IS NOT NULL THEN 'live'
                          WHEN s.is_new THEN 'dropped'
                          ELSE 'batch' END ORDER BY s.ord),
           array_agg(s.live_id ORDER BY s.ord),
           array_agg(s.first_ord ORDER BY s.ord),
           array_agg(coalesce(s.first_created, FALSE) ORDER BY s.ord),
           array_agg(s.size_after ORDER BY s.ord)
    INTO v_kind, v_live, v_first, v_first_created, v_sizes
    FROM sized s;

    INSERT INTO message (id, channel, content, dequeue_at, dedup_key, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now),
           t.dedup_key, v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats, p_dedup_keys, v_kind)
        AS t(id, channel, content, dequeue_at, dedup_key, kind)
    WHERE t.kind = 'created';

    -- Count the new messages and bring each channel's next dequeue time forward to its
    -- earliest new message (respecting the release interval); announce what got sooner.
    FOR v_changed IN
        WITH added AS (
            SELECT coalesce(t.channel, 'default') AS channel, count(*) AS n,
                   min(coalesce(t.dequeue_at, v_now)) AS min_at,
                   min(t.id) AS first_id
            FROM unnest(v_ids, p_channels, p_dequeue_ats, v_kind)
                AS t(id, channel, dequeue_at, kind)
            WHERE t.kind = 'created'
            GROUP BY 1
        ), updated AS (
            UPDATE channel c SET
                current_size = c.current_size + a.n,
                next_dequeue_at = least(c.next_dequeue_at, greatest(a.min_at,
                    c.last_dequeue_at + coalesce(c.release_interval_ms, 0)))
            FROM added a
            WHERE c.name = a.channel
            RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency,
                      a.first_id
        )
        SELECT u.name, u.first_id,
               channel_servable_at(b.next_dequeue_at, b.current_concurrency,
                   b.max_concurrency) AS before_at,
               channel_servable_at(u.next_dequeue_at, u.current_concurrency,
                   u.max_concurrency) AS after_at
        FROM updated u JOIN unnest(v_before) AS b ON b.name = u.name
        -- Soonest first: one announcement then covers the batch.
        ORDER BY after_at NULLS LAST
    LOOP
        PERFORM channel_announce(v_changed.before_at, v_changed.after_at, 'created',
            v_changed.first_id, v_changed.name);
    END LOOP;

    -- Leave no empty policy-free row behind (a channel all of whose items were refused).
    DELETE FROM channel c
    WHERE c.name = ANY (v_names) AND c.current_size = 0 AND NOT c.has_policy;

    RETURN QUERY
        SELECT CASE r.kind WHEN 'created' THEN 'created'
                           WHEN 'live' THEN 'deduplicated'
                           WHEN 'dropped' THEN 'dropped'
                           ELSE CASE WHEN r.first_created THEN 'deduplicated' ELSE 'dropped' END
               END,
               CASE r.kind WHEN 'created' THEN r.id
                           WHEN 'live' THEN r.live
                           WHEN 'batch' THEN CASE WHEN r.first_created THEN v_ids[r.first] END
               END,
               r.size
        FROM unnest(v_kind, v_ids, v_live, v_first, v_first_created, v_sizes)
            AS r(kind, id, live, first, first_created, size);
END;
$$;

-- message_create_settle(): a message due at p_at was added to a locked channel: count it and
-- bring the channel's next dequeue time forward when the message makes it sooner (announcing
-- that, since a worker may be waiting for it).
CREATE FUNCTION message_create_settle(p_channel channel, p_at BIGINT, p_id BIGINT)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_next_at BIGINT := least(p_channel.next_dequeue_at, greatest(p_at,
        p_channel.last_dequeue_at + coalesce(p_channel.release_interval_ms, 0)));
BEGIN
    UPDATE channel c SET
        current_size = c.current_size + 1,
        next_dequeue_at = v_next_at
    WHERE c.name = p_channel.name;
    PERFORM channel_announce(
        channel_servable_at(p_channel.next_dequeue_at, p_channel.current_concurrency,
            p_channel.max_concurrency),
        channel_servable_at(v_next_at, p_channel.current_concurrency, p_channel.max_concurrency),
        'created', p_id, p_channel.name);
END;
$$;
-- message_create(): add one message; see message_create_many for the outcomes. This is the
-- hottest path, so the single-message form is written out: lock the channel row, insert,
-- update the row.
-- Locks: the channel row. Raises: LQ003, LQ005, LQ006.
CREATE FUNCTION message_create(
    p_content BYTEA,
    p_channel TEXT DEFAULT NULL,
    p_dequeue_at BIGINT DEFAULT NULL,
    p_dedup_key TEXT DEFAULT NULL
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_name TEXT := coalesce(p_channel, 'default');
    v_now BIGINT;
    v_at BIGINT;
    v_channel channel;
    v_id BIGINT;
BEGIN
    PERFORM message_check_new(v_name, p_content, p_dequeue_at, p_dedup_key);
    v_now := epoch();
    v_at := coalesce(p_dequeue_at, v_now);
    v_channel := channel_lock(v_name);
    IF p_dedup_key IS NOT NULL THEN
        SELECT m.id INTO v_id FROM message m
        WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
        IF FOUND THEN
            status := 'deduplicated'; id := v_id; channel_size := v_channel.current_size;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    IF v_channel.max_size IS NOT NULL AND v_channel.current_size >= v_channel.max_size THEN
        status := 'dropped'; id := NULL; channel_size := v_channel.current_size;
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO message (channel, content, dequeue_at, dedup_key, created_at)
    VALUES (v_name, p_content, v_at, p_dedup_key, v_now)
    RETURNING message.id INTO v_id;
    PERFORM message_create_settle(v_channel, v_at, v_id);
    status := 'created'; id := v_id; channel_size := v_channel.current_size + 1;
    RETURN NEXT;
END;
$$;


-- message_dequeue_many(): lock up to p_limit messages for p_lock_ms.
-- Each message is found by one index probe: first the oldest expired lock (its attempt is
-- counted again and its channel slot, never released, stays taken); otherwise the head of the
-- channel with the earliest next dequeue time that is under its concurrency limit. That
-- channel's next time moves to max(next head's dequeue_at, now + release interval) and it goes
-- behind channels with the same time (round robin).
-- When no message is returned, one row comes back with id NULL and retry_at set to the
-- earliest time a message may become available: the next due time of a servable channel, or
-- the earliest lock expiry (an expired lock makes its message available again). It is NULL
-- only when nothing is waiting in a servable channel and nothing is locked; a saturated
-- channel becomes servable when one of its messages finishes, which publishes an event.
-- Locks: rows it returns and the channel rows it serves. It never blocks on a lock: it skips
-- rows other sessions hold (SKIP LOCKED), and a call that found nothing polls (NOWAIT, for up
-- to about 0.1 s) for a servable channel that another session is serving, so that it does not
-- report an empty queue while messages are ready.
-- Raises: LQ003 (bad limit or lock_ms).
CREATE FUNCTION message_dequeue_many(p_limit INTEGER, p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch();
    v_taken INTEGER := 0;
    v_probes INTEGER := 0;
    v_message message;
    v_channel channel;
    v_release_at BIGINT;
    v_retry_at BIGINT;
    v_recover BOOLEAN := TRUE;
    v_found BOOLEAN;
    v_waited BOOLEAN := FALSE;
BEGIN
    PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
        format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
    PERFORM arg_check_lock_ms(p_lock_ms);

    WHILE v_taken < p_limit AND v_probes < 2 * p_limit + 8 LOOP
        v_probes := v_probes + 1;

        -- 1. A message whose lock expired: its holder is gone. Its channel slot was never
        -- released, so the channel is not touched. Once none is found, stop looking.
        IF v_recover THEN
            UPDATE message m SET
                unlock_at = v_now + p_lock_ms,
                locked_at = v_now,
                num_attempts = m.num_attempts + 1
            WHERE m.id = (
                SELECT e.id FROM message e
                WHERE e.is_locked AND e.unlock_at <= v_now
                ORDER BY e.unlock_at, e.id
                LIMIT 1
                FOR UPDATE SKIP LOCKED)
            RETURNING m.* INTO v_message;
            v_recover := FOUND;
        END IF;

        IF NOT v_recover THEN
            -- 2. The head of the channel whose turn it is.
            SELECT * INTO v_channel FROM channel c
            WHERE c.next_dequeue_at IS NOT NULL
              AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
              AND c.next_dequeue_at <= v_now
            ORDER BY c.next_dequeue_at, c.turn
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                -- Every servable channel is being served by another session (or none is
                -- servable). Rather than answer "empty" while messages are ready, wait a
                -- little for the first such channel, once per call. It polls with NOWAIT
                -- instead of blocking: a SKIP LOCKED probe may keep locks on rows it did not
                -- return, so this session may hold locks, and a blocking wait could deadlock.
                EXIT WHEN v_taken > 0 OR v_waited;
                v_waited := TRUE;
                SELECT c.name INTO v_channel.name FROM channel c
                WHERE c.next_dequeue_at IS NOT NULL
                  AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
                  AND c.next_dequeue_at <= v_now
                ORDER BY c.next_dequeue_at, c.turn
                LIMIT 1;
                EXIT WHEN NOT FOUND;
                v_found := FALSE;
                FOR v_try IN 1..200 LOOP
                    BEGIN
                        -- The other session pushed the channel back to its own clock, which
                        -- may be ahead of ours: judge it by the release interval and the head
                        -- (which must be due by our clock, below) instead.
                        SELECT * INTO v_channel FROM channel c
                        WHERE c.name = v_channel.name
                          AND c.next_dequeue_at IS NOT NULL
                          AND (c.max_concurrency IS NULL
                               OR c.current_concurrency < c.max_concurrency)
                          AND (coalesce(c.release_interval_ms, 0) = 0
                               OR c.last_dequeue_at + c.release_interval_ms <= v_now)
                        FOR UPDATE NOWAIT;
                        v_found := FOUND;
                        EXIT;
                    EXCEPTION WHEN lock_not_available THEN
                        PERFORM pg_sleep(0.0005);
                    END;
                END LOOP;
                -- Served in the meantime and no longer servable, or still busy: look again.
                CONTINUE WHEN NOT v_found;
            END IF;

            UPDATE message m SET
                is_locked = TRUE,
                unlock_at = v_now + p_lock_ms,
                locked_at = v_now,
                num_attempts = m.num_attempts + 1
            WHERE m.id = (
                SELECT h.id FROM message h
                WHERE h.channel = v_channel.name AND NOT h.is_locked AND h.dequeue_at <= v_now
                ORDER BY h.dequeue_at, h.id
                LIMIT 1
                FOR UPDATE SKIP LOCKED)
            RETURNING m.* INTO v_message;
            v_found := FOUND;

            -- Send the channel to the back: its next time is its new head's dequeue_at, but
            -- not before the release interval has passed since this dequeue. (When no head
            -- was found, another session holds it or it is not due: just recompute.)
            v_release_at := CASE WHEN v_found THEN v_now ELSE v_channel.last_dequeue_at END
                + coalesce(v_channel.release_interval_ms, 0);
            UPDATE channel c SET
                current_concurrency = CASE
                    WHEN v_found AND c.max_concurrency IS NOT NULL
                    THEN c.current_concurrency + 1
                    ELSE c.current_concurrency END,
                last_dequeue_at = CASE WHEN v_found THEN v_now ELSE c.last_dequeue_at END,
                next_dequeue_at = (
                    SELECT greatest(n.dequeue_at, v_release_at) FROM message n
                    WHERE n.channel = c.name AND NOT n.is_locked
                    ORDER BY n.dequeue_at, n.id
                    LIMIT 1),
                turn = nextval('channel_turn_seq')
            WHERE c.name = v_channel.name;
            CONTINUE WHEN NOT v_found;
        END IF;

        v_taken := v_taken + 1;
        id := v_message.id;
        channel := v_message.channel;
        content := v_message.content;
        state := v_message.state;
        num_attempts := v_message.num_attempts;
        dequeue_at := v_message.dequeue_at;
        unlock_at := v_message.unlock_at;
        retry_at := NULL;
        RETURN NEXT;
    END LOOP;

    IF v_taken = 0 THEN
        SELECT least(
            (SELECT c.next_dequeue_at FROM channel c
             WHERE c.next_dequeue_at IS NOT NULL
               AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
             ORDER BY c.next_dequeue_at, c.turn LIMIT 1),
            (SELECT m.unlock_at FROM message m WHERE m.is_locked
             ORDER BY m.unlock_at, m.id LIMIT 1))
        INTO v_retry_at;
        id := NULL; channel := NULL; content := NULL; state := NULL; num_attempts := NULL;
        dequeue_at := NULL; unlock_at := NULL;
        retry_at := CASE WHEN v_retry_at IS NOT NULL THEN greatest(v_retry_at, v_now) END;
        RETURN NEXT;
    END IF;
END;
$$;

-- message_dequeue(): lock one message; see message_dequeue_many.
CREATE FUNCTION message_dequeue(p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM message_dequeue_many(1, p_lock_ms)
$$;


-- message_refuse(): a caller said it holds a message, and the statement that required it
-- matched nothing: raise why. LQ001 when the message does not exist; LQ002 when it is not
-- locked (its lock expired and it went back, or it was never dequeued) or carries another
-- attempt count (its lock expired and another dequeue took it).
CREATE FUNCTION message_refuse(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
BEGIN
    SELECT * INTO v_message FROM message m WHERE m.id = p_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'message % does not exist (already finished, or never created)', p_id
            USING ERRCODE = 'LQ001';
    END IF;
    IF NOT v_message.is_locked THEN
        RAISE EXCEPTION 'message % is not locked: its lock expired and it went back to its '
            'channel, or it was never dequeued', p_id
            USING ERRCODE = 'LQ002';
    END IF;
    RAISE EXCEPTION 'message % was dequeued again (attempt %, you hold attempt %): your lock '
        'expired', p_id, v_message.num_attempts, p_num_attempts
        USING ERRCODE = 'LQ002';
END;
$$;


-- message_heartbeat(): extend the lock of a message you hold to now + p_lock_ms.
-- Returns the new unlock time. Locks: the message row. Raises: LQ001, LQ002, LQ003.
CREATE FUNCTION message_heartbeat(p_id BIGINT, p_num_attempts INTEGER, p_lock_ms BIGINT)
RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_unlock_at BIGINT;
BEGIN
    PERFORM arg_check_lock_ms(p_lock_ms);
    PERFORM arg_check_claim(p_id, p_num_attempts);
    UPDATE message m SET unlock_at = epoch() + p_lock_ms
    WHERE m.id = p_id AND m.is_locked AND m.num_attempts = p_num_attempts
    RETURNING m.unlock_at INTO v_unlock_at;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
    RETURN v_unlock_at;
END;
$$;


-- message_finish(): delete a message you hold, keep a copy with its outcome when the archive
-- is on, and free its channel slot (announcing the channel when that makes it servable).
-- Locks: the message row, then its channel row. Raises: LQ001, LQ002.
CREATE FUNCTION message_finish(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    DELETE FROM message m
    WHERE m.id = p_id AND m.is_locked AND m.num_attempts = p_num_attempts
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
    IF (SELECT c.archive FROM config c) THEN
        INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                             error, created_at, dequeue_at, locked_at, finished_at)
        VALUES (v_message.id, v_message.channel, v_message.content, v_message.state,
                v_message.dedup_key, v_message.num_attempts, p_outcome, p_error,
                v_message.created_at, v_message.dequeue_at, v_message.locked_at, epoch())
        ON CONFLICT (id) DO NOTHING;
    END IF;
    -- The in-flight counter is kept only for channels with a concurrency limit, so that the
    -- row of a policy-free channel gets a HOT update here.
    UPDATE channel c SET
        current_size = c.current_size - 1,
        current_concurrency = CASE
            WHEN c.max_concurrency IS NULL THEN 0 ELSE c.current_concurrency - 1 END
    WHERE c.name = v_message.channel
    RETURNING c.* INTO v_channel;
    IF v_channel.current_size = 0 AND NOT v_channel.has_policy THEN
        DELETE FROM channel c WHERE c.name = v_channel.name;
    ELSIF v_channel.current_concurrency = v_channel.max_concurrency - 1 THEN
        -- It was saturated: a worker may be waiting for this slot.
        PERFORM channel_announce(NULL, v_channel.next_dequeue_at, 'ready', NULL, v_channel.name);
    END IF;
END;
$$;

-- message_delete(): finish a message you hold (outcome 'completed' unless told otherwise).
-- Raises: LQ001, LQ002, LQ003.
CREATE FUNCTION message_delete(
    p_id BIGINT, p_num_attempts INTEGER,
    p_outcome TEXT DEFAULT 'completed', p_error TEXT DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_claim(p_id, p_num_attempts);
    PERFORM arg_check(p_outcome IS NOT NULL AND char_length(p_outcome) BETWEEN 1 AND 64,
        'outcome must be 1 to 64 characters');
    PERFORM message_finish(p_id, p_num_attempts, p_outcome, p_error);
END;
$$;


-- message_requeue(): put a message you hold back to wait until p_dequeue_at (default now),
-- keeping its attempt count and replacing its state when p_state is given; free its channel
-- slot and bring the channel's next dequeue time forward when the message now comes first.
-- Locks: the message row, then its channel row. Raises: LQ001, LQ002.
CREATE FUNCTION message_requeue(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
    v_channel channel;
    v_next_at BIGINT;
    v_concurrency BIGINT;
BEGIN
    UPDATE message m SET
        is_locked = FALSE,
        unlock_at = NULL,
        dequeue_at = coalesce(p_dequeue_at, epoch()),
        state = coalesce(p_state, m.state)
    WHERE m.id = p_id AND m.is_locked AND m.num_attempts = p_num_attempts
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
    SELECT * INTO STRICT v_channel FROM channel c WHERE c.name = v_message.channel FOR UPDATE;
    v_next_at := least(v_channel.next_dequeue_at, greatest(v_message.dequeue_at,
        v_channel.last_dequeue_at + coalesce(v_channel.release_interval_ms, 0)));
    v_concurrency := CASE WHEN v_channel.max_concurrency IS NULL THEN 0
                          ELSE v_channel.current_concurrency - 1 END;
    UPDATE channel c SET current_concurrency = v_concurrency, next_dequeue_at = v_next_at
    WHERE c.name = v_channel.name;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        channel_servable_at(v_next_at, v_concurrency, v_channel.max_concurrency),
        'deferred', p_id, v_channel.name);
END;
$$;

-- message_defer(): give back a message you hold, to be dequeued again at p_dequeue_at
-- (default now) with the same attempt count; p_state, when not NULL, replaces its saved state.
-- Raises: LQ001, LQ002, LQ003, LQ006.
CREATE FUNCTION message_defer(
    p_id BIGINT, p_num_attempts INTEGER,
    p_dequeue_at BIGINT DEFAULT NULL, p_state BYTEA DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_claim(p_id, p_num_attempts);
    PERFORM arg_check_time('dequeue_at', p_dequeue_at);
    PERFORM arg_check_payload('state', p_state);
    PERFORM message_requeue(p_id, p_num_attempts, p_dequeue_at, p_state);
END;
$$;


-- message_delete_many() / message_defer_many(): the batch forms. Each message is checked on
-- its own: the result row says 'ok', 'stale' (LQ002) or 'not_found' (LQ001) per id, in input
-- order, so one lost lock does not undo the rest of a batch.
-- Locks: messages and channel rows in (channel, id) order, each message before its channel.
CREATE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_status TEXT[];
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_ids) = cardinality(p_num_attempts),
        'ids and num_attempts must have the same length');
    PERFORM arg_check_claim(t.id, t.num_attempts)
    FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);

    v_status := array_fill(NULL::TEXT, ARRAY[cardinality(p_ids)]);
    FOR v_item IN
        SELECT t.id, t.num_attempts, t.ord
        FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS t(id, num_attempts, ord)
        LEFT JOIN message m ON m.id = t.id
        ORDER BY m.channel, t.id, t.ord
    LOOP
        BEGIN
            PERFORM message_finish(v_item.id, v_item.num_attempts, 'completed', NULL);
            v_status[v_item.ord] := 'ok';
        EXCEPTION
            WHEN SQLSTATE 'LQ001' THEN v_status[v_item.ord] := 'not_found';
            WHEN SQLSTATE 'LQ002' THEN v_status[v_item.ord] := 'stale';
        END;
    END LOOP;
    RETURN QUERY SELECT t.id, t.status FROM unnest(p_ids, v_status) AS t(id, status);
END;
$$;

CREATE FUNCTION message_defer_many(
    p_ids BIGINT[], p_num_attempts INTEGER[],
    p_dequeue_ats BIGINT[] DEFAULT NULL, p_states BYTEA[] DEFAULT NULL
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_count INTEGER := cardinality(p_ids);
    v_status TEXT[];
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND v_count <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_num_attempts) = v_count
        AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
        AND coalesce(cardinality(p_states), v_count) = v_count,
        'ids, num_attempts, dequeue_ats and states must have the same length');
    PERFORM arg_check_claim(t.id, t.num_attempts),
            arg_check_time('dequeue_at', t.dequeue_at),
            arg_check_payload('state', t.state)
    FROM unnest(p_ids, p_num_attempts, p_dequeue_ats, p_states)
        AS t(id, num_attempts, dequeue_at, state);

    v_status := array_fill(NULL::TEXT, ARRAY[v_count]);
    FOR v_item IN
        SELECT t.id, t.num_attempts, t.dequeue_at, t.state, t.ord
        FROM unnest(p_ids, p_num_attempts, p_dequeue_ats, p_states)
            WITH ORDINALITY AS t(id, num_attempts, dequeue_at, state, ord)
        LEFT JOIN message m ON m.id = t.id
        ORDER BY m.channel, t.id, t.ord
    LOOP
        BEGIN
            PERFORM message_requeue(v_item.id, v_item.num_attempts, v_item.dequeue_at,
                v_item.state);
            v_status[v_item.ord] := 'ok';
        EXCEPTION
            WHEN SQLSTATE 'LQ001' THEN v_status[v_item.ord] := 'not_found';
            WHEN SQLSTATE 'LQ002' THEN v_status[v_item.ord] := 'stale';
        END;
    END LOOP;
    RETURN QUERY SELECT t.id, t.status FROM unnest(p_ids, v_status) AS t(id, status);
END;
$$;


-- channel_policy_set(): set a channel's policy; NULL means unlimited. It applies at once to
-- the live channel (a lower max_concurrency lets in-flight messages finish; a lower max_size
-- keeps the messages already there) and stays when the channel empties.
-- Locks: the channel row. Raises: LQ004 (negative or out-of-range values), LQ005.
CREATE FUNCTION channel_policy_set(
    p_channel TEXT,
    p_max_concurrency INTEGER DEFAULT NULL,
    p_release_interval_ms BIGINT DEFAULT NULL,
    p_max_size BIGINT DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_channel channel;
    v_next_at BIGINT;
    v_concurrency BIGINT;
BEGIN
    PERFORM arg_check_channel(p_channel);
    PERFORM arg_check(p_max_concurrency IS NULL OR p_max_concurrency >= 0,
        format('max_concurrency must be >= 0 (0 pauses the channel), got %s',
            p_max_concurrency), 'LQ004');
    PERFORM arg_check(p_release_interval_ms IS NULL
        OR p_release_interval_ms BETWEEN 0 AND 31536000000,
        format('release_interval_ms must be between 0 and 31536000000 (1 year), got %s',
            p_release_interval_ms), 'LQ004');
    PERFORM arg_check(p_max_size IS NULL OR p_max_size >= 0,
        format('max_size must be >= 0, got %s', p_max_size), 'LQ004');

    v_channel := channel_lock(p_channel);
    v_next_at := channel_next_at(p_channel,
        v_channel.last_dequeue_at + coalesce(p_release_interval_ms, 0));
    UPDATE channel c SET
        has_policy = TRUE,
        -- The in-flight counter is kept only under a limit: count it when one starts.
        current_concurrency = CASE
            WHEN p_max_concurrency IS NULL THEN 0
            WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
            ELSE (SELECT count(*) FROM message m WHERE m.channel = p_channel AND m.is_locked)
            END,
        max_concurrency = p_max_concurrency,
        release_interval_ms = p_release_interval_ms,
        max_size = p_max_size,
        next_dequeue_at = v_next_at
    WHERE c.name = p_channel
    RETURNING c.current_concurrency INTO v_concurrency;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        channel_servable_at(v_next_at, v_concurrency, p_max_concurrency),
        'ready', NULL, p_channel);
END;
$$;

-- channel_policy_clear(): remove a channel's policy (unlimited from now on).
-- Locks: the channel row. Raises: LQ005.
CREATE FUNCTION channel_policy_clear(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_channel channel;
    v_next_at BIGINT;
BEGIN
    PERFORM arg_check_channel(p_channel);
    SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_channel.current_size = 0 THEN
        DELETE FROM channel c WHERE c.name = p_channel;
        RETURN;
    END IF;
    v_next_at := channel_next_at(p_channel, v_channel.last_dequeue_at);
    UPDATE channel c SET
        has_policy = FALSE, max_concurrency = NULL, release_interval_ms = NULL, max_size = NULL,
        current_concurrency = 0, next_dequeue_at = v_next_at
    WHERE c.name = p_channel;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        v_next_at, 'ready', NULL, p_channel);
END;
$$;


-- channel_stats(): every channel that holds messages or has a policy.
CREATE FUNCTION channel_stats()
RETURNS TABLE (
    channel TEXT, size BIGINT, in_flight BIGINT, next_dequeue_at BIGINT,
    max_concurrency INTEGER, release_interval_ms BIGINT, max_size BIGINT
)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    -- Channels without a concurrency limit keep no in-flight counter: count their locks.
    SELECT c.name, c.current_size,
           CASE WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
                ELSE coalesce(l.locked, 0) END,
           c.next_dequeue_at, c.max_concurrency, c.release_interval_ms, c.max_size
    FROM channel c
    LEFT JOIN (
        SELECT m.channel, count(*) AS locked FROM message m WHERE m.is_locked GROUP BY m.channel
    ) l ON l.channel = c.name
    ORDER BY c.name
$$;


-- config_set(): change the installation's settings. p_event_channel '' turns events off;
-- NULL arguments leave a setting as it is.
CREATE FUNCTION config_set(p_event_channel TEXT DEFAULT NULL, p_archive BOOLEAN DEFAULT NULL)
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

-- config_get(): the installation's settings.
CREATE FUNCTION config_get() RETURNS TABLE (event_channel TEXT, archive BOOLEAN)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.event_channel, c.archive FROM config c
$$;

-- clock_offset_set(): move the queue clock (tests only: expiry and schedules without sleeping).
CREATE FUNCTION clock_offset_set(p_offset_ms BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_time('offset_ms', p_offset_ms);
    UPDATE config c SET clock_offset_ms = coalesce(p_offset_ms, 0);
    RETURN epoch();
END;
$$;
