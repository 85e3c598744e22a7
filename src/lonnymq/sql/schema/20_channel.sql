-- 0010_lean_calls: less work per call on a worker's steady path (finish one message, take the
-- next), with the same results, locks and errors.
--
-- A profile of message_complete_and_dequeue with one id (pg_stat_user_functions, one client,
-- 5,000 calls over 100 channels) spent about a fifth of its time outside any statement that
-- touches a row: message_delete_many's batch machinery for a single id, and calls of small
-- helpers that PostgreSQL cannot inline because they pin search_path. So:
--
-- * channel_key() is a plain SQL expression, which the planner inlines into its callers. The
--   schema's hash is computed once, here, instead of on every call; the keys are unchanged.
-- * message_complete_and_dequeue() finishes a single held message directly (as
--   message_delete_many would, one id: the same checks, status and locks) and skips the finish
--   step when it holds none.
-- * channel_rotate() reads the channel's next waiting message itself rather than through
--   channel_rotate_next_at() (kept for compatibility).

-- channel_key(): as in 0002 (hashtextextended of the name, seeded with the schema's hash),
-- with the seed fixed at install time. Not SECURITY DEFINER and no SET clause: the planner
-- inlines it (it names pg_catalog explicitly, so no search_path can redirect it).
DO $$
BEGIN
    EXECUTE format(
        $f$
        CREATE OR REPLACE FUNCTION channel_key(p_channel TEXT) RETURNS BIGINT
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS 'SELECT pg_catalog.hashtextextended(p_channel, %s::BIGINT)'
        $f$,
        hashtext(current_schema())::BIGINT);
END;
$$;


-- channel_lock(): lock a channel's row for update, creating it when missing.
-- Locks: the channel row (FOR UPDATE), held until the transaction ends.
CREATE OR REPLACE FUNCTION channel_lock(p_channel TEXT) RETURNS channel
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
BEGIN
    -- Two rounds at most: a concurrent session may insert the row between our probe and our
    -- insert, or drain and delete it again before we lock it.
    FOR v_round IN 1..3 LOOP
        SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
        IF FOUND THEN
            RETURN v_channel;
        END IF;
        INSERT INTO channel (name) VALUES (p_channel) ON CONFLICT (name) DO NOTHING;
    END LOOP;
    RAISE EXCEPTION 'channel % kept disappearing while being locked', p_channel
        USING ERRCODE = '40001';
END;
$$;


-- channel_next_at(): when the channel's head may next leave, given the earliest time the
-- release interval allows; NULL when nothing waits. One probe of message_channel_head_ix.
CREATE OR REPLACE FUNCTION channel_next_at(p_channel TEXT, p_release_at BIGINT) RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    RETURN (SELECT greatest(m.dequeue_at, p_release_at)
        FROM message m
        WHERE m.channel = p_channel AND NOT m.is_locked
        ORDER BY m.dequeue_at, m.id
        LIMIT 1);
END;
$$;


-- channel_servable_at(): when a channel can next give a message, or NULL when it cannot
-- (nothing waiting, or saturated until a message finishes).
CREATE OR REPLACE FUNCTION channel_servable_at(
    p_next_at BIGINT, p_concurrency BIGINT, p_max_concurrency INTEGER
) RETURNS BIGINT
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT CASE WHEN p_max_concurrency IS NULL OR p_concurrency < p_max_concurrency
                    THEN p_next_at END);
END;
$$;


