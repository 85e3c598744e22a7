-- Least privilege. The queue's tables are reachable only through its functions, and a role is
-- granted the functions of one kind: producer, worker or admin.
--
-- Every function runs as its owner (the role that installed the queue: SECURITY DEFINER), so a
-- role that may call message_dequeue_many needs no right on the message table, and a role that
-- may not call it gets "permission denied" however it reaches the table. A definer's function
-- must not let its caller choose which objects it resolves: each one pins search_path to the
-- queue's schema, then pg_catalog, then pg_temp explicitly last (left out, pg_temp would be
-- searched first, and a caller's temporary table or function could shadow ours). PUBLIC loses
-- EXECUTE on every function (PostgreSQL grants it to PUBLIC by default), and any right on the
-- tables, sequences and CREATE on the schema.
--
-- secure_functions() applies all of that to whatever the schema holds, so it is idempotent:
-- the installer runs it after the function layer (a CREATE OR REPLACE resets SECURITY DEFINER
-- and the SET clause), and tests/security checks that nothing escaped it. It also re-applies
-- the recorded grants, so that a role granted a kind before an upgrade can call the functions
-- the upgrade adds to that kind.
--
-- Kinds nest (producer < worker < admin): a worker creates too (dead letters, schedule
-- firings), an admin does everything. role_kind_functions() is the one list; the README's
-- "Security / least privilege" table shows it. Internal helpers (channel_lock, message_finish,
-- arg_check...) are granted to no one: only the queue's own functions call them.


-- role_kind_functions(): the functions a role of kind p_kind may execute; NULL for an unknown
-- kind. The Spark writer's staging COPY also needs INSERT on spark_stage (see role_apply).
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION role_kind_functions(p_kind TEXT) RETURNS TEXT[]
LANGUAGE sql IMMUTABLE
SET search_path FROM CURRENT
AS $$
    SELECT CASE WHEN p_kind IN ('producer', 'worker', 'admin') THEN
        -- producer: see that the schema is installed, create (one, many, or through a Spark
        -- write), read the clock and settings, follow a message to its outcome (Queue.wait).
        ARRAY['schema_version', 'epoch', 'config_get', 'message_create', 'message_create_many',
              'message_status', 'spark_stage_record', 'spark_stage_clear', 'spark_write_commit',
              'spark_write_result', 'spark_sink_prune', 'spark_sink_claim', 'spark_write_claim']
        || CASE WHEN p_kind IN ('worker', 'admin') THEN
            -- worker: take messages and finish, defer or extend them; channel_stats for
            -- Worker(until_idle) and its metrics; a Spark streaming read consumes too (and
            -- reads the largest message id, its horizon, with spark_scan_bounds, what it
            -- waits for under Trigger.AvailableNow with spark_batch_waiting, and claims its
            -- consumer for its checkpoint with spark_consumer_claim); a Worker reports itself
            -- once a heartbeat round (worker_report, worker_stopped).
            ARRAY['message_dequeue', 'message_dequeue_many', 'message_complete_and_dequeue',
                  'message_settle',
                  'message_heartbeat', 'message_heartbeat_many', 'message_delete',
                  'message_delete_many', 'message_defer', 'message_defer_many', 'channel_stats',
                  'spark_consumer_lock', 'spark_batch_plan', 'spark_batch_ack',
                  'spark_batch_heartbeat', 'spark_batch_read',
                  'spark_scan_bounds', 'spark_batch_waiting', 'spark_consumer_claim',
                  'worker_report', 'worker_stopped']
        ELSE ARRAY[]::TEXT[] END
        || CASE WHEN p_kind = 'admin' THEN
            -- admin: policies, settings, schedules, the archive, checks, raw scans, the clock,
            -- the dashboard's reads (they show messages' content) and its actions on waiting
            -- messages.
            ARRAY['channel_policy_set', 'channel_policy_clear', 'config_set', 'clock_offset_set',
                  'queue_verify', 'schedule_set', 'schedule_list', 'schedule_remove',
                  'archive_list', 'archive_replay', 'spark_stage_purge', 'spark_message_scan',
                  'spark_archive_scan', 'dashboard_overview', 'dashboard_channels',
                  'dashboard_channel_messages', 'dashboard_archive', 'message_discard',
                  'message_expedite', 'channel_pause', 'channel_resume', 'dashboard_schedules',
                  'dashboard_workers']
        ELSE ARRAY[]::TEXT[] END
    END
$$;


-- role_check(): the oid of role p_role, which may be granted a kind here: it must exist, not
-- be a superuser (no privilege limits it) and not own the queue (its rights come from
-- ownership; revoking them would break the queue).
-- Locks: none. Raises: LQ003.
CREATE OR REPLACE FUNCTION role_check(p_role TEXT) RETURNS OID
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_role pg_roles;
BEGIN
    SELECT * INTO v_role FROM pg_roles r WHERE r.rolname = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'role % does not exist (create it first: CREATE ROLE ... LOGIN)',
            coalesce(quote_ident(p_role), 'NULL')
            USING ERRCODE = 'LQ003';
    END IF;
    IF v_role.rolsuper THEN
        RAISE EXCEPTION 'role % is a superuser: no privilege limits it', quote_ident(p_role)
            USING ERRCODE = 'LQ003';
    END IF;
    IF v_role.oid = (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = current_schema())
        OR v_role.oid = (SELECT c.relowner FROM pg_class c WHERE c.oid = 'message'::regclass)
    THEN
        RAISE EXCEPTION 'role % owns the queue and may already do everything',
            quote_ident(p_role)
            USING ERRCODE = 'LQ003';
    END IF;
    RETURN v_role.oid;
END;
$$;


