-- 0007_rotate_recheck: channel_rotate reads the channel's next waiting message again once it
-- holds the channel's exclusive advisory lock.
--
-- 0002's channel_rotate read the next waiting message first and took the lock after. A create
-- of a policy-free channel that saw the row due already (and so did not write it) could commit
-- between the two: the lock was then free, and the rotate, going by its earlier read, deleted
-- the row (or pushed its time past the new message). The message was left with no row that
-- says the channel is due, and no dequeue found it until something else woke the channel
-- (tests/reliability/test_rotate_race.py replays that interleaving). Once the exclusive lock is
-- held no create or defer of the channel is in flight, and a new statement sees every one that
-- committed (READ COMMITTED; a dequeue run in a caller's REPEATABLE READ transaction keeps its
-- snapshot and keeps the old window), so the second read is the one to act on.

-- channel_rotate_next_at(): when a rotated channel is next worth a visit: its next waiting
-- message's dequeue_at (not before p_now when it was just served); NULL when nothing waits.
CREATE FUNCTION channel_rotate_next_at(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS BIGINT
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
AS $$
    SELECT CASE WHEN p_served THEN greatest(m.dequeue_at, p_now) ELSE m.dequeue_at END
    FROM message m
    WHERE m.channel = p_channel AND NOT m.is_locked
    ORDER BY m.dequeue_at, m.id
    LIMIT 1
$$;

-- channel_rotate(): after a dequeue served (p_served) or tried to serve a policy-free channel
-- whose row it holds: send it to the back. Its next time is its next head's dequeue_at, and
-- not before now when it was just served, so that channels due earlier go first (round robin).
-- Pushing the time past now, or deleting the row of a channel with nothing waiting, needs the
-- exclusive advisory lock (see 0002), and is decided on what is waiting once it is held.
-- Locks: tries the channel's exclusive advisory lock; the caller holds the channel's row.
CREATE OR REPLACE FUNCTION channel_rotate(p_channel TEXT, p_now BIGINT, p_served BOOLEAN)
RETURNS VOID
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_next_at BIGINT := channel_rotate_next_at(p_channel, p_now, p_served);
BEGIN
    IF v_next_at IS NULL OR v_next_at > p_now THEN
        IF pg_try_advisory_xact_lock(channel_key(p_channel)) THEN
            -- Creates that committed since the first read are visible to this statement.
            v_next_at := channel_rotate_next_at(p_channel, p_now, p_served);
            IF v_next_at IS NULL THEN
                DELETE FROM channel c WHERE c.name = p_channel;
                RETURN;
            END IF;
        ELSE
            -- Someone is creating or finishing in this channel right now: look again shortly.
            v_next_at := least(v_next_at, p_now + 10);
        END IF;
    END IF;
    UPDATE channel c SET next_dequeue_at = v_next_at, turn = nextval('channel_turn_seq'),
        last_dequeue_at = CASE WHEN p_served THEN p_now ELSE c.last_dequeue_at END
    WHERE c.name = p_channel;
END;
$$;
