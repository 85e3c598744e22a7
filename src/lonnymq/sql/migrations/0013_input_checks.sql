-- 0013_input_checks: refusals that fuzzing found reaching the server as PostgreSQL errors
-- instead of the queue's own SQLSTATEs. Each function is as before apart from the check.
--
-- arg_check() raised with whatever errcode and message it was given: called directly with an
-- unknown condition name or a NULL it failed with 42704 or 22004. It now only ever raises a
-- queue SQLSTATE (LQ000-LQ999, else LQ003) with a message.

CREATE OR REPLACE FUNCTION arg_check(p_ok BOOLEAN, p_message TEXT, p_errcode TEXT DEFAULT 'LQ003')
RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_ok IS NOT TRUE THEN
        IF p_errcode IS NULL OR p_errcode !~ '^LQ[0-9]{3}$' THEN
            p_errcode := 'LQ003';
        END IF;
        RAISE EXCEPTION '%', coalesce(p_message, 'invalid argument') USING ERRCODE = p_errcode;
    END IF;
END;
$$;


-- spark_batch_plan(): as in 0004, but a p_start of 2^63 - 1 (whose next batch number does not
-- fit a BIGINT) is refused with LQ003 instead of failing with "bigint out of range" while the
-- variables were set up, before any check ran.
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
    v_got INTEGER;
    v_late_ids BIGINT[];
    v_late_attempts INTEGER[];
    v_late_ats BIGINT[];
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    PERFORM arg_check(p_start BETWEEN 0 AND 9223372036854775806,
        format('start must be between 0 and 2^63 - 2, got %s', p_start));
    PERFORM arg_check(p_limit BETWEEN 1 AND 1000000,
        format('limit must be between 1 and 1000000, got %s', p_limit));
    PERFORM arg_check_lock_ms(p_lock_ms);
    v_batch := p_start + 1;

    acked := spark_batch_ack(p_consumer, p_start);
    released := spark_batch_release(p_consumer, p_start);

    WHILE v_taken < p_limit LOOP
        WITH taken AS (
            SELECT d.* FROM message_dequeue_many(least(p_limit - v_taken, 10000)::INTEGER,
                p_lock_ms) d
            WHERE d.id IS NOT NULL
        ), kept AS (
            INSERT INTO spark_batch (consumer, batch_no, msg_id, num_attempts, channel, content,
                                     state, dequeue_at)
            SELECT p_consumer, v_batch, t.id, t.num_attempts, t.channel, t.content, t.state,
                   t.dequeue_at
            FROM taken t WHERE p_max_id IS NULL OR t.id <= p_max_id
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM kept),
               (SELECT array_agg(t.id ORDER BY t.id) FROM taken t WHERE t.id > p_max_id),
               (SELECT array_agg(t.num_attempts ORDER BY t.id) FROM taken t
                WHERE t.id > p_max_id),
               (SELECT array_agg(t.dequeue_at ORDER BY t.id) FROM taken t
                WHERE t.id > p_max_id)
        INTO v_got, v_late_ids, v_late_attempts, v_late_ats;
        IF v_late_ids IS NOT NULL THEN
            PERFORM message_defer_many(v_late_ids, v_late_attempts, v_late_ats);
            -- Messages past the horizon are at the heads of their channels now: stop here
            -- rather than take them again.
            v_taken := v_taken + v_got;
            EXIT;
        END IF;
        EXIT WHEN v_got = 0;
        v_taken := v_taken + v_got;
        EXIT WHEN v_got < least(p_limit - (v_taken - v_got), 10000);
    END LOOP;

    batch_no := CASE WHEN v_taken > 0 THEN v_batch ELSE p_start END;
    size := v_taken;
    RETURN NEXT;
END;
$$;


-- spark_sink_prune(): as in 0004, with p_keep checked (LQ003 unless 0 to 2^31 - 1) and a
-- p_batch_id so low that p_batch_id - p_keep does not fit a BIGINT pruning nothing (no batch
-- id is below it) instead of failing with "bigint out of range".
CREATE OR REPLACE FUNCTION spark_sink_prune(p_sink_id TEXT, p_batch_id BIGINT, p_keep INTEGER)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_keep >= 0, format('keep must be >= 0, got %s', p_keep));
    IF p_batch_id < -9223372036854775808 + p_keep THEN
        RETURN;
    END IF;
    DELETE FROM spark_commit c
    WHERE c.sink_id = p_sink_id AND c.batch_id < p_batch_id - p_keep;
END;
$$;


SELECT secure_functions();
