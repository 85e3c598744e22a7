-- 0002_maintenance_vacuum: what the queue's own maintenance last saw of each table it vacuums.
--
-- A VACUUM removes only the dead row versions that no snapshot in the database can still see.
-- While an older snapshot lives (a long transaction anywhere in the database), it removes none
-- of the newer ones and the statistics' dead row count stays above the threshold: counted whole,
-- it would have every maintain() (each worker's, every second) run a VACUUM that can remove
-- nothing. So after each VACUUM, Queue.maintain() records how many dead row versions the table
-- had been given so far (the statistics' updates plus deletes, running totals that no VACUUM
-- resets), and maintenance_due() counts only those made since.

-- One row per table that Queue.maintain() has vacuumed; written by maintenance_vacuumed().
CREATE TABLE maintenance_vacuum (
    table_name TEXT PRIMARY KEY CHECK (table_name IN ('channel', 'message')),
    -- pg_stat_all_tables.n_tup_upd + n_tup_del of the table just after that VACUUM: the dead
    -- row versions it had been given so far.
    dead_made BIGINT NOT NULL,
    -- vacuum_count + autovacuum_count then: lower later means the statistics were reset.
    vacuums BIGINT NOT NULL
);
