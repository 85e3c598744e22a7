-- 0004_spark: what the PySpark data source (lonnymq.spark) needs in the database.
--
-- Spark retries tasks, runs speculative twins and replays streaming micro-batches after a
-- restart, and a Python task's writes are durable before Spark decides which attempt won. So
-- a Spark write never creates messages from its tasks: each task stages its rows (binary COPY
-- into spark_stage) and the driver promotes the winning attempts' rows in one transaction,
-- recorded in spark_commit so that a commit that runs twice enqueues once. A streaming read
-- records each planned micro-batch in spark_batch, so that a replayed batch yields the same
-- messages, and finishes them only once Spark has committed the batch.
--
-- Everything is reached through the functions below (named spark_<noun>_<verb>).

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


-- message_heartbeat_many(): extend the locks of many messages you hold to now + p_lock_ms.
-- Each is checked on its own, like message_heartbeat: 'ok', 'stale' (not locked, or locked by
-- a later attempt) or 'not_found', per id in input order; a stale one is left alone.
-- Locks: the message rows, in id order (so two callers cannot deadlock).
-- Raises: LQ003 (bad lock_ms, mismatched arrays, NULL ids or attempts).
CREATE FUNCTION message_heartbeat_many(
    p_ids BIGINT[], p_num_attempts INTEGER[], p_lock_ms BIGINT
) RETURNS TABLE (id BIGINT, status TEXT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
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
    v_unlock_at := epoch() + p_lock_ms;

    RETURN QUERY
    WITH claim AS (
        SELECT t.id, t.num_attempts, t.ord
        FROM unnest(p_ids, p_num_attempts) WITH ORDINALITY AS t(id, num_attempts, ord)
    ), held AS (
        SELECT m.id FROM message m JOIN claim c ON c.id = m.id
        WHERE m.is_locked AND m.num_attempts = c.num_attempts
        ORDER BY m.id
        FOR UPDATE OF m
    ), extended AS (
        UPDATE message m SET unlock_at = v_unlock_at
        FROM held h
        WHERE m.id = h.id
        RETURNING m.id
    )
    SELECT c.id,
           CASE WHEN e.id IS NOT NULL THEN 'ok'
                WHEN EXISTS (SELECT 1 FROM message m WHERE m.id = c.id) THEN 'stale'
                ELSE 'not_found' END
    FROM claim c LEFT JOIN extended e ON e.id = c.id
    ORDER BY c.ord;
END;
$$;


-- spark_stage_record(): a write task staged p_n_rows rows under (p_write_id, p_task_tag);
-- called in the transaction of its COPY. Raises: LQ003 (missing ids, negative count).
CREATE FUNCTION spark_stage_record(p_write_id TEXT, p_task_tag TEXT, p_n_rows BIGINT)
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
CREATE FUNCTION spark_stage_clear(p_write_id TEXT) RETURNS BIGINT
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
CREATE FUNCTION spark_stage_purge(p_older_than_ms BIGINT) RETURNS BIGINT
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


-- spark_write_commit(): commit a Spark write: enqueue the rows that the winning task attempts
-- (p_task_tags) staged under p_write_id, once per (p_sink_id, p_batch_id), and clear the
-- write's staging. Rows go through message_create_many in chunks ordered by channel (so
-- channel rows are locked in name order across chunks, as one call would), and keep their
-- task's order within a channel.
-- staged is the number of rows found for those tags: the caller compares it with what the
-- tasks reported and rolls back when they differ. When the commit was already recorded,
-- is_new is FALSE and nothing is enqueued. dropped_channels names up to 20 channels that
-- refused messages for their max_size.
-- Locks: the commit record, then channel rows in name order. Raises: LQ003, LQ005, LQ006
-- (a staged row that is not a valid message).
CREATE FUNCTION spark_write_commit(
    p_sink_id TEXT, p_batch_id BIGINT, p_write_id TEXT, p_task_tags TEXT[],
    p_chunk INTEGER DEFAULT 50000
) RETURNS TABLE (
    is_new BOOLEAN, staged BIGINT, created BIGINT, deduplicated BIGINT, dropped BIGINT,
    dropped_channels TEXT[]
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_chunk RECORD;
    v_result RECORD;
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
    IF is_new THEN
        FOR v_chunk IN
            WITH rows AS (
                SELECT s.channel, s.content, s.dequeue_at, s.dedup_key,
                       (row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) - 1)
                           / p_chunk AS part,
                       row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) AS ord
                FROM spark_stage s
                WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
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
    END IF;
    PERFORM spark_stage_clear(p_write_id);
    RETURN NEXT;
END;
$$;

