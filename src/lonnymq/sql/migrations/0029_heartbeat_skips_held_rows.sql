-- 0029_heartbeat_skips_held_rows: a batch heartbeat no longer waits for a message row that
-- another transaction holds.
--
-- message_heartbeat_many locked the rows it extends with FOR UPDATE, so it waited for any
-- transaction holding one of them. A Worker renews all its messages in one call per round, and
-- a handler that finishes its message inside its own transaction (delete(conn=...), then more
-- work before the commit, as the README shows) holds that row until it commits: the whole
-- round waited for it, and the other messages' locks could expire meanwhile and be taken by
-- another consumer while their handlers still ran.
--
-- Now a row held by another transaction is skipped (SKIP LOCKED) and reported 'busy': its lock
-- was not extended this time, and whoever holds the row is about to finish, defer or take it.
-- The others are extended at once. spark_batch_heartbeat counts a busy message neither as
-- extended nor as lost.


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
        FOR UPDATE OF m SKIP LOCKED
    ), extended AS (
        UPDATE message m SET unlock_at = v_unlock_at
        FROM held h
        WHERE m.id = h.id
        RETURNING m.id, m.num_attempts
    )
    SELECT c.id,
           CASE WHEN e.num_attempts = c.num_attempts THEN 'ok'
                -- Held by this claim as last committed, but its row locked by another
                -- transaction: skipped.
                WHEN e.id IS NULL AND EXISTS (
                    SELECT 1 FROM message m
                    WHERE m.id = c.id AND m.unlock_at IS NOT NULL
                      AND m.num_attempts = c.num_attempts) THEN 'busy'
                WHEN EXISTS (SELECT 1 FROM message m WHERE m.id = c.id) THEN 'stale'
                ELSE 'not_found' END
    FROM claim c LEFT JOIN extended e ON e.id = c.id
    ORDER BY c.ord;
END;
$$;


-- spark_batch_heartbeat(): as in 0004, a busy message counted neither way.
CREATE OR REPLACE FUNCTION spark_batch_heartbeat(p_consumer TEXT, p_lock_ms BIGINT)
RETURNS TABLE (extended BIGINT, lost BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_counts RECORD;
BEGIN
    SELECT array_agg(b.msg_id ORDER BY b.msg_id), array_agg(b.num_attempts ORDER BY b.msg_id)
    INTO v_ids, v_attempts
    FROM spark_batch b WHERE b.consumer = p_consumer;
    extended := 0; lost := 0;
    FOR v_from IN 1..coalesce(cardinality(v_ids), 0) BY 50000 LOOP
        SELECT count(*) FILTER (WHERE h.status = 'ok') AS ok,
               count(*) FILTER (WHERE h.status IN ('stale', 'not_found')) AS gone
        INTO v_counts
        FROM message_heartbeat_many(v_ids[v_from:v_from + 49999],
            v_attempts[v_from:v_from + 49999], p_lock_ms) h;
        extended := extended + v_counts.ok;
        lost := lost + v_counts.gone;
    END LOOP;
    RETURN NEXT;
END;
$$;


SELECT secure_functions();
