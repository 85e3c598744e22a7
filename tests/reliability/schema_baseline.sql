BEGIN;
SELECT pg_advisory_xact_lock(1280135424, hashtext('lonnymq_frozen'));
CREATE SCHEMA IF NOT EXISTS "lonnymq_frozen";
CREATE TABLE IF NOT EXISTS "lonnymq_frozen".migration (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS "lonnymq_frozen".function_source (singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton), sha256 TEXT NOT NULL, catalog_md5 TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now());
SET LOCAL search_path TO "lonnymq_frozen", pg_catalog, pg_temp;
-- migration 0001_baseline
-- 0001_baseline: the queue's tables, indexes, sequences and initial data.
--
-- The installer runs this file with `search_path` set to the target schema (quoted by the
-- installer, never spelled here), so every unqualified name below lands in that schema.
-- Migrations hold what cannot simply be re-created: tables and their data. The functions live
-- in sql/schema/ and are re-created from there after the migrations, so no migration may call
-- one of them (on a fresh install they do not exist yet).
--
-- Times are BIGINT milliseconds since the Unix epoch, read from the database clock.
-- Tables that are updated on every take and finish leave room on each page for HOT updates
-- and are vacuumed eagerly (small scale factors, no cost delay): see docs/schema.md for how
-- to watch their bloat.

-- Settings of this installation: one row.
CREATE TABLE config (
    singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    -- NOTIFY channel for wake-up events; NULL turns events off.
    event_channel TEXT,
    -- Keep finished messages in `archive`.
    archive BOOLEAN NOT NULL DEFAULT FALSE,
    -- Added to the database clock by epoch(). Tests move time with it; leave it at 0.
    clock_offset_ms BIGINT NOT NULL DEFAULT 0
);
INSERT INTO config DEFAULT VALUES;

