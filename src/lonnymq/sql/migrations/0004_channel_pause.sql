-- 0004_channel_pause: what a paused channel's concurrency limit was, so that resuming it
-- restores that limit rather than removing it.
--
-- A pause is rare and short-lived, so its memory is a row of a table of its own: the channel
-- table, which every take and finish writes, keeps its width.

-- One row per channel paused by channel_pause() and not resumed since; a policy set or
-- cleared by other means forgets it (the limit it held no longer describes the channel).
CREATE TABLE channel_pause (
    name TEXT PRIMARY KEY,
    -- The channel's max_concurrency before the pause; NULL: it had no limit.
    max_concurrency INTEGER,
    paused_at BIGINT NOT NULL
);
