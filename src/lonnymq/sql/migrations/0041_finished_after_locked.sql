-- 0041_finished_after_locked: an archived message is never finished before it was locked.
--
-- A dequeue stamps locked_at with the clock as the call runs (0021: another session may have
-- moved the queue on since this transaction began), while finishing stamped finished_at with
-- epoch(), the time the transaction began. A message taken and finished in one transaction
-- (a caller's, dequeue and delete inside it) was archived with finished_at before locked_at:
-- a negative processing time in the archive that Spark reads for its reports (found in
-- review: -201 ms after a 0.2 s statement ahead of the dequeue). Both functions that archive
-- a finished message now stamp at least its locked_at. Nothing else changes: same arguments,
-- results, locks, errors and events, and the settings 0037 gave them.


CREATE OR REPLACE FUNCTION message_finish_try(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS TEXT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
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
                v_message.created_at, v_message.dequeue_at, v_message.locked_at,
                greatest(epoch(), v_message.locked_at))
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


CREATE OR REPLACE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
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
                   'completed', NULL, g.created_at, g.dequeue_at, g.locked_at,
                   greatest(v_finished_at, g.locked_at)
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
