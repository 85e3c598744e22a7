SELECT relname AS table_name, n_live_tup AS live_tuples, n_dead_tup AS dead_tuples,
       round(100.0 * n_dead_tup / greatest(n_live_tup + n_dead_tup, 1), 1) AS dead_pct,
       pg_size_pretty(pg_table_size(relid)) AS table_size,
       pg_size_pretty(pg_indexes_size(relid)) AS index_size,
       last_autovacuum, last_vacuum, autovacuum_count
FROM pg_stat_user_tables
WHERE schemaname = 'my_queue'
ORDER BY n_dead_tup DESC, relname;
