-- Creating messages: one, or many in one call.
--
-- Lock order. Every creator takes a channel's row before it claims a dedup key in that channel:
-- a single create makes the channel due (the row write, when one is needed) before it inserts
-- its message, so it holds no key while it waits for a row, and a batch holding rows only ever
-- waits for a key whose holder waits for nothing. A single create and a batch creating the same
-- key at once therefore end with one message and a 'deduplicated' result, never a unique
-- violation or a deadlock (in the rare race the single create loses, the channel was made due
-- for nothing and an event announced an id that never came to exist). Not covered: a
-- transaction that holds a key from an earlier single create and then writes the channel's row
-- can still meet a batch of that key waiting for it, holding the row; and a batch waiting for a
-- key whose message is being finished by a transaction that waits, in turn, behind a policy
-- change of the channel. PostgreSQL detects both deadlocks and rolls one transaction back
-- (40P01), which may then be retried.
--
-- Rows of policy-free channels that are already due are never locked: due rows are what every
-- dequeue takes (SKIP LOCKED), so a producer that locked one would wait behind one dequeue after
-- another (measured: 8 producers and 8 consumers of batches of 100 over 100 channels, a
-- producer waiting 4 to 8 s while the other 7 waited for it). Producers that make a missing
-- row take turns on a creation lock per channel and look again once they hold it; only rows
-- still late as committed, by the clock now, are locked (in name order) and moved forward.
-- A message without a dedup key is a plain insert: ON CONFLICT is a speculative insertion even
-- when the key is NULL, an extra WAL record per message (about 5 % of what a message writes).


-- message_check_new(): refuse a bad new message. The common case (all good) is one
-- expression; the named checks run only to say what is wrong.
-- Locks: none. Raises: LQ003, LQ005, LQ006.
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


