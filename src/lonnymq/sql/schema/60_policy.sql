-- Channel policies (max_concurrency, release_interval_ms, max_size) and per-channel stats.


-- channel_policy_lock(): open a channel for a policy change: check its name, take its
-- exclusive advisory lock (waiting for operations in flight on it), then lock its row, with
-- p_create creating it first (channel_lock). Returns the row, all NULL when there is none.
-- Locks: the channel's exclusive advisory lock, then its row, until the transaction ends.
-- Raises: LQ005; 40001 (p_create, as channel_lock).
CREATE OR REPLACE FUNCTION channel_policy_lock(p_channel TEXT, p_create BOOLEAN DEFAULT FALSE)
RETURNS channel
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
BEGIN
    PERFORM arg_check_channel(p_channel);
    PERFORM pg_advisory_xact_lock(channel_key(p_channel));
    IF p_create THEN
        RETURN channel_lock(p_channel);
    END IF;
    SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
    RETURN v_channel;
END;
$$;


-- channel_policy_set(): set a channel's policy; NULL means unlimited. It applies at once to
-- the live channel (a lower max_concurrency lets in-flight messages finish; a lower max_size
-- keeps the messages already there) and stays when the channel empties. A channel that had no
-- policy has its messages counted once. What channel_pause remembered is forgotten.
-- Locks: the channel's exclusive advisory lock (waiting for operations in flight on it), then
-- its row. Raises: LQ004 (negative or out-of-range values), LQ005.
CREATE OR REPLACE FUNCTION channel_policy_set(
    p_channel TEXT,
    p_max_concurrency INTEGER DEFAULT NULL,
    p_release_interval_ms BIGINT DEFAULT NULL,
    p_max_size BIGINT DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
    v_next_at BIGINT;
    v_concurrency BIGINT;
BEGIN
    PERFORM arg_check(p_max_concurrency IS NULL OR p_max_concurrency >= 0,
        format('max_concurrency must be >= 0 (0 pauses the channel), got %s',
            p_max_concurrency), 'LQ004');
    PERFORM arg_check(p_release_interval_ms IS NULL
        OR p_release_interval_ms BETWEEN 0 AND 31536000000,
        format('release_interval_ms must be between 0 and 31536000000 (1 year), got %s',
            p_release_interval_ms), 'LQ004');
    PERFORM arg_check(p_max_size IS NULL OR p_max_size >= 0,
        format('max_size must be >= 0, got %s', p_max_size), 'LQ004');

    v_channel := channel_policy_lock(p_channel, p_create => TRUE);
    DELETE FROM channel_pause p WHERE p.name = p_channel;
    v_next_at := channel_next_at(p_channel,
        v_channel.last_dequeue_at + coalesce(p_release_interval_ms, 0));
    UPDATE channel c SET
        has_policy = TRUE,
        current_size = CASE WHEN c.has_policy THEN c.current_size
            ELSE (SELECT count(*) FROM message m WHERE m.channel = p_channel) END,
        -- The in-flight counter is kept only under a limit: count it when one starts.
        current_concurrency = CASE
            WHEN p_max_concurrency IS NULL THEN 0
            WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
            ELSE (SELECT count(*) FROM message m WHERE m.channel = p_channel AND m.is_locked)
            END,
        max_concurrency = p_max_concurrency,
        release_interval_ms = p_release_interval_ms,
        max_size = p_max_size,
        next_dequeue_at = v_next_at
    WHERE c.name = p_channel
    RETURNING c.current_concurrency INTO v_concurrency;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        channel_servable_at(v_next_at, v_concurrency, p_max_concurrency),
        'ready', NULL, p_channel);
END;
$$;


