SELECT 'session' AS holder, pid::text AS name, datname::text AS database, state,
       age(backend_xmin) AS xmin_age, now() - xact_start AS open_for
FROM pg_stat_activity
WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
UNION ALL
SELECT 'replication slot', slot_name::text, database::text,
       CASE WHEN active THEN 'active' ELSE 'inactive' END, age(xmin), NULL
FROM pg_replication_slots
WHERE xmin IS NOT NULL
UNION ALL
SELECT 'prepared transaction', gid, database::text, 'prepared', age(transaction),
       now() - prepared
FROM pg_prepared_xacts
ORDER BY xmin_age DESC
LIMIT 10;
