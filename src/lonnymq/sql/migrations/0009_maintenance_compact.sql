-- 0009_maintenance_compact: what the queue's own compaction last saw of each table it rewrote.
--
-- While an older snapshot lives, VACUUM removes none of the dead row versions made since, and
-- Queue.maintain() compacts a table that gathered many of them instead (maintenance_compact:
-- the live rows copied aside, the table truncated, the rows written back). The statistics'
-- dead row count of a table lags its compaction by up to a second or more (the compacting
-- session reports it later), so, as for VACUUM, the dead row versions made since the last
-- compaction are counted from the running totals of updates and deletes.

-- pg_stat_all_tables.n_tup_upd + n_tup_del of the table when maintenance_compact() last
-- rewrote it; NULL: never.
ALTER TABLE maintenance_vacuum ADD COLUMN compacted_made BIGINT;
