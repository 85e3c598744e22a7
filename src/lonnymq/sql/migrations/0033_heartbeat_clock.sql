-- 0033_heartbeat_clock: a heartbeat extends a lock from the time it runs.
--
-- message_heartbeat and message_heartbeat_many set unlock_at to epoch() + lock_ms, and
-- epoch() is the time the caller's transaction began. A heartbeat sent inside a longer
-- transaction (the README suggests heartbeating in your own transaction, last, just before
-- commit) therefore extended the lock by less than lock_ms, or not at all: in a review, a
-- heartbeat of 2 s at the end of a 3 s transaction left the lock already expired, and another
-- worker took the message at once. Both now count from the clock as the call runs, as a
-- dequeue does (0002).

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
    -- The clock as this call runs (see message_take_one), not as its transaction began.
    UPDATE message m SET unlock_at = epoch() + p_lock_ms
        + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
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
    -- The clock as this call runs (see message_take_one), not as its transaction began.
    v_unlock_at := epoch() + p_lock_ms
        + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;

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

SELECT secure_functions();