-- One row per message until it is finished (deleted). Rows are updated on every dequeue and
-- defer, so leave room on each page for HOT updates and vacuum the table eagerly.
CREATE TABLE message (
    id BIGSERIAL PRIMARY KEY,
    channel TEXT NOT NULL,
    content BYTEA NOT NULL,
    -- The worker's saved progress (defer with state), handed back on the next dequeue.
    state BYTEA,
    dedup_key TEXT,
    is_locked BOOLEAN NOT NULL DEFAULT FALSE,
    num_attempts INTEGER NOT NULL DEFAULT 0,
    dequeue_at BIGINT NOT NULL,
    unlock_at BIGINT,
    -- When the current (or last) attempt took the lock: the archive's processing time.
    locked_at BIGINT,
    created_at BIGINT NOT NULL,
    CHECK (is_locked = (unlock_at IS NOT NULL))
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- A channel's waiting messages in the order they leave: the head of a channel is the first
-- entry for that channel. Locked messages are left out so that a channel with many messages
-- in flight still finds its head in one probe.
CREATE INDEX message_channel_head_ix ON message (channel, dequeue_at, id) WHERE NOT is_locked;

-- Locked messages by lock expiry: dequeue recovers the oldest expired lock in one probe.
CREATE INDEX message_unlock_ix ON message (unlock_at, id) WHERE is_locked;

-- A dedup key is unique among the live messages of its channel. Finished messages leave the
-- table, so the key can be reused once its message is done.
CREATE UNIQUE INDEX message_dedup_ux ON message (channel, dedup_key) WHERE dedup_key IS NOT NULL;

-- One row per channel that holds messages or has a policy; a policy-free channel's row is
-- deleted with its last message, so per-user channels cost nothing once drained.
CREATE TABLE channel (
    name TEXT PRIMARY KEY,
    has_policy BOOLEAN NOT NULL DEFAULT FALSE,
    max_concurrency INTEGER,
    release_interval_ms BIGINT,
    max_size BIGINT,
    current_size BIGINT NOT NULL DEFAULT 0,
    -- Messages locked now; kept only while max_concurrency is set (0 otherwise), so that
    -- finishing a message of a policy-free channel is a HOT update of its row.
    current_concurrency BIGINT NOT NULL DEFAULT 0,
    -- When the head may next leave: max(head's dequeue_at, last dequeue + release interval).
    -- NULL when the channel has no waiting (unlocked) message.
    next_dequeue_at BIGINT,
    last_dequeue_at BIGINT,
    -- Tie-break among channels with the same next_dequeue_at: every dequeue draws a new turn,
    -- so a channel just served goes behind the others (round robin within one transaction too).
    turn BIGINT NOT NULL DEFAULT 0
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

CREATE SEQUENCE channel_turn_seq;

-- Channels that can give a message now or later, earliest first. Saturated channels (at their
-- concurrency limit) and channels with nothing waiting are not in the index at all, so a probe
-- never walks past them.
CREATE INDEX channel_ready_ix ON channel (next_dequeue_at, turn)
    WHERE next_dequeue_at IS NOT NULL
      AND (max_concurrency IS NULL OR current_concurrency < max_concurrency);

-- Finished messages, when config.archive is on.
CREATE TABLE archive (
    id BIGINT PRIMARY KEY,
    channel TEXT NOT NULL,
    content BYTEA NOT NULL,
    state BYTEA,
    dedup_key TEXT,
    num_attempts INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    error TEXT,
    created_at BIGINT NOT NULL,
    dequeue_at BIGINT NOT NULL,
    locked_at BIGINT,
    finished_at BIGINT NOT NULL,
    -- A replay points at the message it created, so that a replay is done at most once.
    replayed_as BIGINT
);
CREATE INDEX archive_finished_at_ix ON archive (finished_at);

-- Finished messages that did not complete, newest first: what `archive` inspects. Failures
-- are rare, so this index stays small however large the archive grows.
CREATE INDEX archive_failed_ix ON archive (id) WHERE outcome <> 'completed';

-- Grants made with role_grant(), re-applied by secure_functions(). By role oid, so that a
-- renamed role keeps its grant; a dropped role's row is removed when it is next seen.
CREATE TABLE role_grant (
    role_oid OID PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('producer', 'worker', 'admin')),
    granted_at BIGINT NOT NULL
);


-- What the PySpark data source (lonnymq.spark) needs. Spark retries tasks, runs speculative
-- twins and replays streaming micro-batches after a restart, and a Python task's writes are
-- durable before Spark decides which attempt won. So a Spark write never creates messages
-- from its tasks: each task stages its rows (binary COPY into spark_stage) and the driver
-- promotes the winning attempts' rows in one transaction, recorded in spark_commit so that a
-- commit that runs twice enqueues once. A streaming read records each planned micro-batch in
-- spark_batch, so that a replayed batch yields the same messages, and finishes them only once
-- Spark has committed the batch.

-- Rows staged by write tasks, waiting for the driver's commit. UNLOGGED: staging is
-- throw-away, and a crash empties it (the commit then sees fewer rows than its tasks staged and
-- refuses, so a short set is never promoted).
CREATE UNLOGGED TABLE spark_stage (
    write_id TEXT NOT NULL,
    task_tag TEXT NOT NULL,
    -- Input order within the task: messages of a channel keep their DataFrame order.
    seq INTEGER NOT NULL,
    channel TEXT,
    content BYTEA,
    dequeue_at BIGINT,
    dedup_key TEXT
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX spark_stage_task_ix ON spark_stage (write_id, task_tag);

-- One row per task attempt that staged rows, written in the same transaction as its rows: the
-- janitor finds abandoned staging by its age, and a commit compares counts against it.
CREATE TABLE spark_stage_task (
    write_id TEXT NOT NULL,
    task_tag TEXT NOT NULL,
    n_rows BIGINT NOT NULL,
    staged_at BIGINT NOT NULL,
    PRIMARY KEY (write_id, task_tag)
);
CREATE INDEX spark_stage_task_staged_at_ix ON spark_stage_task (staged_at);

-- Writes that were committed: a batch write is sink (its write id) batch 0; a streaming write
-- is its sink id and micro-batch id. The row is inserted in the transaction that promotes, so a
-- replayed or re-invoked commit finds it and promotes nothing.
CREATE TABLE spark_commit (
    sink_id TEXT NOT NULL,
    batch_id BIGINT NOT NULL,
    created BIGINT NOT NULL,
    deduplicated BIGINT NOT NULL,
    dropped BIGINT NOT NULL,
    committed_at BIGINT NOT NULL,
    PRIMARY KEY (sink_id, batch_id)
);
CREATE INDEX spark_commit_committed_at_ix ON spark_commit (committed_at);

-- The micro-batches a streaming read planned and has not finished: a copy of each message as
-- it was dequeued (so a replay reads the same rows even after its locks expired) and the
-- attempt that locked it (to finish or heartbeat it).
CREATE TABLE spark_batch (
    consumer TEXT NOT NULL,
    batch_no BIGINT NOT NULL,
    msg_id BIGINT NOT NULL,
    num_attempts INTEGER NOT NULL,
    channel TEXT NOT NULL,
    content BYTEA NOT NULL,
    state BYTEA,
    dequeue_at BIGINT NOT NULL,
    PRIMARY KEY (consumer, batch_no, msg_id)
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_vacuum_cost_delay = 0
);

-- Who writes through a sink name: the first streaming query that commits through a sinkId
-- claims it ('stream'), and a batch write claims its writeId ('write', no query). Another
-- query's commit is refused with a message that says to use a new sinkId, instead of skipping
-- its batches in silence because the first query recorded the same batch ids. Spark keeps a
-- query's id across restarts from its checkpoint, so a restarted query finds its own claim.
CREATE TABLE spark_sink (
    sink_id TEXT PRIMARY KEY,
    -- NULL for a batch write: it has no query.
    query_id TEXT,
    claimed_at BIGINT NOT NULL,
    kind TEXT NOT NULL DEFAULT 'stream' CHECK (kind IN ('stream', 'write'))
);

-- A streaming read's consumer belongs to one checkpoint: planning batch n + 1 finishes the
-- messages of the consumer's batches up to n, which holds only for the checkpoint that planned
-- them. The row records the checkpoint that owns the consumer (an id kept in its offsets, so
-- it comes back with every restart), the highest batch it committed and the highest one Spark
-- logged; spark_consumer_claim() checks them. An owner of NULL: offsets that name none, told
-- apart by their batch numbers only, until a new checkpoint takes the consumer over.
CREATE TABLE spark_consumer (
    consumer TEXT PRIMARY KEY,
    owner TEXT,
    committed BIGINT NOT NULL,
    logged BIGINT NOT NULL,
    claimed_at BIGINT NOT NULL
);
INSERT INTO "lonnymq_frozen".migration (version, name) VALUES (1, 'baseline');
-- the function layer
DO $lonnymq$
DECLARE
    v_routine REGPROCEDURE;
BEGIN
    FOR v_routine IN
        SELECT p.oid FROM pg_proc p
        WHERE p.pronamespace =
              (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema())
          AND p.prokind IN ('f', 'p')
          AND NOT EXISTS (SELECT FROM unnest('{epoch(),"arg_check(BOOLEAN, TEXT, TEXT)",arg_check_channel(TEXT),arg_check_lock_ms(BIGINT),"arg_check_time(TEXT, BIGINT)","arg_check_payload(TEXT, BYTEA)",arg_check_dedup_key(TEXT),"arg_check_claim(BIGINT, INTEGER)","event_publish(TEXT, BIGINT, TEXT, BIGINT)",config_get(),"config_set(TEXT, BOOLEAN)",clock_offset_set(BIGINT),schema_version(),channel_key(TEXT),channel_lock(TEXT),"channel_next_at(TEXT, BIGINT)","channel_servable_at(BIGINT, BIGINT, INTEGER)","channel_announce(BIGINT, BIGINT, TEXT, BIGINT, TEXT)","channel_wake(TEXT, BIGINT, BOOLEAN, BIGINT, TEXT, BIGINT)","channel_rotate(TEXT, BIGINT, BOOLEAN)","channel_rotate_next_at(TEXT, BIGINT, BOOLEAN)","message_check_new(TEXT, BYTEA, BIGINT, TEXT)","message_create_settle(channel, BIGINT, BIGINT)","message_create_many_locked(TEXT[], BYTEA[], BIGINT[], TEXT[])","message_create_many(TEXT[], BYTEA[], BIGINT[], TEXT[])","message_create(BYTEA, TEXT, BIGINT, TEXT)",message_take_one(BIGINT),"message_dequeue_loop(INTEGER, BIGINT)","message_dequeue_many(INTEGER, BIGINT)",message_dequeue(BIGINT),"message_heartbeat(BIGINT, INTEGER, BIGINT)","message_heartbeat_many(BIGINT[], INTEGER[], BIGINT)","message_refuse(BIGINT, INTEGER)","message_finish(BIGINT, INTEGER, TEXT, TEXT)","message_finish_try(BIGINT, INTEGER, TEXT, TEXT)","message_delete(BIGINT, INTEGER, TEXT, TEXT)","message_delete_many(BIGINT[], INTEGER[])","message_requeue(BIGINT, INTEGER, BIGINT, BYTEA)","message_requeue_try(BIGINT, INTEGER, BIGINT, BYTEA)","message_defer(BIGINT, INTEGER, BIGINT, BYTEA)","message_defer_many(BIGINT[], INTEGER[], BIGINT[], BYTEA[])","message_complete_and_dequeue(BIGINT[], INTEGER[], INTEGER, BIGINT)",message_status(BIGINT),"channel_policy_set(TEXT, INTEGER, BIGINT, BIGINT)",channel_policy_clear(TEXT),channel_stats(),schedule_check_name(TEXT),"schedule_set(TEXT, BYTEA, BIGINT)",schedule_list(),schedule_remove(TEXT),"archive_list(TEXT, TEXT, BIGINT, INTEGER)",archive_replay(BIGINT[]),"spark_stage_record(TEXT, TEXT, BIGINT)",spark_stage_clear(TEXT),spark_stage_purge(BIGINT),"spark_write_commit(TEXT, BIGINT, TEXT, TEXT[], INTEGER)","spark_write_result(TEXT, BIGINT)","spark_sink_prune(TEXT, BIGINT, INTEGER)",spark_consumer_lock(TEXT),"spark_batch_ack(TEXT, BIGINT)","spark_batch_release(TEXT, BIGINT)","spark_batch_plan(TEXT, BIGINT, INTEGER, BIGINT, BIGINT)","spark_batch_heartbeat(TEXT, BIGINT)","spark_batch_read(TEXT, BIGINT, BIGINT, INTEGER, INTEGER)",spark_scan_bounds(TEXT),"spark_message_scan(BIGINT, BIGINT)","spark_archive_scan(BIGINT, BIGINT)",spark_stage_clear_fast(TEXT),"spark_sink_claim(TEXT, TEXT)",spark_write_claim(TEXT),"spark_batch_waiting(BIGINT, BIGINT)","spark_consumer_claim(TEXT, TEXT, TEXT, BIGINT, BIGINT)",queue_verify(),maintenance_due(),role_kind_functions(TEXT),role_check(TEXT),role_strip(TEXT),"role_apply(TEXT, TEXT)","role_grant(TEXT, TEXT)",role_revoke(TEXT),role_list(),secure_functions()}'::TEXT[]) s
                          WHERE to_regprocedure(s) = p.oid)
    LOOP
        EXECUTE format('DROP ROUTINE %s', v_routine);
    END LOOP;
END;
$lonnymq$;
-- 10_core.sql
-- epoch(): the queue clock in ms. floor(epoch * 1000) keeps sub-second precision without
-- counting the seconds twice. now() is fixed for a transaction, so within one transaction time
-- does not move and order is decided by id.
CREATE OR REPLACE FUNCTION epoch() RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    RETURN (SELECT floor(extract(epoch FROM now()) * 1000)::BIGINT + c.clock_offset_ms
        FROM config c);
END;
$$;


-- 0013_input_checks: refusals that fuzzing found reaching the server as PostgreSQL errors
-- instead of the queue's own SQLSTATEs. Each function is as before apart from the check.
--
-- arg_check() raised with whatever errcode and message it was given: called directly with an
-- unknown condition name or a NULL it failed with 42704 or 22004. It now only ever raises a
-- queue SQLSTATE (LQ000-LQ999, else LQ003) with a message.
CREATE OR REPLACE FUNCTION arg_check(p_ok BOOLEAN, p_message TEXT, p_errcode TEXT DEFAULT 'LQ003')
RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_ok IS NOT TRUE THEN
        IF p_errcode IS NULL OR p_errcode !~ '^LQ[0-9]{3}$' THEN
            p_errcode := 'LQ003';
        END IF;
        RAISE EXCEPTION '%', coalesce(p_message, 'invalid argument') USING ERRCODE = p_errcode;
    END IF;
END;
$$;


CREATE OR REPLACE FUNCTION arg_check_channel(p_channel TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_channel IS NOT NULL AND char_length(p_channel) BETWEEN 1 AND 255,
            format('channel name must be 1 to 255 characters, got %s',
                coalesce(char_length(p_channel)::TEXT || ' characters', 'NULL')),
            'LQ005');
END;
$$;


-- 0016_lean_checks: argument checks that cost nothing when the arguments are good.
--
-- Every check was a call of a small function (arg_check and its wrappers), and each call
-- built its error message with format() before it knew whether it would raise. On this
-- machine a statement or function call inside plpgsql costs 15 to 40 microseconds, so the
-- checks were a visible share of the hot calls: four check calls (and four format()s) in each
-- worker step (message_complete_and_dequeue: its own, then message_dequeue_many's), and one
-- message_check_new call per message in message_create_many. Now each hot function first
-- tests its arguments in one plain expression and calls the named checks only when that test
-- fails, so the errors (codes and messages) are the same as before.
--
-- Changed, each otherwise as before: arg_check_lock_ms and arg_check_claim (return at once
-- when the value is good), message_complete_and_dequeue (as in 0010), message_dequeue_many (as
-- in 0011), message_create (as in 0002) and message_create_many (as in 0011: one statement
-- tests the whole batch).

-- arg_check_lock_ms(), arg_check_claim(): as in 0001, returning at once for a good value.
CREATE OR REPLACE FUNCTION arg_check_lock_ms(p_lock_ms BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_lock_ms BETWEEN 1 AND 604800000 THEN
        RETURN;
    END IF;
    PERFORM arg_check(
            FALSE,
            format('lock_ms must be between 1 and 604800000 (7 days), got %s',
                coalesce(p_lock_ms::TEXT, 'NULL')));
END;
$$;


CREATE OR REPLACE FUNCTION arg_check_time(p_name TEXT, p_value BIGINT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_value IS NULL OR p_value BETWEEN -1000000000000000 AND 1000000000000000,
            format('%s must be within +/-10^15 ms, got %s', p_name, p_value));
END;
$$;


CREATE OR REPLACE FUNCTION arg_check_payload(p_name TEXT, p_value BYTEA) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_value IS NULL OR octet_length(p_value) <= 67108864,
            format('%s must be at most 64 MiB, got %s bytes', p_name, octet_length(p_value)),
            'LQ006');
END;
$$;


CREATE OR REPLACE FUNCTION arg_check_dedup_key(p_dedup_key TEXT) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(
            p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255,
            format('dedup_key must be 1 to 255 characters, got %s characters',
                char_length(p_dedup_key)));
END;
$$;


CREATE OR REPLACE FUNCTION arg_check_claim(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_id IS NOT NULL AND p_num_attempts >= 1 THEN
        RETURN;
    END IF;
    PERFORM arg_check(p_id IS NOT NULL, 'message id must not be NULL'),
               arg_check(p_num_attempts IS NOT NULL AND p_num_attempts >= 1,
                   format('num_attempts must be at least 1 (the value dequeue returned), got %s',
                       coalesce(p_num_attempts::TEXT, 'NULL')));
END;
$$;


-- event_publish(): wake listeners with a NOTIFY on config.event_channel. A transaction that
-- notifies takes a global lock at commit, so callers only publish when a channel can be served
-- sooner than before, and a transaction publishes again only for an earlier time than it
-- already announced (tracked in a transaction-local setting).
CREATE OR REPLACE FUNCTION event_publish(
    p_type TEXT, p_id BIGINT, p_channel TEXT, p_dequeue_at BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_event_channel TEXT;
    v_announced TEXT;
    v_parts TEXT[];
BEGIN
    SELECT c.event_channel INTO v_event_channel FROM config c;
    IF v_event_channel IS NULL THEN
        RETURN;
    END IF;
    v_announced := current_setting('lonnymq.announced', TRUE);
    IF v_announced IS NOT NULL AND v_announced <> '' THEN
        v_parts := string_to_array(v_announced, E'\x1f');
        IF v_parts[1] = v_event_channel AND v_parts[2]::BIGINT <= p_dequeue_at THEN
            RETURN;
        END IF;
    END IF;
    PERFORM set_config('lonnymq.announced', v_event_channel || E'\x1f' || p_dequeue_at, TRUE);
    PERFORM pg_notify(v_event_channel, json_build_object(
        'type', p_type, 'id', p_id, 'channel', p_channel, 'dequeue_at', p_dequeue_at)::TEXT);
END;
$$;


-- config_get(): the installation's settings.
CREATE OR REPLACE FUNCTION config_get() RETURNS TABLE (event_channel TEXT, archive BOOLEAN)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.event_channel, c.archive FROM config c
$$;


-- config_set(): change the installation's settings. p_event_channel '' turns events off;
-- NULL arguments leave a setting as it is.
CREATE OR REPLACE FUNCTION config_set(p_event_channel TEXT DEFAULT NULL, p_archive BOOLEAN DEFAULT NULL)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_event_channel IS NULL OR char_length(p_event_channel) <= 63,
        'event_channel must be at most 63 characters');
    UPDATE config c SET
        event_channel = CASE
            WHEN p_event_channel IS NULL THEN c.event_channel
            ELSE nullif(p_event_channel, '') END,
        archive = coalesce(p_archive, c.archive);
END;
$$;


-- clock_offset_set(): move the queue clock (tests only: expiry and schedules without sleeping).
CREATE OR REPLACE FUNCTION clock_offset_set(p_offset_ms BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_time('offset_ms', p_offset_ms);
    UPDATE config c SET clock_offset_ms = coalesce(p_offset_ms, 0);
    RETURN epoch();
END;
$$;


-- schema_version(): what was applied to this schema: the latest migration, the first
-- one's name, and the function layer's recorded checksum. A role granted
-- a kind has no right on the bookkeeping tables (nor CREATE on the schema): install() asks
-- this instead, so that an application that installs at every start still starts when it runs
-- as such a role, and is told when the schema needs an install by its owner.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION schema_version()
RETURNS TABLE (version INTEGER, baseline TEXT, functions_sha256 TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT (SELECT coalesce(max(m.version), 0) FROM migration m),
           (SELECT m.name FROM migration m WHERE m.version = 1),
           (SELECT f.sha256 FROM function_source f)
$$;

-- 20_channel.sql
-- 0010_lean_calls: less work per call on a worker's steady path (finish one message, take the
-- next), with the same results, locks and errors.
--
-- A profile of message_complete_and_dequeue with one id (pg_stat_user_functions, one client,
-- 5,000 calls over 100 channels) spent about a fifth of its time outside any statement that
-- touches a row: message_delete_many's batch machinery for a single id, and calls of small
-- helpers that PostgreSQL cannot inline because they pin search_path. So:
--
-- * channel_key() is a plain SQL expression, which the planner inlines into its callers. The
--   schema's hash is computed once, here, instead of on every call; the keys are unchanged.
-- * message_complete_and_dequeue() finishes a single held message directly (as
--   message_delete_many would, one id: the same checks, status and locks) and skips the finish
--   step when it holds none.
-- * channel_rotate() reads the channel's next waiting message itself rather than through
--   channel_rotate_next_at() (kept for compatibility).

-- channel_key(): as in 0002 (hashtextextended of the name, seeded with the schema's hash),
-- with the seed fixed at install time. Not SECURITY DEFINER and no SET clause: the planner
-- inlines it (it names pg_catalog explicitly, so no search_path can redirect it).
DO $$
BEGIN
    EXECUTE format(
        $f$
        CREATE OR REPLACE FUNCTION channel_key(p_channel TEXT) RETURNS BIGINT
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS 'SELECT pg_catalog.hashtextextended(p_channel, %s::BIGINT)'
        $f$,
        hashtext(current_schema())::BIGINT);
END;
$$;


-- channel_lock(): lock a channel's row for update, creating it when missing.
-- Locks: the channel row (FOR UPDATE), held until the transaction ends.
CREATE OR REPLACE FUNCTION channel_lock(p_channel TEXT) RETURNS channel
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
BEGIN
    -- Two rounds at most: a concurrent session may insert the row between our probe and our
    -- insert, or drain and delete it again before we lock it.
    FOR v_round IN 1..3 LOOP
        SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
        IF FOUND THEN
            RETURN v_channel;
        END IF;
        INSERT INTO channel (name) VALUES (p_channel) ON CONFLICT (name) DO NOTHING;
    END LOOP;
    RAISE EXCEPTION 'channel % kept disappearing while being locked', p_channel
        USING ERRCODE = '40001';
END;
$$;


-- channel_next_at(): when the channel's head may next leave, given the earliest time the
-- release interval allows; NULL when nothing waits. One probe of message_channel_head_ix.
CREATE OR REPLACE FUNCTION channel_next_at(p_channel TEXT, p_release_at BIGINT) RETURNS BIGINT
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    RETURN (SELECT greatest(m.dequeue_at, p_release_at)
        FROM message m
        WHERE m.channel = p_channel AND NOT m.is_locked
        ORDER BY m.dequeue_at, m.id
        LIMIT 1);
END;
$$;


-- channel_servable_at(): when a channel can next give a message, or NULL when it cannot
-- (nothing waiting, or saturated until a message finishes).
CREATE OR REPLACE FUNCTION channel_servable_at(
    p_next_at BIGINT, p_concurrency BIGINT, p_max_concurrency INTEGER
) RETURNS BIGINT
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT CASE WHEN p_max_concurrency IS NULL OR p_concurrency < p_max_concurrency
                    THEN p_next_at END);
END;
$$;


-- channel_announce(): publish an event when a change made a channel servable sooner than
-- before (the only case where a sleeping worker has a reason to wake).
CREATE OR REPLACE FUNCTION channel_announce(
    p_before BIGINT, p_after BIGINT, p_type TEXT, p_id BIGINT, p_channel TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_after IS NOT NULL AND (p_before IS NULL OR p_after < p_before) THEN
        PERFORM event_publish(p_type, p_id, p_channel, p_after);
    END IF;
END;
$$;


-- 0020_create_unlocked: a single create or defer no longer locks a channel row that is due,
-- and a create without a dedup key is a plain insert.
--
-- channel_wake (the single create's and the defer's way of making a policy-free channel due)
-- still used the upsert that 0019 took out of message_create_many: when the channel's row was
-- missing as the caller saw it and another session had made it since, INSERT ... ON CONFLICT
-- DO UPDATE locked that row before testing whether it was late, and a due row is what every
-- dequeue takes (SKIP LOCKED), so the creator could wait behind one dequeue after another. It
-- now does what message_create_many does since 0019: a missing row is made under the
-- channel's creation lock, after looking again; an existing row is locked and moved forward
-- only while it is later than the message and than the clock now plus 10 ms.
--
-- message_create inserted every message with ON CONFLICT (channel, dedup_key) DO NOTHING.
-- That is a speculative insertion even when the key is NULL (and the row is not in the
-- partial unique index): an extra HEAP_CONFIRM record in the WAL for each message, about 5 %
-- of what a message writes to the WAL in the steady single-message shapes of the bench
-- (create, take and finish). Without a key the insert is now a plain one.


-- channel_wake(): as in 0011, with the channel row written as said above.
CREATE OR REPLACE FUNCTION channel_wake(
    p_channel TEXT, p_at BIGINT, p_seen BOOLEAN, p_seen_next BIGINT, p_type TEXT, p_id BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_found BOOLEAN := p_seen;
    v_next BIGINT := p_seen_next;
    v_clock BIGINT;
BEGIN
    IF v_found AND v_next <= p_at THEN
        RETURN;
    END IF;
    IF NOT v_found THEN
        -- Missing as the caller saw it: made by one creator at a time, each looking again
        -- (as committed now) once it holds the channel's creation lock, so a row another
        -- session made meanwhile is not inserted over (see 0019).
        PERFORM pg_advisory_xact_lock(channel_key(p_channel) # 1);
        INSERT INTO channel AS c (name, next_dequeue_at)
        SELECT p_channel, p_at
        WHERE NOT EXISTS (SELECT FROM channel x WHERE x.name = p_channel)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            PERFORM channel_announce(NULL, p_at, p_type, p_id, p_channel);
            RETURN;
        END IF;
        SELECT c.next_dequeue_at INTO v_next FROM channel c WHERE c.name = p_channel;
        v_found := FOUND;
    END IF;
    -- The clock now (not as the transaction started), plus the 10 ms of 0011: a row due by
    -- then is left alone, even while a dequeue holds it (see 0019 for why that is safe).
    v_clock := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    IF v_found AND v_next <= greatest(p_at, v_clock) THEN
        RETURN;
    END IF;
    IF v_found THEN
        UPDATE channel c SET next_dequeue_at = p_at
        WHERE c.name = p_channel
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock));
    ELSE
        -- Still invisible to this transaction (a snapshot older than the row): as before 0020.
        INSERT INTO channel AS c (name, next_dequeue_at) VALUES (p_channel, p_at)
        ON CONFLICT (name) DO UPDATE SET next_dequeue_at = least(c.next_dequeue_at, p_at)
        WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at;
    END IF;
    IF FOUND THEN
        PERFORM channel_announce(v_next, p_at, p_type, p_id, p_channel);
    END IF;
END;
$$;


-- channel_rotate(): as in 0007.
CREATE OR REPLACE FUNCTION channel_rotate(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT;
BEGIN
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    INTO v_next_at
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1;
    IF v_next_at IS NULL OR v_next_at > p_now THEN
        IF pg_try_advisory_xact_lock(channel_key(p_channel)) THEN
            -- Creates that committed since the first read are visible to this statement.
            SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
            INTO v_next_at
            FROM message m
            WHERE m.channel = p_channel AND NOT m.is_locked
            ORDER BY m.dequeue_at, m.id
            LIMIT 1;
            IF v_next_at IS NULL THEN
                DELETE FROM channel c WHERE c.name = p_channel;
                RETURN;
            END IF;
        ELSE
            -- Someone is creating or finishing in this channel right now: look again shortly.
            v_next_at := least(v_next_at, p_now + 10);
        END IF;
    END IF;
    UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
        last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
    WHERE c.name = p_channel;
END;
$$;


-- 0007_rotate_recheck: channel_rotate reads the channel's next waiting message again once it
-- holds the channel's exclusive advisory lock.
--
-- 0002's channel_rotate read the next waiting message first and took the lock after. A create
-- of a policy-free channel that saw the row due already (and so did not write it) could commit
-- between the two: the lock was then free, and the rotate, going by its earlier read, deleted
-- the row (or pushed its time past the new message). The message was left with no row that
-- says the channel is due, and no dequeue found it until something else woke the channel
-- (tests/reliability/test_rotate_race.py replays that interleaving). Once the exclusive lock is
-- held no create or defer of the channel is in flight, and a new statement sees every one that
-- committed (READ COMMITTED; a dequeue run in a caller's REPEATABLE READ transaction keeps its
-- snapshot and keeps the old window), so the second read is the one to act on.

-- channel_rotate_next_at(): when a rotated channel is next worth a visit: its next waiting
-- message's dequeue_at (not before p_now when it was just served); NULL when nothing waits.
CREATE OR REPLACE FUNCTION channel_rotate_next_at(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS BIGINT
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1
$$;

-- 30_create.sql
-- message_check_new(): refuse a bad new message (LQ003, LQ005, LQ006). The common case (all
-- good) is one expression; the named checks run only to say what is wrong.
CREATE OR REPLACE FUNCTION message_check_new(
    p_channel TEXT, p_content BYTEA, p_dequeue_at BIGINT, p_dedup_key TEXT
) RETURNS VOID
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_content IS NOT NULL AND octet_length(p_content) <= 67108864
        AND char_length(p_channel) BETWEEN 1 AND 255
        AND (p_dequeue_at IS NULL
             OR p_dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
        AND (p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255)
    THEN
        RETURN;
    END IF;
    PERFORM arg_check_channel(p_channel),
            arg_check(p_content IS NOT NULL, 'content must not be NULL'),
            arg_check_payload('content', p_content),
            arg_check_time('dequeue_at', p_dequeue_at),
            arg_check_dedup_key(p_dedup_key);
END;
$$;


-- message_create_settle(): a message due at p_at was added to a locked channel: count it and
-- bring the channel's next dequeue time forward when the message makes it sooner (announcing
-- that, since a worker may be waiting for it).
CREATE OR REPLACE FUNCTION message_create_settle(p_channel channel, p_at BIGINT, p_id BIGINT)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT := least(p_channel.next_dequeue_at, greatest(p_at,
        p_channel.last_dequeue_at + coalesce(p_channel.release_interval_ms, 0)));
BEGIN
    UPDATE channel c SET
        current_size = c.current_size + 1,
        next_dequeue_at = v_next_at
    WHERE c.name = p_channel.name;
    PERFORM channel_announce(
        channel_servable_at(p_channel.next_dequeue_at, p_channel.current_concurrency,
            p_channel.max_concurrency),
        channel_servable_at(v_next_at, p_channel.current_concurrency, p_channel.max_concurrency),
        'created', p_id, p_channel.name);
END;
$$;


-- message_create_many_locked(): as in 0002 (then named message_create_many), with the keyed
-- messages inserted as said above. Same arguments, results, locks and errors.
CREATE OR REPLACE FUNCTION message_create_many_locked(
    p_channels TEXT[],
    p_contents BYTEA[],
    p_dequeue_ats BIGINT[],
    p_dedup_keys TEXT[]
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT := epoch();
    v_count INTEGER := cardinality(p_contents);
    v_names TEXT[];
    v_before channel[];
    v_ids BIGINT[];
    v_kind TEXT[];
    v_live BIGINT[];
    v_first BIGINT[];
    v_sizes BIGINT[];
    v_try BOOLEAN[];
    v_inserted BIGINT;
    v_changed RECORD;
BEGIN
    PERFORM arg_check(v_count IS NOT NULL, 'contents must not be NULL');
    PERFORM arg_check(v_count <= 100000,
        format('at most 100000 messages per call, got %s', v_count));
    PERFORM arg_check(
        coalesce(cardinality(p_channels), v_count) = v_count
        AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
        AND coalesce(cardinality(p_dedup_keys), v_count) = v_count,
        'channels, contents, dequeue_ats and dedup_keys must have the same length');
    -- Validate everything before changing anything.
    PERFORM message_check_new(coalesce(t.channel, 'default'), t.content, t.dequeue_at,
                              t.dedup_key)
    FROM unnest(p_channels, p_contents, p_dequeue_ats, p_dedup_keys)
        AS t(channel, content, dequeue_at, dedup_key);
    IF v_count = 0 THEN
        RETURN;
    END IF;

    -- Lock the channels, creating missing rows, one by one in name order (so batches cannot
    -- deadlock: an upsert either inserts the row or locks it, and waits for a row being
    -- deleted to go). The update changes nothing.
    v_names := ARRAY(
        SELECT DISTINCT coalesce(t.channel, 'default')
        FROM unnest(p_channels, p_contents) AS t(channel, content)
        ORDER BY 1);
    WITH locked AS (
        INSERT INTO channel AS c (name) SELECT n FROM unnest(v_names) AS n ORDER BY n
        ON CONFLICT (name) DO UPDATE SET turn = c.turn
        RETURNING c.*
    )
    SELECT array_agg(l::channel) INTO v_before FROM locked l;

    -- Ids for every item, in input order (those not created leave gaps, as sequences do).
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));

    -- Decide every item: deduplicated on a live message ('live') or on an earlier item of
    -- the batch ('batch'); otherwise new, and created while its channel has room.
    WITH item AS (
        SELECT t.ord, coalesce(t.channel, 'default') AS channel, t.dedup_key, m.id AS live_id
        FROM unnest(p_channels, p_contents, p_dedup_keys)
            WITH ORDINALITY AS t(channel, content, dedup_key, ord)
        LEFT JOIN message m ON t.dedup_key IS NOT NULL
            AND m.channel = coalesce(t.channel, 'default') AND m.dedup_key = t.dedup_key
    ), flagged AS (
        SELECT i.*,
               CASE WHEN i.dedup_key IS NULL THEN i.ord
                    ELSE min(i.ord) OVER (PARTITION BY i.channel, i.dedup_key) END AS first_ord
        FROM item i
    ), counted AS (
        SELECT f.*, f.live_id IS NULL AND f.first_ord = f.ord AS is_new,
               count(*) FILTER (WHERE f.live_id IS NULL AND f.first_ord = f.ord)
                   OVER (PARTITION BY f.channel ORDER BY f.ord) AS new_so_far
        FROM flagged f
    ), placed AS (
        SELECT c.*, b.current_size, b.has_policy,
               c.is_new AND (b.max_size IS NULL OR b.current_size + c.new_so_far <= b.max_size)
                   AS created
        FROM counted c JOIN unnest(v_before) AS b ON b.name = c.channel
    ), sized AS (
        SELECT p.*,
               CASE WHEN p.has_policy THEN p.current_size + count(*) FILTER (WHERE p.created)
                   OVER (PARTITION BY p.channel ORDER BY p.ord) END AS size_after
        FROM placed p
    )
    SELECT array_agg(CASE WHEN s.created THEN 'created'
                          WHEN s.live_id IS NOT NULL THEN 'live'
                          WHEN s.is_new THEN 'dropped'
                          ELSE 'batch' END ORDER BY s.ord),
           array_agg(s.live_id ORDER BY s.ord),
           array_agg(s.first_ord ORDER BY s.ord),
           array_agg(s.size_after ORDER BY s.ord)
    INTO v_kind, v_live, v_first, v_sizes
    FROM sized s;

    -- Messages without a key: a plain insert (see 0020 on the speculative one's cost).
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now), v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats, p_dedup_keys, v_kind)
        AS t(id, channel, content, dequeue_at, dedup_key, kind)
    WHERE t.kind = 'created' AND t.dedup_key IS NULL;
    -- Keyed ones: a key that another transaction's message took after this batch looked (a
    -- single create, which holds no channel row while it claims its key) is theirs. In
    -- (channel, key) order, so that two batches meeting the same keys claim them in one order.
    -- (Every array is read by unnest in one pass, never subscripted per item nor joined to
    -- another unnest: a subscript of an array of texts walks it from the start, and a join of
    -- two unnests may be planned as a nested loop; either makes a large batch cost n².)
    v_try := ARRAY(
        SELECT t.kind = 'created' AND t.dedup_key IS NOT NULL
        FROM unnest(p_dedup_keys, v_kind) WITH ORDINALITY AS t(dedup_key, kind, ord)
        ORDER BY t.ord);
    IF TRUE = ANY (v_try) THEN
        -- A plain insert first (a speculative one costs a quarter more per row); a key that
        -- another transaction committed meanwhile undoes it, and the loop below inserts the
        -- rest with ON CONFLICT. (One subtransaction per call, not per row.)
        BEGIN
            INSERT INTO message (id, channel, content, dequeue_at, dedup_key, created_at)
            SELECT t.id, coalesce(t.channel, 'default'), t.content,
                   coalesce(t.dequeue_at, v_now), t.dedup_key, v_now
            FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats, p_dedup_keys, v_try)
                AS t(id, channel, content, dequeue_at, dedup_key, try)
            WHERE t.try
            ORDER BY coalesce(t.channel, 'default'), t.dedup_key;
            v_try := NULL;
        EXCEPTION WHEN unique_violation THEN
            NULL;
        END;
    END IF;
    FOR v_round IN 1..3 LOOP
        EXIT WHEN NOT coalesce(TRUE = ANY (v_try), FALSE);
        INSERT INTO message (id, channel, content, dequeue_at, dedup_key, created_at)
        SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now),
               t.dedup_key, v_now
        FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats, p_dedup_keys, v_try)
            AS t(id, channel, content, dequeue_at, dedup_key, try)
        WHERE t.try
        ORDER BY coalesce(t.channel, 'default'), t.dedup_key
        ON CONFLICT (channel, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING;
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        IF v_inserted = (SELECT count(*) FROM unnest(v_try) AS t(try) WHERE t.try) THEN
            v_try := NULL;  -- all of them: nothing left to try
            EXIT;
        END IF;
        -- Those not inserted (their id, drawn for this batch, is not in the table).
        v_try := ARRAY(
            SELECT t.try AND NOT EXISTS (SELECT FROM message m WHERE m.id = t.id)
            FROM unnest(v_ids, v_try) WITH ORDINALITY AS t(id, try, ord)
            ORDER BY t.ord);
        EXIT WHEN NOT (TRUE = ANY (v_try));
        -- The live message of each such key, as committed now (a new statement, a new
        -- snapshot); a key whose message finished in between is tried again.
        SELECT array_agg(CASE WHEN t.try AND m.id IS NOT NULL THEN 'live' ELSE t.kind END
                         ORDER BY t.ord),
               array_agg(CASE WHEN t.try AND m.id IS NOT NULL THEN m.id ELSE t.live END
                         ORDER BY t.ord),
               array_agg(t.try AND m.id IS NULL ORDER BY t.ord)
        INTO v_kind, v_live, v_try
        FROM unnest(p_channels, p_dedup_keys, v_kind, v_live, v_try)
            WITH ORDINALITY AS t(channel, dedup_key, kind, live, try, ord)
        LEFT JOIN message m ON t.try AND m.channel = coalesce(t.channel, 'default')
            AND m.dedup_key = t.dedup_key;
    END LOOP;
    IF coalesce(TRUE = ANY (v_try), FALSE) THEN
        RAISE EXCEPTION 'dedup keys of the batch kept changing hands' USING ERRCODE = '40001';
    END IF;

    -- Count the new messages (channels with a policy) and bring each channel's next dequeue
    -- time forward to its earliest new message (respecting the release interval); announce
    -- what got sooner.
    FOR v_changed IN
        WITH added AS (
            SELECT coalesce(t.channel, 'default') AS channel, count(*) AS n,
                   min(coalesce(t.dequeue_at, v_now)) AS min_at,
                   min(t.id) AS first_id
            FROM unnest(v_ids, p_channels, p_dequeue_ats, v_kind)
                AS t(id, channel, dequeue_at, kind)
            WHERE t.kind = 'created'
            GROUP BY 1
        ), updated AS (
            UPDATE channel c SET
                current_size = CASE WHEN c.has_policy THEN c.current_size + a.n ELSE 0 END,
                next_dequeue_at = least(c.next_dequeue_at, greatest(a.min_at,
                    c.last_dequeue_at + coalesce(c.release_interval_ms, 0)))
            FROM added a
            WHERE c.name = a.channel
            RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency,
                      a.first_id
        )
        SELECT u.name, u.first_id,
               channel_servable_at(b.next_dequeue_at, b.current_concurrency,
                   b.max_concurrency) AS before_at,
               channel_servable_at(u.next_dequeue_at, u.current_concurrency,
                   u.max_concurrency) AS after_at
        FROM updated u JOIN unnest(v_before) AS b ON b.name = u.name
        -- Soonest first: one announcement then covers the batch.
        ORDER BY after_at NULLS LAST
    LOOP
        PERFORM channel_announce(v_changed.before_at, v_changed.after_at, 'created',
            v_changed.first_id, v_changed.name);
    END LOOP;

    -- Leave no useless policy-free row behind (a channel all of whose items were refused).
    DELETE FROM channel c
    WHERE c.name = ANY (v_names) AND NOT c.has_policy AND c.next_dequeue_at IS NULL;

    -- An item deduplicated on an earlier one of the batch gets that one's outcome (the first
    -- item of its partition: first is its own ord for an item without a key).
    RETURN QUERY
        SELECT CASE r.kind WHEN 'created' THEN 'created'
                           WHEN 'live' THEN 'deduplicated'
                           WHEN 'dropped' THEN 'dropped'
                           ELSE CASE WHEN r.f_kind IN ('created', 'live') THEN 'deduplicated'
                                     ELSE 'dropped' END
               END,
               CASE r.kind WHEN 'created' THEN r.id
                           WHEN 'live' THEN r.live
                           WHEN 'batch' THEN CASE r.f_kind WHEN 'created' THEN r.f_id
                                                           WHEN 'live' THEN r.f_live END
               END,
               r.size
        FROM (
            SELECT u.*, first_value(u.kind) OVER w AS f_kind, first_value(u.id) OVER w AS f_id,
                   first_value(u.live) OVER w AS f_live
            FROM unnest(v_kind, v_ids, v_live, v_first, v_sizes)
                WITH ORDINALITY AS u(kind, id, live, first, size, ord)
            WINDOW w AS (PARTITION BY u.first ORDER BY u.ord)
        ) r
        ORDER BY r.ord;
END;
$$;


-- 0019_create_many_unlocked: a batch create no longer locks the rows of channels that are
-- already due.
--
-- message_create_many (the path of policy-free channels without dedup keys) brought each
-- channel of the batch forward with one upsert, INSERT ... ON CONFLICT DO UPDATE ... WHERE the
-- row is late. An upsert locks the existing row before it tests the WHERE. When the row had
-- been missing as the producer's snapshot saw it (a dequeue had emptied the channel and deleted
-- its row) and another producer had made it again since, the producer locked a row that was
-- due, and due rows are what every batch dequeue takes (SKIP LOCKED). The producer waited for
-- the dequeue holding it, lost the row to the next dequeue between its retries, and waited
-- again: sampled with pg_blocking_pids during the steady shape of 8 producers and 8 consumers
-- of batches of 100 over 100 channels, the producer at the head of the queue waited behind a
-- different dequeue in each sample for 4 to 8 s while the other 7 producers waited for it,
-- and the shape ran at 38-100 msg/s in about a third of the runs.
--
-- The same wait came from inserting a row that was missing at the producer's last look but
-- made by another producer since: the unique check waits for each transaction rewriting it.
--
-- Now the producers that make a missing row take turns on a creation lock per channel
-- (an advisory lock, in name order) and look again once they hold it, so a row made meanwhile
-- is never inserted over; only rows still late as committed, by the clock now, are locked (in
-- name order) and moved forward. Same results, events and lock order otherwise.


-- message_create_many(): as in 0016, with the channel rows written as said above.
CREATE OR REPLACE FUNCTION message_create_many(
    p_channels TEXT[],
    p_contents BYTEA[],
    p_dequeue_ats BIGINT[],
    p_dedup_keys TEXT[]
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_count INTEGER := cardinality(p_contents);
    v_names TEXT[];
    v_now BIGINT;
    v_clock BIGINT;
    v_ids BIGINT[];
    v_wake RECORD;
    v_late TEXT[];
    v_late_ats BIGINT[];
    v_first_ids BIGINT[];
    v_seen BIGINT[];
    v_written TEXT[];
BEGIN
    IF v_count IS NULL OR v_count = 0 OR v_count > 100000
        OR coalesce(cardinality(p_channels), v_count) <> v_count
        OR coalesce(cardinality(p_dequeue_ats), v_count) <> v_count
        OR coalesce(cardinality(p_dedup_keys), v_count) <> v_count
        OR EXISTS (SELECT FROM unnest(p_dedup_keys) AS k WHERE k IS NOT NULL)
    THEN
        -- Nothing to do, bad arguments (refused there) or dedup keys: the general path.
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;
    v_names := ARRAY(
        SELECT DISTINCT coalesce(t.channel, 'default')
        FROM unnest(p_channels, p_contents) AS t(channel, content)
        ORDER BY 1);
    -- A channel known to have a policy: the row path at once. (A caller may already hold
    -- such a row, e.g. spark_write_commit; waiting for its advisory lock then could deadlock
    -- with a policy change, which takes the advisory lock first and the row second.)
    IF cardinality(v_names) > 128
        OR EXISTS (SELECT FROM channel c WHERE c.name = ANY (v_names) AND c.has_policy)
    THEN
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;

    -- Validate everything before changing anything.
    IF EXISTS (
        SELECT FROM unnest(p_channels, p_contents, p_dequeue_ats)
            AS t(channel, content, dequeue_at)
        WHERE NOT coalesce(t.content IS NOT NULL AND octet_length(t.content) <= 67108864
                AND char_length(coalesce(t.channel, 'default')) BETWEEN 1 AND 255
                AND (t.dequeue_at IS NULL
                     OR t.dequeue_at BETWEEN -1000000000000000 AND 1000000000000000), FALSE))
    THEN
        -- The named checks say what is wrong with the first bad one.
        PERFORM message_check_new(coalesce(t.channel, 'default'), t.content, t.dequeue_at, NULL)
        FROM unnest(p_channels, p_contents, p_dequeue_ats) AS t(channel, content, dequeue_at);
    END IF;

    -- In name order (v_names is sorted), as every taker of several channels' locks does. Held
    -- to commit, they keep a dequeue from pushing a channel's time past these messages (see
    -- 0002), and a policy from being set on a channel until they are counted.
    PERFORM pg_advisory_xact_lock_shared(channel_key(n)) FROM unnest(v_names) AS n;
    -- A policy set meanwhile (before these locks were granted).
    IF EXISTS (SELECT FROM channel c WHERE c.name = ANY (v_names) AND c.has_policy) THEN
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;

    v_now := epoch();
    -- The clock now (not as the transaction started), plus the 10 ms of 0002: a row due by
    -- then needs no write.
    v_clock := v_now + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now), v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats)
        AS t(id, channel, content, dequeue_at);

    -- The channels whose row is missing or says later than their earliest new message, as
    -- this statement sees them.
    SELECT array_agg(l.name ORDER BY l.name), array_agg(l.at ORDER BY l.name),
           array_agg(l.first_id ORDER BY l.name), array_agg(l.seen_next ORDER BY l.name)
    INTO v_late, v_late_ats, v_first_ids, v_seen
    FROM (
        SELECT a.name, a.at, a.first_id, c.next_dequeue_at AS seen_next
        FROM (
            SELECT coalesce(t.channel, 'default') AS name,
                   min(coalesce(t.dequeue_at, v_now)) AS at, min(t.id) AS first_id
            FROM unnest(v_ids, p_channels, p_dequeue_ats) AS t(id, channel, dequeue_at)
            GROUP BY 1
        ) a
        LEFT JOIN channel c ON c.name = a.name
        WHERE c.name IS NULL OR c.next_dequeue_at IS NULL
           OR c.next_dequeue_at > greatest(a.at, v_clock)
    ) l;

    IF v_late IS NOT NULL THEN
        -- Missing rows are created, in name order, one producer at a time per channel: each
        -- takes the channel's creation lock, then looks again, as committed now. A row
        -- another producer made meanwhile is then no longer missing and is not inserted:
        -- inserting it would wait, in the unique check, for every transaction writing that
        -- row, including each dequeue rewriting it, one after the other for as long as
        -- dequeues keep taking it. (ON CONFLICT covers the writers that take no creation
        -- lock: a single create, a defer, a Spark write.)
        PERFORM pg_advisory_xact_lock(channel_key(u.name) # 1)
        FROM unnest(v_late) AS u(name)
        WHERE NOT EXISTS (SELECT FROM channel c WHERE c.name = u.name);
        WITH created AS (
            INSERT INTO channel AS c (name, next_dequeue_at)
            SELECT u.name, u.at FROM unnest(v_late, v_late_ats) AS u(name, at)
            WHERE NOT EXISTS (SELECT FROM channel x WHERE x.name = u.name)
            ORDER BY u.name
            ON CONFLICT (name) DO NOTHING
            RETURNING c.name
        )
        SELECT coalesce(array_agg(w.name), ARRAY[]::TEXT[]) INTO v_written FROM created w;
        -- Existing rows are locked (in name order) and moved forward only if they are late as
        -- committed now, by the clock now (plus the 10 ms above: a producer that waited has
        -- messages stamped with its transaction's start, which every row a dequeue has just
        -- pushed to its own clock is later than). A row due by then is left alone, even while
        -- a dequeue holds it: that dequeue cannot leave it later than its clock + 10 ms while
        -- these messages' channel locks are held (channel_rotate), and every other writer only
        -- moves it earlier. Before 0019 one upsert locked every such row to find out, and a
        -- producer could wait behind one dequeue after another holding a busy channel's row
        -- (each SKIP LOCKED dequeue took the row between the producer's retries): seconds,
        -- with every other producer waiting on it in turn.
        v_clock := v_now + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
            + 10;
        PERFORM FROM channel c
        JOIN unnest(v_late, v_late_ats) AS u(name, at) ON u.name = c.name
        WHERE c.name <> ALL (v_written)
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(u.at, v_clock))
        ORDER BY c.name
        FOR UPDATE OF c;
        WITH moved AS (
            UPDATE channel c SET next_dequeue_at = u.at
            FROM unnest(v_late, v_late_ats) AS u(name, at)
            WHERE c.name = u.name AND c.name <> ALL (v_written)
              AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(u.at, v_clock))
            RETURNING c.name
        )
        SELECT v_written || coalesce(array_agg(m.name), ARRAY[]::TEXT[]) INTO v_written
        FROM moved m;

        -- Announce, soonest first (one NOTIFY then covers the batch).
        FOR v_wake IN
            SELECT u.name, u.at, u.first_id, u.seen_next
            FROM unnest(v_late, v_late_ats, v_first_ids, v_seen)
                AS u(name, at, first_id, seen_next)
            WHERE u.name = ANY (v_written)
            ORDER BY u.at
        LOOP
            PERFORM channel_announce(v_wake.seen_next, v_wake.at, 'created', v_wake.first_id,
                v_wake.name);
        END LOOP;
    END IF;

    RETURN QUERY
        SELECT 'created'::TEXT, t.id, NULL::BIGINT
        FROM unnest(v_ids) WITH ORDINALITY AS t(id, ord) ORDER BY t.ord;
