-- 0030_spark_name_kinds: a batch write's writeId and a streaming write's sinkId can no longer
-- be the same name.
--
-- Both record their commits in spark_commit under (name, batch id): a batch write as batch 0
-- of its writeId, a streaming write as its micro-batch ids under its sinkId. A batch write
-- with writeId X made a later stream with sinkId X find its batch 0 recorded: the batch was
-- skipped, nothing enqueued, no error (and a lonnymq source upstream deleted its messages as
-- delivered). The other way round, a batch write named like a stream's sink found batch 0
-- recorded and was dropped in silence. Found in review.
--
-- spark_sink now says what kind of writer owns a name. A batch write that names its writeId
-- claims it as a 'write' (spark_write_claim, in its commit's transaction, before anything is
-- enqueued); a streaming query's claim (spark_sink_claim) is refused on a name owned by batch
-- writes, and a batch write's on a name of a stream, with a message that says to choose
-- another name. A batch write may claim its own name again: a rerun with the same writeId is
-- recognised as committed, as before.
--
-- Upgrade: names recorded before this migration have no claim. A name whose only commit record
-- is batch 0 was a batch write's, or a stream's that has written one batch: it is claimed as a
-- 'write' here, so that writeId is still never enqueued again and a stream cannot take it. (A
-- UUID-shaped name too: a writeId is often one. A stream whose sink id is its query id, the
-- default, claims nothing, so it goes on as before.) A batch write's claim of an unclaimed name that has commit records is a
-- stream's (any other was claimed here): refused.


ALTER TABLE spark_sink ADD COLUMN kind TEXT NOT NULL DEFAULT 'stream'
    CHECK (kind IN ('stream', 'write'));
-- A batch write has no query.
ALTER TABLE spark_sink ALTER COLUMN query_id DROP NOT NULL;

INSERT INTO spark_sink (sink_id, query_id, claimed_at, kind)
SELECT c.sink_id, NULL, epoch(), 'write'
FROM spark_commit c
GROUP BY c.sink_id
HAVING bool_and(c.batch_id = 0)
ON CONFLICT (sink_id) DO NOTHING;


-- spark_sink_claim(): as in 0025 (record that query p_query_id writes through p_sink_id, or
-- refuse when another query does), and refuse a name owned by batch writes. Raises: LQ003.
CREATE OR REPLACE FUNCTION spark_sink_claim(p_sink_id TEXT, p_query_id TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_owner spark_sink;
BEGIN
    PERFORM arg_check(p_sink_id IS NOT NULL AND char_length(p_sink_id) BETWEEN 1 AND 255,
        'sink_id must be 1 to 255 characters');
    PERFORM arg_check(p_query_id IS NOT NULL AND char_length(p_query_id) BETWEEN 1 AND 255,
        'query_id must be 1 to 255 characters');
    INSERT INTO spark_sink (sink_id, query_id, claimed_at, kind)
    VALUES (p_sink_id, p_query_id, epoch(), 'stream')
    ON CONFLICT (sink_id) DO NOTHING;
    SELECT s.* INTO v_owner FROM spark_sink s WHERE s.sink_id = p_sink_id;
    PERFORM arg_check(v_owner.kind = 'stream', format(
        'sinkId %s is the writeId of a batch write (df.write): its commit record would make '
        'this streaming query skip its batch 0 and enqueue nothing. Give the stream another '
        'sinkId', p_sink_id));
    PERFORM arg_check(v_owner.query_id = p_query_id, format(
        'sinkId %s is written by another streaming query (%s; this one is %s): a query from '
        'a new checkpoint numbers its batches from 0 again and would skip those the other '
        'recorded. Give it a new sinkId, or leave sinkId unset (the query id)',
        p_sink_id, v_owner.query_id, p_query_id));
END;
$$;


-- spark_write_claim(): record that batch writes use p_write_id as their writeId, or refuse
-- when a streaming query's sink has that name. Idempotent for batch writes (a rerun with the
-- same writeId is then found committed and enqueues nothing). Raises: LQ003.
CREATE FUNCTION spark_write_claim(p_write_id TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_kind TEXT;
BEGIN
    PERFORM arg_check(p_write_id IS NOT NULL AND char_length(p_write_id) BETWEEN 1 AND 255,
        'write_id must be 1 to 255 characters');
    INSERT INTO spark_sink (sink_id, query_id, claimed_at, kind)
    VALUES (p_write_id, NULL, epoch(), 'write')
    ON CONFLICT (sink_id) DO NOTHING;
    IF FOUND THEN
        -- A new claim: commit records under this name are a stream's (recorded without a
        -- claim: a query id, or a sinkId from before 0025); a batch write's were claimed by
        -- this migration or by the write.
        PERFORM arg_check(NOT EXISTS (SELECT 1 FROM spark_commit c WHERE c.sink_id = p_write_id),
            format('writeId %s is the sinkId of a streaming write (df.writeStream), whose '
                   'commit records would drop this write in silence. Give the batch write '
                   'another writeId', p_write_id));
        RETURN;
    END IF;
    SELECT s.kind INTO v_kind FROM spark_sink s WHERE s.sink_id = p_write_id;
    PERFORM arg_check(v_kind = 'write', format(
        'writeId %s is the sinkId of a streaming write (df.writeStream), whose commit records '
        'would drop this write in silence. Give the batch write another writeId', p_write_id));
END;
$$;


-- The producer's functions gain spark_write_claim (the rest of the list is 0025's).
CREATE OR REPLACE FUNCTION role_kind_functions(p_kind TEXT) RETURNS TEXT[]
LANGUAGE sql IMMUTABLE
SET search_path FROM CURRENT
AS $$
    SELECT CASE WHEN p_kind IN ('producer', 'worker', 'admin') THEN
        -- producer: see that the schema is installed, create (one, many, or through a Spark
        -- write), read the clock and settings, follow a message to its outcome (Queue.wait).
        ARRAY['schema_version', 'epoch', 'config_get', 'message_create', 'message_create_many',
              'message_status', 'spark_stage_record', 'spark_stage_clear', 'spark_write_commit',
              'spark_write_result', 'spark_sink_prune', 'spark_sink_claim', 'spark_write_claim']
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
