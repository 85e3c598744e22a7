-- 0005_worker: the workers of the queue as they report themselves, for the dashboard's
-- workers page.
--
-- A worker reports once a heartbeat round (one upsert, whatever it runs: nothing is written
-- per message), and marks its row stopped when its run ends. A worker that died stops
-- reporting: its row ages, is shown as gone, and is deleted by the next report of any worker
-- once it is an hour old.

-- One row per worker run (its id is drawn when the run starts).
CREATE TABLE worker (
    id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at BIGINT NOT NULL,
    -- Its last report, by the queue clock; it reports every every_ms.
    seen_at BIGINT NOT NULL,
    every_ms BIGINT NOT NULL,
    concurrency INTEGER NOT NULL,
    -- Handlers running at its last report, and the ids and channels of up to 20 of them.
    running INTEGER NOT NULL,
    message_ids BIGINT[] NOT NULL,
    channels TEXT[] NOT NULL,
    -- When its run ended (a stopped worker's row reports no more).
    stopped_at BIGINT
);
