-- Finishing messages: delete (complete or fail, archiving when the archive is on) and defer,
-- one or many, and where a message is.
--
-- Each operation verifies that the caller holds the message: it is locked and carries the
-- attempt count the caller's dequeue returned. If not, its lock expired and someone else may
-- own it now: the operation refuses (LQ002, or 'stale' in a batch) and changes nothing, which
-- keeps the concurrency accounting exact. The batch forms check each message on its own and
-- use no subtransaction per message: a backend keeps the ids of at most 64 subtransactions in
-- shared memory, beyond that other sessions' visibility checks may have to read pg_subtrans,
-- and every id brings the next anti-wraparound vacuum closer (a Spark streaming read gives back
-- up to 50,000 messages in one call).
--
-- An archived message's finished_at is never before its locked_at: a dequeue stamps locked_at
-- with the clock as the call runs, finishing uses epoch() (the transaction's start), so a
-- message taken and finished in one transaction is stamped at least its locked_at.


-- message_refuse(): a caller said it holds a message, and the statement that required it
-- matched nothing: raise why. LQ001 when the message does not exist; LQ002 when it is not
-- locked (its lock expired and it went back, or it was never dequeued) or carries another
-- attempt count (its lock expired and another dequeue took it).
-- Locks: none. Raises: LQ001, LQ002.
CREATE OR REPLACE FUNCTION message_refuse(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
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


-- message_finish(): message_finish_try, raising when you do not hold the message.
-- Locks: as message_finish_try. Raises: LQ001, LQ002.
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


-- message_finish_try(): delete a message you hold, keep a copy with its outcome when the
-- archive is on, and, for a channel with a policy, free its slot (announcing the channel when
-- that makes it servable). A policy-free channel's row is not touched. Returns 'ok', or
-- 'stale' / 'not_found' (and changes nothing) when you do not hold the message.
-- Locks: the message row, the channel's shared advisory lock, and the row of a channel with a
-- policy. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION message_finish_try(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS TEXT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    -- The message's row and whether the archive is on (one statement: the delete).
    v_message RECORD;
    v_channel channel;
BEGIN
    DELETE FROM message m
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.*, (SELECT c.archive FROM config c) AS archive INTO v_message;
    IF NOT FOUND THEN
        RETURN CASE WHEN EXISTS (SELECT FROM message m WHERE m.id = p_id)
                    THEN 'stale' ELSE 'not_found' END;
    END IF;
    IF v_message.archive THEN
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


-- message_delete(): finish a message you hold (outcome 'completed' unless told otherwise).
-- Locks: as message_finish_try. Raises: LQ001, LQ002, LQ003.
CREATE OR REPLACE FUNCTION message_delete(
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


-- message_delete_many(): the batch form of delete. Each message is checked on its own: the
-- result row says 'ok', 'stale' or 'not_found' per id, in input order, so one lost lock does
-- not undo the rest of a batch. An id named twice is finished once (one message at a time).
-- Locks: the messages in id order, then the channels' shared advisory locks and the rows of
-- those with a policy, in name order. (An id named twice: as message_finish_try for each
-- message, in (channel, id) order.) Raises: LQ003 (mismatched arrays, NULL ids or attempts).
CREATE OR REPLACE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_status TEXT[];
    v_ids BIGINT[];
    v_attempts INTEGER[];
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
        -- An id named twice: one message at a time.
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

    -- The messages still held by these attempts, deleted in one statement: the scan of the
    -- primary key by an array of ids visits (and locks) them in id order, and each one's
    -- attempt is found by a binary search in the ids sorted alike. A message whose row another
    -- session holds is waited for and checked again once it is free.
    SELECT array_agg(t.id ORDER BY t.id), array_agg(t.num_attempts ORDER BY t.id)
    INTO v_ids, v_attempts
    FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);
    v_archive := (SELECT c.archive FROM config c);
    v_finished_at := CASE WHEN v_archive THEN epoch() END;
    WITH gone AS (
        DELETE FROM message m
        WHERE m.id = ANY (v_ids) AND m.unlock_at IS NOT NULL
          AND m.num_attempts = v_attempts[width_bucket(m.id, v_ids)]
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
    SELECT (SELECT array_agg(g.id) FROM gone g),
           array_agg(n.channel ORDER BY n.channel), array_agg(n.n ORDER BY n.channel)
    INTO v_gone, v_names, v_counts
    FROM (SELECT g.channel, count(*) AS n FROM gone g GROUP BY g.channel) n;

    IF v_gone IS NOT NULL THEN
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


-- message_requeue(): message_requeue_try, raising when you do not hold the message.
-- Locks: as message_requeue_try. Raises: LQ001, LQ002.
CREATE OR REPLACE FUNCTION message_requeue(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT message_requeue_try(p_id, p_num_attempts, p_dequeue_at, p_state) THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
END;
$$;


-- message_requeue_try(): put a message you hold back to wait until p_dequeue_at (default now),
-- keeping its attempt count and replacing its state when p_state is given; free its channel
-- slot (channels with a policy) and bring the channel's next dequeue time forward when the
-- message now comes first. Returns FALSE, changing nothing, when you do not hold it.
-- Locks: the message row, the channel's shared advisory lock, and the channel row when the
-- channel has a policy or the message makes it due sooner. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION message_requeue_try(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    UPDATE message m SET
        is_locked = FALSE,
        unlock_at = NULL,
        dequeue_at = coalesce(p_dequeue_at, epoch()),
        state = coalesce(p_state, m.state)
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        RETURN FALSE;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        PERFORM channel_wake(v_message.channel, v_message.dequeue_at, FOUND, v_channel,
            'deferred', p_id);
        RETURN TRUE;
    END IF;
    SELECT * INTO STRICT v_channel FROM channel c WHERE c.name = v_message.channel FOR UPDATE;
    PERFORM channel_wait_locked(v_channel, v_message.dequeue_at, p_id, 'deferred', 0, 1);
    RETURN TRUE;
END;
$$;


-- message_defer(): give back a message you hold, to be dequeued again at p_dequeue_at
-- (default now) with the same attempt count; p_state, when not NULL, replaces its saved state.
-- Locks: as message_requeue_try. Raises: LQ001, LQ002, LQ003, LQ006.
CREATE OR REPLACE FUNCTION message_defer(
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


-- message_defer_many(): the batch form of defer: 'ok', 'stale' or 'not_found' per id, in input
-- order, from one look-up at the end for the refused claims. An id named twice is deferred
-- once: the second claim is refused ('stale').
-- Locks: as message_requeue_try for each message, in (channel, id) order.
-- Raises: LQ003 (mismatched arrays, NULL ids or attempts, bad times), LQ006.
CREATE OR REPLACE FUNCTION message_defer_many(
    p_ids BIGINT[], p_num_attempts INTEGER[],
    p_dequeue_ats BIGINT[] DEFAULT NULL, p_states BYTEA[] DEFAULT NULL
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_count INTEGER := cardinality(p_ids);
    v_done BOOLEAN[];
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

    v_done := array_fill(FALSE, ARRAY[v_count]);
    FOR v_item IN
        SELECT t.id, t.num_attempts, t.dequeue_at, t.state, t.ord
        FROM unnest(p_ids, p_num_attempts, p_dequeue_ats, p_states)
            WITH ORDINALITY AS t(id, num_attempts, dequeue_at, state, ord)
        LEFT JOIN message m ON m.id = t.id
        ORDER BY m.channel, t.id, t.ord
    LOOP
        v_done[v_item.ord] := message_requeue_try(v_item.id, v_item.num_attempts,
            v_item.dequeue_at, v_item.state);
    END LOOP;

    RETURN QUERY
        SELECT t.id,
               CASE WHEN t.done THEN 'ok'
                    WHEN EXISTS (SELECT FROM message m WHERE m.id = t.id) THEN 'stale'
                    ELSE 'not_found' END
        FROM unnest(p_ids, v_done) WITH ORDINALITY AS t(id, done, ord)
        ORDER BY t.ord;
END;
$$;


-- message_complete_and_dequeue(): a worker's step in one call: finish the messages it holds
-- (as message_delete_many) and take up to p_limit more (as message_dequeue_many). A single held
-- message is finished directly, and a limit of 1 calls message_take_one itself: one function
-- call and one RETURN QUERY fewer on a worker's steady path (0.92-0.99x the loop's rate on 100
-- channels through message_dequeue_many, 1.10-1.20x called directly: benchmarks/take_one.py).
-- Locks: as message_delete_many, then as message_dequeue_loop.
-- Raises: LQ003 (mismatched arrays, NULL ids or attempts, bad limit or lock_ms).
CREATE OR REPLACE FUNCTION message_complete_and_dequeue(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_limit INTEGER, p_lock_ms BIGINT
) RETURNS TABLE (
    id BIGINT, status TEXT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
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
    IF p_limit = 1 THEN
        v_message := message_take_one(p_lock_ms);
        IF v_message.id IS NOT NULL THEN
            id := v_message.id;
            status := 'locked';
            channel := v_message.channel;
            content := v_message.content;
            state := v_message.state;
            num_attempts := v_message.num_attempts;
            dequeue_at := v_message.dequeue_at;
            unlock_at := v_message.unlock_at;
            retry_at := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
               q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
        FROM message_dequeue_loop(p_limit, p_lock_ms) AS q;
END;
$$;


-- message_status(): where a message is: 'waiting' or 'locked' while it is live; 'finished'
-- once archived (with its outcome, error, attempts and finish time); 'unknown' when it is
-- neither (finished while the archive was off, or never created).
-- Locks: none. Raises: LQ003 (NULL id).
CREATE OR REPLACE FUNCTION message_status(p_id BIGINT)
RETURNS TABLE (status TEXT, outcome TEXT, error TEXT, num_attempts INTEGER, finished_at BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_locked BOOLEAN;
    v_attempts INTEGER;
BEGIN
    PERFORM arg_check(p_id IS NOT NULL, 'message id must not be NULL');
    SELECT m.is_locked, m.num_attempts INTO v_locked, v_attempts FROM message m
    WHERE m.id = p_id;
    IF FOUND THEN
        status := CASE WHEN v_locked THEN 'locked' ELSE 'waiting' END;
        outcome := NULL; error := NULL; num_attempts := v_attempts; finished_at := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'finished'::TEXT, a.outcome, a.error, a.num_attempts, a.finished_at
        FROM archive a WHERE a.id = p_id;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::TEXT, NULL::TEXT, NULL::TEXT, NULL::INTEGER, NULL::BIGINT;
    END IF;
END;
$$;
