-- 0005_create_many_fast: a batch of new messages for a few policy-free channels no longer locks
-- their channel rows.
--
-- Until here message_create_many locked the row of every channel it touched until commit (see
-- 0002), so producers writing batches over the same channels committed one after another, and
-- dequeues skipped those channels (SKIP LOCKED) while a batch was open. A batch whose channels
-- have no policy and whose messages carry no dedup key now follows the single create's rules
-- instead: it holds each channel's shared advisory lock (channel_key) until commit and writes a
-- channel's row only when the batch makes that channel due sooner than the row says.
--
-- Advisory locks take slots in the server's shared lock table (max_locks_per_transaction per
-- connection on average), so only batches spanning at most 128 channels take this path; larger
-- ones, and those with dedup keys or a channel with a policy (counters, max_size), still lock
-- the rows as before (message_create_many_locked, the previous message_create_many).

ALTER FUNCTION message_create_many(TEXT[], BYTEA[], BIGINT[], TEXT[])
    RENAME TO message_create_many_locked;


CREATE FUNCTION message_create_many(
    p_channels TEXT[],
    p_contents BYTEA[],
    p_dequeue_ats BIGINT[],
    p_dedup_keys TEXT[]
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_count INTEGER := cardinality(p_contents);
    v_names TEXT[];
    v_now BIGINT;
    v_ids BIGINT[];
    v_wake RECORD;
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
    PERFORM message_check_new(coalesce(t.channel, 'default'), t.content, t.dequeue_at, NULL)
    FROM unnest(p_channels, p_contents, p_dequeue_ats) AS t(channel, content, dequeue_at);

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
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now), v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats)
        AS t(id, channel, content, dequeue_at);

    -- Each channel whose row is missing or says later than its earliest new message: write the
    -- row in name order (no deadlocks between batches), then announce, soonest first (one
    -- NOTIFY then covers the batch).
    FOR v_wake IN
        WITH added AS (
            SELECT coalesce(t.channel, 'default') AS name,
                   min(coalesce(t.dequeue_at, v_now)) AS at, min(t.id) AS first_id
            FROM unnest(v_ids, p_channels, p_dequeue_ats) AS t(id, channel, dequeue_at)
            GROUP BY 1
        ), late AS (
            SELECT a.name, a.at, a.first_id, c.next_dequeue_at AS seen_next
            FROM added a LEFT JOIN channel c ON c.name = a.name
            WHERE c.name IS NULL OR c.next_dequeue_at IS NULL OR c.next_dequeue_at > a.at
        ), written AS (
            INSERT INTO channel AS c (name, next_dequeue_at)
            SELECT l.name, l.at FROM late l ORDER BY l.name
            ON CONFLICT (name) DO UPDATE SET next_dequeue_at = excluded.next_dequeue_at
            WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > excluded.next_dequeue_at
            RETURNING c.name
        )
        SELECT l.* FROM late l WHERE l.name IN (SELECT w.name FROM written w) ORDER BY l.at
    LOOP
        PERFORM channel_announce(v_wake.seen_next, v_wake.at, 'created', v_wake.first_id,
            v_wake.name);
    END LOOP;

    RETURN QUERY
        SELECT 'created'::TEXT, t.id, NULL::BIGINT
        FROM unnest(v_ids) WITH ORDINALITY AS t(id, ord) ORDER BY t.ord;
END;
$$;
