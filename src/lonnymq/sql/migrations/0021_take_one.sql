-- 0021_take_one: a dequeue of one message takes a short path.
--
-- Every dequeue of one message (message_dequeue, message_dequeue_many with a limit of 1, and
-- message_complete_and_dequeue with a limit of 1, a worker's steady state) ran the general
-- loop of message_dequeue_many: a function that declares and initialises some twenty
-- variables on every call and returns through RETURN QUERY, with a call of channel_rotate to
-- send a channel to the back. Most single dequeues need three statements: recover an expired
-- lock (none, usually), lock the channel whose turn it is and take its head, or, when every due
-- channel's row is held by another dequeue, ride along on the first one's next head.
--
-- message_take_one() does just that and returns the message it locked, or NULL when the case
-- is any other: a channel with a policy, a policy being changed, no head it can take. The
-- general loop (now message_dequeue_loop, the former message_dequeue_many under a new name,
-- unchanged) then serves the call from the start, as before. A channel whose next head is due
-- goes to the back in the same statement that reads that head; one whose next head is later
-- or missing goes through channel_rotate, as before.
--
-- Same results, order, locks and errors, but for one race: when message_take_one hands a
-- channel with a policy over to the loop, it already holds that channel's row, and the loop
-- serves it unless, in the meantime, a lock expired (the loop recovers that message first) or
-- another channel became due ahead of it; then the row stays held, unserved, until the caller
-- commits (as rows passed by the loop's own probes do).
--
-- Measured side by side with 0020 (8 pgbench clients finishing one message and taking the next
-- from a backlog, PostgreSQL 15, medians of 3 runs): one hot channel 4,487 -> 5,569 calls/s,
-- 100 channels 5,663 -> 5,979; benchmarks/README.md has the rest.


-- The general loop keeps its body; message_dequeue_many becomes the entry point below.
ALTER FUNCTION message_dequeue_many(INTEGER, BIGINT) RENAME TO message_dequeue_loop;


-- message_take_one(): lock one message the usual way (see the top of this file), or return
-- NULL and change nothing a later message_dequeue_loop would not: the channel row it locked,
-- or a channel sent back by channel_rotate when none of its heads could be taken.
CREATE FUNCTION message_take_one(p_lock_ms BIGINT) RETURNS message
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    -- The clock as this call starts (see message_dequeue_loop).
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
    v_message message;
    v_channel channel;
    v_busy TEXT;
BEGIN
    -- 1. A message whose lock expired (its channel slot was never released).
    UPDATE message m SET
        unlock_at = v_now + p_lock_ms,
        locked_at = v_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT e.id FROM message e
        WHERE e.is_locked AND e.unlock_at <= v_now
        ORDER BY e.unlock_at, e.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    RETURNING m.* INTO v_message;
    IF FOUND THEN
        RETURN v_message;
    END IF;

    -- 2. The head of the channel whose turn it is, if it has no policy.
    SELECT * INTO v_channel FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at <= v_now
    ORDER BY c.next_dequeue_at, c.turn
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        -- The shared advisory lock, as every operation on the channel's messages takes it.
        IF v_channel.has_policy
           OR NOT pg_try_advisory_xact_lock_shared(channel_key(v_channel.name)) THEN
            RETURN NULL;
        END IF;
        UPDATE message m SET
            is_locked = TRUE,
            unlock_at = v_now + p_lock_ms,
            locked_at = v_now,
            num_attempts = m.num_attempts + 1
        WHERE m.id = (
            SELECT h.id FROM message h
            WHERE h.channel = v_channel.name AND NOT h.is_locked
              AND h.dequeue_at <= v_now
            ORDER BY h.dequeue_at, h.id
            LIMIT 1
            FOR UPDATE SKIP LOCKED)
        RETURNING m.* INTO v_message;
        IF NOT FOUND THEN
            -- Its heads are held by sessions riding along, or not due yet.
            PERFORM channel_rotate(v_channel.name, v_now, FALSE);
            RETURN NULL;
        END IF;
        -- To the back, when its next head is due (channel_rotate's first case); otherwise
        -- channel_rotate pushes it forward or deletes its row.
        UPDATE channel c SET
            next_dequeue_at = n.next_at,
            turn = nextval('channel_turn_seq'),
            last_dequeue_at = v_now
        FROM (
            SELECT greatest(x.dequeue_at, v_now) AS next_at FROM message x
            WHERE x.channel = v_channel.name AND NOT x.is_locked
            ORDER BY x.dequeue_at, x.id
            LIMIT 1) n
        WHERE c.name = v_channel.name AND n.next_at <= v_now;
        IF NOT FOUND THEN
            PERFORM channel_rotate(v_channel.name, v_now, TRUE);
        END IF;
        RETURN v_message;
    END IF;

    -- 3. Every due channel's row is held by another session: ride along on the first one's
    -- next head, unless it has a policy or its policy is being changed (read under the lock).
    SELECT c.name INTO v_busy FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at <= v_now
    ORDER BY c.next_dequeue_at, c.turn
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(channel_key(v_busy)) THEN
        RETURN NULL;
    END IF;
    -- A statement of its own, so that its snapshot is taken under the lock.
    IF coalesce((SELECT c.has_policy FROM channel c WHERE c.name = v_busy), FALSE) THEN
        RETURN NULL;
    END IF;
    UPDATE message m SET
        is_locked = TRUE,
        unlock_at = v_now + p_lock_ms,
        locked_at = v_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT h.id FROM message h
        WHERE h.channel = v_busy AND NOT h.is_locked
          AND h.dequeue_at <= v_now
        ORDER BY h.dequeue_at, h.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    RETURNING m.* INTO v_message;
    IF FOUND THEN
        RETURN v_message;
    END IF;
    RETURN NULL;
END;
$$;


-- message_dequeue_many(): as before (0016), through message_take_one when the limit is 1.
CREATE FUNCTION message_dequeue_many(p_limit INTEGER, p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
BEGIN
    -- Bad arguments go to the loop, which says what is wrong.
    IF p_limit = 1 AND p_lock_ms BETWEEN 1 AND 604800000 THEN
        v_message := message_take_one(p_lock_ms);
        IF v_message.id IS NOT NULL THEN
            id := v_message.id;
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
    RETURN QUERY SELECT * FROM message_dequeue_loop(p_limit, p_lock_ms);
END;
$$;


-- message_complete_and_dequeue(): as in 0016, taking through message_take_one when the
-- limit is 1. It calls message_take_one itself rather than through message_dequeue_many: one
-- function call and one RETURN QUERY fewer on a worker's steady path. Through
-- message_dequeue_many, benchmarks/take_one.py measured 0.92-0.99x the loop's rate on 100
-- channels (1.23-1.29x on one), against 1.10-1.20x (1.21x) when called directly.
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


SELECT secure_functions();