-- schema_functions(): the functions of the queue's schema, by name, each with its identity
-- arguments (as GRANT and ALTER FUNCTION name it).
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION schema_functions() RETURNS TABLE (name TEXT, args TEXT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT p.proname::TEXT, pg_get_function_identity_arguments(p.oid)
    FROM pg_proc p
    WHERE p.pronamespace = (SELECT n.oid FROM pg_namespace n WHERE n.nspname = current_schema())
      AND p.prokind = 'f'
    ORDER BY p.proname
$$;


-- role_strip(): take every right on the queue's schema and its objects from p_role.
-- Locks: none of ours (GRANT's catalog locks). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION role_strip(p_role TEXT) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
BEGIN
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM %I', v_schema, p_role);
    EXECUTE format('REVOKE ALL ON SCHEMA %I FROM %I', v_schema, p_role);
END;
$$;


-- role_apply(): give p_role exactly the rights of kind p_kind: USAGE on the schema, EXECUTE on
-- the kind's functions, INSERT on spark_stage (the Spark writer's COPY target: rows land
-- there for the writer's own spark_write_commit to promote; a producer may create messages
-- anyway). Returns how many functions were granted.
-- Locks: none of ours (GRANT's catalog locks). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION role_apply(p_role TEXT, p_kind TEXT) RETURNS INTEGER
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
    v_function RECORD;
    v_count INTEGER := 0;
BEGIN
    PERFORM role_strip(p_role);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', v_schema, p_role);
    FOR v_function IN
        SELECT f.name, f.args FROM schema_functions() f
        WHERE f.name = ANY (role_kind_functions(p_kind))
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %I.%I(%s) TO %I',
            v_schema, v_function.name, v_function.args, p_role);
        v_count := v_count + 1;
    END LOOP;
    EXECUTE format('GRANT INSERT ON TABLE %I.spark_stage TO %I', v_schema, p_role);
    RETURN v_count;
END;
$$;


-- role_grant(): make p_role a p_kind of this queue ('producer', 'worker' or 'admin'),
-- replacing any kind it had. Returns how many functions it may now execute.
-- Locks: the role's role_grant row. Raises: LQ003 (unknown kind; role missing, superuser or
-- the queue's owner).
CREATE OR REPLACE FUNCTION role_grant(p_role TEXT, p_kind TEXT) RETURNS INTEGER
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_oid OID;
    v_count INTEGER;
BEGIN
    PERFORM arg_check(p_kind IN ('producer', 'worker', 'admin'),
        format('kind must be producer, worker or admin, got %s',
               coalesce(quote_literal(p_kind), 'NULL')));
    v_oid := role_check(p_role);
    v_count := role_apply(p_role, p_kind);
    INSERT INTO role_grant AS g (role_oid, kind, granted_at) VALUES (v_oid, p_kind, epoch())
    ON CONFLICT (role_oid) DO UPDATE SET kind = excluded.kind, granted_at = excluded.granted_at;
    RETURN v_count;
END;
$$;


-- role_revoke(): take every right on this queue from p_role. Returns whether it had a kind.
-- Locks: the role's role_grant row. Raises: LQ003 (role missing, superuser or the queue's
-- owner).
CREATE OR REPLACE FUNCTION role_revoke(p_role TEXT) RETURNS BOOLEAN
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_oid OID := role_check(p_role);
BEGIN
    PERFORM role_strip(p_role);
    DELETE FROM role_grant g WHERE g.role_oid = v_oid;
    RETURN FOUND;
END;
$$;


-- role_list(): the roles granted a kind, by name.
-- Locks: none. Raises: nothing of ours.
CREATE OR REPLACE FUNCTION role_list() RETURNS TABLE (role_name TEXT, kind TEXT, granted_at BIGINT)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT r.rolname::TEXT, g.kind, g.granted_at
    FROM role_grant g JOIN pg_roles r ON r.oid = g.role_oid
    ORDER BY r.rolname
$$;


-- secure_functions(): make every function of the schema run as its owner with the pinned
-- search_path, executable by no one but the roles granted it; close the tables, sequences and
-- CREATE on the schema to PUBLIC; re-apply the recorded grants. Idempotent; the installer runs
-- it after the function layer.
-- Locks: none of ours (ALTER FUNCTION's and GRANT's catalog locks). Raises: nothing of ours.
CREATE OR REPLACE FUNCTION secure_functions() RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_schema TEXT := current_schema();
    v_function RECORD;
    v_grant RECORD;
BEGIN
    FOR v_function IN
        SELECT f.name, f.args FROM schema_functions() f
        -- Plain SQL helpers the planner inlines into their callers (channel_key,
        -- channel_hash): a SET clause or SECURITY DEFINER would stop that. They name
        -- pg_catalog themselves, touch no table, and lose EXECUTE for PUBLIC below like every
        -- function.
        WHERE f.name <> ALL (ARRAY['channel_key', 'channel_hash'])
    LOOP
        EXECUTE format(
            'ALTER FUNCTION %I.%I(%s) SECURITY DEFINER SET search_path = %I, pg_catalog, pg_temp',
            v_schema, v_function.name, v_function.args, v_schema);
    END LOOP;
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA %I FROM PUBLIC', v_schema);
    EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', v_schema);
    DELETE FROM role_grant g WHERE NOT EXISTS (SELECT FROM pg_roles r WHERE r.oid = g.role_oid);
    FOR v_grant IN
        SELECT r.rolname, g.kind FROM role_grant g JOIN pg_roles r ON r.oid = g.role_oid
    LOOP
        PERFORM role_apply(v_grant.rolname, v_grant.kind);
    END LOOP;
END;
$$;
