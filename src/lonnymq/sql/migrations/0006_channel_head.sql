-- 0006_channel_head: where a channel's waiting messages begin, so that a take starts there.
--
-- message_channel_head_ix holds one entry per waiting message version. Taking a message makes
-- a new version (locked, so outside the index) and leaves the old entry behind until VACUUM
-- removes it; while a long transaction anywhere in the database holds back the horizon, VACUUM
-- cannot, and a probe for a channel's head from the low end of its range walked the entries of
-- every message taken from that channel since the transaction began. Each channel row now
-- says from where its waiting messages start: no waiting message of the channel sorts before
-- (head_at, head_id) in (dequeue_at, id) order. Every writer that makes a message wait below
-- it brings it back down (in the same transaction), and only a take that holds both the row
-- and the channel's exclusive advisory lock moves it up (so no such writer is in flight):
-- the rules are written out at the top of sql/schema/20_channel.sql.
-- The defaults put it below every message: existing channels start from the low end, as
-- before, until their next take moves it.
ALTER TABLE channel
    ADD COLUMN head_at BIGINT NOT NULL DEFAULT -9223372036854775808,
    ADD COLUMN head_id BIGINT NOT NULL DEFAULT 0;
