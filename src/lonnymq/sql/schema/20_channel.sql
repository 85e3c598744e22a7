-- Channels: their advisory locks, rows and turns.
--
-- A channel with a policy (has_policy) has its row locked by every operation, and its counters
-- (current_size, current_concurrency) are exact. A channel without one keeps no counters: its
-- row only says when the channel is next worth a visit (next_dequeue_at) and whose turn it is,
-- and exists while it may hold waiting messages. Create and defer write the row only when they
-- make the channel due sooner than it says; finish does not touch it; the dequeue that holds
-- the row (FOR UPDATE SKIP LOCKED) moves the channel to the back, and concurrent dequeues that
-- find the row held take the channel's next heads anyway ("ride along"), so one hot channel
-- serves many consumers at once.
--
-- Safety rule: next_dequeue_at may be too early (a visit finds nothing and fixes it), never too
-- late while a waiting message is due. A create that sees the row due early enough and skips
-- writing it relies on nobody pushing next_dequeue_at past its message before it commits. So
-- every operation on a channel's messages holds a shared advisory lock on the channel
-- (channel_key) until it commits; pushing a channel's time into the future or deleting its row
-- needs that lock in exclusive mode, which a dequeue only tries (it never waits); when the try
-- fails, the dequeue pushes the time at most 10 ms ahead (a message created meanwhile is then
-- served at most that much later, never lost). Setting a policy waits for the exclusive lock,
-- so in-flight operations finish before it counts the channel's messages.
--
-- Where the waiting messages begin: no waiting message of a channel sorts before its row's
-- (head_at, head_id) in (dequeue_at, id) order, so every probe for a channel's head starts
-- there, not at the low end of message_channel_head_ix, where the entries of the messages
-- taken before stay until VACUUM removes them (and while a long transaction holds back the
-- horizon, it cannot). Two rules keep it true:
-- - A writer that makes a message wait (create, defer, give back, expedite, a schedule's new
--   time) reads the row after taking the channel's shared advisory lock (or its row) and,
--   when the message sorts before (head_at, head_id), brings them down to it in the same
--   transaction (a policy-free channel's row is otherwise left alone). A row made for a
--   message gets a mark a second below it, (dequeue_at - 1000, id): a creator whose
--   transaction began up to a second earlier (its messages stamped with that start) then has
--   nothing to bring down, where bringing it down would lock the row, and wait for every
--   take holding it. (The id stays the message's: channel_head_lock counts from it.)
-- - Only a take that holds the row and the channel's exclusive advisory lock moves them up
--   (channel_head_lock picks the channels, in a worker's message_settle; a batch moves their
--   marks as it sends them to the back, channel_head_advance otherwise): with that lock no
--   such writer is in flight (each holds the shared lock or waits for the row), so a
--   statement run after it sees every waiting message. It reads messages that riders have
--   locked but not committed as waiting, so a rider that rolls back leaves nothing behind the
--   head.
-- A probe reads (head_at, head_id) from the row it holds, in the same statement (the same
-- snapshot) as the messages, or, riding along, under the channel's shared advisory lock, which
-- keeps the mark from moving up: a mark brought down after that read makes this take pass the
-- message that brought it down, as a take begun a moment sooner would, and no later one.


-- channel_key(): the advisory lock key of a channel of this schema: hashtextextended of the
-- name, seeded with the schema's hash (computed once, when the function is created). Not
-- SECURITY DEFINER and no SET clause, so that the planner inlines it into its callers; it names
-- pg_catalog explicitly, so no search_path can redirect it.
-- Locks: none. Raises: nothing of ours.
DO $$
BEGIN
    EXECUTE format(
        $f$
        CREATE OR REPLACE FUNCTION channel_key(p_channel TEXT) RETURNS BIGINT
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS 'SELECT pg_catalog.hashtextextended(p_channel, %s::BIGINT)'
        $f$,
        hashtext(current_schema())::BIGINT);
END;
$$;


-- channel_hash(): the leading key of message_channel_head_ix, a 64-bit hash of the channel's
-- name: a fixed-width key, so that a probe's checks of dequeue_at and id find them at the same
-- offset in every entry (a B-tree scan checks its keys on every entry it reads of a page). The index's expression is this function's body,
-- with no seed of the schema's: an index must not change with the schema's name. A probe of a
-- channel's waiting messages says channel_hash(m.channel) = channel_hash(<name>) AND
-- m.channel = <name>: the planner inlines the function and matches the index by the first,
-- and the second keeps apart two channels whose hashes collide. Inlined like channel_key.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_hash(p_channel TEXT) RETURNS BIGINT
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS 'SELECT pg_catalog.hashtextextended(p_channel, 0)';


-- channel_lock(): lock a channel's row for update, creating it when missing.
-- Locks: the channel row (FOR UPDATE), held until the transaction ends.
-- Raises: 40001 when the row keeps disappearing (the caller may retry).
CREATE OR REPLACE FUNCTION channel_lock(p_channel TEXT) RETURNS channel
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_channel channel;
BEGIN
    -- Two rounds at most: a concurrent session may insert the row between our probe and our
    -- insert, or drain and delete it again before we lock it.
    FOR v_round IN 1..3 LOOP
        SELECT * INTO v_channel FROM channel c WHERE c.name = p_channel FOR UPDATE;
        IF FOUND THEN
            RETURN v_channel;
        END IF;
        INSERT INTO channel (name) VALUES (p_channel) ON CONFLICT (name) DO NOTHING;
    END LOOP;
    RAISE EXCEPTION 'channel % kept disappearing while being locked', p_channel
        USING ERRCODE = '40001';
END;
$$;


-- channel_first_from(): the first waiting message of channel p_channel in (dequeue_at, id)
-- order (no row when none waits), from (p_head_at, p_head_id), where the channel's row says
-- its waiting messages begin, as a caller that holds the row read it (no writer can bring it
-- lower while the row is held, and a value read earlier is never too high): the row is not
-- looked up again, which under a held snapshot would walk every version it left. One probe of
-- message_channel_head_ix.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_first_from(p_channel TEXT, p_head_at BIGINT, p_head_id BIGINT)
RETURNS TABLE (dequeue_at BIGINT, id BIGINT)
LANGUAGE sql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
    SELECT x.dequeue_at, x.id FROM message x
    WHERE channel_hash(x.channel) = channel_hash(p_channel)
      AND x.channel = p_channel AND NOT x.is_locked
      AND (x.dequeue_at, x.id) >= (p_head_at, p_head_id)
    ORDER BY x.dequeue_at, x.id
    LIMIT 1
$$;


-- channel_first(): as channel_first_from, reading where the waiting messages begin from the
-- channel's row in the same snapshot (no row when the channel has none).
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_first(p_channel TEXT)
RETURNS TABLE (dequeue_at BIGINT, id BIGINT)
LANGUAGE sql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
    SELECT f.dequeue_at, f.id
    FROM channel c
    CROSS JOIN LATERAL channel_first_from(c.name, c.head_at, c.head_id) f
    WHERE c.name = p_channel
$$;


-- channel_next_at(): when the channel's head may next leave, given the earliest time the
-- release interval allows; NULL when nothing waits.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_next_at(p_channel TEXT, p_release_at BIGINT) RETURNS BIGINT
LANGUAGE sql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
    SELECT greatest(f.dequeue_at, p_release_at) FROM channel_first(p_channel) f
$$;


-- channel_head_lock(): which of the channels p_rows (their rows as the caller holds them,
-- locked), from which it has just taken, may have where their waiting messages begin moved up
-- by this take; the caller moves them, in a statement run after this call (its snapshot then
-- sees what committed before the locks). Only in a take of message_settle (a worker's group
-- commit, which ends its transaction at once): the exclusive advisory lock it takes is held to
-- commit, and while it is, riders pass the channel and creators in it wait, so a dequeue in a
-- long transaction of its own never takes it. Only in a READ COMMITTED transaction (the
-- statement that reads the first message must see what committed before the lock); those
-- conditions are read once for all the rows. Then only for a row whose mark was set 1,000 ids
-- or more ago (so that a probe's walk over the entries of the messages taken since stays short,
-- while the lock is tried rarely), and whose channel's exclusive advisory lock can be had at
-- once (the rules at the top of this file). Returns their names (none: an empty array).
-- Locks: tries the channels' exclusive advisory locks, held to commit when granted.
-- Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_head_lock(p_rows channel[]) RETURNS TEXT[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_last BIGINT;
BEGIN
    IF current_setting('lonnymq.head_advance', TRUE) IS DISTINCT FROM 'on'
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN ARRAY[]::TEXT[];
    END IF;
    v_last := (SELECT s.last_value FROM message_id_seq s);
    RETURN ARRAY(
        SELECT r.name FROM unnest(p_rows) AS r
        WHERE v_last - r.head_id >= 1000
          AND pg_try_advisory_xact_lock(channel_key(r.name)));
END;
$$;


-- channel_head_advance(): after a take from the channels p_rows (their rows as the caller holds
-- them, locked), move where each one's waiting messages begin up to its first waiting message,
-- for those channel_head_lock picks. When nothing waits, the mark stays. (A batch take moves
-- them in the statement that sends its channels to the back instead: message_dequeue_loop.)
-- Locks: as channel_head_lock. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_head_advance(p_rows channel[]) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_names TEXT[] := channel_head_lock(p_rows);
BEGIN
    IF cardinality(v_names) = 0 THEN
        RETURN;
    END IF;
    -- A statement of its own after the locks, so that its snapshot sees what committed before.
    UPDATE channel c SET head_at = f.dequeue_at, head_id = f.id
    FROM unnest(p_rows) AS r
    CROSS JOIN LATERAL channel_first_from(r.name, r.head_at, r.head_id) f
    WHERE c.name = r.name AND r.name = ANY (v_names);
END;
$$;


-- channel_servable_at(): when a channel can next give a message, or NULL when it cannot
-- (nothing waiting, or saturated until a message finishes).
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_servable_at(
    p_next_at BIGINT, p_concurrency BIGINT, p_max_concurrency INTEGER
) RETURNS BIGINT
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT CASE WHEN p_max_concurrency IS NULL OR p_concurrency < p_max_concurrency
                    THEN p_next_at END);
END;
$$;


-- channel_ready_floor(): from where a take at clock p_now looks for the next due channel in
-- channel_ready_ix: no servable channel's next time lies below the value it returns, as far
-- as the queue knows. Two sequences hold it (no row versions, so reading them costs the same
-- whatever the horizon): ready_floor_seq, the floor, which every change that makes a channel
-- servable sooner than it brings down at once (set at once, not at commit: a take meanwhile
-- only looks lower than it needs to), and ready_sweep_seq, the
-- clock of the last look from the low end. About once a second (the first take after the
-- sweep's clock is a second old, or when the clock moved back) a take looks from the low end
-- instead, for the first servable channel (rows that other sessions hold count, as the
-- versions it sees), and sets the floor to its next time, 2 s earlier at most: what a change
-- committed meanwhile brought lower may be set over (in that race a channel is found by the
-- next look, up to a second late), and a creator in flight whose transaction began up to 2 s
-- ago is covered without a race. Otherwise it returns the floor as it is.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_ready_floor(p_now BIGINT) RETURNS BIGINT
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_sweep BIGINT := (SELECT s.last_value FROM ready_sweep_seq s);
    v_floor BIGINT;
BEGIN
    IF p_now >= v_sweep AND p_now - 1000 < v_sweep THEN
        RETURN (SELECT f.last_value FROM ready_floor_seq f);
    END IF;
    -- (least ignores a NULL: no servable channel.)
    v_floor := least(
        (SELECT c.next_dequeue_at FROM channel c
         WHERE c.next_dequeue_at IS NOT NULL
           AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
         ORDER BY c.next_dequeue_at, c.turn
         LIMIT 1),
        p_now - 2000);
    PERFORM setval('ready_sweep_seq', p_now);
    PERFORM setval('ready_floor_seq', v_floor);
    RETURN v_floor;
END;
$$;


-- channel_announce(): a change made a channel servable at p_after (NULL: not servable), at
-- p_before before it: bring the ready floor down to it (channel_ready_floor), and publish an
-- event when it is sooner than before (the only case where a sleeping worker has a reason to
-- wake). Every change that makes a channel servable sooner calls it.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_announce(
    p_before BIGINT, p_after BIGINT, p_type TEXT, p_id BIGINT, p_channel TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_after IS NULL THEN
        RETURN;
    END IF;
    -- (Written out, here and in channel_rotate: a call of a function for it, once per new
    -- channel of a batch, cost more than the test itself.)
    IF p_after < (SELECT f.last_value FROM ready_floor_seq f) THEN
        PERFORM setval('ready_floor_seq', p_after);
    END IF;
    IF p_before IS NULL OR p_after < p_before THEN
        PERFORM event_publish(p_type, p_id, p_channel, p_after);
    END IF;
END;
$$;


-- channel_wake(): make a policy-free channel due no later than p_at (a single create's and a
-- defer's way), announcing it when that is sooner, for message p_id that now waits at p_at.
-- The row is written only while it is later than the message and than the clock now plus
-- 10 ms (a due row is what every dequeue takes, SKIP LOCKED, and locking one would make the
-- creator wait behind one dequeue after another), or when the message sorts before where the
-- row says its waiting messages begin (the rules at the top of this file). p_seen, p_seen_row:
-- whether the caller found the row and the row as it read it, holding the channel's shared
-- advisory lock. A missing row is made under the channel's creation lock (an advisory lock),
-- after looking again, so a row another session made meanwhile is never inserted over (an
-- upsert would lock it before testing it).
-- Locks: the channel's row when it is written; the creation lock when the row is made.
-- Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_wake(
    p_channel TEXT, p_at BIGINT, p_seen BOOLEAN, p_seen_row channel, p_type TEXT, p_id BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_found BOOLEAN := p_seen;
    v_next BIGINT := p_seen_row.next_dequeue_at;
    v_below BOOLEAN := (p_at, p_id) < (p_seen_row.head_at, p_seen_row.head_id);
    v_after BIGINT;
    v_clock BIGINT;
BEGIN
    IF v_found AND v_next <= p_at AND NOT v_below THEN
        RETURN;
    END IF;
    IF NOT v_found THEN
        -- Missing as the caller saw it: made by one creator at a time, each looking again
        -- (as committed now) once it holds the channel's creation lock, so a row another
        -- session made meanwhile is not inserted over. Nothing else waits in a channel
        -- without a row, so its waiting messages begin at this one: the mark is set a second
        -- below it (the rules at the top of this file).
        PERFORM pg_advisory_xact_lock(channel_key(p_channel) # 1);
        INSERT INTO channel AS c (name, next_dequeue_at, head_at, head_id)
        SELECT p_channel, p_at, p_at - 1000, p_id
        WHERE NOT EXISTS (SELECT FROM channel x WHERE x.name = p_channel)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            PERFORM channel_announce(NULL, p_at, p_type, p_id, p_channel);
            RETURN;
        END IF;
        SELECT c.next_dequeue_at, (p_at, p_id) < (c.head_at, c.head_id)
        INTO v_next, v_below
        FROM channel c WHERE c.name = p_channel;
        v_found := FOUND;
    END IF;
    -- The clock now (not as the transaction started), plus 10 ms: a row due by then is left
    -- alone, even while a dequeue holds it (the safety rule at the top of this file).
    v_clock := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    IF v_found AND v_next <= greatest(p_at, v_clock) AND NOT v_below THEN
        RETURN;
    END IF;
    IF v_found THEN
        UPDATE channel c SET
            next_dequeue_at = CASE
                WHEN c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock)
                THEN p_at ELSE c.next_dequeue_at END,
            (head_at, head_id) = (
                SELECT k.at, k.id FROM (VALUES (c.head_at, c.head_id), (p_at, p_id)) k(at, id)
                ORDER BY k.at, k.id LIMIT 1)
        WHERE c.name = p_channel
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock)
               OR (p_at, p_id) < (c.head_at, c.head_id))
        RETURNING c.next_dequeue_at INTO v_after;
    ELSE
        -- Still invisible to this transaction (a snapshot older than the row): an upsert.
        INSERT INTO channel AS c (name, next_dequeue_at, head_at, head_id)
        VALUES (p_channel, p_at, p_at - 1000, p_id)
        ON CONFLICT (name) DO UPDATE SET
            next_dequeue_at = least(c.next_dequeue_at, p_at),
            (head_at, head_id) = (
                SELECT k.at, k.id FROM (VALUES (c.head_at, c.head_id), (p_at, p_id)) k(at, id)
                ORDER BY k.at, k.id LIMIT 1)
        WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at
           OR (p_at, p_id) < (c.head_at, c.head_id)
        RETURNING c.next_dequeue_at INTO v_after;
    END IF;
    IF FOUND THEN
        PERFORM channel_announce(v_next, v_after, p_type, p_id, p_channel);
    END IF;
END;
$$;


-- channel_wait_locked(): message p_id of a channel whose row the caller holds (p_channel, as
-- locked: a channel with a policy) now waits at p_at: count it (p_added to the size, p_freed
-- slots given back when the channel has max_concurrency), bring the channel's next dequeue
-- time forward to it when that is sooner (no sooner than the release interval allows) and
-- where its waiting messages begin down to it, and announce the change when the channel got
-- servable sooner (a worker may be waiting for it).
-- Locks: the channel row (held by the caller). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_wait_locked(
    p_channel channel, p_at BIGINT, p_id BIGINT, p_type TEXT, p_added INTEGER, p_freed INTEGER
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT := least(p_channel.next_dequeue_at, greatest(p_at,
        p_channel.last_dequeue_at + coalesce(p_channel.release_interval_ms, 0)));
    v_concurrency BIGINT := CASE WHEN p_channel.max_concurrency IS NULL THEN 0
                                 ELSE p_channel.current_concurrency - p_freed END;
BEGIN
    UPDATE channel c SET
        current_size = c.current_size + p_added,
        current_concurrency = v_concurrency,
        next_dequeue_at = v_next_at,
        (head_at, head_id) = (
            SELECT k.at, k.id FROM (VALUES (c.head_at, c.head_id), (p_at, p_id)) k(at, id)
            ORDER BY k.at, k.id LIMIT 1)
    WHERE c.name = p_channel.name;
    PERFORM channel_announce(
        channel_servable_at(p_channel.next_dequeue_at, p_channel.current_concurrency,
            p_channel.max_concurrency),
        channel_servable_at(v_next_at, v_concurrency, p_channel.max_concurrency),
        p_type, p_id, p_channel.name);
END;
$$;


-- channel_wait_many(): the set-based form of channel_wait_locked, for a batch's new messages
-- in channels whose rows the caller holds (p_before: each row as locked, before the batch):
-- p_added[i] messages of channel p_names[i] now wait, none due before p_ats[i] nor with an id
-- below p_from_ids[i]. Counts them (channels with a policy; a policy-free channel's counter
-- stays 0), brings each channel's next dequeue time forward to p_ats[i] when that is sooner
-- (no sooner than the release interval allows) and where its waiting messages begin down to
-- (p_ats[i], p_from_ids[i]), which sorts no later than any of them. Then announces the channel
-- that got servable soonest, if any got sooner, naming its first new message (the lowest id
-- from p_from_ids[i]): one event covers the batch (event_publish keeps one per transaction,
-- the soonest), and the ready floor brought down to the soonest covers the others.
-- Locks: the channel rows (held by the caller). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_wait_many(
    p_before channel[], p_names TEXT[], p_added BIGINT[], p_ats BIGINT[], p_from_ids BIGINT[],
    p_type TEXT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_changed RECORD;
BEGIN
    FOR v_changed IN
        WITH updated AS (
            UPDATE channel c SET
                current_size = CASE WHEN c.has_policy THEN c.current_size + a.n ELSE 0 END,
                next_dequeue_at = least(c.next_dequeue_at, greatest(a.at,
                    c.last_dequeue_at + coalesce(c.release_interval_ms, 0))),
                (head_at, head_id) = (
                    SELECT k.at, k.id
                    FROM (VALUES (c.head_at, c.head_id), (a.at, a.from_id)) k(at, id)
                    ORDER BY k.at, k.id LIMIT 1)
            FROM unnest(p_names, p_added, p_ats, p_from_ids) AS a(name, n, at, from_id)
            WHERE c.name = a.name
            RETURNING c.name, c.next_dequeue_at, c.current_concurrency, c.max_concurrency,
                      a.from_id
        )
        SELECT u.name, u.from_id,
               channel_servable_at(b.next_dequeue_at, b.current_concurrency,
                   b.max_concurrency) AS before_at,
               channel_servable_at(u.next_dequeue_at, u.current_concurrency,
                   u.max_concurrency) AS after_at
        FROM updated u JOIN unnest(p_before) AS b ON b.name = u.name
        ORDER BY after_at NULLS LAST
    LOOP
        IF v_changed.after_at IS NOT NULL
           AND (v_changed.before_at IS NULL OR v_changed.after_at < v_changed.before_at) THEN
            PERFORM channel_announce(v_changed.before_at, v_changed.after_at, p_type,
                (SELECT min(m.id) FROM message m
                 WHERE m.id >= v_changed.from_id AND m.channel = v_changed.name),
                v_changed.name);
            EXIT;
        END IF;
    END LOOP;
END;
$$;


-- channel_rotate(): send a channel to the back after a dequeue: its next time becomes its next
-- waiting message's dequeue_at (not before p_now when it was just served), and its row goes
-- when nothing waits. Pushing the time later or deleting the row needs the channel's exclusive
-- advisory lock, which it only tries; holding it, it reads the next message again (a create that
-- committed between the first read and the lock would otherwise be left with no row that says
-- its channel is due: tests/reliability/test_rotate_race.py replays that). Without the lock the
-- time moves at most 10 ms ahead. (p_head_at, p_head_id): where the row says the channel's
-- waiting messages begin, as the caller read it (channel_first_from).
-- Locks: the channel row (held by the caller); tries the exclusive advisory lock.
-- Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_rotate(
    p_channel TEXT, p_head_at BIGINT, p_head_id BIGINT, p_now BIGINT, p_served BOOLEAN
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_next_at BIGINT;
    v_locked BOOLEAN := FALSE;
BEGIN
    LOOP
        -- The next waiting head, read as channel_first_from reads it (written out: a call
        -- would be planned anew each time).
        SELECT CASE WHEN p_served THEN greatest(r.dequeue_at, p_now) ELSE r.dequeue_at END
        INTO v_next_at
        FROM message r
        WHERE channel_hash(r.channel) = channel_hash(p_channel)
          AND r.channel = p_channel AND NOT r.is_locked
          AND (r.dequeue_at, r.id) >= (p_head_at, p_head_id)
        ORDER BY r.dequeue_at, r.id
        LIMIT 1;
        EXIT WHEN v_locked OR v_next_at <= p_now;
        IF NOT pg_try_advisory_xact_lock(channel_key(p_channel)) THEN
            -- Someone is creating or finishing in this channel right now: look again shortly.
            v_next_at := least(v_next_at, p_now + 10);
            EXIT;
        END IF;
        -- Read again under the lock: creates that committed since the first read are visible
        -- to the next statement.
        v_locked := TRUE;
    END LOOP;
    IF v_locked AND v_next_at IS NULL THEN
        DELETE FROM channel c WHERE c.name = p_channel;
        RETURN;
    END IF;
    UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
        last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
    WHERE c.name = p_channel;
    -- The ready floor down to it (channel_ready_floor): its head may be older than the clock
    -- (one that riders hold, or an early one).
    IF v_next_at < (SELECT f.last_value FROM ready_floor_seq f) THEN
        PERFORM setval('ready_floor_seq', v_next_at);
    END IF;
END;
$$;


-- channel_rotate_many(): channel_rotate for the policy-free channels a batch take served and
-- found no due head in (p_names[i], in the order they go to the back, with where each one's
-- row says its waiting messages begin), each served at p_now: their exclusive advisory locks
-- tried in one statement, then, in a statement of its own (its snapshot sees what committed
-- before those locks), each one's next waiting head read again and its row sent to the back
-- or, when it holds the lock and nothing waits, deleted. Without the lock a channel's next
-- time moves at most 10 ms ahead, as in channel_rotate (whose comment says why). Three
-- statements for the batch, where a call of channel_rotate for each channel ran three or four
-- (tests/reliability/test_rotate_race.py replays the race on both).
-- Locks: the channel rows (held by the caller); tries the exclusive advisory locks.
-- Raises: nothing of ours.
CREATE OR REPLACE FUNCTION channel_rotate_many(
    p_names TEXT[], p_head_ats BIGINT[], p_head_ids BIGINT[], p_now BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_bitmapscan = off SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    v_locked TEXT[];
    v_low BIGINT;
BEGIN
    v_locked := ARRAY(
        SELECT r.name FROM unnest(p_names) WITH ORDINALITY AS r(name, ord)
        WHERE pg_try_advisory_xact_lock(channel_key(r.name))
        ORDER BY r.ord);
    -- (Each next head read as channel_first_from reads it, written out: see next_heads in
    -- message_dequeue_loop.)
    WITH heads AS (
        -- (NULL when nothing waits: greatest() would pass over a NULL.)
        SELECT r.name, r.ord, r.name = ANY (v_locked) AS locked,
               CASE WHEN n.dequeue_at IS NOT NULL THEN greatest(n.dequeue_at, p_now)
               END AS next_at
        FROM unnest(p_names, p_head_ats, p_head_ids)
            WITH ORDINALITY AS r(name, head_at, head_id, ord)
        LEFT JOIN LATERAL (
            SELECT s.dequeue_at FROM message s
            WHERE channel_hash(s.channel) = channel_hash(r.name)
              AND s.channel = r.name AND NOT s.is_locked
              AND (s.dequeue_at, s.id) >= (r.head_at, r.head_id)
            ORDER BY s.dequeue_at, s.id
            LIMIT 1) n ON TRUE
    ), gone AS (
        DELETE FROM channel c USING heads h
        WHERE c.name = h.name AND h.locked AND h.next_at IS NULL
    ), turns AS (
        -- (least() passes over a NULL: nothing seen waiting without the lock.)
        SELECT h.name,
               CASE WHEN h.locked THEN h.next_at ELSE least(h.next_at, p_now + 10) END AS next_at,
               nextval('channel_turn_seq') AS turn
        FROM (SELECT x.name, x.locked, x.next_at FROM heads x
              WHERE NOT x.locked OR x.next_at IS NOT NULL ORDER BY x.ord) h
    ), moved AS (
        UPDATE channel c SET next_dequeue_at = t.next_at, turn = t.turn, last_dequeue_at = p_now
        FROM turns t
        WHERE c.name = t.name
        RETURNING c.next_dequeue_at
    )
    SELECT min(m.next_dequeue_at) INTO v_low FROM moved m;
    -- The ready floor down to the soonest (channel_ready_floor), as channel_rotate brings it.
    IF v_low < (SELECT f.last_value FROM ready_floor_seq f) THEN
        PERFORM setval('ready_floor_seq', v_low);
    END IF;
END;
$$;
