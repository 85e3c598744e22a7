-- Settling: a worker's group commit. The outcomes of the handlers that returned since its
-- last call, and the messages for every free slot, in one call and one transaction, through
-- the functions that finish, defer and take one kind at a time (their logic is theirs).


-- message_settle(): report the outcome of each message you hold in p_ids (attempt
-- p_num_attempts), then take up to p_limit more (none when p_limit is 0). p_outcomes[i] says
-- what to do with message i:
--   'completed'      finish it (message_delete_many, every such message in one call);
--   'failed'         finish it as failed with p_errors[i] (message_finish_try);
--   'deferred'       give it back until p_dequeue_ats[i] (NULL: now), p_states[i] replacing
--                    its saved state when not NULL (message_defer_many, in one call);
--   'dead_lettered'  create a copy of its content (not its state) in channel p_channels[i]
--                    (message_create), then finish it as failed with p_errors[i]; when that
--                    channel is at its max_size, nothing is done and its status is 'full'.
-- Each outcome is fenced by its attempt, as those functions fence it: one row per message,
-- in input order, with status 'ok', 'stale' (its lock was lost), 'not_found' or 'full', and a
-- refused outcome changes nothing. The array arguments other than ids, attempts and outcomes
-- may be NULL (all NULL). Then, when p_limit > 0, the messages taken (as
-- message_dequeue_many): rows with status 'locked', or one row 'empty' with retry_at.
-- Locks: the messages held by these attempts in id order, then the shared advisory locks of
-- their channels and of the dead letters' channels in name order, then the rows of those with
-- a policy and of those a defer or a dead letter writes (created when missing), in name order:
-- all of them before any outcome is applied. When every outcome is a complete, or every one a
-- defer, message_delete_many or message_defer_many takes its own locks (the same order for
-- completes; for defers, message by message in (channel, id) order, each before its channel's
-- row); then as message_dequeue_loop.
-- Raises: LQ003 (bad limit or lock_ms, mismatched arrays, unknown outcome, NULL ids or
-- attempts, bad times), LQ005 (a dead letter without a valid channel), LQ006.
CREATE OR REPLACE FUNCTION message_settle(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_outcomes TEXT[],
    p_dequeue_ats BIGINT[], p_states BYTEA[], p_errors TEXT[], p_channels TEXT[],
    p_limit INTEGER, p_lock_ms BIGINT
) RETURNS TABLE (
    id BIGINT, status TEXT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_count INTEGER := cardinality(p_ids);
    v_status TEXT[];
    v_pick INTEGER[];
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_dequeue_ats BIGINT[];
    v_states BYTEA[];
    v_names TEXT[];
    v_written BOOLEAN[];
    v_item RECORD;
    v_content BYTEA;
    v_created TEXT;
BEGIN
    -- One plain test of every argument (the named checks say what is wrong only when it
    -- fails). Times and states are checked by message_defer_many, and a refusal anywhere
    -- undoes the whole call.
    IF NOT coalesce(p_limit BETWEEN 0 AND 10000 AND p_lock_ms BETWEEN 1 AND 604800000
            AND v_count <= 100000
            AND cardinality(p_num_attempts) = v_count AND cardinality(p_outcomes) = v_count
            AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
            AND coalesce(cardinality(p_states), v_count) = v_count
            AND coalesce(cardinality(p_errors), v_count) = v_count
            AND coalesce(cardinality(p_channels), v_count) = v_count
            AND NOT EXISTS (
                SELECT FROM unnest(p_ids, p_num_attempts, p_outcomes, p_channels)
                    AS t(id, num_attempts, outcome, channel)
                WHERE t.id IS NULL OR t.num_attempts IS NULL OR t.num_attempts < 1
                   OR t.outcome IS NULL
                   OR t.outcome NOT IN ('completed', 'failed', 'deferred', 'dead_lettered')
                   OR (t.outcome = 'dead_lettered'
                       AND coalesce(char_length(t.channel) NOT BETWEEN 1 AND 255, TRUE))),
            FALSE)
    THEN
        PERFORM arg_check(p_limit BETWEEN 0 AND 10000,
            format('limit must be between 0 and 10000, got %s',
                coalesce(p_limit::TEXT, 'NULL')));
        PERFORM arg_check_lock_ms(p_lock_ms);
        PERFORM arg_check(p_ids IS NOT NULL AND v_count <= 100000,
            'ids must be an array of at most 100000 ids');
        PERFORM arg_check(cardinality(p_num_attempts) = v_count
            AND cardinality(p_outcomes) = v_count
            AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
            AND coalesce(cardinality(p_states), v_count) = v_count
            AND coalesce(cardinality(p_errors), v_count) = v_count
            AND coalesce(cardinality(p_channels), v_count) = v_count,
            'ids, num_attempts, outcomes, dequeue_ats, states, errors and channels must have '
            'the same length');
        PERFORM arg_check_claim(t.id, t.num_attempts),
                arg_check(t.outcome IN ('completed', 'failed', 'deferred', 'dead_lettered'),
                    format('outcome must be completed, failed, deferred or dead_lettered, '
                        'got %s', coalesce(quote_literal(t.outcome), 'NULL')))
        FROM unnest(p_ids, p_num_attempts, p_outcomes) AS t(id, num_attempts, outcome);
        PERFORM arg_check_channel(t.channel)
        FROM unnest(p_outcomes, p_channels) AS t(outcome, channel)
        WHERE t.outcome = 'dead_lettered';
    END IF;
    IF v_count > 0 AND p_outcomes <@ ARRAY['completed'] THEN
        -- Completes only (a worker's usual call): message_delete_many's rows are the statuses,
        -- one per message, in input order.
        RETURN QUERY
            SELECT d.id, d.status, NULL::TEXT, NULL::BYTEA, NULL::BYTEA, NULL::INTEGER,
                   NULL::BIGINT, NULL::BIGINT, NULL::BIGINT
            FROM message_delete_many(p_ids, p_num_attempts) AS d;
    ELSIF v_count > 0 THEN
        v_status := array_fill(NULL::TEXT, ARRAY[v_count]);

        -- Every lock the phases below may wait for, taken first and in one order: the
        -- messages still held by these attempts in id order (as message_delete_many locks
        -- them), then their channels' and the dead letters' target channels' shared advisory
        -- locks in name order, then, in name order, the rows of those with a policy and of
        -- those a defer or a dead letter writes. Taken phase by phase instead (completes, then
        -- defers, then failures one by one), two settles could each hold a channel row the
        -- other waits for. A batch of defers only is left to message_defer_many, which takes
        -- its own.
        IF NOT p_outcomes <@ ARRAY['deferred'] THEN
            WITH held AS (
                SELECT m.channel, t.outcome, t.target
                FROM message m
                JOIN unnest(p_ids, p_num_attempts, p_outcomes, p_channels)
                    AS t(id, num_attempts, outcome, target) ON t.id = m.id
                WHERE m.unlock_at IS NOT NULL AND m.num_attempts = t.num_attempts
                ORDER BY m.id
                FOR UPDATE OF m
            ), involved AS (
                SELECT h.channel AS name, h.outcome = 'deferred' AS written FROM held h
                UNION ALL
                SELECT h.target, TRUE FROM held h WHERE h.outcome = 'dead_lettered'
            )
            SELECT array_agg(i.name ORDER BY i.name), array_agg(i.written ORDER BY i.name)
            INTO v_names, v_written
            FROM (SELECT v.name, bool_or(v.written) AS written FROM involved v GROUP BY v.name) i;
            IF v_names IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock_shared(channel_key(u.name))
                FROM unnest(v_names) WITH ORDINALITY AS u(name, ord)
                ORDER BY u.ord;
                -- A statement of its own, after the advisory locks: a policy set before them is
                -- seen, and none can be set until this transaction ends.
                PERFORM channel_lock(u.name)
                FROM unnest(v_names, v_written) WITH ORDINALITY AS u(name, written, ord)
                WHERE u.written
                   OR EXISTS (SELECT FROM channel c WHERE c.name = u.name AND c.has_policy)
                ORDER BY u.ord;
            END IF;
        END IF;

        SELECT array_agg(t.ord ORDER BY t.ord), array_agg(p_ids[t.ord] ORDER BY t.ord),
               array_agg(p_num_attempts[t.ord] ORDER BY t.ord)
        INTO v_pick, v_ids, v_attempts
        FROM unnest(p_outcomes) WITH ORDINALITY AS t(outcome, ord)
        WHERE t.outcome = 'completed';
        IF v_pick IS NOT NULL THEN
            FOR v_item IN
                SELECT d.status, d.n FROM message_delete_many(v_ids, v_attempts)
                    WITH ORDINALITY AS d(id, status, n)
            LOOP
                v_status[v_pick[v_item.n]] := v_item.status;
            END LOOP;
        END IF;

        SELECT array_agg(t.ord ORDER BY t.ord), array_agg(p_ids[t.ord] ORDER BY t.ord),
               array_agg(p_num_attempts[t.ord] ORDER BY t.ord),
               array_agg(p_dequeue_ats[t.ord] ORDER BY t.ord),
               array_agg(p_states[t.ord] ORDER BY t.ord)
        INTO v_pick, v_ids, v_attempts, v_dequeue_ats, v_states
        FROM unnest(p_outcomes) WITH ORDINALITY AS t(outcome, ord)
        WHERE t.outcome = 'deferred';
        IF v_pick IS NOT NULL THEN
            FOR v_item IN
                SELECT d.status, d.n
                FROM message_defer_many(v_ids, v_attempts, v_dequeue_ats, v_states)
                    WITH ORDINALITY AS d(id, status, n)
            LOOP
                v_status[v_pick[v_item.n]] := v_item.status;
            END LOOP;
        END IF;

        -- Failures and dead letters are rare: one message at a time.
        FOR v_item IN
            SELECT t.ord FROM unnest(p_outcomes) WITH ORDINALITY AS t(outcome, ord)
            WHERE t.outcome IN ('failed', 'dead_lettered') ORDER BY t.ord
        LOOP
            IF p_outcomes[v_item.ord] = 'dead_lettered' THEN
                -- Held by this attempt (the row locked until the end), or refused below.
                SELECT m.content INTO v_content FROM message m
                WHERE m.id = p_ids[v_item.ord] AND m.unlock_at IS NOT NULL
                  AND m.num_attempts = p_num_attempts[v_item.ord]
                FOR UPDATE;
                IF FOUND THEN
                    SELECT c.status INTO v_created
                    FROM message_create(v_content, p_channels[v_item.ord]) AS c;
                    IF v_created = 'dropped' THEN
                        v_status[v_item.ord] := 'full';
                        CONTINUE;
                    END IF;
                END IF;
            END IF;
            v_status[v_item.ord] := message_finish_try(p_ids[v_item.ord],
                p_num_attempts[v_item.ord], 'failed', p_errors[v_item.ord]);
        END LOOP;

        RETURN QUERY
            SELECT t.id, t.status, NULL::TEXT, NULL::BYTEA, NULL::BYTEA, NULL::INTEGER,
                   NULL::BIGINT, NULL::BIGINT, NULL::BIGINT
            FROM unnest(p_ids, v_status) AS t(id, status);
    END IF;
    IF p_limit > 0 THEN
        -- A group commit ends its transaction at once: its takes may move where their
        -- channels' waiting messages begin (channel_head_advance).
        PERFORM set_config('lonnymq.head_advance', 'on', TRUE);
        RETURN QUERY
            SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
                   q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
            FROM message_dequeue_many(p_limit, p_lock_ms) AS q;
    END IF;
END;
$$;
