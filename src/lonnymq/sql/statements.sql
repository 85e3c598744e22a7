-- The statements the Python API sends: one call of one function each, with named arguments.
-- `{schema}` is replaced by the quoted schema identifier; `%(name)s` are bound parameters.

-- name: epoch
SELECT {schema}.epoch()

-- name: message_create_many
SELECT status, id, channel_size FROM {schema}.message_create_many(
    p_channels => %(channels)s::text[],
    p_contents => %(contents)s::bytea[],
    p_dequeue_ats => %(dequeue_ats)s::bigint[],
    p_dedup_keys => %(dedup_keys)s::text[])

-- name: message_create
SELECT status, id, channel_size FROM {schema}.message_create(
    p_content => %(content)s::bytea,
    p_channel => %(channel)s::text,
    p_dequeue_at => %(dequeue_at)s::bigint,
    p_dedup_key => %(dedup_key)s::text)

-- name: message_dequeue_many
SELECT id, channel, content, state, num_attempts, dequeue_at, unlock_at, retry_at
FROM {schema}.message_dequeue_many(
    p_limit => %(limit)s::integer,
    p_lock_ms => %(lock_ms)s::bigint)

-- name: message_complete_and_dequeue
SELECT id, status, channel, content, state, num_attempts, dequeue_at, unlock_at, retry_at
FROM {schema}.message_complete_and_dequeue(
    p_ids => %(ids)s::bigint[],
    p_num_attempts => %(num_attempts)s::integer[],
    p_limit => %(limit)s::integer,
    p_lock_ms => %(lock_ms)s::bigint)

-- name: message_settle
SELECT id, status, channel, content, state, num_attempts, dequeue_at, unlock_at, retry_at
FROM {schema}.message_settle(
    p_ids => %(ids)s::bigint[],
    p_num_attempts => %(num_attempts)s::integer[],
    p_outcomes => %(outcomes)s::text[],
    p_dequeue_ats => %(dequeue_ats)s::bigint[],
    p_states => %(states)s::bytea[],
    p_errors => %(errors)s::text[],
    p_channels => %(channels)s::text[],
    p_limit => %(limit)s::integer,
    p_lock_ms => %(lock_ms)s::bigint)

-- name: message_heartbeat
SELECT {schema}.message_heartbeat(
    p_id => %(id)s::bigint,
    p_num_attempts => %(num_attempts)s::integer,
    p_lock_ms => %(lock_ms)s::bigint)

-- name: message_delete
SELECT {schema}.message_delete(
    p_id => %(id)s::bigint,
    p_num_attempts => %(num_attempts)s::integer,
    p_outcome => %(outcome)s::text,
    p_error => %(error)s::text)

-- name: message_heartbeat_many
SELECT id, status FROM {schema}.message_heartbeat_many(
    p_ids => %(ids)s::bigint[],
    p_num_attempts => %(num_attempts)s::integer[],
    p_lock_ms => %(lock_ms)s::bigint)

-- name: message_delete_many
SELECT id, status FROM {schema}.message_delete_many(
    p_ids => %(ids)s::bigint[],
    p_num_attempts => %(num_attempts)s::integer[])

-- name: message_defer
SELECT {schema}.message_defer(
    p_id => %(id)s::bigint,
    p_num_attempts => %(num_attempts)s::integer,
    p_dequeue_at => %(dequeue_at)s::bigint,
    p_state => %(state)s::bytea)

-- name: message_defer_many
SELECT id, status FROM {schema}.message_defer_many(
    p_ids => %(ids)s::bigint[],
    p_num_attempts => %(num_attempts)s::integer[],
    p_dequeue_ats => %(dequeue_ats)s::bigint[],
    p_states => %(states)s::bytea[])

-- name: channel_policy_set
SELECT {schema}.channel_policy_set(
    p_channel => %(channel)s::text,
    p_max_concurrency => %(max_concurrency)s::integer,
    p_release_interval_ms => %(release_interval_ms)s::bigint,
    p_max_size => %(max_size)s::bigint)

-- name: channel_policy_clear
SELECT {schema}.channel_policy_clear(p_channel => %(channel)s::text)

-- name: channel_stats
SELECT channel, size, in_flight, next_dequeue_at, max_concurrency, release_interval_ms, max_size
FROM {schema}.channel_stats()

-- name: queue_verify
SELECT channel, kind, expected, actual, detail
FROM {schema}.queue_verify()

-- name: config_set
SELECT {schema}.config_set(
    p_event_channel => %(event_channel)s::text,
    p_archive => %(archive)s::boolean)

-- name: config_get
SELECT event_channel, archive FROM {schema}.config_get()

-- name: clock_offset_set
SELECT {schema}.clock_offset_set(p_offset_ms => %(offset_ms)s::bigint)

-- name: schedule_set
SELECT status, id FROM {schema}.schedule_set(
    p_name => %(name)s::text,
    p_spec => %(spec)s::bytea,
    p_next_at => %(next_at)s::bigint)

-- name: schedule_list
SELECT name, spec, next_at, state, is_locked FROM {schema}.schedule_list()

