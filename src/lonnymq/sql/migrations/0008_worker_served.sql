-- 0008_worker_served: what each worker took, channel by channel, between its last two reports,
-- for the dashboard's served per second and a channel's share of service.
--
-- A worker counts in memory the messages it takes from each channel and sends the counts with
-- its report, once a heartbeat round: still one row written per round, none per message. It
-- names the channels it took most from (at most 100) and sums the rest into served_other.

ALTER TABLE worker
    -- How long the counts below cover, in ms (the time since the worker's previous report; 0
    -- in a first report).
    ADD COLUMN served_ms BIGINT NOT NULL DEFAULT 0,
    -- The channels it took most messages from in that time, and how many from each.
    ADD COLUMN served_channels TEXT[] NOT NULL DEFAULT '{}',
    ADD COLUMN served_counts BIGINT[] NOT NULL DEFAULT '{}',
    -- Messages it took from the other channels in that time.
    ADD COLUMN served_other BIGINT NOT NULL DEFAULT 0;

-- dashboard_workers returns these columns too: a function's result type changes only by
-- dropping it (the schema's source creates it again).
DROP FUNCTION IF EXISTS dashboard_workers(INTEGER);
