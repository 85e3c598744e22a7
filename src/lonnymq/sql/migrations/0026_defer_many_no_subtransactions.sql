-- 0026_defer_many_no_subtransactions: a batch defer without a subtransaction per message.
--
-- message_defer_many tried each message in a BEGIN … EXCEPTION block, to turn a refused
-- claim into a status: one subtransaction, and one transaction id, per message. A backend
-- keeps the ids of at most 64 subtransactions in shared memory; beyond that its transaction is
-- "overflowed", and while it runs other sessions' visibility checks may have to look its
-- subtransactions up in pg_subtrans. Every id used also brings the next anti-wraparound
-- vacuum closer. The Spark streaming read gives back up to 50,000 messages in one call (a
-- released batch), a plan's give-back up to 10,000.
--
-- message_requeue_try does what message_requeue did and answers FALSE, changing nothing,
-- where message_requeue raised; message_requeue raises on FALSE as before. The batch calls
-- the former in the same (channel, id) order, and a refused claim gets its status ('stale' or
-- 'not_found') from one look-up at the end. An id named twice is deferred once: the second
-- claim is refused ('stale'), as before.

CREATE FUNCTION message_requeue_try(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS BOOLEAN
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
        RETURN FALSE;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        PERFORM channel_wake(v_message.channel, v_message.dequeue_at, FOUND,
            v_channel.next_dequeue_at, 'deferred', p_id);
        RETURN TRUE;
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
    RETURN TRUE;
END;
$$;


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


CREATE OR REPLACE FUNCTION message_defer_many(
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

SELECT secure_functions();
