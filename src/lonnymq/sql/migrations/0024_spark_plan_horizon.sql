-- 0024_spark_plan_horizon: a streaming read that drains up to a horizon (Trigger.AvailableNow)
-- plans every message up to it, and leaves the messages past it as they were.
--
-- With a horizon (p_max_id: the largest id when the query started), spark_batch_plan keeps
-- the messages it dequeues up to the horizon and gives the later ones back. Until now it gave
-- them back at once and stopped planning: back at the heads of their channels, they would only
-- have been taken again. Two faults followed (found in review):
--
--   * a message created after the start and due earlier than the older ones (a priority, or a
--     channel first in turn) made a plan stop early, even with nothing kept: the plan then
--     reported no new batch, and an AvailableNow query ended with older messages still
--     waiting;
--   * every plan raised such a message's attempt count, though no one ever held it: after a
--     few plans a Worker (max_attempts) could fail it without running it.
--
-- Now the later messages stay locked by the plan's transaction until its end, so the dequeues
-- that follow pass them and reach the older messages behind them and in other channels; then
-- they are given back at their own dequeue_at, and their attempt counts are lowered again.
-- Lowering a count is safe only because the lock never committed: no session ever saw that
-- attempt, so no holder can be fenced wrongly. A plan stops when it has its limit, when the
-- queue has nothing more to give now, when it holds 10,000 later messages (as many as one
-- dequeue of the former version could give back), or after a quarter of the lock time: the
-- plan's own locks must
-- not expire while it runs, or its next dequeue would recover them as expired and take them
-- again. (A review found that loop: one old message behind 3,000 later ones, a limit of 1 and
-- 1 s locks.) A plan cut short by those bounds plans what it found; with nothing found, an
-- AvailableNow query ends as before. So do the ones that pass a later message at the head of
-- a channel with a policy: the later message takes the channel's slot (max_concurrency) or
-- its interval (release_interval_ms, which its give-back does not undo) for this plan, and
-- the older messages behind it wait for the next run. Only a dequeue that knows the horizon
-- would avoid that.

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
            FROM taken t WHERE p_max_id IS NULL OR t.id <= p_max_id
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM taken),
               (SELECT count(*) FROM kept),
               v_late || coalesce(
                   (SELECT array_agg(t.id) FROM taken t WHERE t.id > p_max_id), '{}')
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

SELECT secure_functions();
