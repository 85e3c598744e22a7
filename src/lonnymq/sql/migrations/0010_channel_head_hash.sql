-- 0010_channel_head_hash: message_channel_head_ix keyed by a hash of the channel's name.
--
-- A B-tree scan checks every scan key against every entry it reads from a leaf page, not only
-- the one it returns: a take's probe for its channel's head (LIMIT 1) reads the rest of the
-- page. With the channel's name (variable width) leading the index, every key on a later
-- column (dequeue_at, id) finds that column by walking the name first, entry after entry;
-- since takes start where the channel's waiting messages begin (0006), each head probe has one
-- such key more. A fixed-width leading column puts every column at the same offset in each
-- entry: the channel's 64-bit hash (channel_hash(), the same expression, in the function
-- layer). Probes say both the hash and the name; the name is checked on the row, so two
-- channels whose hashes collide share a range of the index and stay apart.
DROP INDEX message_channel_head_ix;
CREATE INDEX message_channel_head_ix
    ON message (pg_catalog.hashtextextended(channel, 0), dequeue_at, id)
    WHERE NOT is_locked;
