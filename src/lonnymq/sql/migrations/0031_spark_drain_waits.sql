-- 0031_spark_drain_waits: a streaming read under Trigger.AvailableNow can tell, when a plan
-- finds nothing, whether messages up to its horizon are still waiting on a channel's policy,
-- and when the first of them may leave.
--
-- Such a query ended at the first plan that found nothing ready (spark_batch_plan stops when
-- a dequeue gives fewer than asked). Messages up to the horizon (the largest id when the query
-- started) that a channel's release_interval_ms or max_concurrency held back at that moment
-- were left for the next run, although they were there, and due, when the run started. A
-- review found it: 6 messages on a channel with a 1.5 s interval and 25 others, 10 per batch:
-- the query ended with 4 of the slow channel's messages left.
--
-- spark_batch_waiting(p_max_id, p_due_by) answers, for the data source to wait and plan again:
-- how many channels hold a message with id <= p_max_id, unlocked, and due by p_due_by (the
-- clock when the query started: a message scheduled later was not available then, and is not
-- waited for), in a channel that is not paused (max_concurrency 0); and the earliest time one
-- of them may leave: its channel's last dequeue plus its release interval, or its own
-- dequeue_at if later; now when the channel's max_concurrency slots are all taken (a holder
-- may finish at any time: the caller polls) or when nothing in its policy holds it (its row was
-- busy during the plan). Locked messages are not counted: they belong to their holders (if a
-- holder fails or defers one, it comes back with a new dequeue_at, after the start).
--
-- A channel counts only while its head (its first unlocked message in (dequeue_at, id) order,
-- which is what a dequeue takes) is one of those: a later message at the head, say created with
-- a priority since the run started, is what every plan would take and give back, so waiting
-- for the channel's policy would only burn the wait (and the channel's turns, which other
-- consumers need). A channel without a policy counts only while it is due now (its
-- next_dequeue_at is its head's due time, or the time of its last dequeue if later: a channel
-- due later has no head due by p_due_by), so a queue of many idle channels costs a scan of the
-- channel table and no probe for them; one probe of message_channel_head_ix for each of the
-- others (with bitmap scans off, as every head probe since 0023).

CREATE FUNCTION spark_batch_waiting(p_max_id BIGINT, p_due_by BIGINT)
RETURNS TABLE (channels BIGINT, next_at BIGINT, now_at BIGINT)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
BEGIN
    PERFORM arg_check(p_max_id IS NOT NULL, 'max_id must not be NULL');
    PERFORM arg_check(p_due_by IS NOT NULL, 'due_by must not be NULL');
    RETURN QUERY
        SELECT count(*),
               min(CASE
                   WHEN c.max_concurrency IS NOT NULL
                        AND c.current_concurrency >= c.max_concurrency THEN v_now
                   ELSE greatest(h.dequeue_at, coalesce(c.last_dequeue_at + c.release_interval_ms,
                                                        h.dequeue_at), v_now)
               END),
               v_now
        FROM channel c
        CROSS JOIN LATERAL (
            SELECT m.id, m.dequeue_at FROM message m
            WHERE m.channel = c.name AND NOT m.is_locked
            ORDER BY m.dequeue_at, m.id
            LIMIT 1) h
        WHERE c.next_dequeue_at IS NOT NULL
          AND (c.has_policy OR c.next_dequeue_at <= v_now)
          AND c.max_concurrency IS DISTINCT FROM 0
          AND h.id <= p_max_id AND h.dequeue_at <= p_due_by;
END;
$$;


-- The worker's functions gain spark_batch_waiting (the rest of the list is 0030's).
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
            -- reads the largest message id, its horizon, with spark_scan_bounds, and what it
            -- waits for under Trigger.AvailableNow with spark_batch_waiting).
            ARRAY['message_dequeue', 'message_dequeue_many', 'message_complete_and_dequeue',
                  'message_heartbeat', 'message_heartbeat_many', 'message_delete',
                  'message_delete_many', 'message_defer', 'message_defer_many', 'channel_stats',
                  'spark_consumer_lock', 'spark_batch_plan', 'spark_batch_ack',
                  'spark_batch_release', 'spark_batch_heartbeat', 'spark_batch_read',
                  'spark_scan_bounds', 'spark_batch_waiting']
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