-- message_create_many_locked(): message_create_many's general path (dedup keys, channels with
-- a policy): add messages; results come back in input order. For each message: a live message
-- of the same channel with the same dedup_key (or an earlier item of the batch with that key)
-- makes it 'deduplicated' and returns that message's id; a channel at its max_size makes it
-- 'dropped' (id NULL); otherwise it is 'created'. Ids are drawn in input order. channel_size
-- is the channel's size once the message is counted, for channels with a policy; NULL for the
-- others. Set-based whatever the batch size: one statement decides every item, one inserts,
-- one updates the channels. Keyed messages are inserted plainly first (one subtransaction per
-- call); a key another transaction committed meanwhile sends the rest through ON CONFLICT and
-- is reported 'deduplicated' with that message's id.
-- Locks: each channel row touched, in channel-name order (so batches cannot deadlock); a batch
-- may name more channels than advisory locks fit in memory, so rows it is.
-- Raises: LQ003 (mismatched arrays, bad time or dedup key), LQ005, LQ006; 40001 when a key's
-- message keeps finishing while the batch claims it.
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

    -- Messages without a key: a plain insert (see the top on the speculative one's cost).
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

    -- Count the new messages (channels with a policy), bring each channel's next dequeue time
    -- forward to its earliest new message (respecting the release interval), and announce.
    PERFORM channel_wait_many(v_before, array_agg(a.channel ORDER BY a.channel),
        array_agg(a.n ORDER BY a.channel), array_agg(a.min_at ORDER BY a.channel),
        array_agg(a.first_id ORDER BY a.channel), 'created')
    FROM (
        SELECT coalesce(t.channel, 'default') AS channel, count(*) AS n,
               min(coalesce(t.dequeue_at, v_now)) AS min_at, min(t.id) AS first_id
        FROM unnest(v_ids, p_channels, p_dequeue_ats, v_kind) AS t(id, channel, dequeue_at, kind)
        WHERE t.kind = 'created'
        GROUP BY 1
    ) a;

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


-- message_create_many(): add messages; see message_create_many_locked for the outcomes. A
-- batch of policy-free channels without dedup keys takes the fast path described at the top
-- of this file; anything else goes to message_create_many_locked.
-- Locks: the channels' shared advisory locks, in name order, held to commit (a dequeue cannot
-- push a channel's time past these messages, nor a policy be set before they are counted);
-- creation locks and late rows as said at the top.
-- Raises: LQ003 (mismatched arrays, bad time or dedup key), LQ005, LQ006.
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
    -- to commit, they keep a dequeue from pushing a channel's time past these messages (the
    -- safety rule of 20_channel.sql), and a policy from being set on a channel until they are
    -- counted.
    PERFORM pg_advisory_xact_lock_shared(channel_key(n)) FROM unnest(v_names) AS n;
    -- A policy set meanwhile (before these locks were granted).
    IF EXISTS (SELECT FROM channel c WHERE c.name = ANY (v_names) AND c.has_policy) THEN
        RETURN QUERY SELECT * FROM message_create_many_locked(
            p_channels, p_contents, p_dequeue_ats, p_dedup_keys);
        RETURN;
    END IF;

    v_now := epoch();
    -- The clock now (not as the transaction started), plus 10 ms: a row due by then needs no
    -- write.
    v_clock := v_now + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    v_ids := ARRAY(SELECT nextval('message_id_seq') FROM generate_series(1, v_count));
    INSERT INTO message (id, channel, content, dequeue_at, created_at)
    SELECT t.id, coalesce(t.channel, 'default'), t.content, coalesce(t.dequeue_at, v_now), v_now
    FROM unnest(v_ids, p_channels, p_contents, p_dequeue_ats)
        AS t(id, channel, content, dequeue_at);

    -- The channels whose row is missing, says later than their earliest new message, or
    -- says their waiting messages begin after it, as this statement sees them (under the
    -- channels' shared locks, so where they begin cannot move up meanwhile: 20_channel.sql).
    -- (at, first_id) sorts no later than any new message of its channel.
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
           OR (a.at, a.first_id) < (c.head_at, c.head_id)
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
            -- (The mark a second below its first message: 20_channel.sql.)
            INSERT INTO channel AS c (name, next_dequeue_at, head_at, head_id)
            SELECT u.name, u.at, u.at - 1000, u.first_id
            FROM unnest(v_late, v_late_ats, v_first_ids) AS u(name, at, first_id)
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
        -- moves it earlier. An upsert would lock every such row to find out, and a producer
        -- could wait behind one dequeue after another holding a busy channel's row (each SKIP
        -- LOCKED dequeue takes the row between the producer's retries): seconds, with every
        -- other producer waiting on it in turn.
        v_clock := v_now + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
            + 10;
        PERFORM FROM channel c
        JOIN unnest(v_late, v_late_ats, v_first_ids) AS u(name, at, first_id)
            ON u.name = c.name
        WHERE c.name <> ALL (v_written)
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(u.at, v_clock)
               OR (u.at, u.first_id) < (c.head_at, c.head_id))
        ORDER BY c.name
        FOR UPDATE OF c;
        WITH moved AS (
            UPDATE channel c SET
                next_dequeue_at = CASE
                    WHEN c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(u.at, v_clock)
                    THEN u.at ELSE c.next_dequeue_at END,
                (head_at, head_id) = (
                    SELECT k.at, k.id
                    FROM (VALUES (c.head_at, c.head_id), (u.at, u.first_id)) k(at, id)
                    ORDER BY k.at, k.id LIMIT 1)
            FROM unnest(v_late, v_late_ats, v_first_ids) AS u(name, at, first_id)
            WHERE c.name = u.name AND c.name <> ALL (v_written)
              AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(u.at, v_clock)
                   OR (u.at, u.first_id) < (c.head_at, c.head_id))
            RETURNING c.name, c.next_dequeue_at <> u.at AS head_only
        )
        SELECT v_written || coalesce(array_agg(m.name) FILTER (WHERE NOT m.head_only),
                                     ARRAY[]::TEXT[])
        INTO v_written
        FROM moved m;

        -- Announce: the soonest channel brings the ready floor down for all of them, and the
        -- soonest that got sooner than it was publishes the batch's one event (one a
        -- transaction: event_publish); no other announcement would do anything, so at most
        -- these two are made, soonest first.
        FOR v_wake IN
            SELECT w.name, w.at, w.first_id, w.seen_next
            FROM (
                SELECT u.name, u.at, u.first_id, u.seen_next,
                       row_number() OVER (ORDER BY u.at) AS soonest,
                       row_number() OVER (
                           PARTITION BY u.seen_next IS NULL OR u.at < u.seen_next
                           ORDER BY u.at) AS soonest_of_its_kind
                FROM unnest(v_late, v_late_ats, v_first_ids, v_seen)
                    AS u(name, at, first_id, seen_next)
                WHERE u.name = ANY (v_written)
            ) w
            WHERE w.soonest = 1
               OR (w.soonest_of_its_kind = 1 AND (w.seen_next IS NULL OR w.at < w.seen_next))
            ORDER BY w.at
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


-- message_create(): add one message; see message_create_many_locked for the outcomes.
-- channel_size is the channel's size for a channel with a policy, NULL otherwise (no counter
-- is kept). This is the hottest path, so the single-message form is written out.
-- Locks: the channel's shared advisory lock; the channel row when the channel has a policy or
-- the message makes it due sooner, taken before the dedup key (the order at the top).
-- Raises: LQ003, LQ005, LQ006; 40001 when the channel row keeps disappearing.
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
        -- Counters and limits: serialise on the row.
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
        PERFORM channel_wait_locked(v_channel, v_at, v_id, 'created', 1, 0);
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
        -- channel_wake's first test, written out: a row already due and a message at or past
        -- its mark (the common case in a busy channel) need no call.
        IF NOT coalesce(v_seen AND v_channel.next_dequeue_at <= v_at
                        AND (v_at, v_id) >= (v_channel.head_at, v_channel.head_id), FALSE) THEN
            PERFORM channel_wake(v_name, v_at, v_seen, v_channel, 'created', v_id);
        END IF;
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
    PERFORM channel_wake(v_name, v_at, v_seen, v_channel, 'created', v_new_id);
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
