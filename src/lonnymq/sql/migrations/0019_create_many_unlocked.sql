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


SELECT secure_functions();
