"""channel_pause and channel_resume (the dashboard's pause and resume): a pause keeps the
channel's other limits and remembers its concurrency limit; a resume gives that limit back,
or removes the policy when nothing else is left; a policy set or cleared meanwhile forgets it."""

from __future__ import annotations

import pytest

from lonnymq import Policy, Queue
from lonnymq.errors import InvalidChannelError

LOCK_MS = 600_000


def _policy(queue: Queue, channel: str) -> Policy | None:
    stats = queue.channel(channel).stats()
    return None if stats is None else stats.policy


def _pause(queue: Queue, channel: str) -> None:
    queue._fetch("channel_pause", {"channel": channel}, None)


def _resume(queue: Queue, channel: str) -> None:
    queue._fetch("channel_resume", {"channel": channel}, None)


def test_resume_restores_the_limit_the_pause_found(queue: Queue) -> None:
    queue.create(b"m", channel="c")
    queue.channel("c").set_policy(max_concurrency=3, release_interval_ms=50)
    _pause(queue, "c")
    assert _policy(queue, "c") == Policy(0, 50, None)
    assert queue.dequeue(lock_ms=LOCK_MS) is None
    _pause(queue, "c")  # paused already: the memory stays the first pause's
    _resume(queue, "c")
    assert _policy(queue, "c") == Policy(3, 50, None)
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    _resume(queue, "c")  # not paused: left as it is
    assert _policy(queue, "c") == Policy(3, 50, None)


def test_a_channel_with_no_other_limit_loses_its_policy_on_resume(queue: Queue) -> None:
    queue.create(b"m", channel="free")
    _pause(queue, "free")
    assert _policy(queue, "free") == Policy(0, None, None)
    _resume(queue, "free")
    assert _policy(queue, "free") == Policy(None, None, None)
    assert queue.dequeue(lock_ms=LOCK_MS) is not None
    # An empty channel paused and resumed leaves no row behind.
    _pause(queue, "empty")
    _resume(queue, "empty")
    assert queue.channel("empty").stats() is None


def test_a_policy_set_meanwhile_forgets_the_pause(queue: Queue) -> None:
    queue.create(b"m", channel="c")
    queue.channel("c").set_policy(max_concurrency=3)
    _pause(queue, "c")
    queue.channel("c").set_policy(max_concurrency=0, max_size=9)
    _resume(queue, "c")
    # Paused by set_policy, not by the pause that remembered 3: no limit comes back.
    assert _policy(queue, "c") == Policy(None, None, 9)
    queue.channel("c").set_policy(max_concurrency=2)
    _pause(queue, "c")
    queue.channel("c").clear_policy()
    queue.channel("c").set_policy(max_concurrency=0)
    _resume(queue, "c")
    assert _policy(queue, "c") == Policy(None, None, None)


def test_a_bad_channel_name_is_refused(queue: Queue) -> None:
    for call in (_pause, _resume):
        with pytest.raises(InvalidChannelError):
            call(queue, "")
        with pytest.raises(InvalidChannelError):
            call(queue, "x" * 256)
    assert queue.stats() == []
