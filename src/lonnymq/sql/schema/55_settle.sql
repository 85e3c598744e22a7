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
-- Locks: as message_delete_many, message_defer_many, message_finish_try and message_create
-- (a dead-lettered message's row first, then its target channel's), in that order, then as
-- message_dequeue_loop.
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
    v_status := array_fill(NULL::TEXT, ARRAY[v_count]);

    v_pick := ARRAY(SELECT t.ord FROM unnest(p_outcomes) WITH ORDINALITY AS t(outcome, ord)
                    WHERE t.outcome = 'completed' ORDER BY t.ord);
    IF cardinality(v_pick) > 0 THEN
        FOR v_item IN
            SELECT d.status, d.n FROM message_delete_many(
                ARRAY(SELECT p_ids[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n) ORDER BY n),
                ARRAY(SELECT p_num_attempts[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n)
                      ORDER BY n)) WITH ORDINALITY AS d(id, status, n)
        LOOP
            v_status[v_pick[v_item.n]] := v_item.status;
        END LOOP;
    END IF;

    v_pick := ARRAY(SELECT t.ord FROM unnest(p_outcomes) WITH ORDINALITY AS t(outcome, ord)
                    WHERE t.outcome = 'deferred' ORDER BY t.ord);
    IF cardinality(v_pick) > 0 THEN
        FOR v_item IN
            SELECT d.status, d.n FROM message_defer_many(
                ARRAY(SELECT p_ids[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n) ORDER BY n),
                ARRAY(SELECT p_num_attempts[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n)
                      ORDER BY n),
                ARRAY(SELECT p_dequeue_ats[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n)
                      ORDER BY n),
                ARRAY(SELECT p_states[o] FROM unnest(v_pick) WITH ORDINALITY AS u(o, n)
                      ORDER BY n)) WITH ORDINALITY AS d(id, status, n)
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
    IF p_limit > 0 THEN
        RETURN QUERY
            SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
                   q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
            FROM message_dequeue_many(p_limit, p_lock_ms) AS q;
    END IF;
END;
$$;
