-- 0032_spark_consumer_owner: a streaming read's consumer belongs to one checkpoint.
--
-- A streaming read plans its micro-batches under its consumer name, and planning batch n + 1
-- finishes (deletes from the queue) the messages of the consumer's batches up to n: Spark has
-- committed them. That holds only for the checkpoint that planned them. A query from another
-- checkpoint that uses the same name (one after the other: two running queries are refused
-- by the consumer's advisory lock) counts batches on its own, so its plans and commits
-- finished batches the other checkpoint had planned and never processed, and a replay after
-- a restart read batches the other had recorded under the same numbers. The same went for an
-- older copy of the checkpoint, restarted after the current one had gone further. Each of
-- those deletes messages that no sink received. Found in review; the README documented it.
--
-- A consumer now records its owner, a token the data source puts into the offsets it plans
-- (so it is in Spark's offset log and comes back with every restart from that checkpoint),
-- the highest batch that checkpoint has committed and the highest one Spark has logged (a
-- batch is read only after Spark wrote it to its offset log). spark_consumer_claim() runs in
-- the transaction of each plan and acknowledgement, and before a logged batch is read:
-- * the owner's checkpoint goes on; a copy of it that is behind (it would plan a batch the
--   original has logged, or replay one older than the original's last) is refused;
-- * a new checkpoint takes the consumer over with its first plan that finds messages: that
--   plan gives back what the previous owner had planned and not committed, as before;
-- * any other checkpoint is refused, before it reads or finishes anything.
-- Offsets written before this migration name no owner (NULL): such checkpoints are told apart
-- by their batch numbers only, until a new checkpoint takes the consumer over.

CREATE TABLE spark_consumer (
    consumer TEXT PRIMARY KEY,
    owner TEXT,
    committed BIGINT NOT NULL,
    logged BIGINT NOT NULL,
    claimed_at BIGINT NOT NULL
);

-- spark_consumer_claim(): check that the checkpoint whose offsets name p_owner may go on with
-- p_consumer, and record how far it got. p_step says what the data source is about to do:
-- * 'plan': plan the batch after p_batch, the last batch Spark committed. Refused when
--   p_batch is behind what the checkpoint committed or logged;
-- * 'read': read the logged batches after p_batch up to p_end. Refused when p_batch is behind
--   what it committed, or p_end behind what it logged;
-- * 'ack': finish the batches up to p_batch, which Spark committed. Refused when p_batch is
--   behind what it committed;
-- * 'take_over': a new checkpoint's first plan found messages (p_batch 0): it becomes the
--   consumer's owner, whoever owned it.
-- Locks: the consumer's row.
-- Raises: LQ003 (the consumer belongs to another checkpoint, this checkpoint is behind the
-- consumer's, or bad arguments).
CREATE FUNCTION spark_consumer_claim(
    p_consumer TEXT, p_owner TEXT, p_step TEXT, p_batch BIGINT, p_end BIGINT DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row spark_consumer;
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    PERFORM arg_check(p_owner IS NULL OR char_length(p_owner) BETWEEN 1 AND 255,
        'owner must be NULL or 1 to 255 characters');
    PERFORM arg_check(p_step IN ('plan', 'read', 'ack', 'take_over'), format(
        'step must be plan, read, ack or take_over, got %s', coalesce(p_step, 'NULL')));
    PERFORM arg_check(p_batch BETWEEN 0 AND 9223372036854775806,
        format('batch must be between 0 and 2^63 - 2, got %s', p_batch));
    PERFORM arg_check((p_step = 'read') = (p_end IS NOT NULL) AND coalesce(p_end >= p_batch, TRUE),
        'end must be given for a read only, and be at least batch');
    PERFORM arg_check(p_step <> 'take_over' OR (p_batch = 0 AND p_owner IS NOT NULL),
        'take_over needs an owner and batch 0');

    INSERT INTO spark_consumer (consumer, owner, committed, logged, claimed_at)
    VALUES (p_consumer, p_owner, p_batch, coalesce(p_end, p_batch), epoch())
    ON CONFLICT (consumer) DO NOTHING;
    IF FOUND THEN
        RETURN;  -- the consumer's first checkpoint (or its first since this migration)
    END IF;
    SELECT * INTO v_row FROM spark_consumer c WHERE c.consumer = p_consumer FOR UPDATE;

    IF p_step = 'take_over' THEN
        UPDATE spark_consumer c SET owner = p_owner, committed = 0, logged = 0,
            claimed_at = epoch()
        WHERE c.consumer = p_consumer;
        RETURN;
    END IF;
    PERFORM arg_check(v_row.owner IS NOT DISTINCT FROM p_owner, format(
        'consumer %s belongs to another streaming query checkpoint, which planned batches '
        'under that name since this one last ran: this checkpoint (at batch %s) would finish '
        'them as delivered. Give this query its own consumer option, or start it from a new '
        'checkpoint (which takes the consumer over and gives back what the other planned and '
        'did not commit)', p_consumer, p_batch));
    PERFORM arg_check(p_batch >= v_row.committed
        AND (p_step <> 'plan' OR p_batch >= v_row.logged)
        AND (p_step <> 'read' OR p_end >= v_row.logged), format(
        'the checkpoint of consumer %s is behind the consumer (it is at batch %s; batch %s is '
        'committed and batch %s logged under this checkpoint): a copy of the checkpoint that '
        'another run has gone past would finish batches planned since as delivered. Restart '
        'from the current checkpoint, or from a new one', p_consumer, coalesce(p_end, p_batch),
        v_row.committed, v_row.logged));
    UPDATE spark_consumer c SET
        committed = greatest(c.committed, p_batch),
        logged = greatest(c.logged, coalesce(p_end, p_batch))
    WHERE c.consumer = p_consumer
      AND (p_batch > c.committed OR coalesce(p_end, p_batch) > c.logged);
END;
$$;


-- The worker's functions gain spark_consumer_claim (the rest of the list is 0031's).
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
            -- reads the largest message id, its horizon, with spark_scan_bounds, what it
            -- waits for under Trigger.AvailableNow with spark_batch_waiting, and claims its
            -- consumer for its checkpoint with spark_consumer_claim).
            ARRAY['message_dequeue', 'message_dequeue_many', 'message_complete_and_dequeue',
                  'message_heartbeat', 'message_heartbeat_many', 'message_delete',
                  'message_delete_many', 'message_defer', 'message_defer_many', 'channel_stats',
                  'spark_consumer_lock', 'spark_batch_plan', 'spark_batch_ack',
                  'spark_batch_release', 'spark_batch_heartbeat', 'spark_batch_read',
                  'spark_scan_bounds', 'spark_batch_waiting', 'spark_consumer_claim']
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
