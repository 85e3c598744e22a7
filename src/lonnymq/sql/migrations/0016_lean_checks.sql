-- 0016_lean_checks: argument checks that cost nothing when the arguments are good.
--
-- Every check was a call of a small function (arg_check and its wrappers), and each call
-- built its error message with format() before it knew whether it would raise. On this
-- machine a statement or function call inside plpgsql costs 15 to 40 microseconds, so the
-- checks were a visible share of the hot calls: four check calls (and four format()s) in each
-- worker step (message_complete_and_dequeue: its own, then message_dequeue_many's), and one
-- message_check_new call per message in message_create_many. Now each hot function first
-- tests its arguments in one plain expression and calls the named checks only when that test
-- fails, so the errors (codes and messages) are the same as before.
--
-- Changed, each otherwise as before: arg_check_lock_ms and arg_check_claim (return at once
-- when the value is good), message_complete_and_dequeue (as in 0010), message_dequeue_many (as
-- in 0011), message_create (as in 0002) and message_create_many (as in 0011: one statement
-- tests the whole batch).

-- arg_check_lock_ms(), arg_check_claim(): as in 0001, returning at once for a good value.
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


-- message_complete_and_dequeue(): as in 0010, with the checks in one expression.
CREATE OR REPLACE FUNCTION message_complete_and_dequeue(
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
    IF NOT coalesce(p_limit BETWEEN 1 AND 10000 AND p_lock_ms BETWEEN 1 AND 604800000, FALSE)
    THEN
        PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
            format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
        PERFORM arg_check_lock_ms(p_lock_ms);
    END IF;
    IF cardinality(p_ids) = 1 AND cardinality(p_num_attempts) = 1
       AND p_ids[1] IS NOT NULL AND p_num_attempts[1] IS NOT NULL THEN
        IF p_num_attempts[1] < 1 THEN
            PERFORM arg_check_claim(p_ids[1], p_num_attempts[1]);
        END IF;
        id := p_ids[1];
        status := message_finish_try(p_ids[1], p_num_attempts[1], 'completed', NULL);
        RETURN NEXT;
    ELSIF p_ids IS NULL OR p_num_attempts IS NULL
          OR cardinality(p_ids) <> 0 OR cardinality(p_num_attempts) <> 0 THEN
        -- Several ids, or what message_delete_many refuses (NULL, unequal lengths, a NULL
        -- item) or reads its own way (an array that is not a plain list).
        RETURN QUERY
            SELECT d.id, d.status, NULL::TEXT, NULL::BYTEA, NULL::BYTEA, NULL::INTEGER,
                   NULL::BIGINT, NULL::BIGINT, NULL::BIGINT
            FROM message_delete_many(p_ids, p_num_attempts) AS d;
    END IF;
    RETURN QUERY
        SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
               q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
        FROM message_dequeue_many(p_limit, p_lock_ms) AS q;
END;
$$;


-- message_dequeue_many(): as in 0011, with the checks in one expression.
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
    v_passed TEXT[] := ARRAY[]::TEXT[];
    v_rest TEXT[];
    v_spread BOOLEAN := FALSE;
    v_free TEXT[];
    v_due channel[];
    v_share INTEGER;
    v_quota INTEGER;
    v_rows INTEGER;
BEGIN
    IF NOT coalesce(p_limit BETWEEN 1 AND 10000 AND p_lock_ms BETWEEN 1 AND 604800000, FALSE)
    THEN
        PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
            format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
        PERFORM arg_check_lock_ms(p_lock_ms);
    END IF;

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
                v_due := ARRAY(
                    SELECT c
                    FROM channel c
                    WHERE c.next_dequeue_at IS NOT NULL
                      AND (c.max_concurrency IS NULL
                           OR c.current_concurrency < c.max_concurrency)
                      AND c.next_dequeue_at <= v_now
                    ORDER BY c.next_dequeue_at, c.turn
                    LIMIT p_limit - v_taken
                    FOR UPDATE SKIP LOCKED);
                v_free := ARRAY(
                    SELECT d.name FROM unnest(v_due) AS d
                    WHERE NOT d.has_policy
                      AND pg_try_advisory_xact_lock_shared(channel_key(d.name)));
                -- One slot stays for each channel with a policy among them: the steps below
                -- serve those (they come first in turn), so a batch never starves them.
                v_share := p_limit - v_taken
                    - (SELECT count(*) FROM unnest(v_due) AS d WHERE d.has_policy)::INTEGER;
                IF cardinality(v_free) > 0 AND v_share > 0 THEN
                    v_quota := ceil(v_share::NUMERIC / cardinality(v_free));
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
                            LIMIT v_share
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
                    -- Send them to the back together: those whose next head is due in one
                    -- statement (new turns in the order they were served), the rest one by
                    -- one (channel_rotate may push them ahead or delete their rows).
                    WITH next_heads AS (
                        SELECT f.name, f.ord,
                               (SELECT greatest(m.dequeue_at, v_now) FROM message m
                                WHERE m.channel = f.name AND NOT m.is_locked
                                ORDER BY m.dequeue_at, m.id
                                LIMIT 1) AS next_at
                        FROM unnest(v_free) WITH ORDINALITY AS f(name, ord)
                    ), turns AS (
                        SELECT n.name, n.next_at, nextval('channel_turn_seq') AS turn
                        FROM (SELECT h.name, h.next_at FROM next_heads h
                              WHERE h.next_at <= v_now ORDER BY h.ord) n
                    ), rotated AS (
                        UPDATE channel c SET
                            next_dequeue_at = t.next_at, turn = t.turn, last_dequeue_at = v_now
                        FROM turns t
                        WHERE c.name = t.name
                        RETURNING c.name
                    )
                    SELECT coalesce(array_agg(h.name ORDER BY h.ord), ARRAY[]::TEXT[])
                    INTO v_rest
                    FROM next_heads h
                    WHERE h.name NOT IN (SELECT r.name FROM rotated r);
                    PERFORM channel_rotate(r.name, v_now, TRUE) FROM unnest(v_rest) AS r(name);
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
                  AND c.name <> ALL (v_passed)
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
                    -- Its waiting heads are all taken by others: try the next busy channel
                    -- rather than answer "nothing" while other channels have messages.
                    v_passed := v_passed || v_busy;
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


-- message_create(): as in 0002, with the checks in one expression.
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
    IF NOT coalesce(p_content IS NOT NULL AND octet_length(p_content) <= 67108864
            AND char_length(v_name) BETWEEN 1 AND 255
            AND (p_dequeue_at IS NULL
                 OR p_dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
            AND (p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255), FALSE)
    THEN
        PERFORM message_check_new(v_name, p_content, p_dequeue_at, p_dedup_key);
    END IF;
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


-- message_create_many(): as in 0011, with the batch's checks in one statement.
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
    v_count INTEGER := cardinality(p_contents);
    v_names TEXT[];
    v_now BIGINT;
    v_clock BIGINT;
    v_ids BIGINT[];
    v_wake RECORD;
BEGIN
    IF v_count IS NULL OR v_count = 0 OR v_count > 100000
        OR coalesce(cardinality(p_channels), v_count) <> v_count
        OR coalesce(cardinality(p_dequeue_ats), v_count) <> v_count
        OR coalesce(cardinality(p_dedup_keys), v_count) <> v_count
        OR EXISTS (SELECT FROM unnest(p_dedup_keys) AS k WHERE k IS NOT NULL)
    THEN
        -- Nothing to do, bad arguments (refused there) or dedup keys: the general path.
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;
    v_names := ARRAY(
        SELECT DISTINCT coalesce(t.channel, 'default')
        FROM unnest(p_channels, p_contents) AS t(channel, content)
        ORDER BY 1);
    -- A channel known to have a policy: the row path at once. (A caller may already hold
    -- such a row, e.g. spark_write_commit; waiting for its advisory lock then could deadlock
    -- with a policy change, which takes the advisory lock first and the row second.)
    IF cardinality(v_names) > 128
        OR EXISTS (SELECT FROM channel c WHERE c.name = ANY (v_names) AND c.has_policy)
    THEN
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;

    -- Validate everything before changing anything.
    IF EXISTS (
        SELECT FROM unnest(p_channels, p_contents, p_dequeue_ats)
            AS t(channel, content, dequeue_at)
        WHERE NOT coalesce(t.content IS NOT NULL AND octet_length(t.content) <= 67108864
                AND char_length(coalesce(t.channel, 'default')) BETWEEN 1 AND 255
                AND (t.dequeue_at IS NULL
                     OR t.dequeue_at BETWEEN -1000000000000000 AND 1000000000000000), FALSE))
    THEN
        -- The named checks say what is wrong with the first bad one.
        PERFORM message_check_new(coalesce(t.channel, 'default'), t.content, t.dequeue_at, NULL)
        FROM unnest(p_channels, p_contents, p_dequeue_ats) AS t(channel, content, dequeue_at);
    END IF;

    -- In name order (v_names is sorted), as every taker of several channels' locks does. Held
    -- to commit, they keep a dequeue from pushing a channel's time past these messages (see
    -- 0002), and a policy from being set on a channel until they are counted.
    PERFORM pg_advisory_xact_lock_shared(channel_key(n)) FROM unnest(v_names) AS n;
    -- A policy set meanwhile (before these locks were granted).
    IF EXISTS (SELECT FROM channel c WHERE c.name = ANY (v_names) AND c.has_policy) THEN
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;

    v_now := epoch();
    -- The clock now (not as the transaction started), plus the 10 ms of 0002: a row due by
    -- then needs no write.
    v_clock := v_now + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now), v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats)
        AS t(id, channel, content, dequeue_at);

    -- Each channel whose row is missing or says later than its earliest new message: write the
    -- row in name order (no deadlocks between batches), then announce, soonest first (one
    -- NOTIFY then covers the batch).
    FOR v_wake IN
        WITH added AS (
            SELECT coalesce(t.channel, 'default') AS name,
                   min(coalesce(t.dequeue_at, v_now)) AS at, min(t.id) AS first_id
            FROM unnest(v_ids, p_channels, p_dequeue_ats) AS t(id, channel, dequeue_at)
            GROUP BY 1
        ), late AS (
            SELECT a.name, a.at, a.first_id, c.next_dequeue_at AS seen_next
            FROM added a LEFT JOIN channel c ON c.name = a.name
            WHERE c.name IS NULL OR c.next_dequeue_at IS NULL
               OR c.next_dequeue_at > greatest(a.at, v_clock)
        ), written AS (
            INSERT INTO channel AS c (name, next_dequeue_at)
            SELECT l.name, l.at FROM late l ORDER BY l.name
            ON CONFLICT (name) DO UPDATE SET next_dequeue_at = excluded.next_dequeue_at
            WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > excluded.next_dequeue_at
            RETURNING c.name
        )
        SELECT l.* FROM late l WHERE l.name IN (SELECT w.name FROM written w) ORDER BY l.at
    LOOP
        PERFORM channel_announce(v_wake.seen_next, v_wake.at, 'created', v_wake.first_id,
            v_wake.name);
    END LOOP;

    RETURN QUERY
        SELECT 'created'::TEXT, t.id, NULL::BIGINT
        FROM unnest(v_ids) WITH ORDINALITY AS t(id, ord) ORDER BY t.ord;
END;
$$;


SELECT secure_functions();
