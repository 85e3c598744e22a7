-- 0017_maintenance: which of the queue's high-churn tables need a VACUUM now.
--
-- Every dequeue rewrites its channel's row (its next dequeue time and turn are indexed, so the
-- update is never HOT) and every message leaves two dead row versions behind (the lock, then
-- the delete). Autovacuum looks at a table once a minute at best, and may be off: meanwhile the
-- channel table of a busy queue grows many times over and each dequeue walks more dead index
-- entries. Measured on this project's machine (pgbench, 8 clients finishing and taking one
-- message over 100 channels): 2,113 → 1,909 → 1,345 calls/s over three 8-second runs without
-- a VACUUM, 2,452 and 2,797 right after one. So the worker runtime vacuums them itself
-- (Queue.maintain), and asks this function first which ones are due.

-- maintenance_due(): the tables among channel and message that hold at least 200 (channel) or
-- 2,000 (message) dead row versions plus one per 20 live rows, as the statistics collector
-- counts them, and that the session's login role may vacuum (it has their owner's
-- privileges: VACUUM needs them). Read-only; the caller runs VACUUM on each name returned.
CREATE FUNCTION maintenance_due() RETURNS TABLE (table_name TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.relname::TEXT
    FROM pg_catalog.pg_class c
    LEFT JOIN pg_catalog.pg_stat_all_tables s ON s.relid = c.oid
    WHERE c.relnamespace = (SELECT n.oid FROM pg_catalog.pg_namespace n
                            WHERE n.nspname = pg_catalog.current_schema())
      AND c.relname IN ('channel', 'message')
      AND pg_catalog.pg_has_role(session_user, c.relowner, 'USAGE')
      AND coalesce(s.n_dead_tup, 0)
          >= CASE c.relname WHEN 'channel' THEN 200 ELSE 2000 END
             + coalesce(s.n_live_tup, 0) / 20
    ORDER BY c.relname
$$;

SELECT secure_functions();
