-- 0003_worker: what the worker runtime, the CLI and `wait()` need beyond the message
-- functions: periodic schedules, a message's status, and inspecting and replaying the archive.
--
-- Schedules are ordinary messages of the reserved channel 'lonnymq.schedules' (one "driver"
-- per schedule, its dedup_key the schedule's name, its content the schedule's spec as the
-- Python package encodes it). A worker that dequeues a driver creates the task message and
-- defers the driver to the next firing in one transaction, so the lock fence of
-- message_defer() keeps a stale holder from firing twice. The functions below only create,
-- update, list and remove drivers; the database never parses a spec.

-- Replays point at the message they created, so that a replay is done at most once.
ALTER TABLE archive ADD COLUMN replayed_as BIGINT;

-- Finished messages that did not complete, newest first: what `archive` inspects. Failures
-- are rare, so this index stays small however large the archive grows.
CREATE INDEX archive_failed_ix ON archive (id) WHERE outcome <> 'completed';


-- schedule_check_name(): a schedule name is 1 to 200 characters (it is the driver's dedup
-- key, and task dedup keys add the fire time to it). Raises LQ003.
CREATE FUNCTION schedule_check_name(p_name TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_name IS NOT NULL AND char_length(p_name) BETWEEN 1 AND 200,
        format('schedule name must be 1 to 200 characters, got %s',
            coalesce(char_length(p_name)::TEXT || ' characters', 'NULL')));
END;
$$;


-- schedule_set(): create a schedule's driver due at p_next_at, or update the existing one:
-- its spec always, and its due time when no worker holds it (a held driver is being fired;
-- the firing defers it, and the worker reads the new spec at its next turn).
-- Returns 'created' or 'updated' and the driver's id.
-- Locks: the driver row, then the schedule channel's row (the order defer uses).
-- Raises: LQ003 (bad name or time), LQ006 (spec too large).
CREATE FUNCTION schedule_set(p_name TEXT, p_spec BYTEA, p_next_at BIGINT)
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
            CONTINUE;
        END IF;
        UPDATE message m SET content = p_spec WHERE m.id = v_message.id;
        IF NOT v_message.is_locked AND v_message.dequeue_at <> p_next_at THEN
            UPDATE message m SET dequeue_at = p_next_at WHERE m.id = v_message.id;
            -- As message_requeue (0002): a policy-free channel's row is only brought forward.
            PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
            SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
            v_seen := FOUND;
            IF NOT v_seen OR NOT v_channel.has_policy THEN
                PERFORM channel_wake(v_message.channel, p_next_at, v_seen,
                    v_channel.next_dequeue_at, 'deferred', v_message.id);
                status := 'updated'; id := v_message.id;
                RETURN NEXT;
                RETURN;
            END IF;
            SELECT * INTO STRICT v_channel FROM channel c
            WHERE c.name = v_message.channel FOR UPDATE;
            v_after := channel_next_at(v_channel.name,
                v_channel.last_dequeue_at + coalesce(v_channel.release_interval_ms, 0));
            UPDATE channel c SET next_dequeue_at = v_after WHERE c.name = v_channel.name;
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
CREATE FUNCTION schedule_list()
RETURNS TABLE (name TEXT, spec BYTEA, next_at BIGINT, state BYTEA, is_locked BOOLEAN)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT m.dedup_key, m.content, m.dequeue_at, m.state, m.is_locked
    FROM message m
    WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key IS NOT NULL
    ORDER BY m.dedup_key
$$;