-- name: schedule_remove
SELECT {schema}.schedule_remove(p_name => %(name)s::text)

-- name: message_status
SELECT status, outcome, error, num_attempts, finished_at
FROM {schema}.message_status(p_id => %(id)s::bigint)

-- name: archive_list
SELECT id, channel, content, state, num_attempts, outcome, error, created_at, finished_at,
       replayed_as
FROM {schema}.archive_list(
    p_outcome => %(outcome)s::text,
    p_channel => %(channel)s::text,
    p_before_id => %(before_id)s::bigint,
    p_limit => %(limit)s::integer)

-- name: archive_replay
SELECT archive_id, status, id FROM {schema}.archive_replay(p_ids => %(ids)s::bigint[])

-- name: role_grant
SELECT {schema}.role_grant(p_role => %(role)s::text, p_kind => %(kind)s::text)

-- name: role_revoke
SELECT {schema}.role_revoke(p_role => %(role)s::text)

-- name: role_list
SELECT role_name, kind, granted_at FROM {schema}.role_list()

-- name: maintenance_due
SELECT table_name FROM {schema}.maintenance_due()

-- name: maintenance_vacuumed
SELECT {schema}.maintenance_vacuumed(p_table_name => %(table_name)s::text)

-- name: maintenance_compact
SELECT {schema}.maintenance_compact(p_table_name => %(table_name)s::text, p_max_live => %(max_live)s::integer)

-- name: dashboard_overview
SELECT now_ms, waiting, due, scheduled, locked, lag_ms, finished_total, failed_recent, archive
FROM {schema}.dashboard_overview(p_window_ms => %(window_ms)s::bigint)

-- name: dashboard_channels
SELECT channel, size, size_exact, in_flight, next_dequeue_at, has_policy, max_concurrency,
       release_interval_ms, max_size
FROM {schema}.dashboard_channels(
    p_sort => %(sort)s::text,
    p_after_name => %(after_name)s::text,
    p_after_due => %(after_due)s::bigint,
    p_search => %(search)s::text,
    p_limit => %(limit)s::integer,
    p_count_cap => %(count_cap)s::bigint,
    p_only => %(only)s::text)

-- name: dashboard_channel_messages
SELECT id, num_attempts, dequeue_at, unlock_at, created_at, content_preview, content_length,
       state_preview, state_length, dedup_key
FROM {schema}.dashboard_channel_messages(
    p_channel => %(channel)s::text,
    p_locked => %(locked)s::boolean,
    p_after_at => %(after_at)s::bigint,
    p_after_id => %(after_id)s::bigint,
    p_limit => %(limit)s::integer,
    p_preview_bytes => %(preview_bytes)s::integer)

-- name: dashboard_archive
SELECT id, channel, outcome, num_attempts, created_at, finished_at, error, error_length,
       content_preview, content_length, replayed_as, next_before
FROM {schema}.dashboard_archive(
    p_outcome => %(outcome)s::text,
    p_channel => %(channel)s::text,
    p_before_id => %(before_id)s::bigint,
    p_limit => %(limit)s::integer,
    p_scan_cap => %(scan_cap)s::integer,
    p_preview_bytes => %(preview_bytes)s::integer,
    p_error_chars => %(error_chars)s::integer)

-- name: message_discard
SELECT {schema}.message_discard(p_id => %(id)s::bigint, p_channel => %(channel)s::text)

-- name: message_expedite
SELECT channel, moved
FROM {schema}.message_expedite(p_id => %(id)s::bigint, p_channel => %(channel)s::text)

-- name: channel_pause
SELECT {schema}.channel_pause(p_channel => %(channel)s::text)

-- name: channel_resume
SELECT {schema}.channel_resume(p_channel => %(channel)s::text)

-- name: dashboard_schedules
SELECT name, spec, spec_length, next_at, state, is_locked
FROM {schema}.dashboard_schedules(
    p_after_name => %(after_name)s::text,
    p_limit => %(limit)s::integer,
    p_spec_bytes => %(spec_bytes)s::integer)

-- name: worker_report
SELECT {schema}.worker_report(
    p_id => %(id)s::text,
    p_host => %(host)s::text,
    p_pid => %(pid)s::integer,
    p_every_ms => %(every_ms)s::bigint,
    p_concurrency => %(concurrency)s::integer,
    p_running => %(running)s::integer,
    p_message_ids => %(message_ids)s::bigint[],
    p_channels => %(channels)s::text[],
    p_served_ms => %(served_ms)s::bigint,
    p_served_channels => %(served_channels)s::text[],
    p_served_counts => %(served_counts)s::bigint[],
    p_served_other => %(served_other)s::bigint)

-- name: worker_stopped
SELECT {schema}.worker_stopped(p_id => %(id)s::text)

-- name: dashboard_workers
SELECT id, host, pid, started_at, seen_at, every_ms, concurrency, running, message_ids,
       channels, stopped_at, served_ms, served_channels, served_counts, served_other, now_ms
FROM {schema}.dashboard_workers(p_limit => %(limit)s::integer)
