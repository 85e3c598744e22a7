-- Schedules: periodic messages. A schedule is a driver message in the channel
-- lonnymq.schedules, deduplicated by the schedule's name, whose content is its spec (the Python
-- package encodes it; the database never parses one). A worker that dequeues a driver creates
-- the task message and defers the driver to the next firing in one transaction, so the lock
-- fence of message_defer() keeps a stale holder from firing twice. The functions below only
-- create, update, list and remove drivers.
--
-- Declarations and removals are rare and short, and take their locks in one order: the
-- schedules channel's shared advisory lock (as every create in that channel does, so a
-- transaction that set the channel's policy is waited for first), then one exclusive
-- transaction lock for the schema's schedules, then the rows. Without that order, a
-- declaration that creates its driver (channel row, then the name's key) and one that updates
-- an existing driver (driver row, then channel row) could wait for each other.


-- schedule_check_name(): a schedule name is 1 to 200 characters (it is the driver's dedup
-- key, and task dedup keys add the fire time to it).
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION schedule_check_name(p_name TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_name IS NOT NULL AND char_length(p_name) BETWEEN 1 AND 200,
        format('schedule name must be 1 to 200 characters, got %s',
            coalesce(char_length(p_name)::TEXT || ' characters', 'NULL')));
END;
$$;


-- schedule_set(): declare schedule p_name with spec p_spec, next due at p_next_at: create its
-- driver ('created'), or set an existing driver's spec and next time ('updated'); a driver
-- that a worker holds is given back at the new time (the holder's firing then rolls back as
-- stale). Returns the status and the driver's id. A policy with a max_size on
-- the schedules channel that refuses a new driver is reported, not retried: no retry could
-- change it.
-- Locks: the order at the top of this file, then the driver's row and the channel's.
-- Raises: LQ003 (bad name, spec or time), LQ004 (the schedules channel is full), 40001 (the
-- driver kept changing while being set: retry).
CREATE OR REPLACE FUNCTION schedule_set(p_name TEXT, p_spec BYTEA, p_next_at BIGINT)
RETURNS TABLE (status TEXT, id BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_message message;
    v_channel channel;
    v_status TEXT;
    v_id BIGINT;
    v_after BIGINT;
    v_seen BOOLEAN;
BEGIN
    PERFORM schedule_check_name(p_name);
    PERFORM arg_check(p_next_at IS NOT NULL, 'next_at must not be NULL');
    PERFORM arg_check_time('next_at', p_next_at);
    PERFORM arg_check(p_spec IS NOT NULL, 'spec must not be NULL');
    PERFORM arg_check_payload('spec', p_spec);
    -- One declaration at a time (see the top), before any row is locked; the channel's own
    -- (shared) lock first, as every create in it takes it.
    PERFORM pg_advisory_xact_lock_shared(channel_key('lonnymq.schedules'));
    PERFORM pg_advisory_xact_lock(channel_key('lonnymq.schedules') # 2);
    -- Two rounds at most: a concurrent schedule_set may create the driver between our probe
    -- and our create (which then reports it deduplicated, holding the channel row).
    FOR v_round IN 1..2 LOOP
        SELECT * INTO v_message FROM message m
        WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key = p_name
        FOR UPDATE;
        IF NOT FOUND THEN
            SELECT c.status, c.id INTO v_status, v_id FROM message_create(
                p_content => p_spec, p_channel => 'lonnymq.schedules',
                p_dequeue_at => p_next_at, p_dedup_key => p_name) c;
            IF v_status = 'created' THEN
                status := 'created'; id := v_id;
                RETURN NEXT;
                RETURN;
            END IF;
            IF v_status = 'dropped' THEN
                -- Refused by the schedules channel's max_size: not a race, so not a
                -- transaction to run again.
                RAISE EXCEPTION 'schedule % cannot be set: channel lonnymq.schedules is full (its policy''s max_size); raise or clear that policy', p_name
                    USING ERRCODE = 'LQ004';
            END IF;
            CONTINUE;
        END IF;
        UPDATE message m SET content = p_spec WHERE m.id = v_message.id;
        IF v_message.is_locked THEN
            -- Held (a worker is firing it): given back at the new spec's time. The holder's
            -- defer then finds it no longer held, and its firing rolls back (stale). A firing
            -- that got to its defer first holds the row: this waited for it to commit, and
            -- found the driver unlocked.
            PERFORM message_requeue(v_message.id, v_message.num_attempts, p_next_at, NULL);
            status := 'updated'; id := v_message.id;
            RETURN NEXT;
            RETURN;
        END IF;
        IF v_message.dequeue_at <> p_next_at THEN
            UPDATE message m SET dequeue_at = p_next_at WHERE m.id = v_message.id;
            -- As message_requeue: a policy-free channel's row is only brought forward.
            PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
            SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
            v_seen := FOUND;
            IF NOT v_seen OR NOT v_channel.has_policy THEN
                PERFORM channel_wake(v_message.channel, p_next_at, v_seen, v_channel,
                    'deferred', v_message.id);
                status := 'updated'; id := v_message.id;
                RETURN NEXT;
                RETURN;
            END IF;
            SELECT * INTO STRICT v_channel FROM channel c
            WHERE c.name = v_message.channel FOR UPDATE;
            -- (The driver may now sort before where the row says the channel's waiting
            -- messages begin, where channel_next_at starts: hence the least.)
            v_after := least(
                channel_next_at(v_channel.name,
                    v_channel.last_dequeue_at + coalesce(v_channel.release_interval_ms, 0)),
                greatest(p_next_at,
                    v_channel.last_dequeue_at + coalesce(v_channel.release_interval_ms, 0)));
            UPDATE channel c SET next_dequeue_at = v_after,
                (head_at, head_id) = (
                    SELECT k.at, k.id
                    FROM (VALUES (c.head_at, c.head_id), (p_next_at, v_message.id)) k(at, id)
                    ORDER BY k.at, k.id LIMIT 1)
            WHERE c.name = v_channel.name;
            PERFORM channel_announce(
                channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
                    v_channel.max_concurrency),
                channel_servable_at(v_after, v_channel.current_concurrency,
                    v_channel.max_concurrency),
                'deferred', v_message.id, v_channel.name);
        END IF;
        status := 'updated'; id := v_message.id;
        RETURN NEXT;
        RETURN;
    END LOOP;
    RAISE EXCEPTION 'schedule % kept changing while being set', p_name USING ERRCODE = '40001';
END;
$$;


-- schedule_list(): every schedule's driver: name, spec, next due time, the saved state (the
-- last fire time, as the worker writes it) and whether a worker holds it now.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION schedule_list()
RETURNS TABLE (name TEXT, spec BYTEA, next_at BIGINT, state BYTEA, is_locked BOOLEAN)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT m.dedup_key, m.content, m.dequeue_at, m.state, m.is_locked
    FROM message m
    WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key IS NOT NULL
    ORDER BY m.dedup_key
$$;


-- schedule_remove(): remove schedule p_name (its driver); whether there was one. A driver that
-- a worker holds is removed too: the worker's defer then finds it gone and its firing rolls
-- back.
-- Locks: the order at the top of this file, then the driver's row and the channel's.
-- Raises: LQ003 (bad name).
CREATE OR REPLACE FUNCTION schedule_remove(p_name TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    PERFORM schedule_check_name(p_name);
    -- As schedule_set (see the top).
    PERFORM pg_advisory_xact_lock_shared(channel_key('lonnymq.schedules'));
    PERFORM pg_advisory_xact_lock(channel_key('lonnymq.schedules') # 2);
    DELETE FROM message m
    WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key = p_name
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        RETURN FALSE;
    END IF;
    -- As message_finish_try: only a channel with a policy keeps counters.
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    IF NOT coalesce(
            (SELECT c.has_policy FROM channel c WHERE c.name = v_message.channel), FALSE) THEN
        RETURN TRUE;
    END IF;
    SELECT * INTO STRICT v_channel FROM channel c WHERE c.name = v_message.channel FOR UPDATE;
    UPDATE channel c SET
        current_size = c.current_size - 1,
        current_concurrency = CASE
            WHEN c.max_concurrency IS NULL THEN 0
            WHEN v_message.is_locked THEN c.current_concurrency - 1
            ELSE c.current_concurrency END,
        next_dequeue_at = channel_next_at(c.name,
            c.last_dequeue_at + coalesce(c.release_interval_ms, 0))
    WHERE c.name = v_channel.name;
    RETURN TRUE;
END;
$$;