-- channel_policy_clear(): remove a channel's policy (unlimited from now on), and what
-- channel_pause remembered.
-- Locks: the channel's exclusive advisory lock, then its row. Raises: LQ005.
CREATE OR REPLACE FUNCTION channel_policy_clear(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
    v_next_at BIGINT;
BEGIN
    v_channel := channel_policy_lock(p_channel);
    DELETE FROM channel_pause p WHERE p.name = p_channel;
    IF v_channel.name IS NULL OR NOT v_channel.has_policy THEN
        RETURN;
    END IF;
    v_next_at := channel_next_at(p_channel, v_channel.last_dequeue_at);
    IF v_next_at IS NULL THEN
        DELETE FROM channel c WHERE c.name = p_channel;
        RETURN;
    END IF;
    UPDATE channel c SET
        has_policy = FALSE, max_concurrency = NULL, release_interval_ms = NULL, max_size = NULL,
        current_size = 0, current_concurrency = 0, next_dequeue_at = v_next_at
    WHERE c.name = p_channel;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        v_next_at, 'ready', NULL, p_channel);
END;
$$;


-- channel_pause(): stop serving a channel (max_concurrency 0, its other limits kept),
-- remembering its concurrency limit for channel_resume. A paused channel is left as it is.
-- Locks: the channel's exclusive advisory lock, then its row (as channel_policy_set).
-- Raises: LQ005.
CREATE OR REPLACE FUNCTION channel_pause(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
BEGIN
    v_channel := channel_policy_lock(p_channel);
    IF v_channel.max_concurrency = 0 THEN
        RETURN;
    END IF;
    PERFORM channel_policy_set(p_channel, 0, v_channel.release_interval_ms, v_channel.max_size);
    INSERT INTO channel_pause (name, max_concurrency, paused_at)
    VALUES (p_channel, v_channel.max_concurrency, epoch());
END;
$$;


-- channel_resume(): serve a paused channel again, with the concurrency limit channel_pause
-- remembered (none when it was paused otherwise), its other limits kept; a channel left with
-- no limit at all loses its policy. A channel that is not paused is left as it is.
-- Locks: the channel's exclusive advisory lock, then its row (as channel_policy_set).
-- Raises: LQ005.
CREATE OR REPLACE FUNCTION channel_resume(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
    v_limit INTEGER;
BEGIN
    v_channel := channel_policy_lock(p_channel);
    IF v_channel.max_concurrency IS DISTINCT FROM 0 THEN
        RETURN;
    END IF;
    SELECT p.max_concurrency INTO v_limit FROM channel_pause p WHERE p.name = p_channel;
    IF v_limit IS NULL AND v_channel.release_interval_ms IS NULL
            AND v_channel.max_size IS NULL THEN
        PERFORM channel_policy_clear(p_channel);
    ELSE
        PERFORM channel_policy_set(p_channel, v_limit, v_channel.release_interval_ms,
            v_channel.max_size);
    END IF;
END;
$$;


-- channel_stats(): every channel that holds messages or has a policy. Channels with a policy
-- report their counters; the others are counted from the message table (a scan: this is an
-- operator's view, not a hot path).
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_stats()
RETURNS TABLE (
    channel TEXT, size BIGINT, in_flight BIGINT, next_dequeue_at BIGINT,
    max_concurrency INTEGER, release_interval_ms BIGINT, max_size BIGINT
)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT coalesce(c.name, s.channel),
           CASE WHEN c.has_policy THEN c.current_size ELSE coalesce(s.total, 0) END,
           CASE WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
                ELSE coalesce(s.locked, 0) END,
           c.next_dequeue_at, c.max_concurrency, c.release_interval_ms, c.max_size
    FROM channel c
    FULL JOIN (
        SELECT m.channel, count(*) AS total, count(*) FILTER (WHERE m.is_locked) AS locked
        FROM message m GROUP BY m.channel
    ) s ON s.channel = c.name
    -- A drained policy-free channel's row may linger until a dequeue visits it: not listed.
    WHERE coalesce(c.has_policy, FALSE) OR s.channel IS NOT NULL
    ORDER BY 1
$$;
