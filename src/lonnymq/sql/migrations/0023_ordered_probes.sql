-- 0023_ordered_probes: the functions that look for a channel's head never plan a bitmap scan.
--
-- A dequeue finds a channel's next messages with message_channel_head_ix: channel, then
-- (dequeue_at, id) order, the first few rows and no more. The planner may instead read every
-- entry of that channel through a bitmap scan and sort them, when it expects only a row or two:
-- it then costs the two plans alike. Its guess multiplies the channel's share of all messages
-- by the share not locked, taken from statistics that in a queue are usually old (a backlog
-- analysed while locked, or before a burst of creates), so it can expect one row where a
-- million wait, and the sort then reads them all on every dequeue. A CI run on PostgreSQL 18
-- chose that plan for the batch dequeue's heads statement
-- (tests/concurrency/test_index_probes.py, the live_locks shape: 70 ready rows, 1 expected).
--
-- Each function below that probes for heads now runs with enable_bitmapscan off, so the plan
-- is the ordered probe whatever the statistics say. Sequential scans stay allowed: the planner
-- rightly reads a table of a page or two whole. The setting is restored when the function
-- returns; functions they call (channel_rotate from the dequeues) inherit it. It costs about
-- 0.4 us per call: 200,000 calls of an empty plpgsql function pinning search_path took 295 ms
-- without it and 373 ms with it (PostgreSQL 15).

ALTER FUNCTION message_take_one(BIGINT) SET enable_bitmapscan = off;
ALTER FUNCTION message_dequeue_loop(INTEGER, BIGINT) SET enable_bitmapscan = off;
ALTER FUNCTION channel_rotate(TEXT, BIGINT, BOOLEAN) SET enable_bitmapscan = off;
ALTER FUNCTION channel_rotate_next_at(TEXT, BIGINT, BOOLEAN) SET enable_bitmapscan = off;
ALTER FUNCTION channel_next_at(TEXT, BIGINT) SET enable_bitmapscan = off;