-- spark_write_result(): what the commit of (p_sink_id, p_batch_id) enqueued; no row when it
-- was not committed (or was purged).
CREATE FUNCTION spark_write_result(p_sink_id TEXT, p_batch_id BIGINT)
RETURNS TABLE (created BIGINT, deduplicated BIGINT, dropped BIGINT, committed_at BIGINT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.created, c.deduplicated, c.dropped, c.committed_at
    FROM spark_commit c WHERE c.sink_id = p_sink_id AND c.batch_id = p_batch_id
$$;

-- spark_sink_prune(): forget a streaming sink's commit records older than its last p_keep
-- micro-batches (Spark only ever replays the last one or two).
CREATE FUNCTION spark_sink_prune(p_sink_id TEXT, p_batch_id BIGINT, p_keep INTEGER)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM spark_commit c
    WHERE c.sink_id = p_sink_id AND c.batch_id < p_batch_id - p_keep;
END;
$$;


-- spark_consumer_lock(): take the session advisory lock that makes p_consumer this session's
-- (released when the session ends, so a killed query frees it). FALSE when another session
-- holds it: two streaming queries must not share a consumer.
CREATE FUNCTION spark_consumer_lock(p_consumer TEXT) RETURNS BOOLEAN
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
CREATE FUNCTION spark_batch_ack(p_consumer TEXT, p_batch_no BIGINT) RETURNS BIGINT
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
CREATE FUNCTION spark_batch_release(p_consumer TEXT, p_batch_no BIGINT) RETURNS BIGINT
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

-- spark_batch_plan(): plan p_consumer's micro-batch after batch p_start. In one transaction:
-- finish batches <= p_start (Spark asks for the next batch only once the previous one is in
-- its commit log), give back orphan batches > p_start, then lock up to p_limit messages for
-- p_lock_ms and record them as batch p_start + 1. With p_max_id (Trigger.AvailableNow),
-- messages created after the query started are given back at once, keeping their place.
-- Returns the batch number planned (p_start when nothing was ready) and its size.
-- Locks: as message_delete_many, message_defer_many and message_dequeue_many.
-- Raises: LQ003 (bad consumer, start, limit or lock_ms).
CREATE FUNCTION spark_batch_plan(
    p_consumer TEXT, p_start BIGINT, p_limit INTEGER, p_lock_ms BIGINT,
    p_max_id BIGINT DEFAULT NULL
) RETURNS TABLE (batch_no BIGINT, size BIGINT, acked BIGINT, released BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_batch BIGINT := p_start + 1;
    v_taken BIGINT := 0;
    v_got INTEGER;
    v_late_ids BIGINT[];
    v_late_attempts INTEGER[];
    v_late_ats BIGINT[];
BEGIN
    PERFORM arg_check(p_consumer IS NOT NULL AND char_length(p_consumer) BETWEEN 1 AND 255,
        'consumer must be 1 to 255 characters');
    PERFORM arg_check(p_start >= 0, format('start must be >= 0, got %s', p_start));
    PERFORM arg_check(p_limit BETWEEN 1 AND 1000000,
        format('limit must be between 1 and 1000000, got %s', p_limit));
    PERFORM arg_check_lock_ms(p_lock_ms);

    acked := spark_batch_ack(p_consumer, p_start);
    released := spark_batch_release(p_consumer, p_start);

    WHILE v_taken < p_limit LOOP
        WITH taken AS (
            SELECT d.* FROM message_dequeue_many(least(p_limit - v_taken, 10000)::INTEGER,
                p_lock_ms) d
            WHERE d.id IS NOT NULL
        ), kept AS (
            INSERT INTO spark_batch (consumer, batch_no, msg_id, num_attempts, channel, content,
                                     state, dequeue_at)
            SELECT p_consumer, v_batch, t.id, t.num_attempts, t.channel, t.content, t.state,
                   t.dequeue_at
            FROM taken t WHERE p_max_id IS NULL OR t.id <= p_max_id
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM kept),
               (SELECT array_agg(t.id ORDER BY t.id) FROM taken t WHERE t.id > p_max_id),
               (SELECT array_agg(t.num_attempts ORDER BY t.id) FROM taken t
                WHERE t.id > p_max_id),
               (SELECT array_agg(t.dequeue_at ORDER BY t.id) FROM taken t
                WHERE t.id > p_max_id)
        INTO v_got, v_late_ids, v_late_attempts, v_late_ats;
        IF v_late_ids IS NOT NULL THEN
            PERFORM message_defer_many(v_late_ids, v_late_attempts, v_late_ats);
            -- Messages past the horizon are at the heads of their channels now: stop here
            -- rather than take them again.
            v_taken := v_taken + v_got;
            EXIT;
        END IF;
        EXIT WHEN v_got = 0;
        v_taken := v_taken + v_got;
        EXIT WHEN v_got < least(p_limit - (v_taken - v_got), 10000);
    END LOOP;

    batch_no := CASE WHEN v_taken > 0 THEN v_batch ELSE p_start END;
    size := v_taken;
    RETURN NEXT;
END;
$$;

-- spark_batch_heartbeat(): extend the locks of every message p_consumer has planned and not
-- finished. Returns how many were extended and how many were lost (stale or gone).
CREATE FUNCTION spark_batch_heartbeat(p_consumer TEXT, p_lock_ms BIGINT)
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
               count(*) FILTER (WHERE h.status <> 'ok') AS gone
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
CREATE FUNCTION spark_batch_read(
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
CREATE FUNCTION spark_scan_bounds(p_table TEXT) RETURNS TABLE (min_id BIGINT, max_id BIGINT)
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
CREATE FUNCTION spark_message_scan(p_lo BIGINT, p_hi BIGINT)
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
CREATE FUNCTION spark_archive_scan(p_lo BIGINT, p_hi BIGINT)
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