END;
$$;


-- 0028_dedup_race: a single create and a batch creating the same dedup key at once end with
-- one message and a 'deduplicated' result, never a unique violation or a deadlock.
--
-- The two paths that create keyed messages disagreed on the order of their locks:
-- * message_create, in a channel without a policy, inserted the message first (the dedup
--   index deciding between creators of one key) and then, when the message made the channel
--   due sooner, locked the channel's row (channel_wake);
-- * message_create_many_locked (a batch with dedup keys or for channels with a policy, and the
--   keyed rows of a Spark write's commit) locks every channel row of the batch first, then
--   decides from its snapshot which keys are new and inserted them plainly.
-- So a batch that met a single create's uncommitted key waited for it and then failed on the
-- unique index (SQLSTATE 23505, an untyped error for the caller), and when that single create
-- was itself waiting for the batch's channel row the two waited for each other (deadlock).
--
-- Now both take the channel row before the key: message_create makes the channel due (the
-- row write, when one is needed) before it inserts the message, so it holds no key while it
-- waits for a row; a batch holding rows only ever waits for a key whose holder waits for
-- nothing. And the batch inserts keyed messages with ON CONFLICT DO NOTHING: a key that
-- another transaction committed meanwhile is reported 'deduplicated' with that message's id,
-- as a single create reports it. (A key can only be contended so in a channel without a
-- policy: in a channel with one every creator serialises on its row.)
--
-- The cost, in the rare race only: when the single create loses, the channel was made due for
-- nothing (a dequeue finds the head that is really there) and an event announced an id that
-- never came to exist. The batch inserts its keyed rows plainly first, as before (a
-- speculative insertion costs about a quarter more per row), inside one subtransaction per
-- call; only when a key was taken meanwhile does it go the ON CONFLICT way.
--
-- Not covered: a transaction that holds a key from an earlier single create and then writes
-- the channel's row (another create that moves the channel's time) can still meet a batch of
-- that key waiting for it, holding the row; and a batch waiting for a key whose message is
-- being finished by a transaction that waits, in turn, behind a policy change of the channel.
-- PostgreSQL detects both deadlocks and rolls one transaction back (SQLSTATE 40P01), which
-- may then be retried.


