-- 0034_spark_skips_schedules: a streaming read leaves schedules' drivers to the workers.
--
-- A schedule is a driver message in the reserved channel 'lonnymq.schedules' that is never
-- finished: a Worker fires it (creates the task, defers the driver to its next time). The
-- Spark streaming read took messages through message_dequeue_many from every channel, drivers
-- included, and finished them when their micro-batch committed: every schedule a streaming
-- query met was gone for good (found in review, with a Worker and a query on one queue).
--
-- spark_batch_plan now gives a driver back as it gives back a message past the horizon
-- (0024): held by the plan's transaction while it takes the rest, then returned at its own
-- dequeue_at with its attempt count as it was, so the plan passes it and a Worker fires it.
-- spark_batch_waiting no longer counts the drivers' channel (Trigger.AvailableNow would wait
-- for a driver it will never take).

CREATE OR REPLACE FUNCTION spark_batch_plan(
    p_consumer TEXT, p_start BIGINT, p_limit INTEGER, p_lock_ms BIGINT,
    p_max_id BIGINT DEFAULT NULL
) RETURNS TABLE (batch_no BIGINT, size BIGINT, acked BIGINT, released BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_batch BIGINT;
    v_taken BIGINT := 0;
    v_asked INTEGER;
    v_got INTEGER;
    v_seen INTEGER;
    v_late BIGINT[] := '{}';
    v_deadline TIMESTAMPTZ;
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_ats BIGINT[];
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    PERFORM arg_check(p_start BETWEEN 0 AND 9223372036854775806,
        format('start must be between 0 and 2^63 - 2, got %s', p_start));
    PERFORM arg_check(p_limit BETWEEN 1 AND 1000000,
        format('limit must be between 1 and 1000000, got %s', p_limit));
    PERFORM arg_check_lock_ms(p_lock_ms);
    v_batch := p_start + 1;
    v_deadline := clock_timestamp() + (p_lock_ms / 4) * INTERVAL '1 millisecond';

    acked := spark_batch_ack(p_consumer, p_start);
    released := spark_batch_release(p_consumer, p_start);

    LOOP
        v_asked := least(p_limit - v_taken, 10000, 10000 - cardinality(v_late));
        WITH taken AS (
            SELECT d.* FROM message_dequeue_many(v_asked, p_lock_ms) d
            WHERE d.id IS NOT NULL
        ), kept AS (
            INSERT INTO spark_batch (consumer, batch_no, msg_id, num_attempts, channel, content,
                                     state, dequeue_at)
            SELECT p_consumer, v_batch, t.id, t.num_attempts, t.channel, t.content, t.state,
                   t.dequeue_at
            FROM taken t
            WHERE (p_max_id IS NULL OR t.id <= p_max_id) AND t.channel <> 'lonnymq.schedules'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM taken),
               (SELECT count(*) FROM kept),
               v_late || coalesce(
                   (SELECT array_agg(t.id) FROM taken t
                    WHERE t.id > p_max_id OR t.channel = 'lonnymq.schedules'), '{}')
        INTO v_seen, v_got, v_late;
        v_taken := v_taken + v_got;
        EXIT WHEN v_taken >= p_limit
            -- Fewer than asked: nothing more to give now (or a busy channel ended the call).
            OR v_seen < v_asked
            OR cardinality(v_late) >= 10000
            OR clock_timestamp() >= v_deadline;
    END LOOP;

    IF cardinality(v_late) > 0 THEN
        SELECT array_agg(m.id ORDER BY m.id), array_agg(m.num_attempts ORDER BY m.id),
               array_agg(m.dequeue_at ORDER BY m.id)
        INTO v_ids, v_attempts, v_ats
        FROM message m WHERE m.id = ANY (v_late);
        v_ids := ARRAY(
            SELECT d.id FROM message_defer_many(v_ids, v_attempts, v_ats) d
            WHERE d.status = 'ok');
        UPDATE message m SET num_attempts = m.num_attempts - 1 WHERE m.id = ANY (v_ids);
    END IF;

    batch_no := CASE WHEN v_taken > 0 THEN v_batch ELSE p_start END;
    size := v_taken;
    RETURN NEXT;
END;
$$;

CREATE OR REPLACE FUNCTION spark_batch_waiting(p_max_id BIGINT, p_due_by BIGINT)
RETURNS TABLE (channels BIGINT, next_at BIGINT, now_at BIGINT)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
BEGIN
    PERFORM arg_check(p_max_id IS NOT NULL, 'max_id must not be NULL');
    PERFORM arg_check(p_due_by IS NOT NULL, 'due_by must not be NULL');
    RETURN QUERY
        SELECT count(*),
               min(CASE
                   WHEN c.max_concurrency IS NOT NULL
                        AND c.current_concurrency >= c.max_concurrency THEN v_now
                   ELSE greatest(h.dequeue_at, coalesce(c.last_dequeue_at + c.release_interval_ms,
                                                        h.dequeue_at), v_now)
               END),
               v_now
        FROM channel c
        CROSS JOIN LATERAL (
            SELECT m.id, m.dequeue_at FROM message m
            WHERE m.channel = c.name AND NOT m.is_locked
            ORDER BY m.dequeue_at, m.id
            LIMIT 1) h
        WHERE c.next_dequeue_at IS NOT NULL AND c.name <> 'lonnymq.schedules'
          AND (c.has_policy OR c.next_dequeue_at <= v_now)
          AND c.max_concurrency IS DISTINCT FROM 0
          AND h.id <= p_max_id AND h.dequeue_at <= p_due_by;
END;
$$;

SELECT secure_functions();
