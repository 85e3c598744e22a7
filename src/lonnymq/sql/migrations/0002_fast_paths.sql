-- 0002_fast_paths: channels without a policy no longer write (or wait for) their channel row
-- on the common paths, and a worker can finish a message and take the next in one call.
--
-- In 0001 every create, dequeue and finish wrote its channel's row and held that row's lock to
-- commit, so the producers of one channel committed one after another and the consumers of one
-- channel skipped each other and saw nothing. From here on:
--
-- * A channel with a policy (has_policy) works as before: its row is locked by every operation
--   and its counters (current_size, current_concurrency) are exact.
-- * A channel without one keeps no counters. Its row only says when the channel is next worth a
--   visit (next_dequeue_at) and whose turn it is, and exists while it may hold waiting messages.
--   - create and defer write the row only when they make the channel due sooner than it says
--     (a new channel, or an earlier message); otherwise they just insert or update the message;
--   - finish does not touch the row at all;
--   - the dequeue that holds the row (FOR UPDATE SKIP LOCKED) moves the channel to the back;
--     concurrent dequeues that find the row held take the channel's next heads anyway
--     ("ride along"), so one hot channel serves many consumers at once.
--
-- Safety rule: next_dequeue_at may be too early (a visit finds nothing and fixes it), never too
-- late while a waiting message is due. A create that sees the row due early enough and skips
-- writing it relies on nobody pushing next_dequeue_at past its message before it commits. So:
--   every operation on a channel's messages holds a shared advisory lock on the channel
--   (channel_key) until it commits; pushing a channel's time into the future or deleting its
--   row needs that lock in exclusive mode, which a dequeue only tries (it never waits); when the
--   try fails, the dequeue pushes the time at most 10 ms ahead (a message created meanwhile is
--   then served at most that much later, never lost). Setting a policy waits for the exclusive
--   lock, so in-flight operations finish before it counts the channel's messages.
-- Large batches (create_many) lock the channel rows instead of taking advisory locks, as in 0001.

-- channel_key(): the advisory lock key of a channel of this schema.
CREATE FUNCTION channel_key(p_channel TEXT) RETURNS BIGINT
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT hashtextextended(p_channel, hashtext(current_schema())::BIGINT)
$$;


