-- Channels: their advisory locks, rows and turns.
--
-- A channel with a policy (has_policy) has its row locked by every operation, and its counters
-- (current_size, current_concurrency) are exact. A channel without one keeps no counters: its
-- row only says when the channel is next worth a visit (next_dequeue_at) and whose turn it is,
-- and exists while it may hold waiting messages. Create and defer write the row only when they
-- make the channel due sooner than it says; finish does not touch it; the dequeue that holds
-- the row (FOR UPDATE SKIP LOCKED) moves the channel to the back, and concurrent dequeues that
-- find the row held take the channel's next heads anyway ("ride along"), so one hot channel
-- serves many consumers at once.
--
-- Safety rule: next_dequeue_at may be too early (a visit finds nothing and fixes it), never too
-- late while a waiting message is due. A create that sees the row due early enough and skips
-- writing it relies on nobody pushing next_dequeue_at past its message before it commits. So
-- every operation on a channel's messages holds a shared advisory lock on the channel
-- (channel_key) until it commits; pushing a channel's time into the future or deleting its row
-- needs that lock in exclusive mode, which a dequeue only tries (it never waits); when the try
-- fails, the dequeue pushes the time at most 10 ms ahead (a message created meanwhile is then
-- served at most that much later, never lost). Setting a policy waits for the exclusive lock,
-- so in-flight operations finish before it counts the channel's messages.


-- channel_key(): the advisory lock key of a channel of this schema: hashtextextended of the
-- name, seeded with the schema's hash (computed once, when the function is created). Not
-- SECURITY DEFINER and no SET clause, so that the planner inlines it into its callers; it names
-- pg_catalog explicitly, so no search_path can redirect it.
-- Locks: none. Raises: nothing of ours.
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
-- Raises: 40001 when the row keeps disappearing (the caller may retry).
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
-- Locks: none. Raises: nothing of ours.
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
-- Locks: none. Raises: nothing of ours.
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
-- Locks: none. Raises: nothing of ours.
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


-- channel_wake(): make a policy-free channel due no later than p_at (a single create's and a
-- defer's way), announcing it when that is sooner. The row is written only while it is later
-- than the message and than the clock now plus 10 ms: a due row is what every dequeue takes
-- (SKIP LOCKED), and locking one would make the creator wait behind one dequeue after another.
-- A missing row is made under the channel's creation lock (an advisory lock), after
-- looking again, so a row another session made meanwhile is never inserted over (an upsert
-- would lock it before testing it).
-- Locks: the channel's row when it is moved forward; the creation lock when the row is made.
-- Raises: nothing of ours.
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
        -- session made meanwhile is not inserted over.
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
    -- The clock now (not as the transaction started), plus 10 ms: a row due by then is left
    -- alone, even while a dequeue holds it (the safety rule at the top of this file).
    v_clock := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    IF v_found AND v_next <= greatest(p_at, v_clock) THEN
        RETURN;
    END IF;
    IF v_found THEN
        UPDATE channel c SET next_dequeue_at = p_at
        WHERE c.name = p_channel
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock));
    ELSE
        -- Still invisible to this transaction (a snapshot older than the row): an upsert.
        INSERT INTO channel AS c (name, next_dequeue_at) VALUES (p_channel, p_at)
        ON CONFLICT (name) DO UPDATE SET next_dequeue_at = least(c.next_dequeue_at, p_at)
        WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at;
    END IF;
    IF FOUND THEN
        PERFORM channel_announce(v_next, p_at, p_type, p_id, p_channel);
    END IF;
END;
$$;


-- channel_rotate(): send a channel to the back after a dequeue: its next time becomes its next
-- waiting message's dequeue_at (not before p_now when it was just served), and its row goes
-- when nothing waits. Pushing the time later or deleting the row needs the channel's exclusive
-- advisory lock, which it only tries; holding it, it reads the next message again (a create that
-- committed between the first read and the lock would otherwise be left with no row that says
-- its channel is due: tests/reliability/test_rotate_race.py replays that). Without the lock the
-- time moves at most 10 ms ahead.
-- Locks: the channel row (held by the caller); tries the exclusive advisory lock.
-- Raises: nothing of ours.
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


-- channel_rotate_next_at(): when a rotated channel is next worth a visit: its next waiting
-- message's dequeue_at (not before p_now when it was just served); NULL when nothing waits.
-- Locks: none. Raises: nothing of ours.
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
