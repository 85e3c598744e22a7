-- 0003_lock_gate: expired locks are looked for about once a second, not by every take.
--
-- A take used to start by probing message_unlock_ix for a lock that had expired. The probe
-- finds nothing nearly always, and while a long transaction anywhere in the database holds
-- back the horizon, the index entries of every message finished since then stay in its range
-- and every take walked them all: from 1 to 55,096 pages per take over a 10-minute idle
-- transaction (docs/long-transactions.md). Two sequences now say when and from where to look.
-- A sequence holds one value, set in place without a new row version, so reading it costs the
-- same whatever the horizon, and setting it is not undone by a rollback.

-- lock_gate_seq: no lock expires before this time, as far as the queue knows: a take looks for
-- expired locks only once the clock has reached it. A look that finds none sets it a second
-- ahead; a take or heartbeat that sets an earlier expiry brings it back to that expiry. The
-- smallest BIGINT at first: the first take looks.
CREATE SEQUENCE lock_gate_seq AS BIGINT
    MINVALUE -9223372036854775808 START WITH -9223372036854775808;

-- lock_sweep_seq: the clock of the last look that found no expired lock (0 at first). The next
-- look starts 5 s before it; the first look of each minute starts from the lowest expiry.
CREATE SEQUENCE lock_sweep_seq AS BIGINT MINVALUE -9223372036854775808 START WITH 0;