-- schedule_remove(): delete a schedule's driver, held or not (a worker firing it then fails
-- its defer with LQ001 and its firing rolls back). Returns whether it existed.
-- Locks: the driver row, then the schedule channel's row. Raises: LQ003.
CREATE FUNCTION schedule_remove(p_name TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    PERFORM schedule_check_name(p_name);
    DELETE FROM message m
    WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key = p_name
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        RETURN FALSE;
    END IF;
    -- As message_finish_try (0002): only a channel with a policy keeps counters.
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


-- message_status(): where a message is: 'waiting' or 'locked' while it is live; 'finished'
-- once archived (with its outcome, error, attempts and finish time); 'unknown' when it is
-- neither (finished while the archive was off, or never created).
CREATE FUNCTION message_status(p_id BIGINT)
RETURNS TABLE (status TEXT, outcome TEXT, error TEXT, num_attempts INTEGER, finished_at BIGINT)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_locked BOOLEAN;
    v_attempts INTEGER;
BEGIN
    PERFORM arg_check(p_id IS NOT NULL, 'message id must not be NULL');
    SELECT m.is_locked, m.num_attempts INTO v_locked, v_attempts FROM message m
    WHERE m.id = p_id;
    IF FOUND THEN
        status := CASE WHEN v_locked THEN 'locked' ELSE 'waiting' END;
        outcome := NULL; error := NULL; num_attempts := v_attempts; finished_at := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'finished'::TEXT, a.outcome, a.error, a.num_attempts, a.finished_at
        FROM archive a WHERE a.id = p_id;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::TEXT, NULL::TEXT, NULL::TEXT, NULL::INTEGER, NULL::BIGINT;
    END IF;
END;
$$;


-- archive_list(): archived messages, newest first, optionally of one outcome and channel,
-- older than p_before_id (for paging). Outcome 'failed' and the like use archive_failed_ix.
-- Raises: LQ003 (limit outside 1..10000).
CREATE FUNCTION archive_list(
    p_outcome TEXT DEFAULT NULL, p_channel TEXT DEFAULT NULL,
    p_before_id BIGINT DEFAULT NULL, p_limit INTEGER DEFAULT 100
) RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER, outcome TEXT,
    error TEXT, created_at BIGINT, finished_at BIGINT, replayed_as BIGINT
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
        format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
    IF p_outcome IS NOT NULL AND p_outcome <> 'completed' THEN
        RETURN QUERY SELECT a.id, a.channel, a.content, a.state, a.num_attempts, a.outcome,
                a.error, a.created_at, a.finished_at, a.replayed_as
            FROM archive a
            WHERE a.outcome <> 'completed' AND a.outcome = p_outcome
              AND (p_channel IS NULL OR a.channel = p_channel)
              AND (p_before_id IS NULL OR a.id < p_before_id)
            ORDER BY a.id DESC LIMIT p_limit;
    ELSE
        RETURN QUERY SELECT a.id, a.channel, a.content, a.state, a.num_attempts, a.outcome,
                a.error, a.created_at, a.finished_at, a.replayed_as
            FROM archive a
            WHERE (p_outcome IS NULL OR a.outcome = p_outcome)
              AND (p_channel IS NULL OR a.channel = p_channel)
              AND (p_before_id IS NULL OR a.id < p_before_id)
            ORDER BY a.id DESC LIMIT p_limit;
    END IF;
END;
$$;


-- archive_replay(): create a new message from each archived one (same channel and content,
-- due now, fresh attempts) and remember it in replayed_as, so that replaying twice creates
-- nothing the second time. One row per input id, in input order: 'replayed' with the new id,
-- 'already' with the earlier replay's id, 'dropped' when the channel is at its max_size, or
-- 'not_found'.
-- Locks: the archive rows (in id order), then the channels (see message_create_many).
-- Raises: LQ003 (NULL or more than 100000 ids).
CREATE FUNCTION archive_replay(p_ids BIGINT[])
RETURNS TABLE (archive_id BIGINT, status TEXT, id BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_ids BIGINT[] := '{}';
    v_channels TEXT[] := '{}';
    v_contents BYTEA[] := '{}';
    v_row RECORD;
    v_result RECORD;
    v_created JSONB := '{}';
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    FOR v_row IN
        SELECT a.id, a.channel, a.content FROM archive a
        WHERE a.id = ANY (p_ids) AND a.replayed_as IS NULL
        ORDER BY a.id
        FOR UPDATE
    LOOP
        v_ids := v_ids || v_row.id;
        v_channels := v_channels || v_row.channel;
        v_contents := v_contents || v_row.content;
    END LOOP;
    IF cardinality(v_ids) > 0 THEN
        FOR v_result IN
            SELECT r.ord, r.status, r.id
            FROM message_create_many(
                p_channels => v_channels, p_contents => v_contents,
                p_dequeue_ats => array_fill(NULL::BIGINT, ARRAY[cardinality(v_ids)]),
                p_dedup_keys => array_fill(NULL::TEXT, ARRAY[cardinality(v_ids)]))
                WITH ORDINALITY AS r(status, id, channel_size, ord)
        LOOP
            v_created := v_created || jsonb_build_object(v_ids[v_result.ord]::TEXT,
                jsonb_build_array(v_result.status, v_result.id));
            IF v_result.status = 'created' THEN
                UPDATE archive a SET replayed_as = v_result.id
                WHERE a.id = v_ids[v_result.ord];
            END IF;
        END LOOP;
    END IF;
    RETURN QUERY
        SELECT i.aid,
               CASE WHEN v_created ? i.aid::TEXT THEN
                        CASE WHEN v_created -> i.aid::TEXT ->> 0 = 'created' THEN 'replayed'
                             ELSE 'dropped' END
                    WHEN a.id IS NULL THEN 'not_found'
                    ELSE 'already' END,
               CASE WHEN v_created ? i.aid::TEXT THEN (v_created -> i.aid::TEXT ->> 1)::BIGINT
                    ELSE a.replayed_as END
        FROM unnest(p_ids) WITH ORDINALITY AS i(aid, ord)
        LEFT JOIN archive a ON a.id = i.aid
        ORDER BY i.ord;
END;
$$;
