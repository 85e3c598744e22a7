-- The archive: finished messages, kept when config.archive is on, listed and replayed.


-- archive_list(): archived messages, newest first, optionally of one outcome and channel,
-- older than p_before_id (for paging). Outcome 'failed' and the like use archive_failed_ix.
-- Locks: none. Raises: LQ003 (limit outside 1..10000).
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
    PERFORM arg_check_range('limit', p_limit, 1, 10000);
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