-- channel_wake(): a message of a policy-free channel became due at p_at; make sure the channel's
-- row says so. p_seen_next is next_dequeue_at as the caller read it, NULL when there was no row;
-- the row is written only when that is later than p_at. The caller holds the channel's shared
-- advisory lock. Announces the sooner time.
CREATE FUNCTION channel_wake(
    p_channel TEXT, p_at BIGINT, p_seen BOOLEAN, p_seen_next BIGINT, p_type TEXT, p_id BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_seen AND p_seen_next <= p_at THEN
        RETURN;
    END IF;
    INSERT INTO channel AS c (name, next_dequeue_at) VALUES (p_channel, p_at)
    ON CONFLICT (name) DO UPDATE SET next_dequeue_at = least(c.next_dequeue_at, p_at)
    WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at;
    PERFORM channel_announce(p_seen_next, p_at, p_type, p_id, p_channel);
END;
$$;


-- channel_rotate(): after a dequeue served (p_served) or tried to serve a policy-free channel
-- whose row it holds: send it to the back. Its next time is its next head's dequeue_at, and
-- not before now when it was just served, so that channels due earlier go first (round robin).
-- Pushing the time past now, or deleting the row of a channel with nothing waiting, needs the
-- exclusive advisory lock (see the top).
CREATE FUNCTION channel_rotate(p_channel TEXT, p_now BIGINT, p_served BOOLEAN) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_next_at BIGINT;
BEGIN
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    INTO v_next_at
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1;
    IF v_next_at <= p_now THEN
        UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
            last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
        WHERE c.name = p_channel;
    ELSIF pg_try_advisory_xact_lock(channel_key(p_channel)) THEN
        IF v_next_at IS NULL THEN
            DELETE FROM channel c WHERE c.name = p_channel;
        ELSE
            UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
                last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
            WHERE c.name = p_channel;
        END IF;
    ELSE
        -- Someone is creating or finishing in this channel right now: look again shortly.
        UPDATE channel c SET
            next_dequeue_at = least(v_next_at, p_now + 10),
            turn = nextval('channel_turn_seq'),
            last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
        WHERE c.name = p_channel;
    END IF;
END;
$$;


-- message_create(): add one message; see message_create_many for the outcomes. channel_size is
-- the channel's size for a channel with a policy, NULL otherwise (no counter is kept).
-- Locks: the channel's shared advisory lock; the channel row only when the channel has a policy
-- or the message makes it due sooner. Raises: LQ003, LQ005, LQ006.
CREATE OR REPLACE FUNCTION message_create(
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
    v_seen BOOLEAN;
    v_id BIGINT;
BEGIN
    PERFORM message_check_new(v_name, p_content, p_dequeue_at, p_dedup_key);
    v_now := epoch();
    v_at := coalesce(p_dequeue_at, v_now);
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_name));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_name;
    v_seen := FOUND;

    IF v_seen AND v_channel.has_policy THEN
        -- Counters and limits: serialise on the row, as 0001 did.
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
        RETURN;
    END IF;

    -- No policy: the dedup index decides between concurrent creators of the same key.
    FOR v_round IN 1..3 LOOP
        INSERT INTO message (channel, content, dequeue_at, dedup_key, created_at)
        VALUES (v_name, p_content, v_at, p_dedup_key, v_now)
        ON CONFLICT (channel, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
        RETURNING message.id INTO v_id;
        IF FOUND THEN
            PERFORM channel_wake(v_name, v_at, v_seen, v_channel.next_dequeue_at, 'created',
                v_id);
            status := 'created'; id := v_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT m.id INTO v_id FROM message m
        WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
        IF FOUND THEN
            status := 'deduplicated'; id := v_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        -- The message holding the key finished in between: try again.
    END LOOP;
    RAISE EXCEPTION 'dedup key % of channel % kept changing hands', p_dedup_key, v_name
        USING ERRCODE = '40001';
END;
$$;


-- message_create_many(): add messages; results come back in input order.
-- For each message: a live message of the same channel with the same dedup_key (or an earlier
-- item of the batch with that key) makes it 'deduplicated' and returns that message's id; a
-- channel at its max_size makes it 'dropped' (id NULL); otherwise it is 'created'. Ids are
-- drawn in input order. channel_size is the channel's size once the message is counted, for
-- channels with a policy; NULL for the others.
-- The work is set-based, whatever the batch size: one statement decides every item, one
-- inserts, one updates the channels.
-- Locks: each channel row touched, in channel-name order (so batches cannot deadlock); a
-- batch may name more channels than advisory locks fit in memory, so rows it is.
-- Raises: LQ003 (mismatched arrays, bad time or dedup key), LQ005, LQ006.
CREATE OR REPLACE FUNCTION message_create_many(
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

    -- Lock the channels, creating missing rows, one by one in name order (so batches cannot
    -- deadlock: an upsert either inserts the row or locks it, and waits for a row being
    -- deleted to go). The update changes nothing.
    v_names := ARRAY(
        SELECT DISTINCT coalesce(t.channel, 'default')
        FROM unnest(p_channels, p_contents) AS t(channel, content)
        ORDER BY 1);
    WITH locked AS (
        INSERT INTO channel AS c (name) SELECT n FROM unnest(v_names) AS n ORDER BY n
        ON CONFLICT (name) DO UPDATE SET turn = c.turn
        RETURNING c.*
    )
    SELECT array_agg(l::channel) INTO v_before FROM locked l;

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
        SELECT c.*, b.current_size, b.has_policy,
               c.is_new AND (b.max_size IS NULL OR b.current_size + c.new_so_far <= b.max_size)
                   AS created
        FROM counted c JOIN unnest(v_before) AS b ON b.name = c.channel
    ), sized AS (
        SELECT p.*,
               CASE WHEN p.has_policy THEN p.current_size + count(*) FILTER (WHERE p.created)
                   OVER (PARTITION BY p.channel ORDER BY p.ord) END AS size_after,
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

    -- Count the new messages (channels with a policy) and bring each channel's next dequeue
    -- time forward to its earliest new message (respecting the release interval); announce
    -- what got sooner.
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
                current_size = CASE WHEN c.has_policy THEN c.current_size + a.n ELSE 0 END,
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

    -- Leave no useless policy-free row behind (a channel all of whose items were refused).
    DELETE FROM channel c
    WHERE c.name = ANY (v_names) AND NOT c.has_policy AND c.next_dequeue_at IS NULL;

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


-- message_dequeue_many(): lock up to p_limit messages for p_lock_ms.
-- Each message is found by one index probe: first the oldest expired lock (its attempt is
-- counted again and its channel slot, never released, stays taken); otherwise the head of the
-- channel with the earliest next dequeue time that is under its concurrency limit. That
-- channel's next time moves to max(next head's dequeue_at, now + release interval) and it goes
-- behind channels with the same time (round robin).
-- When every due channel's row is held by another dequeue, a channel without a policy is served
-- anyway: its next waiting heads are taken without its row (they are distinct rows, locked with
-- SKIP LOCKED). A channel with a policy must be served under its row: the call then polls that
-- row (NOWAIT, for up to about 0.1 s) rather than report an empty queue while messages are ready.
-- When no message is returned, one row comes back with id NULL and retry_at set to the
-- earliest time a message may become available: the next due time of a servable channel, or
-- the earliest lock expiry (an expired lock makes its message available again). It is NULL
-- only when nothing is waiting in a servable channel and nothing is locked; a saturated
-- channel becomes servable when one of its messages finishes, which publishes an event.
-- Locks: rows it returns and the channel rows it serves; advisory locks it only tries. It never
-- blocks on a lock.
-- Raises: LQ003 (bad limit or lock_ms).
CREATE OR REPLACE FUNCTION message_dequeue_many(p_limit INTEGER, p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    -- The clock as this call starts, not as its transaction did: another session may have
    -- served a channel and set its next time by its own, later clock since.
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
    v_taken INTEGER := 0;
    v_probes INTEGER := 0;
    v_message message;
    v_channel channel;
    v_release_at BIGINT;
    v_retry_at BIGINT;
    v_recover BOOLEAN := TRUE;
    v_found BOOLEAN;
    v_waited BOOLEAN := FALSE;
    v_busy TEXT;
    v_spread BOOLEAN := FALSE;
    v_free TEXT[];
    v_quota INTEGER;
    v_rows INTEGER;
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
            -- 2a. A batch, once: the due channels in turn, locked together; those without a
            -- policy give their heads in one statement, round robin (each channel's first
            -- head, then each one's second, ...), up to an equal share each. Channels with a
            -- policy are left to the one-by-one steps below, which come to them next.
            IF NOT v_spread AND p_limit - v_taken >= 2 THEN
                v_spread := TRUE;
                -- (The subquery's order is kept: nothing after it reorders rows.)
                v_free := ARRAY(
                    SELECT s.name
                    FROM (
                        SELECT c.name, c.has_policy FROM channel c
                        WHERE c.next_dequeue_at IS NOT NULL
                          AND (c.max_concurrency IS NULL
                               OR c.current_concurrency < c.max_concurrency)
                          AND c.next_dequeue_at <= v_now
                        ORDER BY c.next_dequeue_at, c.turn
                        LIMIT p_limit - v_taken
                        FOR UPDATE SKIP LOCKED) s
                    WHERE NOT s.has_policy
                      AND pg_try_advisory_xact_lock_shared(channel_key(s.name)));
                IF cardinality(v_free) > 0 THEN
                    v_quota := ceil((p_limit - v_taken)::NUMERIC / cardinality(v_free));
                    RETURN QUERY
                        WITH picked AS (
                            SELECT h.id, f.ord, h.rn
                            FROM unnest(v_free) WITH ORDINALITY AS f(name, ord)
                            CROSS JOIN LATERAL (
                                SELECT x.id, row_number() OVER () AS rn
                                FROM (
                                    SELECT m.id FROM message m
                                    WHERE m.channel = f.name AND NOT m.is_locked
                                      AND m.dequeue_at <= v_now
                                    ORDER BY m.dequeue_at, m.id
                                    LIMIT v_quota
                                    FOR UPDATE SKIP LOCKED) x) h
                        ), chosen AS (
                            SELECT p.id, p.ord, p.rn FROM picked p
                            ORDER BY p.rn, p.ord
                            LIMIT p_limit - v_taken
                        ), taken AS (
                            UPDATE message m SET
                                is_locked = TRUE,
                                unlock_at = v_now + p_lock_ms,
                                locked_at = v_now,
                                num_attempts = m.num_attempts + 1
                            FROM chosen c
                            WHERE m.id = ANY (ARRAY(SELECT c2.id FROM chosen c2))
                              AND m.id = c.id
                            RETURNING m.id, m.channel, m.content, m.state, m.num_attempts,
                                      m.dequeue_at, m.unlock_at, c.rn, c.ord
                        )
                        SELECT t.id, t.channel, t.content, t.state, t.num_attempts,
                               t.dequeue_at, t.unlock_at, NULL::BIGINT
                        FROM taken t ORDER BY t.rn, t.ord;
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    v_taken := v_taken + v_rows;
                    PERFORM channel_rotate(f.name, v_now, TRUE) FROM unnest(v_free) AS f(name);
                    CONTINUE;
                END IF;
            END IF;

            -- 2. The head of the channel whose turn it is.
            SELECT * INTO v_channel FROM channel c
            WHERE c.next_dequeue_at IS NOT NULL
              AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
              AND c.next_dequeue_at <= v_now
            ORDER BY c.next_dequeue_at, c.turn
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
            v_found := FOUND;

            IF NOT v_found THEN
                -- Every due channel's row is held by another session (or none is due).
                SELECT c.name INTO v_busy FROM channel c
                WHERE c.next_dequeue_at IS NOT NULL
                  AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
                  AND c.next_dequeue_at <= v_now
                ORDER BY c.next_dequeue_at, c.turn
                LIMIT 1;
                EXIT WHEN NOT FOUND;
                -- Ride along on a policy-free channel, unless its policy is being changed.
                EXIT WHEN NOT pg_try_advisory_xact_lock_shared(channel_key(v_busy));
                IF NOT coalesce(
                        (SELECT c.has_policy FROM channel c WHERE c.name = v_busy), FALSE)
                THEN
                    RETURN QUERY
                        WITH taken AS (
                            UPDATE message m SET
                                is_locked = TRUE,
                                unlock_at = v_now + p_lock_ms,
                                locked_at = v_now,
                                num_attempts = m.num_attempts + 1
                            WHERE m.id = ANY (ARRAY(
                                SELECT h.id FROM message h
                                WHERE h.channel = v_busy AND NOT h.is_locked
                                  AND h.dequeue_at <= v_now
                                ORDER BY h.dequeue_at, h.id
                                LIMIT p_limit - v_taken
                                FOR UPDATE SKIP LOCKED))
                            RETURNING m.*
                        )
                        SELECT t.id, t.channel, t.content, t.state, t.num_attempts,
                               t.dequeue_at, t.unlock_at, NULL::BIGINT
                        FROM taken t ORDER BY t.dequeue_at, t.id;
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    EXIT WHEN v_rows = 0;
                    v_taken := v_taken + v_rows;
                    CONTINUE;
                ELSE
                    -- A channel with a policy is served under its row: wait a little for it,
                    -- once per call. Poll with NOWAIT instead of blocking: a SKIP LOCKED probe
                    -- may keep locks on rows it did not return, so a blocking wait could
                    -- deadlock.
                    EXIT WHEN v_taken > 0 OR v_waited;
                    v_waited := TRUE;
                    FOR v_try IN 1..200 LOOP
                        BEGIN
                            -- The other session pushed the channel back to its own clock,
                            -- which may be ahead of ours: judge it by the release interval and
                            -- the head (which must be due by our clock, below) instead.
                            SELECT * INTO v_channel FROM channel c
                            WHERE c.name = v_busy
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
                    -- Served in the meantime and no longer servable, or still busy: look
                    -- again.
                    CONTINUE WHEN NOT v_found;
                END IF;
            END IF;

            -- Hold the channel's shared advisory lock too, as every operation on its
            -- messages does: a later delete or create of ours in this transaction then never
            -- waits for a policy change that waits for our row (a deadlock).
            IF v_found AND NOT pg_try_advisory_xact_lock_shared(channel_key(v_channel.name)) THEN
                EXIT;  -- its policy is being changed: serve it next time
            END IF;

            IF v_found THEN
                UPDATE message m SET
                    is_locked = TRUE,
                    unlock_at = v_now + p_lock_ms,
                    locked_at = v_now,
                    num_attempts = m.num_attempts + 1
                WHERE m.id = (
                    SELECT h.id FROM message h
                    WHERE h.channel = v_channel.name AND NOT h.is_locked
                      AND h.dequeue_at <= v_now
                    ORDER BY h.dequeue_at, h.id
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED)
                RETURNING m.* INTO v_message;
                v_found := FOUND;

                IF NOT v_channel.has_policy THEN
                    PERFORM channel_rotate(v_channel.name, v_now, v_found);
                ELSE
                    -- Send the channel to the back: its next time is its new head's
                    -- dequeue_at, but not before the release interval has passed since this
                    -- dequeue. (When no head was found, another session holds it or it is not
                    -- due: just recompute.)
                    v_release_at := CASE WHEN v_found THEN v_now
                                         ELSE v_channel.last_dequeue_at END
                        + coalesce(v_channel.release_interval_ms, 0);
                    UPDATE channel c SET
                        current_concurrency = CASE
                            WHEN v_found AND c.max_concurrency IS NOT NULL
                            THEN c.current_concurrency + 1
                            ELSE c.current_concurrency END,
                        last_dequeue_at = CASE WHEN v_found THEN v_now
                                               ELSE c.last_dequeue_at END,
                        next_dequeue_at = (
                            SELECT greatest(n.dequeue_at, v_release_at) FROM message n
                            WHERE n.channel = c.name AND NOT n.is_locked
                            ORDER BY n.dequeue_at, n.id
                            LIMIT 1),
                        turn = nextval('channel_turn_seq')
                    WHERE c.name = v_channel.name;
                END IF;
                CONTINUE WHEN NOT v_found;
            END IF;
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


-- message_finish_try(): delete a message you hold, keep a copy with its outcome when the
-- archive is on, and, for a channel with a policy, free its slot (announcing the channel when
-- that makes it servable). A policy-free channel's row is not touched. Returns 'ok', or
-- 'stale' / 'not_found' (and changes nothing) when you do not hold the message.
-- Locks: the message row, the channel's shared advisory lock, and the row of a channel with a
-- policy.
CREATE FUNCTION message_finish_try(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS TEXT
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
        RETURN CASE WHEN EXISTS (SELECT FROM message m WHERE m.id = p_id)
                    THEN 'stale' ELSE 'not_found' END;
    END IF;
    IF (SELECT c.archive FROM config c) THEN
        INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                             error, created_at, dequeue_at, locked_at, finished_at)
        VALUES (v_message.id, v_message.channel, v_message.content, v_message.state,
                v_message.dedup_key, v_message.num_attempts, p_outcome, p_error,
                v_message.created_at, v_message.dequeue_at, v_message.locked_at, epoch())
        ON CONFLICT (id) DO NOTHING;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    IF NOT coalesce(
            (SELECT c.has_policy FROM channel c WHERE c.name = v_message.channel), FALSE) THEN
        RETURN 'ok';
    END IF;
    -- The in-flight counter is kept only for channels with a concurrency limit.
    UPDATE channel c SET
        current_size = c.current_size - 1,
        current_concurrency = CASE
            WHEN c.max_concurrency IS NULL THEN 0 ELSE c.current_concurrency - 1 END
    WHERE c.name = v_message.channel
    RETURNING c.* INTO v_channel;
    IF v_channel.current_concurrency = v_channel.max_concurrency - 1 THEN
        -- It was saturated: a worker may be waiting for this slot.
        PERFORM channel_announce(NULL, v_channel.next_dequeue_at, 'ready', NULL, v_channel.name);
    END IF;
    RETURN 'ok';
END;
$$;

-- message_finish(): message_finish_try, raising LQ001 / LQ002 when you do not hold it.
CREATE OR REPLACE FUNCTION message_finish(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF message_finish_try(p_id, p_num_attempts, p_outcome, p_error) <> 'ok' THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
END;
$$;

-- message_delete_many(): the batch form of delete. Each message is checked on its own: the
-- result row says 'ok', 'stale' or 'not_found' per id, in input order, so one lost lock does
-- not undo the rest of a batch. No subtransactions: a refusal changes nothing to begin with.
-- Locks: messages and channel rows in (channel, id) order, each message before its channel.
CREATE OR REPLACE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
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
        v_status[v_item.ord] := message_finish_try(v_item.id, v_item.num_attempts,
            'completed', NULL);
    END LOOP;
    RETURN QUERY SELECT t.id, t.status FROM unnest(p_ids, v_status) AS t(id, status);
END;
$$;


-- message_requeue(): put a message you hold back to wait until p_dequeue_at (default now),
-- keeping its attempt count and replacing its state when p_state is given; free its channel
-- slot (channels with a policy) and bring the channel's next dequeue time forward when the
-- message now comes first.
-- Locks: the message row, the channel's shared advisory lock, and the channel row when the
-- channel has a policy or the message makes it due sooner. Raises: LQ001, LQ002.
CREATE OR REPLACE FUNCTION message_requeue(
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
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        PERFORM channel_wake(v_message.channel, v_message.dequeue_at, FOUND,
            v_channel.next_dequeue_at, 'deferred', p_id);
        RETURN;
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


-- message_complete_and_dequeue(): finish the messages you hold (outcome 'completed') and lock
-- up to p_limit new ones, in one transaction: a worker's steady state then costs one commit per
-- cycle. The first rows report each finished id in input order, with status 'ok', 'stale' or
-- 'not_found' (as message_delete_many); the rest are message_dequeue_many's rows, with status
-- 'locked' (or 'empty' for its row that carries only retry_at).
-- Raises: LQ003.
CREATE FUNCTION message_complete_and_dequeue(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_limit INTEGER, p_lock_ms BIGINT
) RETURNS TABLE (
    id BIGINT, status TEXT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    -- Check the dequeue's arguments first: a refusal must change nothing.
    PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
        format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
    PERFORM arg_check_lock_ms(p_lock_ms);
    RETURN QUERY
        SELECT d.id, d.status, NULL::TEXT, NULL::BYTEA, NULL::BYTEA, NULL::INTEGER,
               NULL::BIGINT, NULL::BIGINT, NULL::BIGINT
        FROM message_delete_many(p_ids, p_num_attempts) AS d;
    RETURN QUERY
        SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
               q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
        FROM message_dequeue_many(p_limit, p_lock_ms) AS q;
END;
$$;


-- channel_policy_set(): set a channel's policy; NULL means unlimited. It applies at once to
-- the live channel (a lower max_concurrency lets in-flight messages finish; a lower max_size
-- keeps the messages already there) and stays when the channel empties. A channel that had no
-- policy has its messages counted once.
-- Locks: the channel's exclusive advisory lock (waiting for operations in flight on it), then
-- its row. Raises: LQ004 (negative or out-of-range values), LQ005.
CREATE OR REPLACE FUNCTION channel_policy_set(
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

    PERFORM pg_advisory_xact_lock(channel_key(p_channel));
    v_channel := channel_lock(p_channel);
    v_next_at := channel_next_at(p_channel,
        v_channel.last_dequeue_at + coalesce(p_release_interval_ms, 0));
    UPDATE channel c SET
        has_policy = TRUE,
        current_size = CASE WHEN c.has_policy THEN c.current_size
            ELSE (SELECT count(*) FROM message m WHERE m.channel = p_channel) END,
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
-- Locks: the channel's exclusive advisory lock, then its row. Raises: LQ005.
CREATE OR REPLACE FUNCTION channel_policy_clear(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_channel channel;
    v_next_at BIGINT;
BEGIN
    PERFORM arg_check_channel(p_channel);
    PERFORM pg_advisory_xact_lock(channel_key(p_channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        RETURN;
    END IF;
    v_next_at := channel_next_at(p_channel, v_channel.last_dequeue_at);
    IF v_next_at IS NULL THEN
        DELETE FROM channel c WHERE c.name = p_channel;
        RETURN;
    END IF;
    UPDATE channel c SET
        has_policy = FALSE, max_concurrency = NULL, release_interval_ms = NULL, max_size = NULL,
        current_size = 0, current_concurrency = 0, next_dequeue_at = v_next_at
    WHERE c.name = p_channel;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        v_next_at, 'ready', NULL, p_channel);
END;
$$;


-- channel_stats(): every channel that holds messages or has a policy. Channels with a policy
-- report their counters; the others are counted from the message table (a scan: this is an
-- operator's view, not a hot path).
CREATE OR REPLACE FUNCTION channel_stats()
RETURNS TABLE (
    channel TEXT, size BIGINT, in_flight BIGINT, next_dequeue_at BIGINT,
    max_concurrency INTEGER, release_interval_ms BIGINT, max_size BIGINT
)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT coalesce(c.name, s.channel),
           CASE WHEN c.has_policy THEN c.current_size ELSE coalesce(s.total, 0) END,
           CASE WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
                ELSE coalesce(s.locked, 0) END,
           c.next_dequeue_at, c.max_concurrency, c.release_interval_ms, c.max_size
    FROM channel c
    FULL JOIN (
        SELECT m.channel, count(*) AS total, count(*) FILTER (WHERE m.is_locked) AS locked
        FROM message m GROUP BY m.channel
    ) s ON s.channel = c.name
    -- A drained policy-free channel's row may linger until a dequeue visits it: not listed.
    WHERE coalesce(c.has_policy, FALSE) OR s.channel IS NOT NULL
    ORDER BY 1
$$;
