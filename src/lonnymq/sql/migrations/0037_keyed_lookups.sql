-- 0037_keyed_lookups: the queue's operations find rows through their indexes, never by reading
-- a table whole.
--
-- plpgsql plans each statement once per session and keeps the plan. A session that starts
-- while `channel` holds a page or two of rows plans `WHERE c.name = v_name` as a sequential
-- scan (cheaper than an index probe, on that page), and keeps that plan while the table grows:
-- every dequeue rewrites its channel's row, so between two vacuums the table fills with dead
-- versions, and a table that once held many channels keeps its pages. 0023 left sequential
-- scans allowed on the reasoning that a page or two is rightly read whole; the plan outlives
-- the page count it was chosen for. Measured on PostgreSQL 15 (pg_stat_statements,
-- `track = all`), 8 producers and 8 consumers of one message per call over 100 channels, the
-- bench's pgbench scripts for 4 s: the channel lookup of message_create took 29 us a call, the
-- policy check of message_finish_try 38 us, message_take_one's send-back 56 us, each reading
-- about 80 row versions of `channel` per call (pg_stat_user_tables: 63,639 sequential scans of
-- `channel` to 20,702 index scans).
--
-- Every function on a message's way through the queue that looks rows of `channel` or
-- `message` up by key now runs with enable_seqscan off (functions it calls inherit the
-- setting; it is restored on return), so its plans are index probes whatever the table's size
-- when the session planned them. (The administrative ones, schedule_set and schedule_remove
-- among them, keep the planner's choice.) A statement with no index to use (the one-row
-- `config` is read whole) is still a sequential scan, now costed above jit_above_cost on
-- PostgreSQL 15: planned with JIT on, each run compiled its expressions first (21 ms a call on
-- an idle machine, 158 ms under the bench's load), so these functions also run with jit off.
-- epoch() and event_publish(), which read `config` and are called from those functions, get
-- jit off too: their one plan is made wherever they are first called, and a session that
-- calls one first under enable_seqscan off of its own would otherwise compile it on every
-- later call.
--
-- One plan shape changes for the worse: where a batch of ids is large enough for the planner
-- to read all of `message` (delete_many, defer_many or heartbeat_many of 10^5 ids, the
-- limit), it now does so through the primary key instead of a sequential scan (delete_many of
-- 10^5 ids over 10^6 messages: that statement 0.35 -> 0.49 s, the call unchanged at 1.3 s;
-- of 10^4 ids the calls got faster, 0.32 -> 0.13 s).

ALTER FUNCTION channel_lock(TEXT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_next_at(TEXT, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_rotate(TEXT, BIGINT, BOOLEAN)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_rotate_next_at(TEXT, BIGINT, BOOLEAN)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_wake(TEXT, BIGINT, BOOLEAN, BIGINT, TEXT, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_policy_set(TEXT, INTEGER, BIGINT, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION channel_policy_clear(TEXT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_create(BYTEA, TEXT, BIGINT, TEXT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_create_many(TEXT[], BYTEA[], BIGINT[], TEXT[])
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_create_many_locked(TEXT[], BYTEA[], BIGINT[], TEXT[])
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_create_settle(channel, BIGINT, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_take_one(BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_dequeue_loop(INTEGER, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_finish_try(BIGINT, INTEGER, TEXT, TEXT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_requeue_try(BIGINT, INTEGER, BIGINT, BYTEA)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_refuse(BIGINT, INTEGER)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_delete_many(BIGINT[], INTEGER[])
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_defer_many(BIGINT[], INTEGER[], BIGINT[], BYTEA[])
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_heartbeat(BIGINT, INTEGER, BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_heartbeat_many(BIGINT[], INTEGER[], BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION message_status(BIGINT)
    SET enable_seqscan = off SET jit = off;
ALTER FUNCTION epoch() SET jit = off;
ALTER FUNCTION event_publish(TEXT, BIGINT, TEXT, BIGINT) SET jit = off;
