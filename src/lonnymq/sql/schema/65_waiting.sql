-- An operator's actions on one waiting message (the dashboard's): discard it, or make it due
-- now. Neither touches a locked message: its holder finishes, defers or loses it, and an
-- operator who changed it under the holder would break the fence on its attempt (LQ007).
-- Messages of lonnymq.schedules are schedules' drivers, changed through the schedule functions
-- only (LQ005).
--
-- Locks, in the order message_requeue_try takes them: the message row, the channel's shared
-- advisory lock (as every operation on a channel's messages), then the channel row; the
-- message is changed last, so a create waiting for the channel row meets no uncommitted change
-- of a dedup key. A channel's time pushed later or its row deleted needs the channel's
-- exclusive advisory lock, which is only tried (as channel_rotate does): without it the row
-- stays too early, which the next visit corrects. Bringing it sooner needs no more.


-- message_waiting_lock(): lock waiting message p_id (of channel p_channel, when given) and
-- return it; raise why when there is none such.
-- Locks: the message row. Raises: LQ001 (no such message, or not in p_channel), LQ003 (NULL
-- id), LQ005 (a bad channel name, or a schedule's driver), LQ007 (locked).
CREATE OR REPLACE FUNCTION message_waiting_lock(p_id BIGINT, p_channel TEXT) RETURNS message
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_message message;
BEGIN
    PERFORM arg_check(p_id IS NOT NULL, 'message id must not be NULL');
    IF p_channel IS NOT NULL THEN
        PERFORM arg_check_channel(p_channel);
    END IF;
    SELECT * INTO v_message FROM message m
    WHERE m.id = p_id AND NOT m.is_locked AND m.channel <> 'lonnymq.schedules'
      AND (p_channel IS NULL OR m.channel = p_channel)
    FOR UPDATE;
    IF FOUND THEN
        RETURN v_message;
    END IF;
    SELECT * INTO v_message FROM message m WHERE m.id = p_id;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, NULL);  -- LQ001
    END IF;
    IF v_message.channel <> p_channel THEN
        RAISE EXCEPTION 'message % is not in channel %', p_id, quote_literal(p_channel)
            USING ERRCODE = 'LQ001';
    END IF;
    IF v_message.channel = 'lonnymq.schedules' THEN
        RAISE EXCEPTION 'message % drives a schedule: change it with schedule() or '
            'unschedule()', p_id
            USING ERRCODE = 'LQ005';
    END IF;
    RAISE EXCEPTION 'message % is locked: a worker holds it (attempt %) until it finishes it, '
        'gives it back or its lock expires', p_id, v_message.num_attempts
        USING ERRCODE = 'LQ007';
END;
$$;


-- message_discard(): delete waiting message p_id (of channel p_channel, when given), archived
-- with outcome 'discarded' when the archive is on; a channel with a policy counts it out. The
-- channel's next time is set from its new head, and a policy-free channel's row goes once
-- nothing waits in it. Returns the message's channel.
-- Locks: the order at the top of this file. Raises: LQ001, LQ003 (NULL id), LQ005, LQ007.
CREATE OR REPLACE FUNCTION message_discard(p_id BIGINT, p_channel TEXT DEFAULT NULL)
RETURNS TEXT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    v_message := message_waiting_lock(p_id, p_channel);
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel FOR UPDATE;
    DELETE FROM message m WHERE m.id = p_id;
    IF (SELECT c.archive FROM config c) THEN
        INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                             error, created_at, dequeue_at, locked_at, finished_at)
        VALUES (v_message.id, v_message.channel, v_message.content, v_message.state,
                v_message.dedup_key, v_message.num_attempts, 'discarded', NULL,
                v_message.created_at, v_message.dequeue_at, v_message.locked_at,
                greatest(epoch(), v_message.locked_at))
        ON CONFLICT (id) DO NOTHING;
    END IF;
    IF v_channel.name IS NULL THEN
        RETURN v_message.channel;
    END IF;
    IF v_channel.has_policy THEN
        UPDATE channel c SET current_size = c.current_size - 1 WHERE c.name = v_channel.name;
    END IF;
    PERFORM message_waiting_settle(v_channel);
    RETURN v_message.channel;
END;
$$;


-- message_waiting_settle(): after a waiting message of channel p_channel left, set the
-- channel's next time from its head (no sooner than its release interval allows), or, for a
-- policy-free channel in which nothing waits, delete its row; only under the channel's
-- exclusive advisory lock, which it tries (without it the row stays as it was: too early at
-- worst, which the next visit corrects).
-- Locks: the channel row (held by the caller); tries the exclusive advisory lock.
-- Raises: nothing of ours.
CREATE OR REPLACE FUNCTION message_waiting_settle(p_channel channel) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(channel_key(p_channel.name)) THEN
        RETURN;
    END IF;
    v_next_at := channel_next_at(p_channel.name, CASE WHEN p_channel.has_policy THEN
        p_channel.last_dequeue_at + coalesce(p_channel.release_interval_ms, 0) END);
    IF v_next_at IS NULL AND NOT p_channel.has_policy THEN
        DELETE FROM channel c WHERE c.name = p_channel.name;
        RETURN;
    END IF;
    UPDATE channel c SET next_dequeue_at = v_next_at WHERE c.name = p_channel.name;
END;
$$;


-- message_expedite(): make waiting message p_id (of channel p_channel, when given) due now
-- (it then leaves after the messages already due in its channel); one already due is left as
-- it is. Returns the message's channel and whether it moved.
-- Locks: the order at the top of this file. Raises: LQ001, LQ003 (NULL id), LQ005, LQ007.
CREATE OR REPLACE FUNCTION message_expedite(p_id BIGINT, p_channel TEXT DEFAULT NULL)
RETURNS TABLE (channel TEXT, moved BOOLEAN)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch();
    v_message message;
    v_channel channel;
BEGIN
    v_message := message_waiting_lock(p_id, p_channel);
    IF v_message.dequeue_at <= v_now THEN
        RETURN QUERY SELECT v_message.channel, FALSE;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        UPDATE message m SET dequeue_at = v_now WHERE m.id = p_id;
        -- As a defer to now does: the row is brought forward only when it says later.
        PERFORM channel_wake(v_message.channel, v_now, FOUND, v_channel, 'ready', p_id);
    ELSE
        -- As message_requeue_try does: sooner only, no sooner than the interval allows.
        SELECT * INTO STRICT v_channel FROM channel c WHERE c.name = v_message.channel
        FOR UPDATE;
        UPDATE message m SET dequeue_at = v_now WHERE m.id = p_id;
        PERFORM channel_wait_locked(v_channel, v_now, p_id, 'ready', 0, 0);
    END IF;
    RETURN QUERY SELECT v_message.channel, TRUE;
END;
$$;
