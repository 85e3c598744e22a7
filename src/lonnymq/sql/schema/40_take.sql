-- Taking messages: dequeue one or many, and extend the locks of those you hold.
--
-- Each message is found by one index probe: first the oldest expired lock (its attempt is
-- counted again and its channel slot, never released, stays taken), looked for only once the
-- clock has reached the lock gate, so about once a second rather than by every take (see
-- message_recover); otherwise the head of the channel with the earliest next dequeue time
-- that is under its concurrency limit (looked for from the ready floor, channel_ready_floor,
-- and the head from where the channel's row says its waiting messages begin, channel_first:
-- neither walks what a long transaction keeps in the indexes). That channel's next time moves to max(next head's
-- dequeue_at, now + release interval) and it goes behind channels with the same time (round
-- robin). When every due channel's row is held by
-- another dequeue, a channel without a policy is served anyway: its next waiting heads are
-- taken without its row ("riding along": they are distinct rows, locked with SKIP LOCKED). A
-- channel with a policy must be served under its row: the call then polls that row (NOWAIT,
-- for up to about 0.1 s) rather than report an empty queue while messages are ready.
--
-- A dequeue of one message (a worker's steady state) takes a short path, message_take_one:
-- three statements at most (recover an expired lock, lock the channel whose turn it is and take
-- its head, or ride along on the first busy channel's next head). Any other case is served by
-- the general loop, message_dequeue_loop. Measured side by side with the loop alone (8 pgbench
-- clients finishing one message and taking the next, PostgreSQL 15): one hot channel 4,487 ->
-- 5,569 calls/s, 100 channels 5,663 -> 5,979.
--
-- The head probes run with bitmap and sequential scans off and without JIT (SET clauses): a
-- probe is one ordered index scan, whatever the statistics say of a table that churns. The
-- short path's statements also keep their generic plans (plan_cache_mode): with the channel
-- table's statistics moving under it, the plan cache otherwise chose a custom plan, made anew,
-- for the look for the due channel in about 40% of takes (28 us a take on average; counted with
-- pg_stat_statements.track_planning, one client draining 100 channels one message a call).


-- message_recover(): lock again for p_lock_ms, at the clock p_now, the message whose lock
-- expired first (its holder is gone; its channel slot was never released, so the channel is
-- not touched), counting an attempt; or, when none has, return no message (its fields all
-- NULL) and close the lock gate for a second (what the sequences lock_gate_seq and
-- lock_sweep_seq hold is said where they are created).
-- p_gate: the gate as the caller read it. The probe starts 5 s before the last look that found
-- nothing (what had expired by then was found then), or at the gate when that is earlier (a
-- lock set since that expires before: the clock moved back), so that its cost does not grow
-- with the index entries a long transaction keeps alive; the first look of each minute starts
-- from the lowest expiry instead, and finds what a narrower look cannot: a lock committed more
-- than 5 s after the clock it took (a long transaction's dequeue), or one whose row another
-- session held at the last look and let go.
-- Locks: the message it returns (SKIP LOCKED). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION message_recover(p_now BIGINT, p_lock_ms BIGINT, p_gate BIGINT)
RETURNS message
LANGUAGE plpgsql
-- One probe of message_unlock_ix, whatever the statistics say; planned for its arguments at
-- every call (it runs about once a second), so that where the probe starts is a bound of the
-- index scan, not a filter of a scan from the lowest expiry (what a generic plan, the kind
-- message_take_one's statements keep, would make of it).
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
SET plan_cache_mode = force_custom_plan
SET search_path FROM CURRENT
AS $$
DECLARE
    v_last BIGINT := (SELECT s.last_value FROM lock_sweep_seq s);
    v_message message;
BEGIN
    UPDATE message m SET
        unlock_at = p_now + p_lock_ms,
        locked_at = p_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT e.id FROM message e
        WHERE e.is_locked AND e.unlock_at <= p_now
          AND (v_last / 60000 <> p_now / 60000
               OR e.unlock_at >= least(least(v_last, p_now) - 5000, p_gate))
        ORDER BY e.unlock_at, e.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    RETURNING m.* INTO v_message;
    -- Found one: the gate stays open, and the next take looks again. None: closed for a second.
    IF NOT FOUND THEN
        PERFORM setval('lock_sweep_seq', p_now);
        PERFORM setval('lock_gate_seq', p_now + 1000);
    END IF;
    RETURN v_message;
END;
$$;


-- message_take_one(): lock one message the usual way (see the top of this file), or return
-- NULL and change nothing a later message_dequeue_loop would not: the channel row it locked,
-- or a channel sent back by channel_rotate when none of its heads could be taken. A channel
-- with a policy is handed over to the loop with its row held.
-- Locks: the message it returns and the channel row it serves (SKIP LOCKED); advisory locks it
-- only tries. It never waits for a lock. Raises: nothing of ours (the callers check).
CREATE OR REPLACE FUNCTION message_take_one(p_lock_ms BIGINT) RETURNS message
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    -- The clock as this call starts (see message_dequeue_loop).
    v_now BIGINT := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT;
    v_gate BIGINT;
    v_sweep BIGINT;
    -- Where the next due channel is looked for (channel_ready_floor).
    v_floor BIGINT;
    v_message message;
    v_channel channel;
    v_busy TEXT;
    v_policy BOOLEAN;
    v_head_at BIGINT;
    v_head_id BIGINT;
BEGIN
    -- The lock gate and the ready floor in one statement; channel_ready_floor only when a look
    -- from the low end is due (it reads the same two sequences first: a call of it by every
    -- take, with its settings, cost more than the reads).
    SELECT g.last_value, s.last_value, f.last_value INTO v_gate, v_sweep, v_floor
    FROM lock_gate_seq g, ready_sweep_seq s, ready_floor_seq f;
    IF NOT (v_now >= v_sweep AND v_now - 1000 < v_sweep) THEN
        v_floor := channel_ready_floor(v_now);
    END IF;
    -- 1. A message whose lock expired (its channel slot was never released), once the lock
    -- gate says one may have.
    IF v_now >= v_gate THEN
        v_message := message_recover(v_now, p_lock_ms, v_gate);
        IF v_message.id IS NOT NULL THEN
            RETURN v_message;
        END IF;
        v_gate := (SELECT g.last_value FROM lock_gate_seq g);
    END IF;
    -- A lock taken below would expire before the gate: bring the gate back to it first.
    IF v_now + p_lock_ms < v_gate THEN
        PERFORM setval('lock_gate_seq', v_now + p_lock_ms);
    END IF;

    -- 2. The head of the channel whose turn it is, if it has no policy.
    SELECT * INTO v_channel FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
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
            WHERE channel_hash(h.channel) = channel_hash(v_channel.name)
              AND h.channel = v_channel.name AND NOT h.is_locked
              AND (h.dequeue_at, h.id) >= (v_channel.head_at, v_channel.head_id)
              AND h.dequeue_at <= v_now
            ORDER BY h.dequeue_at, h.id
            LIMIT 1
            FOR UPDATE SKIP LOCKED)
        RETURNING m.* INTO v_message;
        IF NOT FOUND THEN
            -- Its heads are held by sessions riding along, or not due yet.
            PERFORM channel_rotate(v_channel.name, v_channel.head_at, v_channel.head_id, v_now,
                FALSE);
            RETURN NULL;
        END IF;
        IF current_setting('lonnymq.head_advance', TRUE) = 'on' THEN
            PERFORM channel_head_advance(ARRAY[v_channel]);
        END IF;
        -- To the back, when its next head is due (channel_rotate's first case); otherwise
        -- channel_rotate pushes it forward or deletes its row. (The next head is read as
        -- channel_first_from reads it, written out: a call of that function would be planned
        -- anew by every take.)
        UPDATE channel c SET
            next_dequeue_at = n.next_at,
            turn = nextval('channel_turn_seq'),
            last_dequeue_at = v_now
        FROM (
            SELECT greatest(t.dequeue_at, v_now) AS next_at FROM message t
            WHERE channel_hash(t.channel) = channel_hash(v_channel.name)
              AND t.channel = v_channel.name AND NOT t.is_locked
              AND (t.dequeue_at, t.id) >= (v_channel.head_at, v_channel.head_id)
            ORDER BY t.dequeue_at, t.id
            LIMIT 1) n
        WHERE c.name = v_channel.name AND n.next_at <= v_now;
        IF NOT FOUND THEN
            PERFORM channel_rotate(v_channel.name, v_channel.head_at, v_channel.head_id, v_now,
                TRUE);
        END IF;
        RETURN v_message;
    END IF;

    -- 3. Every due channel's row is held by another session: ride along on the first one's
    -- next head, unless it has a policy or its policy is being changed (read under the lock).
    SELECT c.name INTO v_busy FROM channel c
    WHERE c.next_dequeue_at IS NOT NULL
      AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
      AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
    ORDER BY c.next_dequeue_at, c.turn
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(channel_key(v_busy)) THEN
        RETURN NULL;
    END IF;
    -- A statement of its own, so that its snapshot is taken under the lock; with where the
    -- row says the channel's waiting messages begin. Under the shared advisory lock that mark
    -- only moves down (a writer makes a message wait before it): one that moves after this
    -- read is passed by this take only, as it would be by a take that began a moment sooner.
    SELECT c.has_policy, c.head_at, c.head_id INTO v_policy, v_head_at, v_head_id
    FROM channel c WHERE c.name = v_busy;
    IF NOT FOUND OR v_policy THEN
        RETURN NULL;
    END IF;
    UPDATE message m SET
        is_locked = TRUE,
        unlock_at = v_now + p_lock_ms,
        locked_at = v_now,
        num_attempts = m.num_attempts + 1
    WHERE m.id = (
        SELECT h.id FROM message h
        WHERE channel_hash(h.channel) = channel_hash(v_busy)
          AND h.channel = v_busy AND NOT h.is_locked
          AND (h.dequeue_at, h.id) >= (v_head_at, v_head_id)
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


-- message_dequeue_loop(): the general dequeue: lock up to p_limit messages for p_lock_ms, as
-- described at the top of this file. A batch shares the due policy-free channels' slots
-- fairly, leaving one slot for each channel with a policy it passes (the one-by-one steps that
-- follow serve those: they hold the earliest turns). A batch riding along on many busy channels
-- counts what each gave in the statement that takes the heads (grouped by channel, one row per
-- ridden channel beside them): counting per channel was |channels| x |batch| (7.0 s of a 7.5 s
-- take of 10,000 over 100,000 held channels).
-- When no message is returned, one row comes back with id NULL and retry_at set to the
-- earliest time a message may become available: the next due time of a servable channel, or
-- the earliest lock expiry. It is NULL only when nothing is waiting in a servable channel and
-- nothing is locked; a saturated channel becomes servable when one of its messages finishes,
-- which publishes an event.
-- Locks: rows it returns and the channel rows it serves; advisory locks it only tries; a
-- policy channel's row polled with NOWAIT. Raises: LQ003 (bad limit or lock_ms).
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
    -- Whether to look for expired locks: once the lock gate says one may have.
    v_gate BIGINT := (SELECT g.last_value FROM lock_gate_seq g);
    -- Where the next due channel is looked for (channel_ready_floor).
    v_floor BIGINT := channel_ready_floor(v_now);
    v_recover BOOLEAN := v_now >= v_gate;
    v_found BOOLEAN;
    v_waited BOOLEAN := FALSE;
    v_busy TEXT;
    v_passed TEXT[] := ARRAY[]::TEXT[];
    v_rest TEXT[];
    v_rest_at BIGINT[];
    v_rest_id BIGINT[];
    v_spread BOOLEAN := FALSE;
    v_free TEXT[] := ARRAY[]::TEXT[];
    v_free_at BIGINT[];
    v_free_id BIGINT[];
    v_due channel[];
    v_share INTEGER;
    v_quota INTEGER;
    v_extra INTEGER;
    v_rows INTEGER;
    v_ride TEXT[];
    v_ride_at BIGINT[];
    v_ride_id BIGINT[];
    v_policy BOOLEAN;
    v_head_at BIGINT;
    v_head_id BIGINT;
    v_ride_more BOOLEAN := TRUE;
    v_rows_held BOOLEAN := FALSE;
    v_reserved INTEGER := 0;
    v_rode BOOLEAN := FALSE;
    v_budget INTEGER;
    v_batch message[];
    v_keep TEXT[] := ARRAY[]::TEXT[];
    v_advance TEXT[] := ARRAY[]::TEXT[];
    v_keep_at BIGINT[] := ARRAY[]::BIGINT[];
    v_keep_id BIGINT[] := ARRAY[]::BIGINT[];
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
            v_message := message_recover(v_now, p_lock_ms, v_gate);
            v_recover := v_message.id IS NOT NULL;
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
                      AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
                    ORDER BY c.next_dequeue_at, c.turn
                    LIMIT p_limit - v_taken
                    FOR UPDATE SKIP LOCKED);
                -- Fewer than asked for: every other due channel's row is held elsewhere.
                v_rows_held := cardinality(v_due) < p_limit - v_taken;
                -- With where each one's waiting messages begin, as locked (the probes below
                -- start there without looking the rows up again).
                SELECT coalesce(array_agg(d.name ORDER BY d.ordinality), ARRAY[]::TEXT[]),
                       coalesce(array_agg(d.head_at ORDER BY d.ordinality), ARRAY[]::BIGINT[]),
                       coalesce(array_agg(d.head_id ORDER BY d.ordinality), ARRAY[]::BIGINT[])
                INTO v_free, v_free_at, v_free_id
                FROM unnest(v_due) WITH ORDINALITY AS d
                WHERE NOT d.has_policy
                  AND pg_try_advisory_xact_lock_shared(channel_key(d.name));
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
                            FROM unnest(v_free, v_free_at, v_free_id)
                                WITH ORDINALITY AS f(name, head_at, head_id, ord)
                            CROSS JOIN LATERAL (
                                SELECT x.id, row_number() OVER () AS rn
                                FROM (
                                    SELECT m.id FROM message m
                                    WHERE channel_hash(m.channel) = channel_hash(f.name)
                                      AND m.channel = f.name AND NOT m.is_locked
                                      AND (m.dequeue_at, m.id) >= (f.head_at, f.head_id)
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
                    -- statement (new turns in the order they were served), then the rest
                    -- (channel_rotate_many may push them ahead or delete their rows).
                    -- (Every row held: one this batch took nothing from moves only if it can.)
                    -- In a worker's group commit, the channels whose marks may move up
                    -- (channel_head_lock) have them moved in the same statement, to the next
                    -- head it reads after the locks: one write of each row, not two. (Those
                    -- left to channel_rotate_many keep theirs until they are served again.)
                    IF current_setting('lonnymq.head_advance', TRUE) = 'on' THEN
                        v_advance := channel_head_lock(ARRAY(
                            SELECT d FROM unnest(v_due) AS d WHERE d.name = ANY (v_free)));
                    END IF;
                    -- (Each next head read as channel_first_from reads it, written out: a
                    -- call per channel would be planned anew for each.)
                    WITH next_heads AS (
                        -- (NULL when nothing waits: greatest() would pass over a NULL.)
                        SELECT f.name, f.ord, f.head_at, f.head_id, n.dequeue_at AS first_at,
                               n.id AS first_id,
                               CASE WHEN n.id IS NOT NULL THEN greatest(n.dequeue_at, v_now)
                               END AS next_at
                        FROM unnest(v_free, v_free_at, v_free_id)
                            WITH ORDINALITY AS f(name, head_at, head_id, ord)
                        LEFT JOIN LATERAL (
                            SELECT s.dequeue_at, s.id FROM message s
                            WHERE channel_hash(s.channel) = channel_hash(f.name)
                              AND s.channel = f.name AND NOT s.is_locked
                              AND (s.dequeue_at, s.id) >= (f.head_at, f.head_id)
                            ORDER BY s.dequeue_at, s.id
                            LIMIT 1) n ON TRUE
                    ), turns AS (
                        SELECT n.name, n.next_at, n.first_at, n.first_id,
                               n.name = ANY (v_advance) AS advance,
                               nextval('channel_turn_seq') AS turn
                        FROM (SELECT h.name, h.next_at, h.first_at, h.first_id FROM next_heads h
                              WHERE h.next_at <= v_now ORDER BY h.ord) n
                    ), rotated AS (
                        UPDATE channel c SET
                            next_dequeue_at = t.next_at, turn = t.turn, last_dequeue_at = v_now,
                            head_at = CASE WHEN t.advance THEN t.first_at ELSE c.head_at END,
                            head_id = CASE WHEN t.advance THEN t.first_id ELSE c.head_id END
                        FROM turns t
                        WHERE c.name = t.name
                        RETURNING c.name
                    )
                    SELECT coalesce(array_agg(h.name ORDER BY h.ord), ARRAY[]::TEXT[]),
                           coalesce(array_agg(h.head_at ORDER BY h.ord), ARRAY[]::BIGINT[]),
                           coalesce(array_agg(h.head_id ORDER BY h.ord), ARRAY[]::BIGINT[])
                    INTO v_rest, v_rest_at, v_rest_id
                    FROM next_heads h
                    WHERE h.name NOT IN (SELECT r.name FROM rotated r);
                    IF cardinality(v_rest) > 0 THEN
                        PERFORM channel_rotate_many(v_rest, v_rest_at, v_rest_id, v_now);
                    END IF;
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
                    v_ride_at := v_keep_at;
                    v_ride_id := v_keep_id;
                ELSE
                    v_ride := ARRAY(
                        SELECT c.name FROM channel c
                        WHERE c.next_dequeue_at IS NOT NULL
                          -- (What channel_ready_ix holds: redundant with NOT has_policy.)
                          AND (c.max_concurrency IS NULL
                               OR c.current_concurrency < c.max_concurrency)
                          AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
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
                        -- then left.) With where each one's waiting messages begin, as the
                        -- one-channel ride-along reads it.
                        SELECT coalesce(array_agg(r.name ORDER BY r.ord), ARRAY[]::TEXT[]),
                               coalesce(array_agg(p.head_at ORDER BY r.ord), ARRAY[]::BIGINT[]),
                               coalesce(array_agg(p.head_id ORDER BY r.ord), ARRAY[]::BIGINT[])
                        INTO v_ride, v_ride_at, v_ride_id
                        FROM unnest(v_ride) WITH ORDINALITY AS r(name, ord)
                        JOIN channel p ON p.name = r.name
                        WHERE NOT p.has_policy;
                    END IF;
                END IF;
                IF cardinality(v_ride) >= 2 THEN
                    v_quota := v_budget / cardinality(v_ride);
                    v_extra := v_budget % cardinality(v_ride);
                    WITH picked AS (
                        SELECT h.id, f.ord, h.rn
                        FROM unnest(v_ride, v_ride_at, v_ride_id)
                            WITH ORDINALITY AS f(name, head_at, head_id, ord)
                        CROSS JOIN LATERAL (
                            SELECT x.id, row_number() OVER () AS rn
                            FROM (
                                SELECT m.id FROM message m
                                WHERE channel_hash(m.channel) = channel_hash(f.name)
                                  AND m.channel = f.name AND NOT m.is_locked
                                  AND (m.dequeue_at, m.id) >= (f.head_at, f.head_id)
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
                        SELECT k.ord, max(k.name) AS name, max(k.head_at) AS head_at,
                               max(k.head_id) AS head_id, count(k.id) AS gave
                        FROM (SELECT f.ord, f.name, f.head_at, f.head_id, NULL::BIGINT AS id
                              FROM unnest(v_ride, v_ride_at, v_ride_id)
                                  WITH ORDINALITY AS f(name, head_at, head_id, ord)
                              UNION ALL
                              SELECT p.ord, NULL::TEXT, NULL::BIGINT, NULL::BIGINT, p.id
                              FROM picked p) k
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
                            WHERE y.gave >= v_quota + CASE WHEN y.ord <= v_extra THEN 1 ELSE 0 END),
                           (SELECT coalesce(array_agg(y.head_at ORDER BY y.ord), ARRAY[]::BIGINT[])
                            FROM tally y
                            WHERE y.gave >= v_quota + CASE WHEN y.ord <= v_extra THEN 1 ELSE 0 END),
                           (SELECT coalesce(array_agg(y.head_id ORDER BY y.ord), ARRAY[]::BIGINT[])
                            FROM tally y
                            WHERE y.gave >= v_quota + CASE WHEN y.ord <= v_extra THEN 1 ELSE 0 END)
                    INTO v_batch, v_short, v_keep, v_keep_at, v_keep_id
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
              AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
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
                  AND c.next_dequeue_at >= v_floor AND c.next_dequeue_at <= v_now
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
                -- With where its row says its waiting messages begin, in the same look-up
                -- (as take_one's ride-along reads them).
                SELECT c.has_policy, c.head_at, c.head_id INTO v_policy, v_head_at, v_head_id
                FROM channel c WHERE c.name = v_busy;
                IF NOT coalesce(v_policy, FALSE) THEN
                    RETURN QUERY
                        WITH taken AS (
                            UPDATE message m SET
                                is_locked = TRUE,
                                unlock_at = v_now + p_lock_ms,
                                locked_at = v_now,
                                num_attempts = m.num_attempts + 1
                            WHERE m.id = ANY (ARRAY(
                                SELECT h.id FROM message h
                                WHERE channel_hash(h.channel) = channel_hash(v_busy)
                                  AND h.channel = v_busy AND NOT h.is_locked
                                  AND (h.dequeue_at, h.id) >= (v_head_at, v_head_id)
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
                    WHERE channel_hash(h.channel) = channel_hash(v_channel.name)
                      AND h.channel = v_channel.name AND NOT h.is_locked
                      AND (h.dequeue_at, h.id) >= (v_channel.head_at, v_channel.head_id)
                      AND h.dequeue_at <= v_now
                    ORDER BY h.dequeue_at, h.id
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED)
                RETURNING m.* INTO v_message;
                v_found := FOUND;
                IF v_found AND current_setting('lonnymq.head_advance', TRUE) = 'on' THEN
                    PERFORM channel_head_advance(ARRAY[v_channel]);
                END IF;

                IF NOT v_channel.has_policy THEN
                    PERFORM channel_rotate(v_channel.name, v_channel.head_at,
                        v_channel.head_id, v_now, v_found);
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
                            WHERE channel_hash(n.channel) = channel_hash(c.name)
                              AND n.channel = c.name AND NOT n.is_locked
                              AND (n.dequeue_at, n.id) >= (c.head_at, c.head_id)
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

    -- A lock that expires before the lock gate brings the gate back to it.
    IF v_taken > 0 AND v_now + p_lock_ms < (SELECT g.last_value FROM lock_gate_seq g) THEN
        PERFORM setval('lock_gate_seq', v_now + p_lock_ms);
    END IF;

    IF v_taken = 0 THEN
        -- The earliest lock expiry, from where message_recover's next look would start.
        SELECT least(
            (SELECT c.next_dequeue_at FROM channel c
             WHERE c.next_dequeue_at IS NOT NULL
               AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
               AND c.next_dequeue_at >= v_floor
             ORDER BY c.next_dequeue_at, c.turn LIMIT 1),
            (SELECT m.unlock_at FROM message m
             WHERE m.is_locked
               AND m.unlock_at >= (
                   SELECT least(s.last_value - 5000, g.last_value)
                   FROM lock_sweep_seq s, lock_gate_seq g)
             ORDER BY m.unlock_at, m.id LIMIT 1))
        INTO v_retry_at;
        id := NULL; channel := NULL; content := NULL; state := NULL; num_attempts := NULL;
        dequeue_at := NULL; unlock_at := NULL;
        retry_at := CASE WHEN v_retry_at IS NOT NULL THEN greatest(v_retry_at, v_now) END;
        RETURN NEXT;
    END IF;
END;
$$;


-- message_dequeue_many(): lock up to p_limit messages for p_lock_ms (see message_dequeue_loop
-- for the rows it returns), through message_take_one when the limit is 1.
-- Locks: as message_dequeue_loop. Raises: LQ003 (bad limit or lock_ms).
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
-- Locks: as message_dequeue_loop. Raises: LQ003 (bad lock_ms).
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


-- message_heartbeat(): extend the lock of a message you hold to p_lock_ms from the clock as
-- the call runs (not as its transaction began: a heartbeat sent last in a longer transaction
-- must still extend the lock by p_lock_ms), as a dequeue does.
-- Locks: the message row. Raises: LQ001, LQ002 (not held: its lock expired or another attempt
-- holds it), LQ003.
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
    -- A lock that now expires before the lock gate brings the gate back to it.
    IF v_unlock_at < (SELECT g.last_value FROM lock_gate_seq g) THEN
        PERFORM setval('lock_gate_seq', v_unlock_at);
    END IF;
    RETURN v_unlock_at;
END;
$$;


-- message_heartbeat_many(): extend the locks of many messages you hold to the clock as the call
-- runs plus p_lock_ms. Each is checked on its own, like message_heartbeat: 'ok', 'stale' (not
-- locked, or locked by a later attempt) or 'not_found', per id in input order; a stale one is
-- left alone.
-- Locks: the message rows, in id order (so two callers cannot deadlock).
-- Raises: LQ003 (bad lock_ms, mismatched arrays, NULL ids or attempts).
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
    -- Locks that now expire before the lock gate bring the gate back (it may move back for
    -- nothing when every claim turns out stale: the next take then looks and finds nothing).
    IF v_unlock_at < (SELECT g.last_value FROM lock_gate_seq g) THEN
        PERFORM setval('lock_gate_seq', v_unlock_at);
    END IF;

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
