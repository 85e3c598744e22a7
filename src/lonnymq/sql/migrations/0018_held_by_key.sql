-- 0018_held_by_key: a message you hold is looked up by its primary key, never by the index of
-- locked messages.
--
-- Finishing, deferring and heartbeating a message look it up by id and check that it is still
-- locked by the caller's attempt. They wrote that check as `m.is_locked AND ...`, and
-- `is_locked` is the predicate of message_unlock_ix (unlock_at, id) WHERE is_locked, so the
-- planner may answer `m.id = $1` from that partial index instead of the primary key: with
-- `id` as its second column it is a scan of the whole index, one entry per locked message and
-- one per dead version not yet vacuumed. It does so whenever the statistics say that few
-- messages are locked, which is what they say after a quiet moment, on a server whose
-- autovacuum is off or late, or just before a burst of dequeues (a Spark micro-batch locking
-- 50,000 messages). Seen on PostgreSQL 15: with 124,000 messages locked after an ANALYZE that
-- saw none, a finish of 100 took 58 ms (a hash join over all 123,600 entries of the index) and
-- 790 ms per call under pgbench; a single finish or heartbeat planned
-- `Index Scan using message_unlock_ix, Index Cond: (id = $1)`.
--
-- The check now reads `m.unlock_at IS NOT NULL`: the same test (the table's CHECK keeps
-- is_locked = (unlock_at IS NOT NULL)), which does not imply the partial index's predicate, so
-- only the primary key can serve these lookups and each costs one probe per id whatever the
-- statistics say. Nothing else changes in the five functions below: same arguments, results,
-- locks, errors and events.


CREATE OR REPLACE FUNCTION message_finish_try(
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
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
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


CREATE OR REPLACE FUNCTION message_heartbeat(p_id BIGINT, p_num_attempts INTEGER, p_lock_ms BIGINT)
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
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.unlock_at INTO v_unlock_at;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
    RETURN v_unlock_at;
END;
$$;


CREATE OR REPLACE FUNCTION message_heartbeat_many(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_lock_ms BIGINT
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_unlock_at BIGINT;
BEGIN
    PERFORM arg_check_lock_ms(p_lock_ms);
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_ids) = cardinality(p_num_attempts),
        'ids and num_attempts must have the same length');
    PERFORM arg_check_claim(t.id, t.num_attempts)
    FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);
    v_unlock_at := epoch() + p_lock_ms;

    RETURN QUERY
    WITH claim AS (
        SELECT t.id, t.num_attempts, t.ord
        FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS t(id, num_attempts, ord)
    ), held AS (
        SELECT m.id FROM message m JOIN claim c ON c.id = m.id
        WHERE m.unlock_at IS NOT NULL AND m.num_attempts = c.num_attempts
        ORDER BY m.id
        FOR UPDATE OF m
    ), extended AS (
        UPDATE message m SET unlock_at = v_unlock_at
        FROM held h
        WHERE m.id = h.id
        RETURNING m.id
    )
    SELECT c.id,
           CASE WHEN e.id IS NOT NULL THEN 'ok'
                WHEN EXISTS (SELECT 1 FROM message m WHERE m.id = c.id) THEN 'stale'
                ELSE 'not_found' END
    FROM claim c LEFT JOIN extended e ON e.id = c.id
    ORDER BY c.ord;
END;
$$;


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
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
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


CREATE OR REPLACE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_status TEXT[];
    v_gone BIGINT[];
    v_names TEXT[];
    v_counts BIGINT[];
    v_freed RECORD;
    v_archive BOOLEAN;
    v_finished_at BIGINT;
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_ids) = cardinality(p_num_attempts),
        'ids and num_attempts must have the same length');
    IF EXISTS (
        SELECT FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts)
        WHERE t.id IS NULL OR t.num_attempts IS NULL OR t.num_attempts < 1)
    THEN
        -- The named check says which argument is wrong.
        PERFORM arg_check_claim(t.id, t.num_attempts)
        FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);
    END IF;

    IF (SELECT count(DISTINCT t.id) FROM unnest(p_ids) AS t(id)) < cardinality(p_ids) THEN
        -- An id named twice: one message at a time, as in 0002.
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
        RETURN;
    END IF;

    -- The messages still held by these attempts, locked in (channel, id) order (the lock is
    -- taken above the sort). A message whose row another session holds is waited for and
    -- checked again once it is free.
    v_gone := ARRAY(
        SELECT m.id
        FROM message m
        JOIN unnest(p_ids, p_num_attempts) AS t(id, num_attempts) ON t.id = m.id
        WHERE m.unlock_at IS NOT NULL AND m.num_attempts = t.num_attempts
        ORDER BY m.channel, m.id
        FOR UPDATE OF m);

    IF cardinality(v_gone) > 0 THEN
        v_archive := (SELECT c.archive FROM config c);
        v_finished_at := CASE WHEN v_archive THEN epoch() END;
        WITH gone AS (
            DELETE FROM message m WHERE m.id = ANY (v_gone)
            RETURNING m.*
        ), kept AS (
            INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                                 error, created_at, dequeue_at, locked_at, finished_at)
            SELECT g.id, g.channel, g.content, g.state, g.dedup_key, g.num_attempts,
                   'completed', NULL, g.created_at, g.dequeue_at, g.locked_at, v_finished_at
            FROM gone g
            WHERE v_archive
            ON CONFLICT (id) DO NOTHING
        )
        SELECT array_agg(n.channel ORDER BY n.channel), array_agg(n.n ORDER BY n.channel)
        INTO v_names, v_counts
        FROM (SELECT g.channel, count(*) AS n FROM gone g GROUP BY g.channel) n;

        PERFORM pg_advisory_xact_lock_shared(channel_key(u.name))
        FROM unnest(v_names) WITH ORDINALITY AS u(name, ord)
        ORDER BY u.ord;

        -- Channels with a policy: lock their rows in name order, then free their slots.
        PERFORM FROM channel c
        WHERE c.name = ANY (v_names) AND c.has_policy
        ORDER BY c.name
        FOR UPDATE;
        FOR v_freed IN
            WITH updated AS (
                UPDATE channel c SET
                    current_size = c.current_size - u.n,
                    current_concurrency = CASE
                        WHEN c.max_concurrency IS NULL THEN 0
                        ELSE c.current_concurrency - u.n END
                FROM unnest(v_names, v_counts) AS u(name, n)
                WHERE c.name = u.name AND c.has_policy
                RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency,
                          u.n
            )
            SELECT u.name, u.next_dequeue_at FROM updated u
            -- It was saturated (at or above its limit) and a slot is free now: a worker may
            -- be waiting for it.
            WHERE u.current_concurrency < u.max_concurrency
              AND u.current_concurrency + u.n >= u.max_concurrency
            ORDER BY u.name
        LOOP
            PERFORM channel_announce(NULL, v_freed.next_dequeue_at, 'ready', NULL, v_freed.name);
        END LOOP;
    END IF;

    RETURN QUERY
        SELECT t.id,
               CASE WHEN g.id IS NOT NULL THEN 'ok'
                    WHEN EXISTS (SELECT FROM message m WHERE m.id = t.id) THEN 'stale'
                    ELSE 'not_found' END
        FROM unnest(p_ids) WITH ORDINALITY AS t(id, ord)
        LEFT JOIN unnest(v_gone) AS g(id) ON g.id = t.id
        ORDER BY t.ord;
END;
$$;

SELECT secure_functions();
