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


SELECT secure_functions();
