-- 0020_create_unlocked: a single create or defer no longer locks a channel row that is due,
-- and a create without a dedup key is a plain insert.
--
-- channel_wake (the single create's and the defer's way of making a policy-free channel due)
-- still used the upsert that 0019 took out of message_create_many: when the channel's row was
-- missing as the caller saw it and another session had made it since, INSERT ... ON CONFLICT
-- DO UPDATE locked that row before testing whether it was late, and a due row is what every
-- dequeue takes (SKIP LOCKED), so the creator could wait behind one dequeue after another. It
-- now does what message_create_many does since 0019: a missing row is made under the
-- channel's creation lock, after looking again; an existing row is locked and moved forward
-- only while it is later than the message and than the clock now plus 10 ms.
--
-- message_create inserted every message with ON CONFLICT (channel, dedup_key) DO NOTHING.
-- That is a speculative insertion even when the key is NULL (and the row is not in the
-- partial unique index): an extra HEAP_CONFIRM record in the WAL for each message, about 5 %
-- of what a message writes to the WAL in the steady single-message shapes of the bench
-- (create, take and finish). Without a key the insert is now a plain one.


-- channel_wake(): as in 0011, with the channel row written as said above.
CREATE OR REPLACE FUNCTION channel_wake(
    p_channel TEXT, p_at BIGINT, p_seen BOOLEAN, p_seen_next BIGINT, p_type TEXT, p_id BIGINT
) RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_found BOOLEAN := p_seen;
    v_next BIGINT := p_seen_next;
    v_clock BIGINT;
BEGIN
    IF v_found AND v_next <= p_at THEN
        RETURN;
    END IF;
    IF NOT v_found THEN
        -- Missing as the caller saw it: made by one creator at a time, each looking again
        -- (as committed now) once it holds the channel's creation lock, so a row another
        -- session made meanwhile is not inserted over (see 0019).
        PERFORM pg_advisory_xact_lock(channel_key(p_channel) # 1);
        INSERT INTO channel AS c (name, next_dequeue_at)
        SELECT p_channel, p_at
        WHERE NOT EXISTS (SELECT FROM channel x WHERE x.name = p_channel)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            PERFORM channel_announce(NULL, p_at, p_type, p_id, p_channel);
            RETURN;
        END IF;
        SELECT c.next_dequeue_at INTO v_next FROM channel c WHERE c.name = p_channel;
        v_found := FOUND;
    END IF;
    -- The clock now (not as the transaction started), plus the 10 ms of 0011: a row due by
    -- then is left alone, even while a dequeue holds it (see 0019 for why that is safe).
    v_clock := epoch() + floor(extract(epoch FROM clock_timestamp() - now()) * 1000)::BIGINT + 10;
    IF v_found AND v_next <= greatest(p_at, v_clock) THEN
        RETURN;
    END IF;
    IF v_found THEN
        UPDATE channel c SET next_dequeue_at = p_at
        WHERE c.name = p_channel
          AND (c.next_dequeue_at IS NULL OR c.next_dequeue_at > greatest(p_at, v_clock));
    ELSE
        -- Still invisible to this transaction (a snapshot older than the row): as before 0020.
        INSERT INTO channel AS c (name, next_dequeue_at) VALUES (p_channel, p_at)
        ON CONFLICT (name) DO UPDATE SET next_dequeue_at = least(c.next_dequeue_at, p_at)
        WHERE c.next_dequeue_at IS NULL OR c.next_dequeue_at > p_at;
    END IF;
    IF FOUND THEN
        PERFORM channel_announce(v_next, p_at, p_type, p_id, p_channel);
    END IF;
END;
$$;


-- message_create(): as in 0016, with a plain insert when there is no dedup key.
CREATE OR REPLACE FUNCTION message_create(
    p_content BYTEA,
    p_channel TEXT DEFAULT NULL,
    p_dequeue_at BIGINT DEFAULT NULL,
    p_dedup_key TEXT DEFAULT NULL
) RETURNS TABLE (status TEXT, id BIGINT, channel_size BIGINT)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_name TEXT := coalesce(p_channel, 'default');
    v_now BIGINT;
    v_at BIGINT;
    v_channel channel;
    v_seen BOOLEAN;
    v_id BIGINT;
BEGIN
    IF NOT coalesce(p_content IS NOT NULL AND octet_length(p_content) <= 67108864
            AND char_length(v_name) BETWEEN 1 AND 255
            AND (p_dequeue_at IS NULL
                 OR p_dequeue_at BETWEEN -1000000000000000 AND 1000000000000000)
            AND (p_dedup_key IS NULL OR char_length(p_dedup_key) BETWEEN 1 AND 255), FALSE)
    THEN
        PERFORM message_check_new(v_name, p_content, p_dequeue_at, p_dedup_key);
    END IF;
    v_now := epoch();
    v_at := coalesce(p_dequeue_at, v_now);
    PERFORM pg_advisory_xact_lock_shared(channel_key(v_name));
    SELECT * INTO v_channel FROM channel c WHERE c.name = v_name;
    v_seen := FOUND;

    IF v_seen AND v_channel.has_policy THEN
        -- Counters and limits: serialise on the row, as 0001 did.
        v_channel := channel_lock(v_name);
        IF p_dedup_key IS NOT NULL THEN
            SELECT m.id INTO v_id FROM message m
            WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
            IF FOUND THEN
                status := 'deduplicated'; id := v_id; channel_size := v_channel.current_size;
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
        IF v_channel.max_size IS NOT NULL AND v_channel.current_size >= v_channel.max_size THEN
            status := 'dropped'; id := NULL; channel_size := v_channel.current_size;
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO message (channel, content, dequeue_at, dedup_key, created_at)
        VALUES (v_name, p_content, v_at, p_dedup_key, v_now)
        RETURNING message.id INTO v_id;
        PERFORM message_create_settle(v_channel, v_at, v_id);
        status := 'created'; id := v_id; channel_size := v_channel.current_size + 1;
        RETURN NEXT;
        RETURN;
    END IF;

    IF p_dedup_key IS NULL THEN
        -- A plain insert: ON CONFLICT would make it a speculative one, which writes a second
        -- WAL record per message for an index that a NULL key is not even in.
        INSERT INTO message (channel, content, dequeue_at, created_at)
        VALUES (v_name, p_content, v_at, v_now)
        RETURNING message.id INTO v_id;
        PERFORM channel_wake(v_name, v_at, v_seen, v_channel.next_dequeue_at, 'created', v_id);
        status := 'created'; id := v_id; channel_size := NULL;
        RETURN NEXT;
        RETURN;
    END IF;

    -- No policy: the dedup index decides between concurrent creators of the same key.
    FOR v_round IN 1..3 LOOP
        INSERT INTO message (channel, content, dequeue_at, dedup_key, created_at)
        VALUES (v_name, p_content, v_at, p_dedup_key, v_now)
        ON CONFLICT (channel, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
        RETURNING message.id INTO v_id;
        IF FOUND THEN
            PERFORM channel_wake(v_name, v_at, v_seen, v_channel.next_dequeue_at, 'created',
                v_id);
            status := 'created'; id := v_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT m.id INTO v_id FROM message m
        WHERE m.channel = v_name AND m.dedup_key = p_dedup_key;
        IF FOUND THEN
            status := 'deduplicated'; id := v_id; channel_size := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        -- The message holding the key finished in between: try again.
    END LOOP;
    RAISE EXCEPTION 'dedup key % of channel % kept changing hands', p_dedup_key, v_name
        USING ERRCODE = '40001';
END;
$$;


SELECT secure_functions();