-- channel_announce(): publish an event when a change made a channel servable sooner than
-- before (the only case where a sleeping worker has a reason to wake).
CREATE OR REPLACE FUNCTION channel_announce(
    p_before BIGINT, p_after BIGINT, p_type TEXT, p_id BIGINT, p_channel TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_after IS NOT NULL AND (p_before IS NULL OR p_after < p_before) THEN
        PERFORM event_publish(p_type, p_id, p_channel, p_after);
    END IF;
END;
$$;


-- 0020_create_unlocked: a single create or defer no longer locks a channel row that is due,
-- and a create without a dedup key is a plain insert.
--
-- channel_wake (the single create's and the defer's way of making a policy-free channel due)
-- still used the upsert that 0019 took out of message_create_many: when the channel's row was
-- missing as the caller saw it and another session had made it since, INSERT ... ON CONFLICT
-- DO UPDATE locked that row before testing whether it was late, and a due row is what every
-- dequeue takes (SKIP LOCKED), so the creator could wait behind one dequeue after another. It
-- now does what message_create_many does since 0019: a missing row is made under the
-- channel's creation lock, after looking again; an existing row is locked and moved forward
-- only while it is later than the message and than the clock now plus 10 ms.
--
-- message_create inserted every message with ON CONFLICT (channel, dedup_key) DO NOTHING.
-- That is a speculative insertion even when the key is NULL (and the row is not in the
-- partial unique index): an extra HEAP_CONFIRM record in the WAL for each message, about 5 %
-- of what a message writes to the WAL in the steady single-message shapes of the bench
-- (create, take and finish). Without a key the insert is now a plain one.


-- channel_wake(): as in 0011, with the channel row written as said above.
CREATE OR REPLACE FUNCTION channel_wake(
    p_channel TEXT, p_at BIGINT, p_seen BOOLEAN, p_seen_next BIGINT, p_type TEXT, p_id BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_found BOOLEAN := p_seen;
    v_next BIGINT := p_seen_next;
    v_clock BIGINT;
BEGIN
    IF v_found AND v_next <= p_at THEN
        RETURN;
    END IF;
    IF NOT v_found THEN
        -- Missing as the caller saw it: made by one creator at a time, each looking again
        -- (as committed now) once it holds the channel's creation lock, so a row another
        -- session made meanwhile is not inserted over (see 0019).
        PERFORM pg_advisory_xact_lock(channel_key(p_channel) # 1);
        INSERT INTO channel AS c (name, next_dequeue_at)
        SELECT p_channel, p_at
        WHERE NOT EXISTS (SELECT FROM channel x WHERE x.name = p_channel)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            PERFORM channel_announce(NULL, p_at, p_type, p_id, p_channel);
            RETURN;
        END IF;
        SELECT c.next_dequeue_at INTO v_next FROM channel c WHERE c.name = p_channel;
        v_found := FOUND;
    END IF;
    -- The clock now (not as the transaction started), plus the 10 ms of 0011: a row due by
    -- then is left alone, even while a dequeue holds it (see 0019 for why that is safe).
    v_clock := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    IF v_found AND v_next <= greatest(p_at, v_clock) THEN
        RETURN;
    END IF;
    IF v_found THEN
        UPDATE channel c SET next_dequeue_at = p_at
        WHERE c.name = p_channel
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock));
    ELSE
        -- Still invisible to this transaction (a snapshot older than the row): as before 0020.
        INSERT INTO channel AS c (name, next_dequeue_at) VALUES (p_channel, p_at)
        ON CONFLICT (name) DO UPDATE SET next_dequeue_at = least(c.next_dequeue_at, p_at)
        WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at;
    END IF;
    IF FOUND THEN
        PERFORM channel_announce(v_next, p_at, p_type, p_id, p_channel);
    END IF;
END;
$$;


-- channel_rotate(): as in 0007.
CREATE OR REPLACE FUNCTION channel_rotate(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT;
BEGIN
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    INTO v_next_at
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1;
    IF v_next_at IS NULL OR v_next_at > p_now THEN
        IF pg_try_advisory_xact_lock(channel_key(p_channel)) THEN
            -- Creates that committed since the first read are visible to this statement.
            SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
            INTO v_next_at
            FROM message m
            WHERE m.channel = p_channel AND NOT m.is_locked
            ORDER BY m.dequeue_at, m.id
            LIMIT 1;
            IF v_next_at IS NULL THEN
                DELETE FROM channel c WHERE c.name = p_channel;
                RETURN;
            END IF;
        ELSE
            -- Someone is creating or finishing in this channel right now: look again shortly.
            v_next_at := least(v_next_at, p_now + 10);
        END IF;
    END IF;
    UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
        last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
    WHERE c.name = p_channel;
END;
$$;


-- 0007_rotate_recheck: channel_rotate reads the channel's next waiting message again once it
-- holds the channel's exclusive advisory lock.
--
-- 0002's channel_rotate read the next waiting message first and took the lock after. A create
-- of a policy-free channel that saw the row due already (and so did not write it) could commit
-- between the two: the lock was then free, and the rotate, going by its earlier read, deleted
-- the row (or pushed its time past the new message). The message was left with no row that
-- says the channel is due, and no dequeue found it until something else woke the channel
-- (tests/reliability/test_rotate_race.py replays that interleaving). Once the exclusive lock is
-- held no create or defer of the channel is in flight, and a new statement sees every one that
-- committed (READ COMMITTED; a dequeue run in a caller's REPEATABLE READ transaction keeps its
-- snapshot and keeps the old window), so the second read is the one to act on.

-- channel_rotate_next_at(): when a rotated channel is next worth a visit: its next waiting
-- message's dequeue_at (not before p_now when it was just served); NULL when nothing waits.
CREATE OR REPLACE FUNCTION channel_rotate_next_at(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS BIGINT
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1
$$;
