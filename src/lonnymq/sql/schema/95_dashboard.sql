-- The dashboard's reads: what `lonnymq dashboard` shows, each a bounded index walk so that a
-- queue of 10^6 messages in 10^5 channels renders a page quickly. They change nothing; the
-- dashboard's actions call the queue's own functions (channel_policy_set, archive_replay, and
-- those of 65_waiting.sql).
-- Rates are not stored: the dashboard samples the counters below and divides by the time
-- between two samples, so no message pays a row write for them.


-- dashboard_overview(): the whole queue at a glance: messages waiting (not locked), of which
-- due now and scheduled later, locked now, the longest a ready channel's head has been due
-- (the queue's lag, in ms; NULL when nothing is due), the message table's deleted-row counter
-- (every finished message is a delete: its growth over time is the finish rate; PostgreSQL
-- publishes a backend's counts at its transaction ends, at most about once a second) and the
-- failures archived in the last p_window_ms (not the messages an operator discarded; 0 when
-- the archive is off), with the clock.
-- Locks: none. Raises: LQ003 (p_window_ms outside 1..3600000).
CREATE OR REPLACE FUNCTION dashboard_overview(p_window_ms BIGINT DEFAULT 10000)
RETURNS TABLE (
    now_ms BIGINT, waiting BIGINT, due BIGINT, scheduled BIGINT, locked BIGINT,
    lag_ms BIGINT, finished_total BIGINT, failed_recent BIGINT, archive BOOLEAN
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS $$
DECLARE
    v_now BIGINT := epoch();
BEGIN
    PERFORM arg_check_range('window_ms', p_window_ms, 1, 3600000);
    now_ms := v_now;
    -- message_channel_head_ix holds exactly the unlocked messages, with their due times.
    SELECT count(*), count(*) FILTER (WHERE m.dequeue_at <= v_now)
        INTO waiting, due
        FROM message m WHERE NOT m.is_locked;
    scheduled := waiting - due;
    SELECT count(*) INTO locked FROM message m WHERE m.is_locked;
    -- The first entry of channel_ready_ix: the earliest servable channel's next time.
    -- (In NUMERIC: a head created with a historic dequeue_at may lie far before the epoch.)
    SELECT least(greatest(v_now::NUMERIC - c.next_dequeue_at, 0), 9223372036854775807)::BIGINT
        INTO lag_ms
        FROM channel c
        WHERE c.next_dequeue_at IS NOT NULL
          AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
          AND c.next_dequeue_at <= v_now
        ORDER BY c.next_dequeue_at, c.turn
        LIMIT 1;
    finished_total := pg_stat_get_tuples_deleted('message'::regclass)
        + pg_stat_get_xact_tuples_deleted('message'::regclass);
    SELECT cfg.archive INTO archive FROM config cfg;
    failed_recent := 0;
    IF archive THEN
        SELECT count(*) INTO failed_recent FROM archive a
            WHERE a.finished_at > v_now - p_window_ms
              AND a.outcome NOT IN ('completed', 'discarded');
    END IF;
    RETURN NEXT;
END;
$$;


-- dashboard_channels(): one page of channels (those with a row: holding messages or a
-- policy), for keyset paging: p_sort 'name' (ascending, after p_after_name), '-name'
-- (descending, before p_after_name) or 'due' (the channels that can give a message now or
-- later, earliest next time first, after (p_after_due, p_after_name)); p_search keeps the names
-- containing it (case-insensitive); p_only: just that channel (no row if it has none). Size is the messages held (a policy's counter; for a
-- channel without one, its waiting messages counted up to p_count_cap, plus its locked ones,
-- so size_exact is false when the cap was reached); in_flight the locked ones (counted from
-- message_unlock_ix, which holds only locked messages).
-- Locks: none. Raises: LQ003 (bad sort, limit outside 1..1000, cap outside 1..10^7).
CREATE OR REPLACE FUNCTION dashboard_channels(
    p_sort TEXT DEFAULT 'name', p_after_name TEXT DEFAULT NULL, p_after_due BIGINT DEFAULT NULL,
    p_search TEXT DEFAULT NULL, p_limit INTEGER DEFAULT 50, p_count_cap BIGINT DEFAULT 10000,
    p_only TEXT DEFAULT NULL
) RETURNS TABLE (
    channel TEXT, size BIGINT, size_exact BOOLEAN, in_flight BIGINT, next_dequeue_at BIGINT,
    has_policy BOOLEAN, max_concurrency INTEGER, release_interval_ms BIGINT, max_size BIGINT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_names TEXT[];
    v_needle TEXT := nullif(lower(p_search), '');
BEGIN
    PERFORM arg_check(p_sort IN ('name', '-name', 'due'),
        format('sort must be name, -name or due, got %s', coalesce(quote_literal(p_sort), 'NULL')));
    PERFORM arg_check_range('limit', p_limit, 1, 1000);
    PERFORM arg_check_range('count_cap', p_count_cap, 1, 10000000);
    IF p_only IS NOT NULL THEN
        SELECT array_agg(c.name) INTO v_names FROM channel c WHERE c.name = p_only;
    ELSIF p_sort = 'name' THEN
        SELECT array_agg(s.name ORDER BY s.name) INTO v_names FROM (
            SELECT c.name FROM channel c
            WHERE (p_after_name IS NULL OR c.name > p_after_name)
              AND (v_needle IS NULL OR strpos(lower(c.name), v_needle) > 0)
            ORDER BY c.name LIMIT p_limit) s;
    ELSIF p_sort = '-name' THEN
        SELECT array_agg(s.name ORDER BY s.name DESC) INTO v_names FROM (
            SELECT c.name FROM channel c
            WHERE (p_after_name IS NULL OR c.name < p_after_name)
              AND (v_needle IS NULL OR strpos(lower(c.name), v_needle) > 0)
            ORDER BY c.name DESC LIMIT p_limit) s;
    ELSE
        SELECT array_agg(s.name ORDER BY s.next_dequeue_at, s.turn) INTO v_names FROM (
            SELECT c.name, c.next_dequeue_at, c.turn FROM channel c
            WHERE c.next_dequeue_at IS NOT NULL
              AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency)
              AND (p_after_due IS NULL
                   OR (c.next_dequeue_at, c.turn) > (p_after_due, coalesce(
                       (SELECT t.turn FROM channel t WHERE t.name = p_after_name), -1)))
              AND (v_needle IS NULL OR strpos(lower(c.name), v_needle) > 0)
            ORDER BY c.next_dequeue_at, c.turn LIMIT p_limit) s;
    END IF;
    RETURN QUERY
    WITH page AS (
        SELECT f.name, f.ord FROM unnest(coalesce(v_names, ARRAY[]::TEXT[]))
            WITH ORDINALITY AS f(name, ord)
    ), held AS (
        -- Locked messages of the page's channels: message_unlock_ix holds only those.
        SELECT m.channel, count(*) AS n FROM message m
        WHERE m.is_locked AND m.channel = ANY (v_names)
        GROUP BY m.channel
    )
    SELECT c.name,
           CASE WHEN c.has_policy THEN c.current_size
                ELSE w.n + coalesce(h.n, 0) END,
           c.has_policy OR w.n < p_count_cap,
           CASE WHEN c.max_concurrency IS NOT NULL THEN c.current_concurrency
                ELSE coalesce(h.n, 0) END,
           c.next_dequeue_at, c.has_policy, c.max_concurrency, c.release_interval_ms, c.max_size
    FROM page p
    JOIN channel c ON c.name = p.name
    LEFT JOIN held h ON h.channel = p.name
    CROSS JOIN LATERAL (
        SELECT count(*) AS n FROM (
            SELECT 1 FROM message m
            WHERE NOT c.has_policy AND channel_hash(m.channel) = channel_hash(p.name)
              AND m.channel = p.name AND NOT m.is_locked
            LIMIT p_count_cap) x
    ) w
    ORDER BY p.ord;
END;
$$;


-- dashboard_channel_messages(): one page of a channel's messages, with a preview of their
-- content and state (their first p_preview_bytes bytes, and their full lengths): the waiting
-- ones in the order they leave ((dequeue_at, id), after p_after_at and p_after_id), or, with
-- p_locked, the locked ones by lock expiry (read from message_unlock_ix, which holds only
-- locked messages: as many as workers hold at once).
-- Locks: none. Raises: LQ003 (limit outside 1..1000, preview outside 0..65536), LQ005.
CREATE OR REPLACE FUNCTION dashboard_channel_messages(
    p_channel TEXT, p_locked BOOLEAN DEFAULT FALSE, p_after_at BIGINT DEFAULT NULL,
    p_after_id BIGINT DEFAULT NULL, p_limit INTEGER DEFAULT 50,
    p_preview_bytes INTEGER DEFAULT 200
) RETURNS TABLE (
    id BIGINT, num_attempts INTEGER, dequeue_at BIGINT, unlock_at BIGINT, created_at BIGINT,
    content_preview BYTEA, content_length INTEGER, state_preview BYTEA, state_length INTEGER,
    dedup_key TEXT
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS $$
BEGIN
    PERFORM arg_check_channel(p_channel);
    PERFORM arg_check_range('limit', p_limit, 1, 1000);
    PERFORM arg_check_range('preview_bytes', p_preview_bytes, 0, 65536);
    IF p_locked THEN
        RETURN QUERY SELECT m.id, m.num_attempts, m.dequeue_at, m.unlock_at, m.created_at,
                substring(m.content FROM 1 FOR p_preview_bytes), octet_length(m.content),
                substring(m.state FROM 1 FOR p_preview_bytes), octet_length(m.state),
                m.dedup_key
            FROM message m
            WHERE m.is_locked AND m.channel = p_channel
              AND (p_after_at IS NULL OR (m.unlock_at, m.id) > (p_after_at, p_after_id))
            ORDER BY m.unlock_at, m.id
            LIMIT p_limit;
    ELSE
        RETURN QUERY SELECT m.id, m.num_attempts, m.dequeue_at, m.unlock_at, m.created_at,
                substring(m.content FROM 1 FOR p_preview_bytes), octet_length(m.content),
                substring(m.state FROM 1 FOR p_preview_bytes), octet_length(m.state),
                m.dedup_key
            FROM message m
            WHERE channel_hash(m.channel) = channel_hash(p_channel)
              AND m.channel = p_channel AND NOT m.is_locked
              AND (p_after_at IS NULL OR (m.dequeue_at, m.id) > (p_after_at, p_after_id))
            ORDER BY m.dequeue_at, m.id
            LIMIT p_limit;
    END IF;
END;
$$;


-- dashboard_archive(): one page of the archive, newest first, for keyset paging (ids below
-- p_before_id). By default (p_outcome NULL) the messages that did not complete, read from
-- archive_failed_ix, which stays small however large the archive grows; p_outcome keeps one
-- outcome, p_channel one channel. A call walks at most p_scan_cap archived rows, so that a
-- filter few of them match still answers quickly: then, and when the page is full, a last row
-- with id NULL says in next_before where the next page starts. Each row carries its error (the
-- traceback, type and message a worker kept), of which a longer one than p_error_chars
-- characters keeps its start and its end (where the exception is) around a line '…', and the
-- first p_preview_bytes bytes of its content, with their full lengths.
-- Locks: none. Raises: LQ003 (limit outside 1..1000, scan cap outside 1..1000000, preview
-- outside 0..65536, error_chars outside 0..1000000, outcome over 64 characters), LQ005.
CREATE OR REPLACE FUNCTION dashboard_archive(
    p_outcome TEXT DEFAULT NULL, p_channel TEXT DEFAULT NULL, p_before_id BIGINT DEFAULT NULL,
    p_limit INTEGER DEFAULT 50, p_scan_cap INTEGER DEFAULT 10000,
    p_preview_bytes INTEGER DEFAULT 200, p_error_chars INTEGER DEFAULT 65536
) RETURNS TABLE (
    id BIGINT, channel TEXT, outcome TEXT, num_attempts INTEGER, created_at BIGINT,
    finished_at BIGINT, error TEXT, error_length INTEGER, content_preview BYTEA,
    content_length INTEGER, replayed_as BIGINT, next_before BIGINT
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    -- Below every id: the walk's start is always an index bound, whatever the plan.
    v_before BIGINT := coalesce(p_before_id, 9223372036854775807);
    v_ids BIGINT[];
    v_next BIGINT;
BEGIN
    PERFORM arg_check_range('limit', p_limit, 1, 1000);
    PERFORM arg_check_range('scan_cap', p_scan_cap, 1, 1000000);
    PERFORM arg_check_range('preview_bytes', p_preview_bytes, 0, 65536);
    PERFORM arg_check_range('error_chars', p_error_chars, 0, 1000000);
    PERFORM arg_check(p_outcome IS NULL OR char_length(p_outcome) BETWEEN 1 AND 64,
        'outcome must be 1 to 64 characters');
    IF p_channel IS NOT NULL THEN
        PERFORM arg_check_channel(p_channel);
    END IF;
    IF p_outcome IS DISTINCT FROM 'completed' THEN
        v_ids := ARRAY(
            SELECT s.id FROM (
                SELECT a.id, a.outcome, a.channel FROM archive a
                WHERE a.outcome <> 'completed' AND a.id < v_before
                ORDER BY a.id DESC LIMIT p_scan_cap) s
            WHERE (p_outcome IS NULL OR s.outcome = p_outcome)
              AND (p_channel IS NULL OR s.channel = p_channel)
            ORDER BY s.id DESC LIMIT p_limit + 1);
        IF cardinality(v_ids) <= p_limit THEN
            v_next := (SELECT a.id FROM archive a
                       WHERE a.outcome <> 'completed' AND a.id < v_before
                       ORDER BY a.id DESC OFFSET p_scan_cap LIMIT 1) + 1;
        END IF;
    ELSE
        v_ids := ARRAY(
            SELECT s.id FROM (
                SELECT a.id, a.outcome, a.channel FROM archive a
                WHERE a.id < v_before
                ORDER BY a.id DESC LIMIT p_scan_cap) s
            WHERE s.outcome = 'completed' AND (p_channel IS NULL OR s.channel = p_channel)
            ORDER BY s.id DESC LIMIT p_limit + 1);
        IF cardinality(v_ids) <= p_limit THEN
            v_next := (SELECT a.id FROM archive a WHERE a.id < v_before
                       ORDER BY a.id DESC OFFSET p_scan_cap LIMIT 1) + 1;
        END IF;
    END IF;
    IF cardinality(v_ids) > p_limit THEN
        v_next := v_ids[p_limit];
    END IF;
    RETURN QUERY
        SELECT a.id, a.channel, a.outcome, a.num_attempts, a.created_at, a.finished_at,
               CASE WHEN char_length(a.error) <= p_error_chars THEN a.error
                    ELSE left(a.error, p_error_chars / 2) || E'\n…\n'
                         || right(a.error, p_error_chars - p_error_chars / 2) END,
               char_length(a.error),
               substring(a.content FROM 1 FOR p_preview_bytes), octet_length(a.content),
               a.replayed_as, NULL::BIGINT
        FROM unnest(v_ids[1:p_limit]) WITH ORDINALITY AS u(id, ord)
        JOIN archive a ON a.id = u.id
        ORDER BY u.ord;
    IF v_next IS NOT NULL THEN
        RETURN QUERY SELECT NULL::BIGINT, NULL::TEXT, NULL::TEXT, NULL::INTEGER, NULL::BIGINT,
            NULL::BIGINT, NULL::TEXT, NULL::INTEGER, NULL::BYTEA, NULL::INTEGER, NULL::BIGINT,
            v_next;
    END IF;
END;
$$;


-- dashboard_schedules(): one page of schedules by name, after p_after_name (keyset paging over
-- message_dedup_ux: a schedule is the driver message of lonnymq.schedules keyed by its name),
-- with each driver's spec (NULL when it is longer than p_spec_bytes: the spec holds the
-- content the schedule creates), its length, its next time, its state (the last firing's
-- time, as the package writes it) and whether a worker holds it now.
-- Locks: none. Raises: LQ003 (limit outside 1..1000, spec_bytes outside 0..67108864).
CREATE OR REPLACE FUNCTION dashboard_schedules(
    p_after_name TEXT DEFAULT NULL, p_limit INTEGER DEFAULT 50,
    p_spec_bytes INTEGER DEFAULT 1048576
) RETURNS TABLE (
    name TEXT, spec BYTEA, spec_length INTEGER, next_at BIGINT, state BYTEA, is_locked BOOLEAN
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS $$
BEGIN
    PERFORM arg_check_range('limit', p_limit, 1, 1000);
    PERFORM arg_check_range('spec_bytes', p_spec_bytes, 0, 67108864);
    RETURN QUERY SELECT m.dedup_key,
            CASE WHEN octet_length(m.content) <= p_spec_bytes THEN m.content END,
            octet_length(m.content), m.dequeue_at, m.state, m.is_locked
        FROM message m
        WHERE m.channel = 'lonnymq.schedules' AND m.dedup_key IS NOT NULL
          -- Every name is longer than '': the bound is an index bound, whatever the plan.
          AND m.dedup_key > coalesce(p_after_name, '')
        ORDER BY m.dedup_key
        LIMIT p_limit;
END;
$$;


-- dashboard_workers(): the workers that reported in the last hour (the table keeps no
-- others), the longest running first, at most p_limit, with what each runs now, what it took
-- from which channels between its last two reports, and the clock (a worker whose last report
-- is more than a few of its rounds old has died).
-- Locks: none. Raises: LQ003 (limit outside 1..10000).
CREATE OR REPLACE FUNCTION dashboard_workers(p_limit INTEGER DEFAULT 1000)
RETURNS TABLE (
    id TEXT, host TEXT, pid INTEGER, started_at BIGINT, seen_at BIGINT, every_ms BIGINT,
    concurrency INTEGER, running INTEGER, message_ids BIGINT[], channels TEXT[],
    stopped_at BIGINT, served_ms BIGINT, served_channels TEXT[], served_counts BIGINT[],
    served_other BIGINT, now_ms BIGINT
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    PERFORM arg_check_range('limit', p_limit, 1, 10000);
    RETURN QUERY SELECT w.id, w.host, w.pid, w.started_at, w.seen_at, w.every_ms,
            w.concurrency, w.running, w.message_ids, w.channels, w.stopped_at, w.served_ms,
            w.served_channels, w.served_counts, w.served_other, epoch()
        FROM worker w
        ORDER BY w.started_at, w.id
        LIMIT p_limit;
END;
$$;
