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
