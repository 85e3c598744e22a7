-- What the PySpark data source (lonnymq.spark) calls, named spark_<noun>_<verb>.
--
-- A Spark write never creates messages from its tasks: each task stages its rows (binary COPY
-- into spark_stage, recorded with spark_stage_record) and the driver's commit promotes the
-- winning attempts' rows in one transaction, recorded in spark_commit, so that a commit that
-- runs twice enqueues once. A streaming read records each planned micro-batch in spark_batch,
-- so that a replayed batch yields the same messages, and finishes them only once Spark has
-- committed the batch; its consumer belongs to one checkpoint (spark_consumer). Sink names are
-- claimed by one streaming query or by batch writes (spark_sink), so that two writers never
-- skip each other's batches in silence.


-- spark_stage_record(): a write task staged p_n_rows rows under (p_write_id, p_task_tag);
-- called in the transaction of its COPY.
-- Locks: the task's spark_stage_task row. Raises: LQ003 (missing ids, negative count).
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
-- Locks: the write's staged rows. Raises: nothing of ours.
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
-- Returns the staged rows removed.
-- Locks: the rows it deletes. Raises: LQ003 (negative or NULL age).
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


-- spark_write_commit(): commit a Spark write: enqueue the rows that the winning task attempts
-- (p_task_tags) staged under p_write_id, once per (p_sink_id, p_batch_id), and clear the
-- write's staging. staged is the number of rows found for those tags: the caller compares it
-- with what the tasks reported and rolls back when they differ. When the commit was already
-- recorded, is_new is FALSE and nothing is enqueued. dropped_channels names up to 20 channels
-- that refused messages for their max_size.
-- A channel without a policy none of whose rows carries a dedup key is promoted the fast way,
-- with one INSERT ... SELECT from staging (nothing can refuse or deduplicate its rows: ids in
-- task order, input order within a task) and made due at its earliest new message; the other
-- channels go through message_create_many, whole, in chunks ordered by channel. One scan both
-- validates the rows and groups them per channel; the INSERT returns nothing (the one event of
-- the write names the first new message of its channel, looked up above an id drawn before the
-- INSERT: every later id of a locked channel is this write's).
-- Locks: the commit record, then every channel row of the write in name order (has_policy is
-- read under it, so channel_policy_set waits for the commit and then counts the new messages;
-- holding the row also keeps dequeues from moving the channel to the back meanwhile); staging
-- as spark_stage_clear_fast. Raises: LQ003, LQ005, LQ006 (a staged row that is not a valid
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

    -- Bring each fast channel's next dequeue time forward to its earliest new message, and
    -- announce the one that got servable soonest (channel_wait_many, as message_create_many).
    PERFORM channel_wait_many(v_before, v_fast,
        array_fill(0::BIGINT, ARRAY[cardinality(v_fast)]), v_fast_ats,
        array_fill(v_floor, ARRAY[cardinality(v_fast)]), 'created');

    -- The other channels: through message_create_many (only when there are any).
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
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION spark_write_result(p_sink_id TEXT, p_batch_id BIGINT)
RETURNS TABLE (created BIGINT, deduplicated BIGINT, dropped BIGINT, committed_at BIGINT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.created, c.deduplicated, c.dropped, c.committed_at
    FROM spark_commit c WHERE c.sink_id = p_sink_id AND c.batch_id = p_batch_id
$$;


-- spark_sink_prune(): forget a streaming sink's commit records older than its last p_keep
-- micro-batches (Spark only ever replays the last one or two). A p_batch_id so low that
-- p_batch_id - p_keep does not fit a BIGINT prunes nothing.
-- Locks: the rows it deletes. Raises: LQ003 (p_keep outside 0 to 2^31 - 1).
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
-- Locks: the consumer's session advisory lock (tried). Raises: LQ003 (bad consumer name).
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


-- spark_batch_close(): forget p_consumer's batches up to p_batch_no (p_ack) or after it (not
-- p_ack), and finish (p_ack) or give back, due now with their attempts kept, the messages
-- they hold. A message whose lock was lost meanwhile (another consumer holds it now) is left
-- alone. Returns how many were finished or given back.
-- Locks: as message_delete_many or message_defer_many. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION spark_batch_close(p_consumer TEXT, p_batch_no BIGINT, p_ack BOOLEAN)
RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids BIGINT[];
    v_attempts INTEGER[];
    v_done BIGINT := 0;
BEGIN
    WITH closed AS (
        DELETE FROM spark_batch b
        WHERE b.consumer = p_consumer
          AND CASE WHEN p_ack THEN b.batch_no <= p_batch_no ELSE b.batch_no > p_batch_no END
        RETURNING b.msg_id, b.num_attempts
    )
    SELECT array_agg(c.msg_id ORDER BY c.msg_id), array_agg(c.num_attempts ORDER BY c.msg_id)
    INTO v_ids, v_attempts FROM closed c;
    -- The batch functions take at most 100000 ids per call. Of the two branches below, only
    -- the one whose condition holds runs (a constant false filter is tested first).
    FOR v_from IN 1..coalesce(cardinality(v_ids), 0) BY 50000 LOOP
        v_done := v_done + (SELECT count(*)
            FROM (SELECT d.status FROM message_delete_many(v_ids[v_from:v_from + 49999],
                      v_attempts[v_from:v_from + 49999]) d
                  WHERE p_ack
                  UNION ALL
                  SELECT r.status FROM message_defer_many(v_ids[v_from:v_from + 49999],
                      v_attempts[v_from:v_from + 49999]) r
                  WHERE NOT p_ack) x
            WHERE x.status = 'ok');
    END LOOP;
    RETURN v_done;
END;
$$;


-- spark_batch_ack(): finish the messages of p_consumer's batches up to p_batch_no (Spark has
-- committed them) and forget those batches (spark_batch_close). Returns how many were finished.
-- Locks: as message_delete_many. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION spark_batch_ack(p_consumer TEXT, p_batch_no BIGINT) RETURNS BIGINT
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT spark_batch_close(p_consumer, p_batch_no, TRUE)
$$;


-- spark_batch_plan(): plan p_consumer's micro-batch after batch p_start. In one transaction:
-- finish batches <= p_start (Spark asks for the next batch only once the previous one is in
-- its commit log), give back orphan batches > p_start, then lock up to p_limit messages for
-- p_lock_ms and record them as batch p_start + 1. With p_max_id (Trigger.AvailableNow),
-- messages created after the query started stay locked by this transaction while it takes the
-- rest (so the dequeues that follow pass them) and are then given back at their own dequeue_at
-- with their attempt count as it was. Schedules' drivers are given back the same way: they are
-- never finished, a Worker fires them.
-- Returns the batch number planned (p_start when nothing was ready) and its size.
-- Locks: as message_delete_many, message_defer_many and message_dequeue_many.
-- Raises: LQ003 (bad consumer, start, limit or lock_ms).
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
    released := spark_batch_close(p_consumer, p_start, FALSE);

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


-- spark_batch_heartbeat(): extend the locks of every message p_consumer has planned and not
-- finished. Returns how many were extended and how many were lost (stale or gone); a message
-- another transaction holds now is counted neither way.
-- Locks: as message_heartbeat_many. Raises: LQ003 (bad lock_ms).
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
-- Locks: none. Raises: nothing of ours.
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
-- Locks: none. Raises: LQ003 (another table).
CREATE OR REPLACE FUNCTION spark_scan_bounds(p_table TEXT) RETURNS TABLE (min_id BIGINT, max_id BIGINT)
LANGUAGE plpgsql
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
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION spark_message_scan(p_lo BIGINT, p_hi BIGINT)
RETURNS TABLE (
    id BIGINT, channel TEXT, content BYTEA, state BYTEA, dedup_key TEXT, num_attempts INTEGER,
    dequeue_at BIGINT, is_locked BOOLEAN, unlock_at BIGINT, created_at BIGINT
)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT m.id, m.channel, m.content, m.state, m.dedup_key, m.num_attempts, m.dequeue_at,
           m.is_locked, m.unlock_at, m.created_at
    FROM message m WHERE m.id BETWEEN p_lo AND p_hi ORDER BY m.id
$$;


-- spark_archive_scan(): the archived messages with p_lo <= id <= p_hi, in id order.
-- Locks: none. Raises: nothing of ours.
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


-- spark_stage_clear_fast(): spark_stage_clear for a commit. When staging holds rows of no other
-- write and nobody else uses the table (the exclusive lock is taken without waiting; a task
-- COPYing holds a conflicting lock), TRUNCATE empties it at once, leaving no dead rows behind;
-- otherwise the write's rows are deleted. The lock is then held to the end of the transaction:
-- tasks of other writes wait for it before they stage.
-- Locks: spark_stage ACCESS EXCLUSIVE (tried, NOWAIT) or the write's rows. Raises: nothing of
-- ours.
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


-- spark_sink_claim(): record that query p_query_id writes through p_sink_id, or refuse when
-- another query does, or when batch writes own the name.
-- Locks: the sink's row. Raises: LQ003.
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
-- same writeId is then found committed and enqueues nothing).
-- Locks: the sink's row. Raises: LQ003.
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
        -- claim: a stream whose sink id is its query id claims nothing); a batch write's
        -- were claimed by the write.
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


-- spark_batch_waiting(): for a streaming read under Trigger.AvailableNow whose plan found
-- nothing: how many channels hold a message with id <= p_max_id, unlocked and due by p_due_by
-- (the clock when the query started), in a channel that is not paused and is not the
-- schedules' drivers'; and the earliest time one of them may leave (its channel's last dequeue
-- plus its release interval, or its own dequeue_at if later; now when the channel's slots are
-- all taken, or nothing in its policy holds it). A channel counts only while its head is one of
-- those messages; a channel without a policy only while it is due now, so many idle channels
-- cost a scan of the channel table and no probe; the others one probe each of
-- message_channel_head_ix (with bitmap scans off).
-- Locks: none. Raises: LQ003 (NULL arguments).
CREATE OR REPLACE FUNCTION spark_batch_waiting(p_max_id BIGINT, p_due_by BIGINT)
RETURNS TABLE (channels BIGINT, next_at BIGINT, now_at BIGINT)
LANGUAGE plpgsql
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
            WHERE channel_hash(m.channel) = channel_hash(c.name)
              AND m.channel = c.name AND NOT m.is_locked
              AND (m.dequeue_at, m.id) >= (c.head_at, c.head_id)
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
        RETURN;  -- the consumer's first checkpoint
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
