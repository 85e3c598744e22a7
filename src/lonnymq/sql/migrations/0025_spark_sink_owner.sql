-- 0025_spark_sink_owner: a streaming write's sinkId belongs to one query.
--
-- A streaming write records (sink id, batch id) with the messages it enqueues, and skips a
-- batch found recorded: a replay after a restart from the same checkpoint. The sink id is the
-- query id unless the sinkId option names one. A query started from a new checkpoint is a new
-- query and numbers its batches from 0 again; with the same sinkId its batches were found
-- recorded by the old query and skipped, so their rows were never enqueued (and a lonnymq
-- source upstream deleted them as delivered). Found in review.
--
-- A sinkId is now claimed by the first query that commits through it (spark_sink); another
-- query's commit is refused with a message that says to use a new sinkId, and nothing of its
-- batch is skipped in silence. Spark keeps a query's id across restarts from its checkpoint,
-- so a restarted query finds its own claim.

CREATE TABLE spark_sink (
    sink_id TEXT PRIMARY KEY,
    query_id TEXT NOT NULL,
    claimed_at BIGINT NOT NULL
);

-- spark_sink_claim(): record that query p_query_id writes through p_sink_id, or refuse when
-- another query does.
CREATE FUNCTION spark_sink_claim(p_sink_id TEXT, p_query_id TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_owner TEXT;
BEGIN
    PERFORM arg_check(p_sink_id IS NOT NULL AND char_length(p_sink_id) BETWEEN 1 AND 255,
        'sink_id must be 1 to 255 characters');
    PERFORM arg_check(p_query_id IS NOT NULL AND char_length(p_query_id) BETWEEN 1 AND 255,
        'query_id must be 1 to 255 characters');
    INSERT INTO spark_sink (sink_id, query_id, claimed_at)
    VALUES (p_sink_id, p_query_id, epoch())
    ON CONFLICT (sink_id) DO NOTHING;
    SELECT s.query_id INTO v_owner FROM spark_sink s WHERE s.sink_id = p_sink_id;
    PERFORM arg_check(v_owner = p_query_id, format(
        'sinkId %s is written by another streaming query (%s; this one is %s): a query from '
        'a new checkpoint numbers its batches from 0 again and would skip those the other '
        'recorded. Give it a new sinkId, or leave sinkId unset (the query id)',
        p_sink_id, v_owner, p_query_id));
END;
$$;

-- The producer's functions gain spark_sink_claim (the rest of the list is 0012's).
CREATE OR REPLACE FUNCTION role_kind_functions(p_kind TEXT) RETURNS TEXT[]
LANGUAGE sql IMMUTABLE
SET search_path FROM CURRENT
AS $$
    SELECT CASE WHEN p_kind IN ('producer', 'worker', 'admin') THEN
        -- producer: see that the schema is installed, create (one, many, or through a Spark
        -- write), read the clock and settings, follow a message to its outcome (Queue.wait).
        ARRAY['schema_version', 'epoch', 'config_get', 'message_create', 'message_create_many',
              'message_status', 'spark_stage_record', 'spark_stage_clear', 'spark_write_commit',
              'spark_write_result', 'spark_sink_prune', 'spark_sink_claim']
        || CASE WHEN p_kind IN ('worker', 'admin') THEN
            -- worker: take messages and finish, defer or extend them; channel_stats for
            -- Worker(until_idle) and its metrics; a Spark streaming read consumes too (and
            -- reads the largest message id, its horizon, with spark_scan_bounds).
            ARRAY['message_dequeue', 'message_dequeue_many', 'message_complete_and_dequeue',
                  'message_heartbeat', 'message_heartbeat_many', 'message_delete',
                  'message_delete_many', 'message_defer', 'message_defer_many', 'channel_stats',
                  'spark_consumer_lock', 'spark_batch_plan', 'spark_batch_ack',
                  'spark_batch_release', 'spark_batch_heartbeat', 'spark_batch_read',
                  'spark_scan_bounds']
        ELSE ARRAY[]::TEXT[] END
        || CASE WHEN p_kind = 'admin' THEN
            -- admin: policies, settings, schedules, the archive, checks, raw scans, the clock.
            ARRAY['channel_policy_set', 'channel_policy_clear', 'config_set', 'clock_offset_set',
                  'queue_verify', 'schedule_set', 'schedule_list', 'schedule_remove',
                  'archive_list', 'archive_replay', 'spark_stage_purge', 'spark_message_scan',
                  'spark_archive_scan']
        ELSE ARRAY[]::TEXT[] END
    END
$$;

SELECT secure_functions();
