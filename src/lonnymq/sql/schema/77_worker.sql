-- Workers' reports of themselves: who runs, where, how wide, and what it runs now. A worker
-- calls worker_report once a heartbeat round and worker_stopped when its run ends; the
-- dashboard reads the table (dashboard_workers). Nothing here is written per message.


-- arg_check_worker_id(): a worker id is 1 to 64 characters.
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION arg_check_worker_id(p_id TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(char_length(p_id) BETWEEN 1 AND 64, 'worker id must be 1 to 64 characters');
END;
$$;


-- worker_report(): upsert worker p_id's row: its host and pid, how often it reports
-- (p_every_ms), its concurrency, the handlers it runs now (p_running) and the ids and channels
-- of up to 100 of them, and what it took in the p_served_ms since its previous report: how many
-- messages from each of up to 100 channels (p_served_channels, p_served_counts) and from the
-- others together (p_served_other). A row already marked stopped is left as it is. Then delete
-- the rows of workers not seen for an hour (died, or stopped long ago).
-- Locks: the worker's row; the rows it deletes. Raises: LQ003 (an id of 1 to 64 characters,
-- a host of at most 255, a pid, concurrency, count, time and counts in range, arrays of the
-- same length, at most 100, without NULLs), LQ005 (a bad channel name).
CREATE OR REPLACE FUNCTION worker_report(
    p_id TEXT, p_host TEXT, p_pid INTEGER, p_every_ms BIGINT, p_concurrency INTEGER,
    p_running INTEGER, p_message_ids BIGINT[], p_channels TEXT[],
    p_served_ms BIGINT DEFAULT 0, p_served_channels TEXT[] DEFAULT '{}',
    p_served_counts BIGINT[] DEFAULT '{}', p_served_other BIGINT DEFAULT 0
) RETURNS VOID
LANGUAGE plpgsql
-- (The worker table holds an hour of workers: a small table, whatever the plan.)
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now BIGINT := epoch();
BEGIN
    PERFORM arg_check_worker_id(p_id);
    PERFORM arg_check(char_length(p_host) <= 255, 'host must be at most 255 characters');
    PERFORM arg_check(p_pid >= 0, format('pid must be 0 or more, got %s',
        coalesce(p_pid::TEXT, 'NULL')));
    PERFORM arg_check_range('every_ms', p_every_ms, 1, 86400000);
    PERFORM arg_check_range('concurrency', p_concurrency, 1, 1000000);
    PERFORM arg_check_range('running', p_running, 0, 1000000);
    PERFORM arg_check_range('served_ms', p_served_ms, 0, 86400000);
    PERFORM arg_check_range('served_other', p_served_other, 0, 9223372036854775807);
    PERFORM arg_check(
        coalesce(cardinality(p_message_ids), -1) BETWEEN 0 AND 100
            AND cardinality(p_channels) = cardinality(p_message_ids)
            AND array_position(p_message_ids, NULL) IS NULL,
        'message_ids and channels must be arrays of the same length, at most 100, no NULL');
    PERFORM arg_check(
        coalesce(cardinality(p_served_counts), -1) BETWEEN 0 AND 100
            AND cardinality(p_served_channels) = cardinality(p_served_counts)
            AND NOT EXISTS (SELECT FROM unnest(p_served_counts) AS n WHERE n IS NULL OR n < 1),
        'served_channels and served_counts must be arrays of the same length, at most 100, '
            || 'of counts of 1 or more');
    PERFORM arg_check_channel(c) FROM unnest(p_channels || p_served_channels) AS c;
    INSERT INTO worker AS w (id, host, pid, started_at, seen_at, every_ms, concurrency, running,
                             message_ids, channels, served_ms, served_channels, served_counts,
                             served_other)
    VALUES (p_id, p_host, p_pid, v_now, v_now, p_every_ms, p_concurrency, p_running,
            p_message_ids, p_channels, p_served_ms, p_served_channels, p_served_counts,
            p_served_other)
    ON CONFLICT (id) DO UPDATE SET
        host = excluded.host, pid = excluded.pid, seen_at = excluded.seen_at,
        every_ms = excluded.every_ms, concurrency = excluded.concurrency,
        running = excluded.running, message_ids = excluded.message_ids,
        channels = excluded.channels, served_ms = excluded.served_ms,
        served_channels = excluded.served_channels, served_counts = excluded.served_counts,
        served_other = excluded.served_other
    WHERE w.stopped_at IS NULL;
    DELETE FROM worker w WHERE w.seen_at < v_now - 3600000;
END;
$$;


-- worker_stopped(): mark worker p_id's row stopped (nothing running); a report that comes
-- later leaves it so.
-- Locks: the worker's row. Raises: LQ003 (a bad id).
CREATE OR REPLACE FUNCTION worker_stopped(p_id TEXT) RETURNS VOID
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT arg_check_worker_id(p_id);
    UPDATE worker w SET stopped_at = t.now, seen_at = t.now, running = 0,
        message_ids = '{}', channels = '{}', served_ms = 0, served_channels = '{}',
        served_counts = '{}', served_other = 0
    FROM (SELECT epoch() AS now) t
    WHERE w.id = p_id;
$$;
