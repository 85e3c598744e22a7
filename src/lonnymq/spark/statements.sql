-- The statements the Spark data source sends: one call of one function each, with named
-- arguments (the same format as lonnymq/sql/statements.sql). `{schema}` is replaced by the
-- quoted schema identifier; `%(name)s` are bound parameters.

-- name: spark_stage_record
SELECT {schema}.spark_stage_record(
    p_write_id => %(write_id)s::text,
    p_task_tag => %(task_tag)s::text,
    p_n_rows => %(n_rows)s::bigint)

-- name: spark_stage_clear
SELECT {schema}.spark_stage_clear(p_write_id => %(write_id)s::text)

-- name: spark_stage_purge
SELECT {schema}.spark_stage_purge(p_older_than_ms => %(older_than_ms)s::bigint)

-- name: spark_write_commit
SELECT is_new, staged, created, deduplicated, dropped, dropped_channels
FROM {schema}.spark_write_commit(
    p_sink_id => %(sink_id)s::text,
    p_batch_id => %(batch_id)s::bigint,
    p_write_id => %(write_id)s::text,
    p_task_tags => %(task_tags)s::text[])

-- name: spark_write_result
SELECT created, deduplicated, dropped, committed_at
FROM {schema}.spark_write_result(
    p_sink_id => %(sink_id)s::text,
    p_batch_id => %(batch_id)s::bigint)

-- name: spark_sink_prune
SELECT {schema}.spark_sink_prune(
    p_sink_id => %(sink_id)s::text,
    p_batch_id => %(batch_id)s::bigint,
    p_keep => %(keep)s::integer)

-- name: spark_consumer_lock
SELECT {schema}.spark_consumer_lock(p_consumer => %(consumer)s::text)

-- name: spark_consumer_claim
SELECT {schema}.spark_consumer_claim(
    p_consumer => %(consumer)s::text,
    p_owner => %(owner)s::text,
    p_step => %(step)s::text,
    p_batch => %(batch)s::bigint,
    p_end => %(end)s::bigint)

-- name: spark_batch_plan
SELECT batch_no, size, acked, released FROM {schema}.spark_batch_plan(
    p_consumer => %(consumer)s::text,
    p_start => %(start)s::bigint,
    p_limit => %(limit)s::integer,
    p_lock_ms => %(lock_ms)s::bigint,
    p_max_id => %(max_id)s::bigint)

-- name: spark_batch_ack
SELECT {schema}.spark_batch_ack(
    p_consumer => %(consumer)s::text,
    p_batch_no => %(batch_no)s::bigint)

-- name: spark_batch_heartbeat
SELECT extended, lost FROM {schema}.spark_batch_heartbeat(
    p_consumer => %(consumer)s::text,
    p_lock_ms => %(lock_ms)s::bigint)

-- name: spark_batch_read
SELECT id, channel, content, state, num_attempts, dequeue_at, batch_no
FROM {schema}.spark_batch_read(
    p_consumer => %(consumer)s::text,
    p_after => %(after)s::bigint,
    p_upto => %(upto)s::bigint,
    p_slice => %(slice)s::integer,
    p_slices => %(slices)s::integer)

-- name: spark_batch_waiting
SELECT channels, next_at, now_at FROM {schema}.spark_batch_waiting(
    p_max_id => %(max_id)s::bigint,
    p_due_by => %(due_by)s::bigint)

-- name: epoch
SELECT {schema}.epoch()

-- name: spark_scan_bounds
SELECT min_id, max_id FROM {schema}.spark_scan_bounds(p_table => %(table)s::text)

-- name: spark_message_scan
SELECT id, channel, content, state, dedup_key, num_attempts, dequeue_at, is_locked, unlock_at,
       created_at
FROM {schema}.spark_message_scan(p_lo => %(lo)s::bigint, p_hi => %(hi)s::bigint)

-- name: spark_archive_scan
SELECT id, channel, content, state, dedup_key, num_attempts, outcome, error, created_at,
       dequeue_at, locked_at, finished_at
FROM {schema}.spark_archive_scan(p_lo => %(lo)s::bigint, p_hi => %(hi)s::bigint)

-- name: spark_sink_claim
SELECT {schema}.spark_sink_claim(
    p_sink_id => %(sink_id)s::text,
    p_query_id => %(query_id)s::text)

-- name: spark_write_claim
SELECT {schema}.spark_write_claim(p_write_id => %(write_id)s::text)
