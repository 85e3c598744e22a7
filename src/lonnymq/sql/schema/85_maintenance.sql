-- Maintenance: a consistency check of the channel rows against the message rows, and which
-- high-churn tables need a VACUUM.
--
-- The two kinds of channel keep different state, so they are checked differently:
-- * A channel with a policy (has_policy) keeps exact counters under its row lock:
--   current_size is the number of its messages, current_concurrency the number of its locked
--   messages while max_concurrency is set (0 otherwise). Its next_dequeue_at must not be later
--   than max(head's dequeue_at, last_dequeue_at + release_interval_ms), the time every
--   operation on it computes (it may be earlier: a visit then finds nothing and recomputes).
-- * A channel without one keeps no counters (both stay 0). Its row exists while it may hold
--   waiting messages and says when it is next worth a visit. Its next_dequeue_at must not be
--   later than its head's dequeue_at, with one bounded exception: a dequeue that cannot take
--   the channel's exclusive advisory lock (someone is creating in it) pushes the time at most
--   10 ms past its own clock, so a row up to 10 ms ahead of the clock is not reported.
--   A row may outlive the channel's last waiting message (a dequeue that could not take the
--   advisory lock, a schedule removed): it keeps a time, so the dequeue that visits it then
--   deletes it. Only a row with no time (never visited, never deleted) counts as orphaned.
-- A waiting (unlocked) message whose channel has no row, a row with no time, or a time later
-- than allowed is stranded: no dequeue would find it. That is what "lost" means here.
--
-- Every dequeue rewrites its channel's row (its next dequeue time and turn are indexed, so the
-- update is never HOT) and every message leaves two dead row versions behind (the lock, then
-- the delete). Autovacuum looks at a table once a minute at best, and may be off: meanwhile the
-- channel table of a busy queue grows many times over and each dequeue walks more dead index
-- entries (pgbench, 8 clients finishing and taking one message over 100 channels: 2,113 ->
-- 1,909 -> 1,345 calls/s over three 8-second runs without a VACUUM, 2,452 and 2,797 right
-- after one). So the worker runtime vacuums them itself (Queue.maintain), and asks
-- maintenance_due() first which ones are due.
--
-- A VACUUM removes only the dead row versions that no snapshot in the database can still see.
-- While an older snapshot lives (a long transaction anywhere in the database), it removes none
-- of the newer ones and the statistics' dead row count stays as high as before: counted whole,
-- it would make every later maintain() (each worker's, every second) vacuum again for nothing.
-- So maintain() records after each VACUUM how many dead row versions the table had been given
-- (maintenance_vacuumed), and maintenance_due() counts only those made since, capped by the
-- statistics' dead row count (autovacuum or pruning may have removed some of them since).
-- What the held-back VACUUM left is removed by the next one, once enough new rows died.
--
-- Under such a snapshot the dead row versions of the two tables (two per message, one per
-- take in the channel rows) grow for as long as it is held: 720,666 in message after a
-- 10-minute idle transaction at 600 msg/s. No VACUUM can remove them, but a TRUNCATE can: it
-- needs the table's lock, not a horizon. So maintain() also compacts a table whose dead rows
-- outnumber its live ones many times (maintenance_compact): under the table's exclusive lock,
-- taken at a moment no transaction has the table open, it copies the live rows aside, truncates
-- the table and writes them back, ids, locks, attempts and marks unchanged. The price: a
-- transaction whose snapshot is older than the compaction and that reads the table for the
-- first time after it sees the table as empty (TRUNCATE is not MVCC-safe). Hence the guards:
-- no compaction of message while a lonnymq.spark.snapshot() is held (its advisory lock; a
-- Spark read in it reads message, never channel), none while a pg_dump is connected or while
-- any transaction has the table open (it holds a lock on it); and no function of the schema
-- that reads channel or message is STABLE (a STABLE function reads with its caller's
-- snapshot, which may predate the lock it then waits for).


-- queue_verify(): one row per discrepancy between the channel rows and the message rows:
-- the channel, a kind, the expected and the actual value (NULL where there is none) and a
-- sentence. Kinds:
--   size_mismatch       current_size differs from the channel's message count (policy), or
--                       is not 0 (no policy);
--   in_flight_mismatch  current_concurrency differs from the channel's locked messages
--                       (policy with max_concurrency), or is not 0 (otherwise);
--   channel_missing     waiting messages but no channel row (expected: the head's dequeue_at);
--   head_unscheduled    waiting messages but next_dequeue_at is NULL;
--   head_late           next_dequeue_at later than allowed (expected: the latest allowed);
--   head_hidden         a waiting message sorts before where the row says the channel's
--                       waiting messages begin (head_at, head_id): takes start there and
--                       would pass it (expected: the message's id; actual: head_id);
--   orphan_channel      a policy-free row with no waiting message and no next_dequeue_at;
--   stray_policy        a policy-free row with policy values set;
--   bad_lock            a message whose lock is inconsistent (locked without unlock_at or the
--                       other way round, locked with num_attempts < 1, negative attempts);
--                       the detail names the message.
-- It reads everything in one statement (STABLE: one snapshot); run it in a REPEATABLE READ,
-- READ ONLY transaction to keep it apart from concurrent writers. It scans both tables: an
-- operator's tool, not a hot path.
-- Locks: none beyond reading. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION queue_verify()
RETURNS TABLE (channel TEXT, kind TEXT, expected BIGINT, actual BIGINT, detail TEXT)
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    WITH clock AS (
        -- The clock as the check runs (after its snapshot), not as its transaction started:
        -- every time a committed operation wrote is then at most this.
        SELECT epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT
            AS now_ms
    ), counted AS (
        SELECT m.channel, count(*) AS total, count(*) FILTER (WHERE m.is_locked) AS locked
        FROM message m
        GROUP BY m.channel
    ), head AS (
        SELECT DISTINCT ON (m.channel) m.channel, m.id, m.dequeue_at
        FROM message m
        WHERE NOT m.is_locked
        ORDER BY m.channel, m.dequeue_at, m.id
    ), state AS (
        SELECT coalesce(c.name, n.channel) AS name,
               c.name IS NOT NULL AS has_row,
               coalesce(c.has_policy, FALSE) AS has_policy,
               c.max_concurrency, c.release_interval_ms, c.max_size,
               c.current_size, c.current_concurrency, c.next_dequeue_at, c.last_dequeue_at,
               coalesce(n.total, 0) AS total, coalesce(n.locked, 0) AS locked,
               h.id AS head_id, h.dequeue_at AS head_at,
               c.head_at AS mark_at, c.head_id AS mark_id,
               CASE WHEN coalesce(c.has_policy, FALSE)
                    THEN greatest(h.dequeue_at,
                        c.last_dequeue_at + coalesce(c.release_interval_ms, 0))
                    ELSE greatest(h.dequeue_at, (SELECT k.now_ms FROM clock k) + 10)
               END AS latest_at
        FROM channel c
        FULL JOIN counted n ON n.channel = c.name
        LEFT JOIN head h ON h.channel = coalesce(c.name, n.channel)
    )
    SELECT r.channel, r.kind, r.expected, r.actual, r.detail
    FROM (
        SELECT s.name AS channel, 'size_mismatch' AS kind,
               CASE WHEN s.has_policy THEN s.total ELSE 0 END AS expected,
               s.current_size AS actual,
               CASE WHEN s.has_policy
                    THEN format('current_size is %s but the channel holds %s messages',
                        s.current_size, s.total)
                    ELSE format('a channel without a policy keeps no size, but current_size is %s',
                        s.current_size)
               END AS detail
        FROM state s
        WHERE s.has_row
          AND s.current_size <> CASE WHEN s.has_policy THEN s.total ELSE 0 END
        UNION ALL
        SELECT s.name, 'in_flight_mismatch',
               CASE WHEN s.max_concurrency IS NOT NULL THEN s.locked ELSE 0 END,
               s.current_concurrency,
               CASE WHEN s.max_concurrency IS NOT NULL
                    THEN format('current_concurrency is %s but %s messages are locked',
                        s.current_concurrency, s.locked)
                    ELSE format('a channel without max_concurrency keeps no in-flight count, '
                        'but current_concurrency is %s', s.current_concurrency)
               END
        FROM state s
        WHERE s.has_row
          AND s.current_concurrency
              <> CASE WHEN s.max_concurrency IS NOT NULL THEN s.locked ELSE 0 END
        UNION ALL
        SELECT s.name, 'channel_missing', s.head_at, NULL::BIGINT,
               format('message %s waits (due at %s) but the channel has no row: '
                   'no dequeue will find it', s.head_id, s.head_at)
        FROM state s
        WHERE NOT s.has_row AND s.head_id IS NOT NULL
        UNION ALL
        SELECT s.name, 'head_unscheduled', s.latest_at, NULL::BIGINT,
               format('message %s waits (due at %s) but next_dequeue_at is NULL: '
                   'no dequeue will find it', s.head_id, s.head_at)
        FROM state s
        WHERE s.has_row AND s.head_id IS NOT NULL AND s.next_dequeue_at IS NULL
        UNION ALL
        SELECT s.name, 'head_late', s.latest_at, s.next_dequeue_at,
               format('message %s is due at %s but next_dequeue_at is %s, later than %s',
                   s.head_id, s.head_at, s.next_dequeue_at, s.latest_at)
        FROM state s
        WHERE s.has_row AND s.head_id IS NOT NULL AND s.next_dequeue_at > s.latest_at
        UNION ALL
        SELECT s.name, 'head_hidden', s.head_id, s.mark_id,
               format('message %s waits (due at %s) but the channel row says its waiting '
                   'messages begin at (%s, %s), after it: no dequeue will find it',
                   s.head_id, s.head_at, s.mark_at, s.mark_id)
        FROM state s
        WHERE s.has_row AND s.head_id IS NOT NULL
          AND (s.head_at, s.head_id) < (s.mark_at, s.mark_id)
        UNION ALL
        SELECT s.name, 'orphan_channel', NULL::BIGINT, NULL::BIGINT,
               format('a channel row without a policy, without a waiting message (%s locked) '
                   'and without next_dequeue_at: no dequeue will ever remove it', s.locked)
        FROM state s
        WHERE s.has_row AND NOT s.has_policy AND s.head_id IS NULL
          AND s.next_dequeue_at IS NULL
        UNION ALL
        SELECT s.name, 'stray_policy', NULL::BIGINT, NULL::BIGINT,
               format('has_policy is false but max_concurrency=%s, release_interval_ms=%s, '
                   'max_size=%s', s.max_concurrency, s.release_interval_ms, s.max_size)
        FROM state s
        WHERE s.has_row AND NOT s.has_policy
          AND (s.max_concurrency IS NOT NULL OR s.release_interval_ms IS NOT NULL
               OR s.max_size IS NOT NULL)
        UNION ALL
        SELECT m.channel, 'bad_lock',
               CASE WHEN m.is_locked THEN 1 ELSE 0 END, m.num_attempts::BIGINT,
               format('message %s: is_locked=%s, unlock_at=%s, num_attempts=%s',
                   m.id, m.is_locked, coalesce(m.unlock_at::TEXT, 'NULL'), m.num_attempts)
        FROM message m
        WHERE m.is_locked <> (m.unlock_at IS NOT NULL)
           OR (m.is_locked AND m.num_attempts < 1)
           OR m.num_attempts < 0
    ) r
    ORDER BY r.channel, r.kind, r.detail
$$;


-- maintenance_due(): the tables among channel and message that hold at least 200 (channel) or
-- 2,000 (message) dead row versions plus one per 20 live rows, as the statistics count them,
-- and that the session's login role may vacuum (it has their owner's privileges: VACUUM needs
-- them). A table that maintenance_vacuumed() recorded counts only the dead row versions made
-- since (its updates plus deletes since then), at most the statistics' dead row count: those
-- a VACUUM left behind for an older snapshot are not counted again. Counters lower than
-- recorded mean the statistics were reset: the statistics' dead row count then counts whole.
-- Read-only; the caller runs VACUUM on each name returned, then maintenance_vacuumed().
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION maintenance_due() RETURNS TABLE (table_name TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.relname::TEXT
    FROM pg_catalog.pg_class c
    LEFT JOIN pg_catalog.pg_stat_all_tables s ON s.relid = c.oid
    LEFT JOIN maintenance_vacuum v ON v.table_name = c.relname::TEXT
    CROSS JOIN LATERAL (
        SELECT coalesce(s.n_dead_tup, 0) AS dead,
               coalesce(s.n_tup_upd, 0) + coalesce(s.n_tup_del, 0) AS dead_made,
               coalesce(s.vacuum_count, 0) + coalesce(s.autovacuum_count, 0) AS vacuums
    ) n
    WHERE c.relnamespace = (SELECT ns.oid FROM pg_catalog.pg_namespace ns
                            WHERE ns.nspname = pg_catalog.current_schema())
      AND c.relname IN ('channel', 'message')
      AND pg_catalog.pg_has_role(session_user, c.relowner, 'USAGE')
      AND CASE WHEN v.table_name IS NULL OR n.dead_made < v.dead_made OR n.vacuums < v.vacuums
               THEN n.dead
               ELSE least(n.dead, n.dead_made - v.dead_made)
          END
          >= CASE c.relname WHEN 'channel' THEN 200 ELSE 2000 END
             + coalesce(s.n_live_tup, 0) / 20
    ORDER BY c.relname
$$;


-- maintenance_vacuumed(): record that Queue.maintain() has just run VACUUM on p_table_name
-- ('channel' or 'message'): how many dead row versions the table had been given so far (the
-- statistics' updates plus deletes, which no VACUUM resets) and how many times it was
-- vacuumed (that drops only when the statistics are reset). It drops the statistics this
-- transaction may have cached (stats_fetch_consistency) to read them as the VACUUM left them.
-- A VACUUM that SKIP_LOCKED skipped is recorded too: the lock it could not take is mostly
-- another VACUUM's (autovacuum's, another worker's), which reaches the same rows.
-- Locks: the table's maintenance_vacuum row. Raises: LQ003 (another table name).
CREATE OR REPLACE FUNCTION maintenance_vacuumed(p_table_name TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM arg_check(p_table_name IN ('channel', 'message'),
        format('table_name must be channel or message, got %s',
               coalesce(quote_literal(p_table_name), 'NULL')));
    PERFORM pg_catalog.pg_stat_clear_snapshot();
    INSERT INTO maintenance_vacuum (table_name, dead_made, vacuums)
    SELECT p_table_name,
           coalesce(sum(s.n_tup_upd + s.n_tup_del), 0),
           coalesce(sum(s.vacuum_count + s.autovacuum_count), 0)
    FROM pg_catalog.pg_stat_all_tables s
    WHERE s.schemaname = pg_catalog.current_schema() AND s.relname = p_table_name
    ON CONFLICT (table_name) DO UPDATE
        SET dead_made = excluded.dead_made, vacuums = excluded.vacuums;
END;
$$;


-- maintenance_compact(): rewrite p_table_name ('channel' or 'message') with its live rows only,
-- when its dead row versions are at least 1,000 (channel) or 10,000 (message) and four times
-- its live rows, as the statistics count them (what VACUUM cannot remove while an older
-- snapshot lives: see the top of this file), those made before its last compaction left out
-- (recorded in maintenance_vacuum, as maintenance_vacuumed() records a VACUUM). A channel's
-- row is rewritten by every take that serves it, and each statement that finds it by name
-- walks its versions: hence the lower mark for a table of a few rows. Returns what it did:
-- 'compacted'; 'not_needed'; 'too_large' (more than p_max_live live rows, or more than 64 MiB
-- of them: the copy is held in memory and everything waits for it); 'snapshot_held' (message
-- only: a lonnymq.spark.snapshot() block is open, or another schema's compaction of message
-- runs);
-- 'dump_running' (a pg_dump is connected to the database); 'busy' (in 50 tries about a
-- millisecond apart, the table was never free of open transactions). It never waits in the
-- table's lock queue: its tries are NOWAIT, so no operation of the queue waits behind it,
-- only during the copy (milliseconds for 10,000 rows). The rows written back keep every
-- column (ids, locks, attempts, the channel marks) and fire the table's INSERT triggers (none
-- of the schema's own).
-- Locks: the table (ACCESS EXCLUSIVE, to its transaction's end), for message the advisory
-- lock that snapshot() shares (exclusive), the table's maintenance_vacuum row. Raises: LQ003
-- (another table name, p_max_live out of 1..1,000,000).
CREATE OR REPLACE FUNCTION maintenance_compact(p_table_name TEXT, p_max_live INTEGER)
RETURNS TEXT
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_dead BIGINT;
    v_live BIGINT;
    v_rows BIGINT;
    v_bytes BIGINT;
    v_tries INTEGER := 0;
    v_made BIGINT;
    v_vacuums BIGINT;
    v_seen BIGINT;
    v_messages message[];
    v_channels channel[];
BEGIN
    PERFORM arg_check(p_table_name IN ('channel', 'message'),
        format('table_name must be channel or message, got %s',
               coalesce(quote_literal(p_table_name), 'NULL')));
    PERFORM arg_check_range('max_live', p_max_live, 1, 1000000);
    PERFORM pg_catalog.pg_stat_clear_snapshot();
    -- Counted as maintenance_due() counts for VACUUM, from the last compaction's totals.
    SELECT CASE WHEN v.compacted_made IS NULL OR n.made < v.compacted_made THEN n.dead
                ELSE least(n.dead, n.made - v.compacted_made) END,
           n.live, n.made, n.vacuums, v.compacted_made
    INTO v_dead, v_live, v_made, v_vacuums, v_seen
    FROM pg_catalog.pg_stat_all_tables s
    LEFT JOIN maintenance_vacuum v ON v.table_name = p_table_name
    CROSS JOIN LATERAL (
        SELECT coalesce(s.n_dead_tup, 0) AS dead, coalesce(s.n_live_tup, 0) AS live,
               coalesce(s.n_tup_upd, 0) + coalesce(s.n_tup_del, 0) AS made,
               coalesce(s.vacuum_count, 0) + coalesce(s.autovacuum_count, 0) AS vacuums
    ) n
    WHERE s.schemaname = pg_catalog.current_schema() AND s.relname = p_table_name;
    IF coalesce(v_dead, 0) < greatest(
        CASE p_table_name WHEN 'channel' THEN 1000 ELSE 10000 END, 4 * v_live)
    THEN
        RETURN 'not_needed';
    END IF;
    IF v_live > p_max_live THEN
        RETURN 'too_large';
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_stat_activity a
               WHERE a.datname = pg_catalog.current_database()
                 AND a.application_name IN ('pg_dump', 'pg_dumpall'))
    THEN
        RETURN 'dump_running';
    END IF;
    -- The key lonnymq.spark.snapshot() holds shared while its snapshot lives. A Spark read in
    -- that snapshot reads message (or archive, which is never compacted), not channel: a
    -- channel's row, rewritten by every take, is still compacted while one is open.
    IF p_table_name = 'message' AND NOT pg_catalog.pg_try_advisory_xact_lock(
        pg_catalog.hashtextextended('lonnymq.snapshot', 0))
    THEN
        RETURN 'snapshot_held';
    END IF;
    LOOP
        BEGIN
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', p_table_name);
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            v_tries := v_tries + 1;
            IF v_tries >= 50 THEN
                RETURN 'busy';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.001);
        END;
    END LOOP;
    -- Under the lock, statements of their own (their snapshots are taken after it, so they see
    -- every transaction that had the table open as committed): another worker's compaction
    -- that ran meanwhile (it read the same statistics), then exactly what is live now.
    IF (SELECT v.compacted_made FROM maintenance_vacuum v WHERE v.table_name = p_table_name)
       IS DISTINCT FROM v_seen
    THEN
        RETURN 'not_needed';
    END IF;
    EXECUTE format('SELECT count(*), coalesce(sum(pg_catalog.pg_column_size(t.*)), 0) FROM %I t',
        p_table_name) INTO v_rows, v_bytes;
    IF v_rows > p_max_live OR v_bytes > 64 * 1024 * 1024 THEN
        RETURN 'too_large';
    END IF;
    IF p_table_name = 'message' THEN
        v_messages := ARRAY(SELECT m FROM message m);
        TRUNCATE message;
        INSERT INTO message SELECT * FROM unnest(v_messages);
    ELSE
        v_channels := ARRAY(SELECT c FROM channel c);
        TRUNCATE channel;
        INSERT INTO channel SELECT * FROM unnest(v_channels);
    END IF;
    -- Every dead row version counted so far is gone (a new table row for a first compaction
    -- also says that nothing made so far is left for VACUUM).
    INSERT INTO maintenance_vacuum (table_name, dead_made, vacuums, compacted_made)
    VALUES (p_table_name, v_made, v_vacuums, v_made)
    ON CONFLICT (table_name) DO UPDATE SET compacted_made = excluded.compacted_made;
    RETURN 'compacted';
END;
$$;
