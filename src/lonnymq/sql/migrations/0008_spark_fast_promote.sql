-- 0008_spark_fast_promote: a Spark write's commit promotes the rows of plain channels with one
-- INSERT … SELECT from staging, instead of handing every row to message_create_many.
--
-- In 0004 every staged row went through message_create_many, which decides each item (dedup,
-- max_size, counters) in arrays: right for channels with a policy and rows with dedup keys,
-- but most of a bulk load is neither. A channel is promoted the fast way when it has no policy
-- and none of the write's rows for it carries a dedup key: nothing can then refuse or
-- deduplicate its rows, so they are all created, with ids in task order (the order of
-- p_task_tags) and input order within a task, and the channel only needs to become due. The
-- other channels keep the 0004 path, whole (a channel's rows are never split between the two,
-- so their ids keep the order they had).
--
-- Locks: like message_create_many (a write may name more channels than advisory locks fit in
-- memory), every channel row of the write is locked, in name order, before anything is
-- decided; has_policy is read under that lock, so channel_policy_set (which locks the row
-- after its exclusive advisory lock) waits for the commit and then counts the new messages.
-- Holding the row also keeps dequeues from moving the channel to the back while its new
-- messages are not committed (channel_rotate needs the row).


-- spark_write_commit(): as in 0004 (same arguments and results); see the top for how rows are
-- promoted. Policy-free channels of the fast path are made due at their earliest new message
-- (never later than they were), as message_create_many does, and the soonest change is
-- announced (at most one event per transaction, only when a channel got due sooner).
-- Locks: the commit record, then every channel row of the write in name order.
-- Raises: LQ003, LQ005, LQ006 (a staged row that is not a valid message).
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
    v_fast TEXT[];
    v_fast_rows BIGINT;
    v_added_channels TEXT[];
    v_added_ats BIGINT[];
    v_added_ids BIGINT[];
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

    -- Validate every row before changing anything: message_check_new's test of a good
    -- message, in one pass; the check itself runs on the first bad row only, to say what is
    -- wrong.
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

    -- Lock every channel of the write, creating missing rows, in name order (as
    -- message_create_many: an upsert either inserts the row or locks it, and waits for a row
    -- being deleted to go). The update changes nothing. The fast channels are those without
    -- a policy (read under the lock) whose rows carry no dedup key.
    WITH per_channel AS (
        SELECT coalesce(s.channel, 'default') AS name,
               bool_or(s.dedup_key IS NOT NULL) AS keyed
        FROM spark_stage s
        WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
        GROUP BY 1
    ), locked AS (
        INSERT INTO channel AS c (name) SELECT p.name FROM per_channel p ORDER BY p.name
        ON CONFLICT (name) DO UPDATE SET turn = c.turn
        RETURNING c.*
    )
    SELECT array_agg(l::channel),
           coalesce(array_agg(l.name ORDER BY l.name)
               FILTER (WHERE NOT l.has_policy AND NOT p.keyed), ARRAY[]::TEXT[])
    INTO v_before, v_fast
    FROM locked l JOIN per_channel p ON p.name = l.name;
    v_fast := coalesce(v_fast, ARRAY[]::TEXT[]);

    -- Their rows, ids drawn in (task, seq) order.
    WITH inserted AS (
        INSERT INTO message (id, channel, content, dequeue_at, created_at)
        SELECT nextval('message_id_seq'), o.channel, o.content, o.dequeue_at, v_now
        FROM (
            SELECT coalesce(s.channel, 'default') AS channel, s.content,
                   coalesce(s.dequeue_at, v_now) AS dequeue_at
            FROM spark_stage s
            JOIN unnest(p_task_tags) WITH ORDINALITY AS t(tag, ord) ON t.tag = s.task_tag
            WHERE s.write_id = p_write_id
              AND coalesce(s.channel, 'default') = ANY (v_fast)
            -- Task, then input order: each channel's rows keep their task's order. The
            -- tasks' own order is arbitrary (as it was): their place in p_task_tags sorts
            -- fastest (integers).
            ORDER BY t.ord, s.seq
        ) o
        RETURNING message.id, message.channel, message.dequeue_at
    ), added AS (
        SELECT i.channel, count(*) AS n, min(i.dequeue_at) AS min_at, min(i.id) AS first_id
        FROM inserted i
        GROUP BY i.channel
    )
    SELECT coalesce(sum(a.n), 0), array_agg(a.channel), array_agg(a.min_at),
           array_agg(a.first_id)
    INTO v_fast_rows, v_added_channels, v_added_ats, v_added_ids
    FROM added a;
    staged := v_fast_rows;
    created := v_fast_rows;

    -- Bring each fast channel's next dequeue time forward to its earliest new message (the
    -- formula of message_create_many); announce what got sooner, soonest first, so that one
    -- event covers the write.
    FOR v_changed IN
        WITH updated AS (
            UPDATE channel c SET
                next_dequeue_at = least(c.next_dequeue_at, greatest(a.min_at,
                    c.last_dequeue_at + coalesce(c.release_interval_ms, 0)))
            FROM unnest(v_added_channels, v_added_ats, v_added_ids)
                AS a(channel, min_at, first_id)
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
        ORDER BY after_at NULLS LAST
    LOOP
        PERFORM channel_announce(v_changed.before_at, v_changed.after_at, 'created',
            v_changed.first_id, v_changed.name);
    END LOOP;

    -- The other channels: through message_create_many, as in 0004.
    FOR v_chunk IN
        WITH rows AS (
            SELECT s.channel, s.content, s.dequeue_at, s.dedup_key,
                   (row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) - 1)
                       / p_chunk AS part,
                   row_number() OVER (ORDER BY s.channel, s.task_tag, s.seq) AS ord
            FROM spark_stage s
            WHERE s.write_id = p_write_id AND s.task_tag = ANY (p_task_tags)
              AND NOT coalesce(s.channel, 'default') = ANY (v_fast)
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
    PERFORM spark_stage_clear(p_write_id);
    RETURN NEXT;
END;
$$;
