"""What a worker counts of the messages it takes, per channel, between two reports
(``_policy.Served``): the channels it took most from are named, the rest summed, and each
drain starts the count again."""

from __future__ import annotations

import time

from lonnymq.worker import _policy


def test_a_drain_names_the_channels_taken_from_most_and_sums_the_rest() -> None:
    served = _policy.Served()
    for i in range(_policy.REPORTED_CHANNELS + 5):
        for _ in range(i + 1):
            served.add(f"c{i}")
    time.sleep(0.01)
    report = served.drain()
    named = _policy.REPORTED_CHANNELS
    assert report["served_channels"] == [f"c{i}" for i in range(named + 4, 4, -1)]
    assert report["served_counts"] == list(range(named + 5, 5, -1))
    assert report["served_other"] == sum(range(1, 6))
    served_ms = report["served_ms"]
    assert isinstance(served_ms, int)
    assert served_ms >= 10
    # Drained: the next report starts from nothing.
    assert served.drain() | {"served_ms": 0} == {
        "served_ms": 0,
        "served_channels": [],
        "served_counts": [],
        "served_other": 0,
    }


def test_channels_past_the_counted_ones_go_to_other() -> None:
    served = _policy.Served()
    for i in range(_policy.COUNTED_CHANNELS):
        served.add(f"c{i}")
    for _ in range(50):
        served.add("late")  # a channel past the counted ones: summed, never named
    served.add("c0")  # a counted one still counts on its own
    report = served.drain()
    channels, counts, other = (
        report["served_channels"],
        report["served_counts"],
        report["served_other"],
    )
    assert isinstance(channels, list)
    assert isinstance(counts, list)
    assert isinstance(other, int)
    assert "late" not in channels
    assert (channels[0], counts[0]) == ("c0", 2)
    assert sum(counts) + other == _policy.COUNTED_CHANNELS + 51