-- message_create(): as in 0020, with the keyed path of a channel without a policy in the
-- order said above.
CREATE OR REPLACE FUNCTION message_create(
    p_content BYTEA,
    p_channel TEXT DEFAULT NULL,
    p_dequeue_at BIGINT DEFAULT NULL,
    p_dedup_key TEXT DEFAULT NULL
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_name TEXT := coalesce(p_channel, 'default');
    v_now BIGINT;
    v_at BIGINT;
    v_channel channel;
    v_seen BOOLEAN;
    v_id BIGINT;
    v_new_id BIGINT;
BEGIN
    IF NOT coalesce(p_content IS NOT NULL AND octet_length(p_content) <= 67108864
            AND char_length(v_name) BETWEEN 1 AND 255
            AND (p_dequeue_at IS NULL
                 OR p_dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
            AND (p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255), FALSE)
    THEN
        PERFORM message_check_new(v_name, p_content, p_dequeue_at, p_dedup_key);
    END IF;
    v_now := epoch();
    v_at := coalesce(p_dequeue_at, v_now);
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_name));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_name;
    v_seen := FOUND;

    IF v_seen AND v_channel.has_policy THEN
        -- Counters and limits: serialise on the row, as 0001 did.
        v_channel := channel_lock(v_name);
        IF p_dedup_key IS NOT NULL THEN
            SELECT m.id INTO v_id FROM message m
            WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
            IF FOUND THEN
                status := 'deduplicated'; id := v_id; channel_size := v_channel.current_size;
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
        IF v_channel.max_size IS NOT NULL AND v_channel.current_size >= v_channel.max_size THEN
            status := 'dropped'; id := NULL; channel_size := v_channel.current_size;
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO message (channel, content, dequeue_at, dedup_key, created_at)
        VALUES (v_name, p_content, v_at, p_dedup_key, v_now)
        RETURNING message.id INTO v_id;
        PERFORM message_create_settle(v_channel, v_at, v_id);
        status := 'created'; id := v_id; channel_size := v_channel.current_size + 1;
        RETURN NEXT;
        RETURN;
    END IF;

    IF p_dedup_key IS NULL THEN
        -- A plain insert: ON CONFLICT would make it a speculative one, which writes a second
        -- WAL record per message for an index that a NULL key is not even in.
        INSERT INTO message (channel, content, dequeue_at, created_at)
        VALUES (v_name, p_content, v_at, v_now)
        RETURNING message.id INTO v_id;
        PERFORM channel_wake(v_name, v_at, v_seen, v_channel.next_dequeue_at, 'created', v_id);
        status := 'created'; id := v_id; channel_size := NULL;
        RETURN NEXT;
        RETURN;
    END IF;

    -- No policy: the dedup index decides between concurrent creators of the same key. A key
    -- already live needs no row write at all.
    SELECT m.id INTO v_id FROM message m WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
    IF FOUND THEN
        status := 'deduplicated'; id := v_id; channel_size := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    -- The channel row first (it may wait for a batch holding it), the key after: see the top.
    v_new_id := nextval('message_id_seq');
    PERFORM channel_wake(v_name, v_at, v_seen, v_channel.next_dequeue_at, 'created', v_new_id);
    FOR v_round IN 1..3 LOOP
        INSERT INTO message (id, channel, content, dequeue_at, dedup_key, created_at)
        VALUES (v_new_id, v_name, p_content, v_at, p_dedup_key, v_now)
        ON CONFLICT (channel, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING;
        IF FOUND THEN
            status := 'created'; id := v_new_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT m.id INTO v_id FROM message m
        WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
        IF FOUND THEN
            status := 'deduplicated'; id := v_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        -- The message holding the key finished in between: try again.
    END LOOP;
    RAISE EXCEPTION 'dedup key % of channel % kept changing hands', p_dedup_key, v_name
        USING ERRCODE = '40001';
END;
$$;

-- 40_take.sql
-- message_take_one(): lock one message the usual way (see the top of this file), or return
-- NULL and change nothing a later message_dequeue_loop would not: the channel row it locked,
-- or a channel sent back by channel_rotate when none of its heads could be taken.
CREATE OR REPLACE FUNCTION message_take_one(p_lock_ms BIGINT) RETURNS message
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    -- The clock as this call starts (see message_dequeue_loop).
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
    v_message message;
    v_channel channel;
    v_busy TEXT;
BEGIN
    -- 1. A message whose lock expired (its channel slot was never released).
    UPDATE message m SET
        unlock_at = v_now + p_lock_ms,
        locked_at = v_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT e.id FROM message e
        WHERE e.is_locked AND e.unlock_at <= v_now
        ORDER BY e.unlock_at, e.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    RETURNING m.* INTO v_message;
    IF FOUND THEN
        RETURN v_message;
    END IF;

    -- 2. The head of the channel whose turn it is, if it has no policy.
    SELECT * INTO v_channel FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at <= v_now
    ORDER BY c.next_dequeue_at, c.turn
    LIMIT 1
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        -- The shared advisory lock, as every operation on the channel's messages takes it.
        IF v_channel.has_policy
           OR NOT pg_try_advisory_xact_lock_shared(channel_key(v_channel.name)) THEN
            RETURN NULL;
        END IF;
        UPDATE message m SET
            is_locked = TRUE,
            unlock_at = v_now + p_lock_ms,
            locked_at = v_now,
            num_attempts = m.num_attempts + 1
        WHERE m.id = (
            SELECT h.id FROM message h
            WHERE h.channel = v_channel.name AND NOT h.is_locked
              AND h.dequeue_at <= v_now
            ORDER BY h.dequeue_at, h.id
            LIMIT 1
            FOR UPDATE SKIP LOCKED)
        RETURNING m.* INTO v_message;
        IF NOT FOUND THEN
            -- Its heads are held by sessions riding along, or not due yet.
            PERFORM channel_rotate(v_channel.name, v_now, FALSE);
            RETURN NULL;
        END IF;
        -- To the back, when its next head is due (channel_rotate's first case); otherwise
        -- channel_rotate pushes it forward or deletes its row.
        UPDATE channel c SET
            next_dequeue_at = n.next_at,
            turn = nextval('channel_turn_seq'),
            last_dequeue_at = v_now
        FROM (
            SELECT greatest(x.dequeue_at, v_now) AS next_at FROM message x
            WHERE x.channel = v_channel.name AND NOT x.is_locked
            ORDER BY x.dequeue_at, x.id
            LIMIT 1) n
        WHERE c.name = v_channel.name AND n.next_at <= v_now;
        IF NOT FOUND THEN
            PERFORM channel_rotate(v_channel.name, v_now, TRUE);
        END IF;
        RETURN v_message;
    END IF;

    -- 3. Every due channel's row is held by another session: ride along on the first one's
    -- next head, unless it has a policy or its policy is being changed (read under the lock).
    SELECT c.name INTO v_busy FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at <= v_now
    ORDER BY c.next_dequeue_at, c.turn
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(channel_key(v_busy)) THEN
        RETURN NULL;
    END IF;
    -- A statement of its own, so that its snapshot is taken under the lock.
    IF coalesce((SELECT c.has_policy FROM channel c WHERE c.name = v_busy), FALSE) THEN
        RETURN NULL;
    END IF;
    UPDATE message m SET
        is_locked = TRUE,
        unlock_at = v_now + p_lock_ms,
        locked_at = v_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT h.id FROM message h
        WHERE h.channel = v_busy AND NOT h.is_locked
          AND h.dequeue_at <= v_now
        ORDER BY h.dequeue_at, h.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    RETURNING m.* INTO v_message;
    IF FOUND THEN
        RETURN v_message;
    END IF;
    RETURN NULL;
END;
$$;


-- 0039_ride_along_tally: a batch riding along on many busy channels counts what each gave in
-- one grouping.
--
-- Step 2b of message_dequeue_loop (a batch riding along, in one statement, on due channels
-- whose rows other dequeues hold) then decides which of those channels to pass (they gave less
-- than their share, so they have no head left) and which to try again. It counted each
-- channel's messages by a scan of the whole batch per channel: |channels| x |batch|. With
-- every channel row of 100,000 channels held by another transaction, two messages in each, a
-- take of 10,000 rode along on 9,999 channels and that count took 7.0 s of the call's 7.5 s
-- (PostgreSQL 15, pg_stat_statements with track = all).
--
-- The statement that takes the heads now also counts them: its picked heads grouped by
-- channel, with one row per ridden channel beside them so that a channel that gave nothing
-- counts 0 (a grouping, not a join: n log n in any plan the session caches). The channels
-- passed and those kept come out of it in turn order, as before.
CREATE OR REPLACE FUNCTION message_dequeue_loop(p_limit INTEGER, p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    -- The clock as this call starts, not as its transaction did: another session may have
    -- served a channel and set its next time by its own, later clock since.
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
    v_taken INTEGER := 0;
    v_probes INTEGER := 0;
    v_message message;
    v_channel channel;
    v_release_at BIGINT;
    v_retry_at BIGINT;
    v_recover BOOLEAN := TRUE;
    v_found BOOLEAN;
    v_waited BOOLEAN := FALSE;
    v_busy TEXT;
    v_passed TEXT[] := ARRAY[]::TEXT[];
    v_rest TEXT[];
    v_spread BOOLEAN := FALSE;
    v_free TEXT[] := ARRAY[]::TEXT[];
    v_due channel[];
    v_share INTEGER;
    v_quota INTEGER;
    v_extra INTEGER;
    v_rows INTEGER;
    v_ride TEXT[];
    v_ride_more BOOLEAN := TRUE;
    v_rows_held BOOLEAN := FALSE;
    v_reserved INTEGER := 0;
    v_rode BOOLEAN := FALSE;
    v_budget INTEGER;
    v_batch message[];
    v_keep TEXT[] := ARRAY[]::TEXT[];
    v_short TEXT[];
BEGIN
    IF NOT coalesce(p_limit BETWEEN 1 AND 10000 AND p_lock_ms BETWEEN 1 AND 604800000, FALSE)
    THEN
        PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
            format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
        PERFORM arg_check_lock_ms(p_lock_ms);
    END IF;

    WHILE v_taken < p_limit AND v_probes < 2 * p_limit + 8 LOOP
        v_probes := v_probes + 1;

        -- 1. A message whose lock expired: its holder is gone. Its channel slot was never
        -- released, so the channel is not touched. Once none is found, stop looking.
        IF v_recover THEN
            UPDATE message m SET
                unlock_at = v_now + p_lock_ms,
                locked_at = v_now,
                num_attempts = m.num_attempts + 1
            WHERE m.id = (
                SELECT e.id FROM message e
                WHERE e.is_locked AND e.unlock_at <= v_now
                ORDER BY e.unlock_at, e.id
                LIMIT 1
                FOR UPDATE SKIP LOCKED)
            RETURNING m.* INTO v_message;
            v_recover := FOUND;
        END IF;

        IF NOT v_recover THEN
            -- 2a. A batch, once: the due channels in turn, locked together; those without a
            -- policy give their heads in one statement, round robin (each channel's first
            -- head, then each one's second, ...), up to an equal share each. Channels with a
            -- policy are left to the one-by-one steps below, which come to them next.
            IF NOT v_spread AND p_limit - v_taken >= 2 THEN
                v_spread := TRUE;
                -- (The subquery's order is kept: nothing after it reorders rows.)
                v_due := ARRAY(
                    SELECT c
                    FROM channel c
                    WHERE c.next_dequeue_at IS NOT NULL
                      AND (c.max_concurrency IS NULL
                           OR c.current_concurrency < c.max_concurrency)
                      AND c.next_dequeue_at <= v_now
                    ORDER BY c.next_dequeue_at, c.turn
                    LIMIT p_limit - v_taken
                    FOR UPDATE SKIP LOCKED);
                -- Fewer than asked for: every other due channel's row is held elsewhere.
                v_rows_held := cardinality(v_due) < p_limit - v_taken;
                v_free := ARRAY(
                    SELECT d.name FROM unnest(v_due) AS d
                    WHERE NOT d.has_policy
                      AND pg_try_advisory_xact_lock_shared(channel_key(d.name)));
                -- One slot stays for each channel with a policy among them: the steps below
                -- serve those (they come first in turn), so a batch never starves them.
                v_reserved := (SELECT count(*) FROM unnest(v_due) AS d WHERE d.has_policy);
                v_share := p_limit - v_taken - v_reserved;
                IF cardinality(v_free) > 0 AND v_share > 0 THEN
                    -- Each channel's share exactly (the first in turn take one more when
                    -- they do not divide evenly), so every head locked is a head taken: a
                    -- head locked and left out would stay locked until this transaction
                    -- ends, and other dequeues would pass it and take the messages behind it.
                    v_quota := v_share / cardinality(v_free);
                    v_extra := v_share % cardinality(v_free);
                    RETURN QUERY
                        WITH picked AS (
                            SELECT h.id, f.ord, h.rn
                            FROM unnest(v_free) WITH ORDINALITY AS f(name, ord)
                            CROSS JOIN LATERAL (
                                SELECT x.id, row_number() OVER () AS rn
                                FROM (
                                    SELECT m.id FROM message m
                                    WHERE m.channel = f.name AND NOT m.is_locked
                                      AND m.dequeue_at <= v_now
                                    ORDER BY m.dequeue_at, m.id
                                    LIMIT v_quota + CASE WHEN f.ord <= v_extra THEN 1 ELSE 0 END
                                    FOR UPDATE SKIP LOCKED) x) h
                        ), chosen AS (
                            SELECT p.id, row_number() OVER (ORDER BY p.rn, p.ord) AS place
                            FROM picked p
                            ORDER BY p.rn, p.ord
                            LIMIT v_share
                        ), wanted AS (
                            -- In id order, each with its place in the batch (see the top).
                            SELECT array_agg(c.id ORDER BY c.id) AS ids,
                                   array_agg(c.place ORDER BY c.id) AS places
                            FROM chosen c
                        ), taken AS (
                            UPDATE message m SET
                                is_locked = TRUE,
                                unlock_at = v_now + p_lock_ms,
                                locked_at = v_now,
                                num_attempts = m.num_attempts + 1
                            WHERE m.id = ANY ((SELECT w.ids FROM wanted w)::BIGINT[])
                            RETURNING m.id, m.channel, m.content, m.state, m.num_attempts,
                                      m.dequeue_at, m.unlock_at
                        )
                        SELECT t.id, t.channel, t.content, t.state, t.num_attempts,
                               t.dequeue_at, t.unlock_at, NULL::BIGINT
                        FROM taken t CROSS JOIN wanted w
                        ORDER BY w.places[width_bucket(t.id, w.ids)];
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    v_taken := v_taken + v_rows;
                    -- Send them to the back together: those whose next head is due in one
                    -- statement (new turns in the order they were served), the rest one by
                    -- one (channel_rotate may push them ahead or delete their rows).
                    WITH next_heads AS (
                        SELECT f.name, f.ord,
                               (SELECT greatest(m.dequeue_at, v_now) FROM message m
                                WHERE m.channel = f.name AND NOT m.is_locked
                                ORDER BY m.dequeue_at, m.id
                                LIMIT 1) AS next_at
                        FROM unnest(v_free) WITH ORDINALITY AS f(name, ord)
                    ), turns AS (
                        SELECT n.name, n.next_at, nextval('channel_turn_seq') AS turn
                        FROM (SELECT h.name, h.next_at FROM next_heads h
                              WHERE h.next_at <= v_now ORDER BY h.ord) n
                    ), rotated AS (
                        UPDATE channel c SET
                            next_dequeue_at = t.next_at, turn = t.turn, last_dequeue_at = v_now
                        FROM turns t
                        WHERE c.name = t.name
                        RETURNING c.name
                    )
                    SELECT coalesce(array_agg(h.name ORDER BY h.ord), ARRAY[]::TEXT[])
                    INTO v_rest
                    FROM next_heads h
                    WHERE h.name NOT IN (SELECT r.name FROM rotated r);
                    PERFORM channel_rotate(r.name, v_now, TRUE) FROM unnest(v_rest) AS r(name);
                    CONTINUE;
                END IF;
            END IF;

            -- 2b. Once the one-channel ride-along below has taken what the first busy channel
            -- had and the batch is still short (that channel was shallow; a deep one fills the
            -- batch in one statement, and 2b never runs), ride along, in one statement, on the
            -- other due channels whose rows other dequeues hold: their heads round robin, an
            -- equal share each, as in 2a, but leaving their rows to their holders. Channels
            -- with a policy, or whose policy is being changed, are left to the steps below, and
            -- so is a lone busy channel (the one-channel ride-along serves it). Repeated while
            -- it takes something; a channel that gave less than its share has no head left and
            -- is passed.
            -- It keeps 2a's slots for the channels with a policy whose rows 2a holds, and the
            -- channels it locks count as probes (each holds its advisory lock to the end).
            v_budget := p_limit - v_taken - v_reserved;
            IF v_ride_more AND v_rows_held AND v_rode AND v_budget >= 2 THEN
                v_ride_more := FALSE;
                IF cardinality(v_keep) >= 2 THEN
                    -- The channels of the last round that gave their whole share (they may
                    -- have more): already locked, so no new probes.
                    v_ride := v_keep;
                ELSE
                    v_ride := ARRAY(
                        SELECT c.name FROM channel c
                        WHERE c.next_dequeue_at IS NOT NULL
                          -- (What channel_ready_ix holds: redundant with NOT has_policy.)
                          AND (c.max_concurrency IS NULL
                               OR c.current_concurrency < c.max_concurrency)
                          AND c.next_dequeue_at <= v_now
                          AND NOT c.has_policy
                          AND c.name <> ALL (v_passed)
                          AND c.name <> ALL (v_free)
                        ORDER BY c.next_dequeue_at, c.turn
                        LIMIT v_budget);
                    IF cardinality(v_ride) >= 2 THEN
                        v_ride := ARRAY(
                            SELECT r.name FROM unnest(v_ride) WITH ORDINALITY AS r(name, ord)
                            WHERE pg_try_advisory_xact_lock_shared(channel_key(r.name))
                            ORDER BY r.ord);
                        v_probes := v_probes + cardinality(v_ride);
                        -- A statement of its own after the advisory locks, so that its snapshot
                        -- sees any policy set before them: such a channel is left to the steps
                        -- below, which serve it under its row. (Filtered here, not beside the
                        -- heads' FOR UPDATE, which the planner may run first: heads locked,
                        -- then left.)
                        v_ride := ARRAY(
                            SELECT r.name FROM unnest(v_ride) WITH ORDINALITY AS r(name, ord)
                            WHERE NOT EXISTS (
                                SELECT FROM channel p WHERE p.name = r.name AND p.has_policy)
                            ORDER BY r.ord);
                    END IF;
                END IF;
                IF cardinality(v_ride) >= 2 THEN
                    v_quota := v_budget / cardinality(v_ride);
                    v_extra := v_budget % cardinality(v_ride);
                    WITH picked AS (
                        SELECT h.id, f.ord, h.rn
                        FROM unnest(v_ride) WITH ORDINALITY AS f(name, ord)
                        CROSS JOIN LATERAL (
                            SELECT x.id, row_number() OVER () AS rn
                            FROM (
                                SELECT m.id FROM message m
                                WHERE m.channel = f.name AND NOT m.is_locked
                                  AND m.dequeue_at <= v_now
                                ORDER BY m.dequeue_at, m.id
                                LIMIT v_quota + CASE WHEN f.ord <= v_extra THEN 1 ELSE 0 END
                                FOR UPDATE SKIP LOCKED) x) h
                    ), wanted AS (
                        -- In id order, each with its place in the batch (see the top).
                        SELECT array_agg(q.id ORDER BY q.id) AS ids,
                               array_agg(q.place ORDER BY q.id) AS places
                        FROM (SELECT p.id, row_number() OVER (ORDER BY p.rn, p.ord) AS place
                              FROM picked p) q
                    ), taken AS (
                        UPDATE message m SET
                            is_locked = TRUE,
                            unlock_at = v_now + p_lock_ms,
                            locked_at = v_now,
                            num_attempts = m.num_attempts + 1
                        WHERE m.id = ANY ((SELECT w.ids FROM wanted w)::BIGINT[])
                        RETURNING m AS msg
                    ), tally AS (
                        -- What each ridden channel gave (every head it picked is taken), by
                        -- one grouping of its heads beside a row for the channel itself: no
                        -- join, so n log n in any plan.
                        SELECT k.ord, max(k.name) AS name, count(k.id) AS gave
                        FROM (SELECT f.ord, f.name, NULL::BIGINT AS id
                              FROM unnest(v_ride) WITH ORDINALITY AS f(name, ord)
                              UNION ALL
                              SELECT p.ord, NULL::TEXT, p.id FROM picked p) k
                        GROUP BY k.ord
                    )
                    SELECT coalesce(
                               array_agg(t.msg ORDER BY w.places[width_bucket((t.msg).id, w.ids)]),
                               ARRAY[]::message[]),
                           (SELECT coalesce(array_agg(y.name ORDER BY y.ord), ARRAY[]::TEXT[])
                            FROM tally y
                            WHERE y.gave < v_quota + CASE WHEN y.ord <= v_extra THEN 1 ELSE 0 END),
                           (SELECT coalesce(array_agg(y.name ORDER BY y.ord), ARRAY[]::TEXT[])
                            FROM tally y
                            WHERE y.gave >= v_quota + CASE WHEN y.ord <= v_extra THEN 1 ELSE 0 END)
                    INTO v_batch, v_short, v_keep
                    FROM taken t CROSS JOIN wanted w;
                    RETURN QUERY
                        SELECT b.id, b.channel, b.content, b.state, b.num_attempts,
                               b.dequeue_at, b.unlock_at, NULL::BIGINT
                        FROM unnest(v_batch) AS b;
                    v_taken := v_taken + cardinality(v_batch);
                    -- A channel that gave less than its share has no head left: pass it. Those
                    -- that gave it all may have more (v_keep, in turn order).
                    v_passed := v_passed || v_short;
                    -- One channel left with more to give: the one-channel ride-along takes
                    -- the rest from it.
                    IF cardinality(v_batch) > 0 AND cardinality(v_keep) <> 1 THEN
                        v_ride_more := TRUE;
                        CONTINUE;
                    END IF;
                END IF;
            END IF;

            -- 2. The head of the channel whose turn it is (one not passed by this call).
            SELECT * INTO v_channel FROM channel c
            WHERE c.next_dequeue_at IS NOT NULL
              AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
              AND c.next_dequeue_at <= v_now
              AND c.name <> ALL (v_passed)
            ORDER BY c.next_dequeue_at, c.turn
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
            v_found := FOUND;

            IF NOT v_found THEN
                -- Every due channel's row is held by another session (or none is due).
                SELECT c.name INTO v_busy FROM channel c
                WHERE c.next_dequeue_at IS NOT NULL
                  AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
                  AND c.next_dequeue_at <= v_now
                  AND c.name <> ALL (v_passed)
                ORDER BY c.next_dequeue_at, c.turn
                LIMIT 1;
                EXIT WHEN NOT FOUND;
                -- Ride along on a policy-free channel, unless its policy is being changed:
                -- then pass it and try the next busy channel.
                IF NOT pg_try_advisory_xact_lock_shared(channel_key(v_busy)) THEN
                    v_passed := v_passed || v_busy;
                    CONTINUE;
                END IF;
                IF NOT coalesce(
                        (SELECT c.has_policy FROM channel c WHERE c.name = v_busy), FALSE)
                THEN
                    RETURN QUERY
                        WITH taken AS (
                            UPDATE message m SET
                                is_locked = TRUE,
                                unlock_at = v_now + p_lock_ms,
                                locked_at = v_now,
                                num_attempts = m.num_attempts + 1
                            WHERE m.id = ANY (ARRAY(
                                SELECT h.id FROM message h
                                WHERE h.channel = v_busy AND NOT h.is_locked
                                  AND h.dequeue_at <= v_now
                                ORDER BY h.dequeue_at, h.id
                                LIMIT p_limit - v_taken
                                FOR UPDATE SKIP LOCKED))
                            RETURNING m.*
                        )
                        SELECT t.id, t.channel, t.content, t.state, t.num_attempts,
                               t.dequeue_at, t.unlock_at, NULL::BIGINT
                        FROM taken t ORDER BY t.dequeue_at, t.id;
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    -- Its waiting heads are all taken by others: try the next busy channel
                    -- rather than answer "nothing" while other channels have messages.
                    v_passed := v_passed || v_busy;
                    v_taken := v_taken + v_rows;
                    v_rode := TRUE;
                    CONTINUE;
                ELSE
                    -- A channel with a policy is served under its row: wait a little for it,
                    -- once per call. Poll with NOWAIT instead of blocking: a SKIP LOCKED probe
                    -- may keep locks on rows it did not return, so a blocking wait could
                    -- deadlock. Once waited, pass such channels: another busy channel
                    -- without a policy may still be ridden along on.
                    EXIT WHEN v_taken > 0;
                    IF v_waited THEN
                        v_passed := v_passed || v_busy;
                        CONTINUE;
                    END IF;
                    v_waited := TRUE;
                    FOR v_try IN 1..200 LOOP
                        BEGIN
                            -- The other session pushed the channel back to its own clock,
                            -- which may be ahead of ours: judge it by the release interval and
                            -- the head (which must be due by our clock, below) instead.
                            SELECT * INTO v_channel FROM channel c
                            WHERE c.name = v_busy
                              AND c.next_dequeue_at IS NOT NULL
                              AND (c.max_concurrency IS NULL
                                   OR c.current_concurrency < c.max_concurrency)
                              AND (coalesce(c.release_interval_ms, 0) = 0
                                   OR c.last_dequeue_at + c.release_interval_ms <= v_now)
                            FOR UPDATE NOWAIT;
                            v_found := FOUND;
                            EXIT;
                        EXCEPTION WHEN lock_not_available THEN
                            PERFORM pg_sleep(0.0005);
                        END;
                    END LOOP;
                    -- Still busy, or served in the meantime and no longer servable: pass it
                    -- and look for another channel.
                    IF NOT v_found THEN
                        v_passed := v_passed || v_busy;
                        CONTINUE;
                    END IF;
                END IF;
            END IF;

            -- Hold the channel's shared advisory lock too, as every operation on its
            -- messages does: a later delete or create of ours in this transaction then never
            -- waits for a policy change that waits for our row (a deadlock).
            IF v_found AND NOT pg_try_advisory_xact_lock_shared(channel_key(v_channel.name)) THEN
                -- Its policy is being changed: serve it next time, and another channel now.
                v_passed := v_passed || v_channel.name;
                CONTINUE;
            END IF;

            IF v_found THEN
                UPDATE message m SET
                    is_locked = TRUE,
                    unlock_at = v_now + p_lock_ms,
                    locked_at = v_now,
                    num_attempts = m.num_attempts + 1
                WHERE m.id = (
                    SELECT h.id FROM message h
                    WHERE h.channel = v_channel.name AND NOT h.is_locked
                      AND h.dequeue_at <= v_now
                    ORDER BY h.dequeue_at, h.id
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED)
                RETURNING m.* INTO v_message;
                v_found := FOUND;

                IF NOT v_channel.has_policy THEN
                    PERFORM channel_rotate(v_channel.name, v_now, v_found);
                ELSE
                    -- Send the channel to the back: its next time is its new head's
                    -- dequeue_at, but not before the release interval has passed since this
                    -- dequeue. (When no head was found, another session holds it or it is not
                    -- due: just recompute.)
                    v_release_at := CASE WHEN v_found THEN v_now
                                         ELSE v_channel.last_dequeue_at END
                        + coalesce(v_channel.release_interval_ms, 0);
                    UPDATE channel c SET
                        current_concurrency = CASE
                            WHEN v_found AND c.max_concurrency IS NOT NULL
                            THEN c.current_concurrency + 1
                            ELSE c.current_concurrency END,
                        last_dequeue_at = CASE WHEN v_found THEN v_now
                                               ELSE c.last_dequeue_at END,
                        next_dequeue_at = (
                            SELECT greatest(n.dequeue_at, v_release_at) FROM message n
                            WHERE n.channel = c.name AND NOT n.is_locked
                            ORDER BY n.dequeue_at, n.id
                            LIMIT 1),
                        turn = nextval('channel_turn_seq')
                    WHERE c.name = v_channel.name;
                END IF;
                IF NOT v_found THEN
                    -- Its due heads are held by sessions riding along: pass it, or it would
                    -- come first again (its next time is still its head's) and this call
                    -- would answer "nothing" while other channels have messages.
                    v_passed := v_passed || v_channel.name;
                    CONTINUE;
                END IF;
            END IF;
        END IF;

        v_taken := v_taken + 1;
        id := v_message.id;
        channel := v_message.channel;
        content := v_message.content;
        state := v_message.state;
        num_attempts := v_message.num_attempts;
        dequeue_at := v_message.dequeue_at;
        unlock_at := v_message.unlock_at;
        retry_at := NULL;
        RETURN NEXT;
    END LOOP;

    IF v_taken = 0 THEN
        SELECT least(
            (SELECT c.next_dequeue_at FROM channel c
             WHERE c.next_dequeue_at IS NOT NULL
               AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
             ORDER BY c.next_dequeue_at, c.turn LIMIT 1),
            (SELECT m.unlock_at FROM message m WHERE m.is_locked
             ORDER BY m.unlock_at, m.id LIMIT 1))
        INTO v_retry_at;
        id := NULL; channel := NULL; content := NULL; state := NULL; num_attempts := NULL;
        dequeue_at := NULL; unlock_at := NULL;
        retry_at := CASE WHEN v_retry_at IS NOT NULL THEN greatest(v_retry_at, v_now) END;
        RETURN NEXT;
    END IF;
END;
$$;


-- message_dequeue_many(): as before (0016), through message_take_one when the limit is 1.
CREATE OR REPLACE FUNCTION message_dequeue_many(p_limit INTEGER, p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
BEGIN
    -- Bad arguments go to the loop, which says what is wrong.
    IF p_limit = 1 AND p_lock_ms BETWEEN 1 AND 604800000 THEN
        v_message := message_take_one(p_lock_ms);
        IF v_message.id IS NOT NULL THEN
            id := v_message.id;
            channel := v_message.channel;
            content := v_message.content;
            state := v_message.state;
            num_attempts := v_message.num_attempts;
            dequeue_at := v_message.dequeue_at;
            unlock_at := v_message.unlock_at;
            retry_at := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM message_dequeue_loop(p_limit, p_lock_ms);
END;
$$;


-- message_dequeue(): lock one message; see message_dequeue_many.
CREATE OR REPLACE FUNCTION message_dequeue(p_lock_ms BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT * FROM message_dequeue_many(1, p_lock_ms)
$$;


-- 0033_heartbeat_clock: a heartbeat extends a lock from the time it runs.
--
-- message_heartbeat and message_heartbeat_many set unlock_at to epoch() + lock_ms, and
-- epoch() is the time the caller's transaction began. A heartbeat sent inside a longer
-- transaction (the README suggests heartbeating in your own transaction, last, just before
-- commit) therefore extended the lock by less than lock_ms, or not at all: in a review, a
-- heartbeat of 2 s at the end of a 3 s transaction left the lock already expired, and another
-- worker took the message at once. Both now count from the clock as the call runs, as a
-- dequeue does (0002).
CREATE OR REPLACE FUNCTION message_heartbeat(p_id BIGINT, p_num_attempts INTEGER, p_lock_ms BIGINT)
RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_unlock_at BIGINT;
BEGIN
    PERFORM arg_check_lock_ms(p_lock_ms);
    PERFORM arg_check_claim(p_id, p_num_attempts);
    -- The clock as this call runs (see message_take_one), not as its transaction began.
    UPDATE message m SET unlock_at = epoch() + p_lock_ms
        + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.unlock_at INTO v_unlock_at;
    IF NOT FOUND THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
    RETURN v_unlock_at;
END;
$$;


CREATE OR REPLACE FUNCTION message_heartbeat_many(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_lock_ms BIGINT
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_unlock_at BIGINT;
BEGIN
    PERFORM arg_check_lock_ms(p_lock_ms);
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_ids) = cardinality(p_num_attempts),
        'ids and num_attempts must have the same length');
    PERFORM arg_check_claim(t.id, t.num_attempts)
    FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);
    -- The clock as this call runs (see message_take_one), not as its transaction began.
    v_unlock_at := epoch() + p_lock_ms
        + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;

    RETURN QUERY
    WITH claim AS (
        SELECT t.id, t.num_attempts, t.ord
        FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS t(id, num_attempts, ord)
    ), held AS (
        SELECT m.id FROM message m JOIN claim c ON c.id = m.id
        WHERE m.unlock_at IS NOT NULL AND m.num_attempts = c.num_attempts
        ORDER BY m.id
        FOR UPDATE OF m SKIP LOCKED
    ), extended AS (
        UPDATE message m SET unlock_at = v_unlock_at
        FROM held h
        WHERE m.id = h.id
        RETURNING m.id, m.num_attempts
    )
    SELECT c.id,
           CASE WHEN e.num_attempts = c.num_attempts THEN 'ok'
                -- Held by this claim as last committed, but its row locked by another
                -- transaction: skipped.
                WHEN e.id IS NULL AND EXISTS (
                    SELECT 1 FROM message m
                    WHERE m.id = c.id AND m.unlock_at IS NOT NULL
                      AND m.num_attempts = c.num_attempts) THEN 'busy'
                WHEN EXISTS (SELECT 1 FROM message m WHERE m.id = c.id) THEN 'stale'
                ELSE 'not_found' END
    FROM claim c LEFT JOIN extended e ON e.id = c.id
    ORDER BY c.ord;
END;
$$;

-- 50_finish.sql
-- message_refuse(): a caller said it holds a message, and the statement that required it
-- matched nothing: raise why. LQ001 when the message does not exist; LQ002 when it is not
-- locked (its lock expired and it went back, or it was never dequeued) or carries another
-- attempt count (its lock expired and another dequeue took it).
CREATE OR REPLACE FUNCTION message_refuse(p_id BIGINT, p_num_attempts INTEGER) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_message message;
BEGIN
    SELECT * INTO v_message FROM message m WHERE m.id = p_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'message % does not exist (already finished, or never created)', p_id
            USING ERRCODE = 'LQ001';
    END IF;
    IF NOT v_message.is_locked THEN
        RAISE EXCEPTION 'message % is not locked: its lock expired and it went back to its '
            'channel, or it was never dequeued', p_id
            USING ERRCODE = 'LQ002';
    END IF;
    RAISE EXCEPTION 'message % was dequeued again (attempt %, you hold attempt %): your lock '
        'expired', p_id, v_message.num_attempts, p_num_attempts
        USING ERRCODE = 'LQ002';
END;
$$;


-- message_finish(): message_finish_try, raising LQ001 / LQ002 when you do not hold it.
CREATE OR REPLACE FUNCTION message_finish(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF message_finish_try(p_id, p_num_attempts, p_outcome, p_error) <> 'ok' THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
END;
$$;


-- 0041_finished_after_locked: an archived message is never finished before it was locked.
--
-- A dequeue stamps locked_at with the clock as the call runs (0021: another session may have
-- moved the queue on since this transaction began), while finishing stamped finished_at with
-- epoch(), the time the transaction began. A message taken and finished in one transaction
-- (a caller's, dequeue and delete inside it) was archived with finished_at before locked_at:
-- a negative processing time in the archive that Spark reads for its reports (found in
-- review: -201 ms after a 0.2 s statement ahead of the dequeue). Both functions that archive
-- a finished message now stamp at least its locked_at. Nothing else changes: same arguments,
-- results, locks, errors and events, and the settings 0037 gave them.
CREATE OR REPLACE FUNCTION message_finish_try(
    p_id BIGINT, p_num_attempts INTEGER, p_outcome TEXT, p_error TEXT
) RETURNS TEXT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_message message;
    v_channel channel;
BEGIN
    DELETE FROM message m
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        RETURN CASE WHEN EXISTS (SELECT FROM message m WHERE m.id = p_id)
                    THEN 'stale' ELSE 'not_found' END;
    END IF;
    IF (SELECT c.archive FROM config c) THEN
        INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                             error, created_at, dequeue_at, locked_at, finished_at)
        VALUES (v_message.id, v_message.channel, v_message.content, v_message.state,
                v_message.dedup_key, v_message.num_attempts, p_outcome, p_error,
                v_message.created_at, v_message.dequeue_at, v_message.locked_at,
                greatest(epoch(), v_message.locked_at))
        ON CONFLICT (id) DO NOTHING;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    IF NOT coalesce(
            (SELECT c.has_policy FROM channel c WHERE c.name = v_message.channel), FALSE) THEN
        RETURN 'ok';
    END IF;
    -- The in-flight counter is kept only for channels with a concurrency limit.
    UPDATE channel c SET
        current_size = c.current_size - 1,
        current_concurrency = CASE
            WHEN c.max_concurrency IS NULL THEN 0 ELSE c.current_concurrency - 1 END
    WHERE c.name = v_message.channel
    RETURNING c.* INTO v_channel;
    IF v_channel.current_concurrency = v_channel.max_concurrency - 1 THEN
        -- It was saturated: a worker may be waiting for this slot.
        PERFORM channel_announce(NULL, v_channel.next_dequeue_at, 'ready', NULL, v_channel.name);
    END IF;
    RETURN 'ok';
END;
$$;


-- message_delete(): finish a message you hold (outcome 'completed' unless told otherwise).
-- Raises: LQ001, LQ002, LQ003.
CREATE OR REPLACE FUNCTION message_delete(
    p_id BIGINT, p_num_attempts INTEGER,
    p_outcome TEXT DEFAULT 'completed', p_error TEXT DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_claim(p_id, p_num_attempts);
    PERFORM arg_check(p_outcome IS NOT NULL AND char_length(p_outcome) BETWEEN 1 AND 64,
        'outcome must be 1 to 64 characters');
    PERFORM message_finish(p_id, p_num_attempts, p_outcome, p_error);
END;
$$;


CREATE OR REPLACE FUNCTION message_delete_many(p_ids BIGINT[], p_num_attempts INTEGER[])
RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_status TEXT[];
    v_gone BIGINT[];
    v_names TEXT[];
    v_counts BIGINT[];
    v_freed RECORD;
    v_archive BOOLEAN;
    v_finished_at BIGINT;
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND cardinality(p_ids) <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_ids) = cardinality(p_num_attempts),
        'ids and num_attempts must have the same length');
    IF EXISTS (
        SELECT FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts)
        WHERE t.id IS NULL OR t.num_attempts IS NULL OR t.num_attempts < 1)
    THEN
        -- The named check says which argument is wrong.
        PERFORM arg_check_claim(t.id, t.num_attempts)
        FROM unnest(p_ids, p_num_attempts) AS t(id, num_attempts);
    END IF;

    IF (SELECT count(DISTINCT t.id) FROM unnest(p_ids) AS t(id)) < cardinality(p_ids) THEN
        -- An id named twice: one message at a time, as in 0002.
        v_status := array_fill(NULL::TEXT, ARRAY[cardinality(p_ids)]);
        FOR v_item IN
            SELECT t.id, t.num_attempts, t.ord
            FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS t(id, num_attempts, ord)
            LEFT JOIN message m ON m.id = t.id
            ORDER BY m.channel, t.id, t.ord
        LOOP
            v_status[v_item.ord] := message_finish_try(v_item.id, v_item.num_attempts,
                'completed', NULL);
        END LOOP;
        RETURN QUERY SELECT t.id, t.status FROM unnest(p_ids, v_status) AS t(id, status);
        RETURN;
    END IF;

    -- The messages still held by these attempts, locked in (channel, id) order (the lock is
    -- taken above the sort). A message whose row another session holds is waited for and
    -- checked again once it is free.
    v_gone := ARRAY(
        SELECT m.id
        FROM message m
        JOIN unnest(p_ids, p_num_attempts) AS t(id, num_attempts) ON t.id = m.id
        WHERE m.unlock_at IS NOT NULL AND m.num_attempts = t.num_attempts
        ORDER BY m.channel, m.id
        FOR UPDATE OF m);

    IF cardinality(v_gone) > 0 THEN
        v_archive := (SELECT c.archive FROM config c);
        v_finished_at := CASE WHEN v_archive THEN epoch() END;
        WITH gone AS (
            DELETE FROM message m WHERE m.id = ANY (v_gone)
            RETURNING m.*
        ), kept AS (
            INSERT INTO archive (id, channel, content, state, dedup_key, num_attempts, outcome,
                                 error, created_at, dequeue_at, locked_at, finished_at)
            SELECT g.id, g.channel, g.content, g.state, g.dedup_key, g.num_attempts,
                   'completed', NULL, g.created_at, g.dequeue_at, g.locked_at,
                   greatest(v_finished_at, g.locked_at)
            FROM gone g
            WHERE v_archive
            ON CONFLICT (id) DO NOTHING
        )
        SELECT array_agg(n.channel ORDER BY n.channel), array_agg(n.n ORDER BY n.channel)
        INTO v_names, v_counts
        FROM (SELECT g.channel, count(*) AS n FROM gone g GROUP BY g.channel) n;

        PERFORM pg_advisory_xact_lock_shared(channel_key(u.name))
        FROM unnest(v_names) WITH ORDINALITY AS u(name, ord)
        ORDER BY u.ord;

        -- Channels with a policy: lock their rows in name order, then free their slots.
        PERFORM FROM channel c
        WHERE c.name = ANY (v_names) AND c.has_policy
        ORDER BY c.name
        FOR UPDATE;
        FOR v_freed IN
            WITH updated AS (
                UPDATE channel c SET
                    current_size = c.current_size - u.n,
                    current_concurrency = CASE
                        WHEN c.max_concurrency IS NULL THEN 0
                        ELSE c.current_concurrency - u.n END
                FROM unnest(v_names, v_counts) AS u(name, n)
                WHERE c.name = u.name AND c.has_policy
                RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency,
                          u.n
            )
            SELECT u.name, u.next_dequeue_at FROM updated u
            -- It was saturated (at or above its limit) and a slot is free now: a worker may
            -- be waiting for it.
            WHERE u.current_concurrency < u.max_concurrency
              AND u.current_concurrency + u.n >= u.max_concurrency
            ORDER BY u.name
        LOOP
            PERFORM channel_announce(NULL, v_freed.next_dequeue_at, 'ready', NULL, v_freed.name);
        END LOOP;
    END IF;

    RETURN QUERY
        SELECT t.id,
               CASE WHEN g.id IS NOT NULL THEN 'ok'
                    WHEN EXISTS (SELECT FROM message m WHERE m.id = t.id) THEN 'stale'
                    ELSE 'not_found' END
        FROM unnest(p_ids) WITH ORDINALITY AS t(id, ord)
        LEFT JOIN unnest(v_gone) AS g(id) ON g.id = t.id
        ORDER BY t.ord;
END;
$$;


CREATE OR REPLACE FUNCTION message_requeue(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT message_requeue_try(p_id, p_num_attempts, p_dequeue_at, p_state) THEN
        PERFORM message_refuse(p_id, p_num_attempts);
    END IF;
END;
$$;


-- 0026_defer_many_no_subtransactions: a batch defer without a subtransaction per message.
--
-- message_defer_many tried each message in a BEGIN … EXCEPTION block, to turn a refused
-- claim into a status: one subtransaction, and one transaction id, per message. A backend
-- keeps the ids of at most 64 subtransactions in shared memory; beyond that its transaction is
-- "overflowed", and while it runs other sessions' visibility checks may have to look its
-- subtransactions up in pg_subtrans. Every id used also brings the next anti-wraparound
-- vacuum closer. The Spark streaming read gives back up to 50,000 messages in one call (a
-- released batch), a plan's give-back up to 10,000.
--
-- message_requeue_try does what message_requeue did and answers FALSE, changing nothing,
-- where message_requeue raised; message_requeue raises on FALSE as before. The batch calls
-- the former in the same (channel, id) order, and a refused claim gets its status ('stale' or
-- 'not_found') from one look-up at the end. An id named twice is deferred once: the second
-- claim is refused ('stale'), as before.
CREATE OR REPLACE FUNCTION message_requeue_try(
    p_id BIGINT, p_num_attempts INTEGER, p_dequeue_at BIGINT, p_state BYTEA
) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_message message;
    v_channel channel;
    v_next_at BIGINT;
    v_concurrency BIGINT;
BEGIN
    UPDATE message m SET
        is_locked = FALSE,
        unlock_at = NULL,
        dequeue_at = coalesce(p_dequeue_at, epoch()),
        state = coalesce(p_state, m.state)
    WHERE m.id = p_id AND m.unlock_at IS NOT NULL AND m.num_attempts = p_num_attempts
    RETURNING m.* INTO v_message;
    IF NOT FOUND THEN
        RETURN FALSE;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_message.channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_message.channel;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
        PERFORM channel_wake(v_message.channel, v_message.dequeue_at, FOUND,
            v_channel.next_dequeue_at, 'deferred', p_id);
        RETURN TRUE;
    END IF;
    SELECT * INTO STRICT v_channel FROM channel c WHERE c.name = v_message.channel FOR UPDATE;
    v_next_at := least(v_channel.next_dequeue_at, greatest(v_message.dequeue_at,
        v_channel.last_dequeue_at + coalesce(v_channel.release_interval_ms, 0)));
    v_concurrency := CASE WHEN v_channel.max_concurrency IS NULL THEN 0
                          ELSE v_channel.current_concurrency - 1 END;
    UPDATE channel c SET current_concurrency = v_concurrency, next_dequeue_at = v_next_at
    WHERE c.name = v_channel.name;
    PERFORM channel_announce(
        channel_servable_at(v_channel.next_dequeue_at, v_channel.current_concurrency,
            v_channel.max_concurrency),
        channel_servable_at(v_next_at, v_concurrency, v_channel.max_concurrency),
        'deferred', p_id, v_channel.name);
    RETURN TRUE;
END;
$$;


-- message_defer(): give back a message you hold, to be dequeued again at p_dequeue_at
-- (default now) with the same attempt count; p_state, when not NULL, replaces its saved state.
-- Raises: LQ001, LQ002, LQ003, LQ006.
CREATE OR REPLACE FUNCTION message_defer(
    p_id BIGINT, p_num_attempts INTEGER,
    p_dequeue_at BIGINT DEFAULT NULL, p_state BYTEA DEFAULT NULL
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check_claim(p_id, p_num_attempts);
    PERFORM arg_check_time('dequeue_at', p_dequeue_at);
    PERFORM arg_check_payload('state', p_state);
    PERFORM message_requeue(p_id, p_num_attempts, p_dequeue_at, p_state);
END;
$$;


CREATE OR REPLACE FUNCTION message_defer_many(
    p_ids BIGINT[], p_num_attempts INTEGER[],
    p_dequeue_ats BIGINT[] DEFAULT NULL, p_states BYTEA[] DEFAULT NULL
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_item RECORD;
    v_count INTEGER := cardinality(p_ids);
    v_done BOOLEAN[];
BEGIN
    PERFORM arg_check(p_ids IS NOT NULL AND v_count <= 100000,
        'ids must be an array of at most 100000 ids');
    PERFORM arg_check(cardinality(p_num_attempts) = v_count
        AND coalesce(cardinality(p_dequeue_ats), v_count) = v_count
        AND coalesce(cardinality(p_states), v_count) = v_count,
        'ids, num_attempts, dequeue_ats and states must have the same length');
    PERFORM arg_check_claim(t.id, t.num_attempts),
            arg_check_time('dequeue_at', t.dequeue_at),
            arg_check_payload('state', t.state)
    FROM unnest(p_ids, p_num_attempts, p_dequeue_ats, p_states)
        AS t(id, num_attempts, dequeue_at, state);

    v_done := array_fill(FALSE, ARRAY[v_count]);
    FOR v_item IN
        SELECT t.id, t.num_attempts, t.dequeue_at, t.state, t.ord
        FROM unnest(p_ids, p_num_attempts, p_dequeue_ats, p_states)
            WITH ORDINALITY AS t(id, num_attempts, dequeue_at, state, ord)
        LEFT JOIN message m ON m.id = t.id
        ORDER BY m.channel, t.id, t.ord
    LOOP
        v_done[v_item.ord] := message_requeue_try(v_item.id, v_item.num_attempts,
            v_item.dequeue_at, v_item.state);
    END LOOP;

    RETURN QUERY
        SELECT t.id,
               CASE WHEN t.done THEN 'ok'
                    WHEN EXISTS (SELECT FROM message m WHERE m.id = t.id) THEN 'stale'
                    ELSE 'not_found' END
        FROM unnest(p_ids, v_done) WITH ORDINALITY AS t(id, done, ord)
        ORDER BY t.ord;
END;
$$;


-- message_complete_and_dequeue(): as in 0016, taking through message_take_one when the
-- limit is 1. It calls message_take_one itself rather than through message_dequeue_many: one
-- function call and one RETURN QUERY fewer on a worker's steady path. Through
-- message_dequeue_many, benchmarks/take_one.py measured 0.92-0.99x the loop's rate on 100
-- channels (1.23-1.29x on one), against 1.10-1.20x (1.21x) when called directly.
CREATE OR REPLACE FUNCTION message_complete_and_dequeue(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_limit INTEGER, p_lock_ms BIGINT
) RETURNS TABLE (
    id BIGINT, status TEXT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, unlock_at BIGINT, retry_at BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_message message;
BEGIN
    -- Check the dequeue's arguments first: a refusal must change nothing.
    IF NOT coalesce(p_limit BETWEEN 1 AND 10000 AND p_lock_ms BETWEEN 1 AND 604800000, FALSE)
    THEN
        PERFORM arg_check(p_limit BETWEEN 1 AND 10000,
            format('limit must be between 1 and 10000, got %s', coalesce(p_limit::TEXT, 'NULL')));
        PERFORM arg_check_lock_ms(p_lock_ms);
    END IF;
    IF cardinality(p_ids) = 1 AND cardinality(p_num_attempts) = 1
       AND p_ids[1] IS NOT NULL AND p_num_attempts[1] IS NOT NULL THEN
        IF p_num_attempts[1] < 1 THEN
            PERFORM arg_check_claim(p_ids[1], p_num_attempts[1]);
        END IF;
        id := p_ids[1];
        status := message_finish_try(p_ids[1], p_num_attempts[1], 'completed', NULL);
        RETURN NEXT;
    ELSIF p_ids IS NULL OR p_num_attempts IS NULL
          OR cardinality(p_ids) <> 0 OR cardinality(p_num_attempts) <> 0 THEN
        -- Several ids, or what message_delete_many refuses (NULL, unequal lengths, a NULL
        -- item) or reads its own way (an array that is not a plain list).
        RETURN QUERY
            SELECT d.id, d.status, NULL::TEXT, NULL::BYTEA, NULL::BYTEA, NULL::INTEGER,
                   NULL::BIGINT, NULL::BIGINT, NULL::BIGINT
            FROM message_delete_many(p_ids, p_num_attempts) AS d;
    END IF;
    IF p_limit = 1 THEN
        v_message := message_take_one(p_lock_ms);
        IF v_message.id IS NOT NULL THEN
            id := v_message.id;
            status := 'locked';
            channel := v_message.channel;
            content := v_message.content;
            state := v_message.state;
            num_attempts := v_message.num_attempts;
            dequeue_at := v_message.dequeue_at;
            unlock_at := v_message.unlock_at;
            retry_at := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        SELECT q.id, CASE WHEN q.id IS NULL THEN 'empty' ELSE 'locked' END, q.channel,
               q.content, q.state, q.num_attempts, q.dequeue_at, q.unlock_at, q.retry_at
        FROM message_dequeue_loop(p_limit, p_lock_ms) AS q;
END;
$$;


-- message_status(): where a message is: 'waiting' or 'locked' while it is live; 'finished'
-- once archived (with its outcome, error, attempts and finish time); 'unknown' when it is
-- neither (finished while the archive was off, or never created).
CREATE OR REPLACE FUNCTION message_status(p_id BIGINT)
RETURNS TABLE (status TEXT, outcome TEXT, error TEXT, num_attempts INTEGER, finished_at BIGINT)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
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

-- 60_policy.sql
-- channel_policy_set(): set a channel's policy; NULL means unlimited. It applies at once to
-- the live channel (a lower max_concurrency lets in-flight messages finish; a lower max_size
-- keeps the messages already there) and stays when the channel empties. A channel that had no
-- policy has its messages counted once.
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
    PERFORM arg_check_channel(p_channel);
    PERFORM arg_check(p_max_concurrency IS NULL OR p_max_concurrency >= 0,
        format('max_concurrency must be >= 0 (0 pauses the channel), got %s',
            p_max_concurrency), 'LQ004');
    PERFORM arg_check(p_release_interval_ms IS NULL
        OR p_release_interval_ms BETWEEN 0 AND 31536000000,
        format('release_interval_ms must be between 0 and 31536000000 (1 year), got %s',
            p_release_interval_ms), 'LQ004');
    PERFORM arg_check(p_max_size IS NULL OR p_max_size >= 0,
        format('max_size must be >= 0, got %s', p_max_size), 'LQ004');

    PERFORM pg_advisory_xact_lock(channel_key(p_channel));
    v_channel := channel_lock(p_channel);
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


-- channel_policy_clear(): remove a channel's policy (unlimited from now on).
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
    PERFORM arg_check_channel(p_channel);
    PERFORM pg_advisory_xact_lock(channel_key(p_channel));
    SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
    IF NOT FOUND OR NOT v_channel.has_policy THEN
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


-- channel_stats(): every channel that holds messages or has a policy. Channels with a policy
-- report their counters; the others are counted from the message table (a scan: this is an
-- operator's view, not a hot path).
CREATE OR REPLACE FUNCTION channel_stats()
RETURNS TABLE (
    channel TEXT, size BIGINT, in_flight BIGINT, next_dequeue_at BIGINT,
    max_concurrency INTEGER, release_interval_ms BIGINT, max_size BIGINT
)
LANGUAGE sql STABLE
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

-- 70_schedule.sql
-- schedule_check_name(): a schedule name is 1 to 200 characters (it is the driver's dedup
-- key, and task dedup keys add the fire time to it). Raises LQ003.
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


-- 0040_schedule_set: declaring a schedule in a full schedules channel says so, and
-- declarations of schedules take their locks in one order.
--
-- A policy with a max_size on the channel that holds the schedules' drivers
-- (lonnymq.schedules) makes message_create refuse a new driver ('dropped'). schedule_set took
-- that for a concurrent declaration of the same name, tried again, and raised 40001 ("kept
-- changing while being set"), which the Python API runs again three times and then reports as
-- a conflict to retry, for a refusal that no retry can change. It now raises LQ004
-- (InvalidPolicyError) naming the policy, and changes nothing.
--
-- A declaration that creates its driver locks the channel's row (message_create makes it due)
-- and then waits for any other session inserting the same name; one that updates an existing
-- driver locks the driver's row and then the channel's. Two transactions could therefore wait
-- for each other: one declaring s1 and then s2 (holding s1's uncommitted key), the other
-- declaring s1 (holding the channel row, waiting for that key), a deadlock once the first
-- reaches s2's channel row. Declarations are rare and short: each now takes one exclusive
-- transaction lock for the schema's schedules first, so they queue up instead. So does
-- schedule_remove (it locks a driver's row, which a declaration may wait for), and both take
-- the schedules channel's shared lock before it, as every create in that channel does: a
-- transaction that set the channel's policy (which holds that lock exclusively) and then
-- declares a schedule is then waited for before the declarations' lock, not under it.
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
CREATE OR REPLACE FUNCTION schedule_list()
RETURNS TABLE (name TEXT, spec BYTEA, next_at BIGINT, state BYTEA, is_locked BOOLEAN)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT m.dedup_key, m.content, m.dequeue_at, m.state, m.is_locked
    FROM message m
    WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key IS NOT NULL
    ORDER BY m.dedup_key
$$;


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

-- 75_archive.sql
-- archive_list(): archived messages, newest first, optionally of one outcome and channel,
-- older than p_before_id (for paging). Outcome 'failed' and the like use archive_failed_ix.
-- Raises: LQ003 (limit outside 1..10000).
CREATE OR REPLACE FUNCTION archive_list(
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
CREATE OR REPLACE FUNCTION archive_replay(p_ids BIGINT[])
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

-- 80_spark.sql
-- spark_stage_record(): a write task staged p_n_rows rows under (p_write_id, p_task_tag);
-- called in the transaction of its COPY. Raises: LQ003 (missing ids, negative count).
CREATE OR REPLACE FUNCTION spark_stage_record(p_write_id TEXT, p_task_tag TEXT, p_n_rows BIGINT)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_write_id IS NOT NULL AND p_task_tag IS NOT NULL,
        'write_id and task_tag must not be NULL');
    PERFORM arg_check(p_n_rows >= 0, format('n_rows must be >= 0, got %s', p_n_rows));
    INSERT INTO spark_stage_task (write_id, task_tag, n_rows, staged_at)
    VALUES (p_write_id, p_task_tag, p_n_rows, epoch());
END;
$$;


-- spark_stage_clear(): forget everything staged under p_write_id (after a commit, or when a
-- write is aborted). Returns the number of staged rows removed.
CREATE OR REPLACE FUNCTION spark_stage_clear(p_write_id TEXT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_rows BIGINT;
BEGIN
    DELETE FROM spark_stage s WHERE s.write_id = p_write_id;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    DELETE FROM spark_stage_task t WHERE t.write_id = p_write_id;
    RETURN v_rows;
END;
$$;


-- spark_stage_purge(): the janitor. Removes staging whose task staged it more than
-- p_older_than_ms ago (left behind by a driver that died between its tasks and its commit or
-- abort), and commit records older than that (a sink that commits again after that long could
-- not be recognised as a replay, so keep it well above any restart delay).
-- Returns the staged rows removed. Raises: LQ003 (negative or NULL age).
CREATE OR REPLACE FUNCTION spark_stage_purge(p_older_than_ms BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_cutoff BIGINT;
    v_rows BIGINT;
BEGIN
    PERFORM arg_check(p_older_than_ms >= 0,
        format('older_than_ms must be >= 0, got %s', coalesce(p_older_than_ms::TEXT, 'NULL')));
    v_cutoff := epoch() - p_older_than_ms;
    WITH old AS (
        DELETE FROM spark_stage_task t WHERE t.staged_at < v_cutoff
        RETURNING t.write_id, t.task_tag
    ), gone AS (
        DELETE FROM spark_stage s USING old o
        WHERE s.write_id = o.write_id AND s.task_tag = o.task_tag
        RETURNING 1
    )
    SELECT count(*) INTO v_rows FROM gone;
    DELETE FROM spark_commit c WHERE c.committed_at < v_cutoff;
    RETURN v_rows;
END;
$$;


-- spark_write_commit(): as in 0008 (same arguments, results, locks and errors); the top of
-- this file says what changed. Raises: LQ003, LQ005, LQ006 (a staged row that is not a valid
-- message).
CREATE OR REPLACE FUNCTION spark_write_commit(
    p_sink_id TEXT, p_batch_id BIGINT, p_write_id TEXT, p_task_tags TEXT[],
    p_chunk INTEGER DEFAULT 50000
) RETURNS TABLE (
    is_new BOOLEAN, staged BIGINT, created BIGINT, deduplicated BIGINT, dropped BIGINT,
    dropped_channels TEXT[]
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- The rows are sorted once, in memory when they fit (the default 4MB spills a 200,000-row
-- write to disk).
SET work_mem = '64MB'
AS $$
#variable_conflict use_column
DECLARE
    v_now BIGINT;
    v_before channel[];
    v_names TEXT[];
    v_min_ats BIGINT[];
    v_keyed BOOLEAN[];
    v_bad BOOLEAN;
    v_fast TEXT[];
    v_fast_ats BIGINT[];
    v_fast_rows BIGINT;
    v_floor BIGINT;
    v_chunk RECORD;
    v_result RECORD;
    v_changed RECORD;
BEGIN
    PERFORM arg_check(p_sink_id IS NOT NULL AND p_batch_id IS NOT NULL AND p_write_id IS NOT NULL,
        'sink_id, batch_id and write_id must not be NULL');
    PERFORM arg_check(p_chunk BETWEEN 1 AND 100000, 'chunk must be between 1 and 100000');
    INSERT INTO spark_commit (sink_id, batch_id, created, deduplicated, dropped, committed_at)
    VALUES (p_sink_id, p_batch_id, 0, 0, 0, epoch())
    ON CONFLICT ON CONSTRAINT spark_commit_pkey DO NOTHING;
    is_new := FOUND;
    staged := 0; created := 0; deduplicated := 0; dropped := 0;
    dropped_channels := ARRAY[]::TEXT[];
    IF NOT is_new THEN
        PERFORM spark_stage_clear(p_write_id);
        RETURN NEXT;
        RETURN;
    END IF;
    v_now := epoch();

    -- One pass over the write's rows: per channel, the earliest due time and whether a row
    -- carries a dedup key; and whether any row is not a valid message (the test of
    -- message_check_new).
    SELECT array_agg(g.name ORDER BY g.name), array_agg(g.min_at ORDER BY g.name),
           array_agg(g.keyed ORDER BY g.name), coalesce(bool_or(g.bad), FALSE)
    INTO v_names, v_min_ats, v_keyed, v_bad
    FROM (
        SELECT coalesce(s.channel, 'default') AS name, min(coalesce(s.dequeue_at, v_now)) AS min_at,
               bool_or(s.dedup_key IS NOT NULL) AS keyed,
               bool_or(NOT coalesce(
                   s.content IS NOT NULL AND octet_length(s.content) <= 67108864
                   AND char_length(coalesce(s.channel, 'default')) BETWEEN 1 AND 255
                   AND (s.dequeue_at IS NULL
                        OR s.dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
                   AND (s.dedup_key IS NULL OR char_length(s.dedup_key) BETWEEN 1 AND 255),
                   FALSE)) AS bad
        FROM spark_stage s
        WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
        GROUP BY 1
    ) g;
    IF v_bad THEN
        -- The named checks, on the first bad row, say what is wrong.
        PERFORM message_check_new(coalesce(s.channel, 'default'), s.content, s.dequeue_at,
                                  s.dedup_key)
        FROM (
            SELECT s.channel, s.content, s.dequeue_at, s.dedup_key
            FROM spark_stage s
            WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
              AND NOT coalesce(
                  s.content IS NOT NULL AND octet_length(s.content) <= 67108864
                  AND char_length(coalesce(s.channel, 'default')) BETWEEN 1 AND 255
                  AND (s.dequeue_at IS NULL
                       OR s.dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
                  AND (s.dedup_key IS NULL OR char_length(s.dedup_key) BETWEEN 1 AND 255),
                  FALSE)
            LIMIT 1
        ) s;
    END IF;

    -- Lock every channel of the write, creating missing rows, in name order (as
    -- message_create_many: an upsert either inserts the row or locks it, and waits for a row
    -- being deleted to go). The update changes nothing. The fast channels are those without
    -- a policy (read under the lock) whose rows carry no dedup key.
    WITH locked AS (
        INSERT INTO channel AS c (name) SELECT u.name FROM unnest(v_names) AS u(name)
        ORDER BY u.name
        ON CONFLICT (name) DO UPDATE SET turn = c.turn
        RETURNING c.*
    )
    SELECT array_agg(l::channel),
           array_agg(l.name ORDER BY l.name) FILTER (WHERE NOT l.has_policy AND NOT p.keyed),
           array_agg(p.min_at ORDER BY l.name) FILTER (WHERE NOT l.has_policy AND NOT p.keyed)
    INTO v_before, v_fast, v_fast_ats
    FROM locked l
    JOIN unnest(v_names, v_keyed, v_min_ats) AS p(name, keyed, min_at)
        ON p.name = l.name;
    v_fast := coalesce(v_fast, ARRAY[]::TEXT[]);
    v_names := coalesce(v_names, ARRAY[]::TEXT[]);

    -- Their rows, ids drawn in (task, seq) order, all above v_floor.
    v_floor := nextval('message_id_seq');
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT nextval('message_id_seq'), o.channel, o.content, o.dequeue_at, v_now
    FROM (
        SELECT coalesce(s.channel, 'default') AS channel, s.content,
               coalesce(s.dequeue_at, v_now) AS dequeue_at
        FROM spark_stage s
        JOIN unnest(p_task_tags) WITH ORDINALITY AS t(tag, ord) ON t.tag = s.task_tag
        WHERE s.write_id = p_write_id
          AND coalesce(s.channel, 'default') = ANY (v_fast)
        -- Task, then input order: each channel's rows keep their task's order. The tasks'
        -- own order is arbitrary (as it was): their place in p_task_tags sorts fastest.
        ORDER BY t.ord, s.seq
    ) o;
    GET DIAGNOSTICS v_fast_rows = ROW_COUNT;
    staged := v_fast_rows;
    created := v_fast_rows;

    -- Bring each fast channel's next dequeue time forward to its earliest new message (the
    -- formula of message_create_many). One event covers the write: the channel that got
    -- servable soonest, if any got sooner (event_publish keeps one per transaction, the
    -- soonest), naming its first new message.
    FOR v_changed IN
        WITH updated AS (
            UPDATE channel c SET
                next_dequeue_at = least(c.next_dequeue_at, greatest(a.min_at,
                    c.last_dequeue_at + coalesce(c.release_interval_ms, 0)))
            FROM unnest(v_fast, v_fast_ats) AS a(channel, min_at)
            WHERE c.name = a.channel
            RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency
        )
        SELECT u.name,
               channel_servable_at(b.next_dequeue_at, b.current_concurrency,
                   b.max_concurrency) AS before_at,
               channel_servable_at(u.next_dequeue_at, u.current_concurrency,
                   u.max_concurrency) AS after_at
        FROM updated u JOIN unnest(v_before) AS b ON b.name = u.name
        ORDER BY after_at NULLS LAST
    LOOP
        IF v_changed.after_at IS NOT NULL
           AND (v_changed.before_at IS NULL OR v_changed.after_at < v_changed.before_at) THEN
            PERFORM channel_announce(v_changed.before_at, v_changed.after_at, 'created',
                (SELECT min(m.id) FROM message m
                 WHERE m.id > v_floor AND m.channel = v_changed.name),
                v_changed.name);
            EXIT;
        END IF;
    END LOOP;

    -- The other channels: through message_create_many, as in 0004 (only when there are any).
    FOR v_chunk IN
        WITH rows AS (
            SELECT s.channel, s.content, s.dequeue_at, s.dedup_key,
                   (row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) - 1)
                       / p_chunk AS part,
                   row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) AS ord
            FROM spark_stage s
            WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
              AND NOT coalesce(s.channel, 'default') = ANY (v_fast)
              AND cardinality(v_fast) < cardinality(v_names)
        )
        SELECT r.part,
               array_agg(r.channel ORDER BY r.ord) AS channels,
               array_agg(r.content ORDER BY r.ord) AS contents,
               array_agg(r.dequeue_at ORDER BY r.ord) AS dequeue_ats,
               array_agg(r.dedup_key ORDER BY r.ord) AS dedup_keys
        FROM rows r
        GROUP BY r.part
        ORDER BY r.part
    LOOP
        staged := staged + cardinality(v_chunk.contents);
        FOR v_result IN
            SELECT c.status, count(*) AS n,
                   array_agg(DISTINCT coalesce(c.channel, 'default'))
                       FILTER (WHERE c.status = 'dropped') AS channels
            FROM (
                SELECT r.status, t.channel
                FROM message_create_many(v_chunk.channels, v_chunk.contents,
                        v_chunk.dequeue_ats, v_chunk.dedup_keys)
                    WITH ORDINALITY AS r(status, id, channel_size, ord)
                JOIN unnest(v_chunk.channels) WITH ORDINALITY AS t(channel, ord)
                    ON t.ord = r.ord
            ) c
            GROUP BY c.status
        LOOP
            CASE v_result.status
                WHEN 'created' THEN created := created + v_result.n;
                WHEN 'deduplicated' THEN deduplicated := deduplicated + v_result.n;
                ELSE
                    dropped := dropped + v_result.n;
                    dropped_channels := (SELECT array_agg(DISTINCT x)
                        FROM unnest(dropped_channels || v_result.channels) AS x);
            END CASE;
        END LOOP;
    END LOOP;

    dropped_channels := coalesce(dropped_channels[1:20], ARRAY[]::TEXT[]);
    UPDATE spark_commit c SET
        created = spark_write_commit.created,
        deduplicated = spark_write_commit.deduplicated,
        dropped = spark_write_commit.dropped
    WHERE c.sink_id = p_sink_id AND c.batch_id = p_batch_id;
    PERFORM spark_stage_clear_fast(p_write_id);
    RETURN NEXT;
END;
$$;


-- spark_write_result(): what the commit of (p_sink_id, p_batch_id) enqueued; no row when it
-- was not committed (or was purged).
CREATE OR REPLACE FUNCTION spark_write_result(p_sink_id TEXT, p_batch_id BIGINT)
RETURNS TABLE (created BIGINT, deduplicated BIGINT, dropped BIGINT, committed_at BIGINT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.created, c.deduplicated, c.dropped, c.committed_at
    FROM spark_commit c WHERE c.sink_id = p_sink_id AND c.batch_id = p_batch_id
$$;


-- spark_sink_prune(): as in 0004, with p_keep checked (LQ003 unless 0 to 2^31 - 1) and a
-- p_batch_id so low that p_batch_id - p_keep does not fit a BIGINT pruning nothing (no batch
-- id is below it) instead of failing with "bigint out of range".
CREATE OR REPLACE FUNCTION spark_sink_prune(p_sink_id TEXT, p_batch_id BIGINT, p_keep INTEGER)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_keep >= 0, format('keep must be >= 0, got %s', p_keep));
    IF p_batch_id < -9223372036854775808 + p_keep THEN
        RETURN;
    END IF;
    DELETE FROM spark_commit c
    WHERE c.sink_id = p_sink_id AND c.batch_id < p_batch_id - p_keep;
END;
$$;


-- spark_consumer_lock(): take the session advisory lock that makes p_consumer this session's
-- (released when the session ends, so a killed query frees it). FALSE when another session
-- holds it: two streaming queries must not share a consumer.
CREATE OR REPLACE FUNCTION spark_consumer_lock(p_consumer TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    -- Class "LMQS"; the object is the consumer within this schema.
    RETURN pg_try_advisory_lock(1280134483,
        hashtext(current_schema() || E'\x1f' || p_consumer));
END;
$$;


-- spark_batch_ack(): finish the messages of p_consumer's batches up to p_batch_no (Spark has
-- committed them) and forget those batches. A message whose lock was lost meanwhile (another
-- consumer holds it now) is left alone. Returns how many were finished.
-- Locks: messages and channel rows as message_delete_many.
CREATE OR REPLACE FUNCTION spark_batch_ack(p_consumer TEXT, p_batch_no BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_done BIGINT := 0;
BEGIN
    WITH done AS (
        DELETE FROM spark_batch b WHERE b.consumer = p_consumer AND b.batch_no <= p_batch_no
        RETURNING b.msg_id, b.num_attempts
    )
    SELECT array_agg(d.msg_id ORDER BY d.msg_id), array_agg(d.num_attempts ORDER BY d.msg_id)
    INTO v_ids, v_attempts FROM done d;
    -- message_delete_many takes at most 100000 ids per call.
    FOR v_from IN 1..coalesce(cardinality(v_ids), 0) BY 50000 LOOP
        v_done := v_done + (SELECT count(*)
            FROM message_delete_many(v_ids[v_from:v_from + 49999],
                v_attempts[v_from:v_from + 49999]) r
            WHERE r.status = 'ok');
    END LOOP;
    RETURN v_done;
END;
$$;


-- spark_batch_release(): give back (due now, attempts kept) the messages of p_consumer's
-- batches after p_batch_no: batches it planned that Spark never recorded (the driver died
-- in between). Returns how many were given back.
CREATE OR REPLACE FUNCTION spark_batch_release(p_consumer TEXT, p_batch_no BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_done BIGINT := 0;
BEGIN
    WITH orphan AS (
        DELETE FROM spark_batch b WHERE b.consumer = p_consumer AND b.batch_no > p_batch_no
        RETURNING b.msg_id, b.num_attempts
    )
    SELECT array_agg(o.msg_id ORDER BY o.msg_id), array_agg(o.num_attempts ORDER BY o.msg_id)
    INTO v_ids, v_attempts FROM orphan o;
    FOR v_from IN 1..coalesce(cardinality(v_ids), 0) BY 50000 LOOP
        v_done := v_done + (SELECT count(*)
            FROM message_defer_many(v_ids[v_from:v_from + 49999],
                v_attempts[v_from:v_from + 49999]) r
            WHERE r.status = 'ok');
    END LOOP;
    RETURN v_done;
END;
$$;


-- 0034_spark_skips_schedules: a streaming read leaves schedules' drivers to the workers.
--
-- A schedule is a driver message in the reserved channel 'lonnymq.schedules' that is never
-- finished: a Worker fires it (creates the task, defers the driver to its next time). The
-- Spark streaming read took messages through message_dequeue_many from every channel, drivers
-- included, and finished them when their micro-batch committed: every schedule a streaming
-- query met was gone for good (found in review, with a Worker and a query on one queue).
--
-- spark_batch_plan now gives a driver back as it gives back a message past the horizon
-- (0024): held by the plan's transaction while it takes the rest, then returned at its own
-- dequeue_at with its attempt count as it was, so the plan passes it and a Worker fires it.
-- spark_batch_waiting no longer counts the drivers' channel (Trigger.AvailableNow would wait
-- for a driver it will never take).
CREATE OR REPLACE FUNCTION spark_batch_plan(
    p_consumer TEXT, p_start BIGINT, p_limit INTEGER, p_lock_ms BIGINT,
    p_max_id BIGINT DEFAULT NULL
) RETURNS TABLE (batch_no BIGINT, size BIGINT, acked BIGINT, released BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_batch BIGINT;
    v_taken BIGINT := 0;
    v_asked INTEGER;
    v_got INTEGER;
    v_seen INTEGER;
    v_late BIGINT[] := '{}';
    v_deadline TIMESTAMPTZ;
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_ats BIGINT[];
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    PERFORM arg_check(p_start BETWEEN 0 AND 9223372036854775806,
        format('start must be between 0 and 2^63 - 2, got %s', p_start));
    PERFORM arg_check(p_limit BETWEEN 1 AND 1000000,
        format('limit must be between 1 and 1000000, got %s', p_limit));
    PERFORM arg_check_lock_ms(p_lock_ms);
    v_batch := p_start + 1;
    v_deadline := clock_timestamp() + (p_lock_ms / 4) * INTERVAL '1 millisecond';

    acked := spark_batch_ack(p_consumer, p_start);
    released := spark_batch_release(p_consumer, p_start);

    LOOP
        v_asked := least(p_limit - v_taken, 10000, 10000 - cardinality(v_late));
        WITH taken AS (
            SELECT d.* FROM message_dequeue_many(v_asked, p_lock_ms) d
            WHERE d.id IS NOT NULL
        ), kept AS (
            INSERT INTO spark_batch (consumer, batch_no, msg_id, num_attempts, channel, content,
                                     state, dequeue_at)
            SELECT p_consumer, v_batch, t.id, t.num_attempts, t.channel, t.content, t.state,
                   t.dequeue_at
            FROM taken t
            WHERE (p_max_id IS NULL OR t.id <= p_max_id) AND t.channel <> 'lonnymq.schedules'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM taken),
               (SELECT count(*) FROM kept),
               v_late || coalesce(
                   (SELECT array_agg(t.id) FROM taken t
                    WHERE t.id > p_max_id OR t.channel = 'lonnymq.schedules'), '{}')
        INTO v_seen, v_got, v_late;
        v_taken := v_taken + v_got;
        EXIT WHEN v_taken >= p_limit
            -- Fewer than asked: nothing more to give now (or a busy channel ended the call).
            OR v_seen < v_asked
            OR cardinality(v_late) >= 10000
            OR clock_timestamp() >= v_deadline;
    END LOOP;

    IF cardinality(v_late) > 0 THEN
        SELECT array_agg(m.id ORDER BY m.id), array_agg(m.num_attempts ORDER BY m.id),
               array_agg(m.dequeue_at ORDER BY m.id)
        INTO v_ids, v_attempts, v_ats
        FROM message m WHERE m.id = ANY (v_late);
        v_ids := ARRAY(
            SELECT d.id FROM message_defer_many(v_ids, v_attempts, v_ats) d
            WHERE d.status = 'ok');
        UPDATE message m SET num_attempts = m.num_attempts - 1 WHERE m.id = ANY (v_ids);
    END IF;

    batch_no := CASE WHEN v_taken > 0 THEN v_batch ELSE p_start END;
    size := v_taken;
    RETURN NEXT;
END;
$$;


-- spark_batch_heartbeat(): as in 0004, a busy message counted neither way.
CREATE OR REPLACE FUNCTION spark_batch_heartbeat(p_consumer TEXT, p_lock_ms BIGINT)
RETURNS TABLE (extended BIGINT, lost BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_counts RECORD;
BEGIN
    SELECT array_agg(b.msg_id ORDER BY b.msg_id), array_agg(b.num_attempts ORDER BY b.msg_id)
    INTO v_ids, v_attempts
    FROM spark_batch b WHERE b.consumer = p_consumer;
    extended := 0; lost := 0;
    FOR v_from IN 1..coalesce(cardinality(v_ids), 0) BY 50000 LOOP
        SELECT count(*) FILTER (WHERE h.status = 'ok') AS ok,
               count(*) FILTER (WHERE h.status IN ('stale', 'not_found')) AS gone
        INTO v_counts
        FROM message_heartbeat_many(v_ids[v_from:v_from + 49999],
            v_attempts[v_from:v_from + 49999], p_lock_ms) h;
        extended := extended + v_counts.ok;
        lost := lost + v_counts.gone;
    END LOOP;
    RETURN NEXT;
END;
$$;


-- spark_batch_read(): the recorded messages of p_consumer's batches in (p_after, p_upto],
-- slice p_slice of p_slices (by id), in batch and id order.
CREATE OR REPLACE FUNCTION spark_batch_read(
    p_consumer TEXT, p_after BIGINT, p_upto BIGINT, p_slice INTEGER, p_slices INTEGER
) RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, num_attempts INTEGER,
    dequeue_at BIGINT, batch_no BIGINT
)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT b.msg_id, b.channel, b.content, b.state, b.num_attempts, b.dequeue_at, b.batch_no
    FROM spark_batch b
    WHERE b.consumer = p_consumer AND b.batch_no > p_after AND b.batch_no <= p_upto
      AND b.msg_id % p_slices = p_slice
    ORDER BY b.batch_no, b.msg_id
$$;


-- spark_scan_bounds(): the smallest and largest id of the message table ('message') or of
-- the archive ('archive'), for planning a parallel read. NULLs when it is empty.
CREATE OR REPLACE FUNCTION spark_scan_bounds(p_table TEXT) RETURNS TABLE (min_id BIGINT, max_id BIGINT)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_table IN ('message', 'archive'),
        format('table must be ''message'' or ''archive'', got %s', p_table));
    IF p_table = 'message' THEN
        RETURN QUERY SELECT min(m.id), max(m.id) FROM message m;
    ELSE
        RETURN QUERY SELECT min(a.id), max(a.id) FROM archive a;
    END IF;
END;
$$;


-- spark_message_scan(): the messages with p_lo <= id <= p_hi, in id order.
CREATE OR REPLACE FUNCTION spark_message_scan(p_lo BIGINT, p_hi BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, dedup_key TEXT, num_attempts INTEGER,
    dequeue_at BIGINT, is_locked BOOLEAN, unlock_at BIGINT, created_at BIGINT
)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT m.id, m.channel, m.content, m.state, m.dedup_key, m.num_attempts, m.dequeue_at,
           m.is_locked, m.unlock_at, m.created_at
    FROM message m WHERE m.id BETWEEN p_lo AND p_hi ORDER BY m.id
$$;


-- spark_archive_scan(): the archived messages with p_lo <= id <= p_hi, in id order.
CREATE OR REPLACE FUNCTION spark_archive_scan(p_lo BIGINT, p_hi BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, dedup_key TEXT, num_attempts INTEGER,
    outcome TEXT, error TEXT, created_at BIGINT, dequeue_at BIGINT, locked_at BIGINT,
    finished_at BIGINT
)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT a.id, a.channel, a.content, a.state, a.dedup_key, a.num_attempts, a.outcome, a.error,
           a.created_at, a.dequeue_at, a.locked_at, a.finished_at
    FROM archive a WHERE a.id BETWEEN p_lo AND p_hi ORDER BY a.id
$$;


-- 0014_spark_promote_lean: less work per row in a Spark write's commit (spark_write_commit).
--
-- 0008 read the write's staged rows four times besides the INSERT (validation, the per-channel
-- grouping, the RETURNING of every new row and its grouping, the scan for the slow path) and
-- cleared staging with a DELETE of every row. Now:
-- * one scan both validates the rows and groups them per channel (earliest due time, whether
--   any row carries a dedup key); the named checks run only when a row is bad;
-- * the INSERT returns nothing: each channel's earliest new message comes from that scan, and
--   the one event of the write names the first new message of its channel, looked up by
--   primary key above an id drawn before the INSERT (every later id of a locked channel is
--   this write's: creating a message locks its channel row first);
-- * the slow path (message_create_many) scans staging only when a channel needs it;
-- * staging is emptied with TRUNCATE when it holds nothing but this write (no other write's
--   tasks staged, none is COPYing: the exclusive lock is taken without waiting, else the rows
--   are deleted as before).
-- Same arguments, results, locks and outcome as 0008.


-- spark_stage_clear_fast(): spark_stage_clear for a commit. When staging holds rows of no other
-- write and nobody else uses the table (the exclusive lock is taken without waiting; a task
-- COPYing holds a conflicting lock), TRUNCATE empties it at once, leaving no dead rows behind;
-- otherwise the write's rows are deleted. The lock is then held to the end of the transaction:
-- tasks of other writes wait for it before they stage.
CREATE OR REPLACE FUNCTION spark_stage_clear_fast(p_write_id TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    BEGIN
        LOCK TABLE spark_stage IN ACCESS EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        PERFORM spark_stage_clear(p_write_id);
        RETURN;
    END;
    -- Staged rows always come with their task's record (one transaction writes both, and
    -- every clear and purge removes both).
    IF EXISTS (SELECT 1 FROM spark_stage_task t WHERE t.write_id <> p_write_id) THEN
        PERFORM spark_stage_clear(p_write_id);
        RETURN;
    END IF;
    TRUNCATE spark_stage;
    DELETE FROM spark_stage_task t WHERE t.write_id = p_write_id;
END;
$$;


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
CREATE OR REPLACE FUNCTION spark_write_claim(p_write_id TEXT) RETURNS VOID
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


CREATE OR REPLACE FUNCTION spark_batch_waiting(p_max_id BIGINT, p_due_by BIGINT)
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
        WHERE c.next_dequeue_at IS NOT NULL AND c.name <> 'lonnymq.schedules'
          AND (c.has_policy OR c.next_dequeue_at <= v_now)
          AND c.max_concurrency IS DISTINCT FROM 0
          AND h.id <= p_max_id AND h.dequeue_at <= p_due_by;
END;
$$;


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
CREATE OR REPLACE FUNCTION spark_consumer_claim(
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

-- 85_maintenance.sql
-- 0006_verify: a read-only consistency check of the channel rows against the message rows.
--
-- Since 0002 the two kinds of channel keep different state, so they are checked differently:
--
-- * A channel with a policy (has_policy) keeps exact counters under its row lock:
--   current_size is the number of its messages, current_concurrency the number of its locked
--   messages while max_concurrency is set (0 otherwise). Its next_dequeue_at must not be later
--   than max(head's dequeue_at, last_dequeue_at + release_interval_ms), the time every
--   operation on it computes (it may be earlier: a visit then finds nothing and recomputes).
-- * A channel without one keeps no counters (both stay 0). Its row exists while it may hold
--   waiting messages and says when it is next worth a visit. Its next_dequeue_at must not be
--   later than its head's dequeue_at, with one bounded exception: a dequeue that cannot take
--   the channel's exclusive advisory lock (someone is creating in it) pushes the time at most
--   10 ms past its own clock, so a row up to 10 ms ahead of the clock is not reported.
--   A row may outlive the channel's last waiting message (a dequeue that could not take the
--   advisory lock, a schedule removed): it keeps a time, so the dequeue that visits it then
--   deletes it. Only a row with no time (never visited, never deleted) counts as orphaned.
--
-- A waiting (unlocked) message whose channel has no row, a row with no time, or a time later
-- than allowed is stranded: no dequeue would find it. That is what "lost" means here.

-- queue_verify(): one row per discrepancy between the channel rows and the message rows:
-- the channel, a kind, the expected and the actual value (NULL where there is none) and a
-- sentence. Kinds:
--   size_mismatch       current_size differs from the channel's message count (policy), or
--                       is not 0 (no policy);
--   in_flight_mismatch  current_concurrency differs from the channel's locked messages
--                       (policy with max_concurrency), or is not 0 (otherwise);
--   channel_missing     waiting messages but no channel row (expected: the head's dequeue_at);
--   head_unscheduled    waiting messages but next_dequeue_at is NULL;
--   head_late           next_dequeue_at later than allowed (expected: the latest allowed);
--   orphan_channel      a policy-free row with no waiting message and no next_dequeue_at;
--   stray_policy        a policy-free row with policy values set;
--   bad_lock            a message whose lock is inconsistent (locked without unlock_at or the
--                       other way round, locked with num_attempts < 1, negative attempts);
--                       the detail names the message.
-- It reads everything in one statement (STABLE: one snapshot); run it in a REPEATABLE READ,
-- READ ONLY transaction to keep it apart from concurrent writers. It scans both tables: an
-- operator's tool, not a hot path.
-- Locks: none beyond reading. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION queue_verify()
RETURNS TABLE (channel TEXT, kind TEXT, expected BIGINT, actual BIGINT, detail TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    WITH clock AS (
        -- The clock as the check runs (after its snapshot), not as its transaction started:
        -- every time a committed operation wrote is then at most this.
        SELECT epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
            AS now_ms
    ), counted AS (
        SELECT m.channel, count(*) AS total, count(*) FILTER (WHERE m.is_locked) AS locked
        FROM message m
        GROUP BY m.channel
    ), head AS (
        SELECT DISTINCT ON (m.channel) m.channel, m.id, m.dequeue_at
        FROM message m
        WHERE NOT m.is_locked
        ORDER BY m.channel, m.dequeue_at, m.id
    ), state AS (
        SELECT coalesce(c.name, n.channel) AS name,
               c.name IS NOT NULL AS has_row,
               coalesce(c.has_policy, FALSE) AS has_policy,
               c.max_concurrency, c.release_interval_ms, c.max_size,
               c.current_size, c.current_concurrency, c.next_dequeue_at, c.last_dequeue_at,
               coalesce(n.total, 0) AS total, coalesce(n.locked, 0) AS locked,
               h.id AS head_id, h.dequeue_at AS head_at,
               CASE WHEN coalesce(c.has_policy, FALSE)
                    THEN greatest(h.dequeue_at,
                        c.last_dequeue_at + coalesce(c.release_interval_ms, 0))
                    ELSE greatest(h.dequeue_at, (SELECT k.now_ms FROM clock k) + 10)
               END AS latest_at
        FROM channel c
        FULL JOIN counted n ON n.channel = c.name
        LEFT JOIN head h ON h.channel = coalesce(c.name, n.channel)
    )
    SELECT r.channel, r.kind, r.expected, r.actual, r.detail
    FROM (
        SELECT s.name AS channel, 'size_mismatch' AS kind,
               CASE WHEN s.has_policy THEN s.total ELSE 0 END AS expected,
               s.current_size AS actual,
               CASE WHEN s.has_policy
                    THEN format('current_size is %s but the channel holds %s messages',
                        s.current_size, s.total)
                    ELSE format('a channel without a policy keeps no size, but current_size is %s',
                        s.current_size)
               END AS detail
        FROM state s
        WHERE s.has_row
          AND s.current_size <> CASE WHEN s.has_policy THEN s.total ELSE 0 END
        UNION ALL
        SELECT s.name, 'in_flight_mismatch',
               CASE WHEN s.max_concurrency IS NOT NULL THEN s.locked ELSE 0 END,
               s.current_concurrency,
               CASE WHEN s.max_concurrency IS NOT NULL
                    THEN format('current_concurrency is %s but %s messages are locked',
                        s.current_concurrency, s.locked)
                    ELSE format('a channel without max_concurrency keeps no in-flight count, '
                        'but current_concurrency is %s', s.current_concurrency)
               END
        FROM state s
        WHERE s.has_row
          AND s.current_concurrency
              <> CASE WHEN s.max_concurrency IS NOT NULL THEN s.locked ELSE 0 END
        UNION ALL
        SELECT s.name, 'channel_missing', s.head_at, NULL::BIGINT,
               format('message %s waits (due at %s) but the channel has no row: '
                   'no dequeue will find it', s.head_id, s.head_at)
        FROM state s
        WHERE NOT s.has_row AND s.head_id IS NOT NULL
        UNION ALL
        SELECT s.name, 'head_unscheduled', s.latest_at, NULL::BIGINT,
               format('message %s waits (due at %s) but next_dequeue_at is NULL: '
                   'no dequeue will find it', s.head_id, s.head_at)
        FROM state s
        WHERE s.has_row AND s.head_id IS NOT NULL AND s.next_dequeue_at IS NULL
        UNION ALL
        SELECT s.name, 'head_late', s.latest_at, s.next_dequeue_at,
               format('message %s is due at %s but next_dequeue_at is %s, later than %s',
                   s.head_id, s.head_at, s.next_dequeue_at, s.latest_at)
        FROM state s
        WHERE s.has_row AND s.head_id IS NOT NULL AND s.next_dequeue_at > s.latest_at
        UNION ALL
        SELECT s.name, 'orphan_channel', NULL::BIGINT, NULL::BIGINT,
               format('a channel row without a policy, without a waiting message (%s locked) '
                   'and without next_dequeue_at: no dequeue will ever remove it', s.locked)
        FROM state s
        WHERE s.has_row AND NOT s.has_policy AND s.head_id IS NULL
          AND s.next_dequeue_at IS NULL
        UNION ALL
        SELECT s.name, 'stray_policy', NULL::BIGINT, NULL::BIGINT,
               format('has_policy is false but max_concurrency=%s, release_interval_ms=%s, '
                   'max_size=%s', s.max_concurrency, s.release_interval_ms, s.max_size)
        FROM state s
        WHERE s.has_row AND NOT s.has_policy
          AND (s.max_concurrency IS NOT NULL OR s.release_interval_ms IS NOT NULL
               OR s.max_size IS NOT NULL)
        UNION ALL
        SELECT m.channel, 'bad_lock',
               CASE WHEN m.is_locked THEN 1 ELSE 0 END, m.num_attempts::BIGINT,
               format('message %s: is_locked=%s, unlock_at=%s, num_attempts=%s',
                   m.id, m.is_locked, coalesce(m.unlock_at::TEXT, 'NULL'), m.num_attempts)
        FROM message m
        WHERE m.is_locked <> (m.unlock_at IS NOT NULL)
           OR (m.is_locked AND m.num_attempts < 1)
           OR m.num_attempts < 0
    ) r
    ORDER BY r.channel, r.kind, r.detail
$$;


-- 0017_maintenance: which of the queue's high-churn tables need a VACUUM now.
--
-- Every dequeue rewrites its channel's row (its next dequeue time and turn are indexed, so the
-- update is never HOT) and every message leaves two dead row versions behind (the lock, then
-- the delete). Autovacuum looks at a table once a minute at best, and may be off: meanwhile the
-- channel table of a busy queue grows many times over and each dequeue walks more dead index
-- entries. Measured on this project's machine (pgbench, 8 clients finishing and taking one
-- message over 100 channels): 2,113 → 1,909 → 1,345 calls/s over three 8-second runs without
-- a VACUUM, 2,452 and 2,797 right after one. So the worker runtime vacuums them itself
-- (Queue.maintain), and asks this function first which ones are due.

-- maintenance_due(): the tables among channel and message that hold at least 200 (channel) or
-- 2,000 (message) dead row versions plus one per 20 live rows, as the statistics collector
-- counts them, and that the session's login role may vacuum (it has their owner's
-- privileges: VACUUM needs them). Read-only; the caller runs VACUUM on each name returned.
CREATE OR REPLACE FUNCTION maintenance_due() RETURNS TABLE (table_name TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.relname::TEXT
    FROM pg_catalog.pg_class c
    LEFT JOIN pg_catalog.pg_stat_all_tables s ON s.relid = c.oid
    WHERE c.relnamespace = (SELECT n.oid FROM pg_catalog.pg_namespace n
                            WHERE n.nspname = pg_catalog.current_schema())
      AND c.relname IN ('channel', 'message')
      AND pg_catalog.pg_has_role(session_user, c.relowner, 'USAGE')
      AND coalesce(s.n_dead_tup, 0)
          >= CASE c.relname WHEN 'channel' THEN 200 ELSE 2000 END
             + coalesce(s.n_live_tup, 0) / 20
    ORDER BY c.relname
$$;

-- 90_security.sql
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


-- role_check(): the oid of role p_role, which may be granted a kind here. Raises LQ003 when
-- the role does not exist, is a superuser (no privilege limits it) or owns the queue (its
-- rights come from ownership; revoking them would break the queue).
CREATE OR REPLACE FUNCTION role_check(p_role TEXT) RETURNS OID
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_role pg_roles;
BEGIN
    SELECT * INTO v_role FROM pg_roles r WHERE r.rolname = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'role % does not exist (create it first: CREATE ROLE ... LOGIN)',
            coalesce(quote_ident(p_role), 'NULL')
            USING ERRCODE = 'LQ003';
    END IF;
    IF v_role.rolsuper THEN
        RAISE EXCEPTION 'role % is a superuser: no privilege limits it', quote_ident(p_role)
            USING ERRCODE = 'LQ003';
    END IF;
    IF v_role.oid = (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = current_schema())
        OR v_role.oid = (SELECT c.relowner FROM pg_class c WHERE c.oid = 'message'::regclass)
    THEN
        RAISE EXCEPTION 'role % owns the queue and may already do everything',
            quote_ident(p_role)
            USING ERRCODE = 'LQ003';
    END IF;
    RETURN v_role.oid;
END;
$$;


-- role_strip(): take every right on the queue's schema and its objects from p_role.
CREATE OR REPLACE FUNCTION role_strip(p_role TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
BEGIN
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON SCHEMA %I FROM %I', v_schema, p_role);
END;
$$;


-- role_apply(): give p_role exactly the rights of kind p_kind: USAGE on the schema, EXECUTE on
-- the kind's functions, INSERT on spark_stage (the Spark writer's COPY target: rows land
-- there for the writer's own spark_write_commit to promote; a producer may create messages
-- anyway). Returns how many functions were granted.
CREATE OR REPLACE FUNCTION role_apply(p_role TEXT, p_kind TEXT) RETURNS INTEGER
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
    v_function RECORD;
    v_count INTEGER := 0;
BEGIN
    PERFORM role_strip(p_role);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
    FOR v_function IN
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args
        FROM pg_proc p
        WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = v_schema)
          AND p.proname = ANY (role_kind_functions(p_kind))
        ORDER BY p.proname
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.%I(%s) TO %I',
            v_schema, v_function.proname, v_function.args, p_role);
        v_count := v_count + 1;
    END LOOP;
    EXECUTE format('GRANT INSERT ON TABLE %I.spark_stage TO %I', v_schema, p_role);
    RETURN v_count;
END;
$$;


-- role_grant(): make p_role a p_kind of this queue ('producer', 'worker' or 'admin'),
-- replacing any kind it had. Returns how many functions it may now execute.
-- Raises: LQ003 (unknown kind; role missing, superuser or the queue's owner).
CREATE OR REPLACE FUNCTION role_grant(p_role TEXT, p_kind TEXT) RETURNS INTEGER
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_oid OID;
    v_count INTEGER;
BEGIN
    PERFORM arg_check(p_kind IN ('producer', 'worker', 'admin'),
        format('kind must be producer, worker or admin, got %s',
               coalesce(quote_literal(p_kind), 'NULL')));
    v_oid := role_check(p_role);
    v_count := role_apply(p_role, p_kind);
    INSERT INTO role_grant AS g (role_oid, kind, granted_at) VALUES (v_oid, p_kind, epoch())
    ON CONFLICT (role_oid) DO UPDATE SET kind = excluded.kind, granted_at = excluded.granted_at;
    RETURN v_count;
END;
$$;


-- role_revoke(): take every right on this queue from p_role. Returns whether it had a kind.
-- Raises: LQ003 (role missing, superuser or the queue's owner).
CREATE OR REPLACE FUNCTION role_revoke(p_role TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_oid OID := role_check(p_role);
BEGIN
    PERFORM role_strip(p_role);
    DELETE FROM role_grant g WHERE g.role_oid = v_oid;
    RETURN FOUND;
END;
$$;


-- role_list(): the roles granted a kind, by name.
CREATE OR REPLACE FUNCTION role_list() RETURNS TABLE (role_name TEXT, kind TEXT, granted_at BIGINT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT r.rolname::TEXT, g.kind, g.granted_at
    FROM role_grant g JOIN pg_roles r ON r.oid = g.role_oid
    ORDER BY r.rolname
$$;


-- secure_functions(): make every function of the schema run as its owner with the pinned
-- search_path, executable by no one but the roles granted it; close the tables, sequences and
-- CREATE on the schema to PUBLIC; re-apply the recorded grants. Idempotent; every migration
-- that creates or replaces functions ends with SELECT secure_functions().
CREATE OR REPLACE FUNCTION secure_functions() RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
    v_function RECORD;
    v_grant RECORD;
BEGIN
    FOR v_function IN
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args
        FROM pg_proc p
        WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = v_schema)
          AND p.prokind = 'f'
          -- Plain SQL helpers the planner inlines into their callers (0010_lean_calls): a
          -- SET clause or SECURITY DEFINER would stop that. They name pg_catalog themselves,
          -- touch no table, and lose EXECUTE for PUBLIC below like every function.
          AND p.proname <> ALL (ARRAY['channel_key'])
    LOOP
        EXECUTE format(
            'ALTER FUNCTION %I.%I(%s) SECURITY DEFINER SET search_path = %I, pg_catalog, pg_temp',
            v_schema, v_function.proname, v_function.args, v_schema);
    END LOOP;
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', v_schema);
    DELETE FROM role_grant g WHERE NOT EXISTS (SELECT FROM pg_roles r WHERE r.oid = g.role_oid);
    FOR v_grant IN
        SELECT r.rolname, g.kind FROM role_grant g JOIN pg_roles r ON r.oid = g.role_oid
    LOOP
        PERFORM role_apply(v_grant.rolname, v_grant.kind);
    END LOOP;
END;
$$;
SELECT secure_functions();
INSERT INTO "lonnymq_frozen".function_source (sha256, catalog_md5) VALUES ('49226ac1cb215e041b863829f50ee06f96871eb30a7dc35c4a889a4fc2e35bab', (SELECT md5(coalesce(string_agg(p.oid::TEXT || ':' || p.xmin::TEXT, ',' ORDER BY p.oid), '')) FROM pg_proc p WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = 'lonnymq_frozen'))) ON CONFLICT (singleton) DO UPDATE SET sha256 = excluded.sha256, catalog_md5 = excluded.catalog_md5, applied_at = now();
COMMIT;
