-- 0007_ready_floor: where a take starts looking for the next due channel.
--
-- channel_ready_ix holds an entry per version of each servable channel row, and a take rewrites
-- the row of the channel it serves (its next time and turn, both in the index). While a long
-- transaction anywhere in the database holds back the horizon, the old entries stay, below the
-- live ones, and a probe for the earliest channel from the low end of the index walked all of
-- them. Two sequences (set in place, so reading them costs the same whatever the horizon) now
-- say from where to look: the probe starts at the floor, below which no servable channel's
-- next time lies as far as the queue knows; about once a second a take looks from the low end
-- instead and sets the floor again. What they hold is said with channel_ready_floor().

-- ready_floor_seq: no servable channel's next time is below it, as far as the queue knows. A
-- change that makes a channel servable sooner than it brings it down at once.
CREATE SEQUENCE ready_floor_seq AS BIGINT
    MINVALUE -9223372036854775808 START WITH -9223372036854775808;

-- ready_sweep_seq: the clock of the last look from the low end; the smallest BIGINT at first,
-- so that the first take looks.
CREATE SEQUENCE ready_sweep_seq AS BIGINT
    MINVALUE -9223372036854775808 START WITH -9223372036854775808;
