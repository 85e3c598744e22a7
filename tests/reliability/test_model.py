"""Model-based test: random operation sequences against a small reference model of SPEC §2.

One real queue schema, one connection at a time, operations in sequence. The model keeps each
message (channel, dequeue_at, id, locked, unlock_at, attempts, dedup key) and each channel's
policy; every result is checked against it, and ``verify()`` must be clean after every step.

Time: the queue clock is the database clock plus ``config.clock_offset_ms``; the machine moves
it forward with ``set_clock_offset``. The real clock still runs, so a dequeue happens at some
``v`` between the clock read just before and just after it (``lo`` and ``hi``). Chosen times
are seconds apart, so ``lo`` and ``hi`` rarely disagree; where they do, both answers are
admitted. Times the queue picks itself (``dequeue_at`` left to "now", unlock times) are read
back exactly: the model never guesses them.

Where the spec leaves a choice (which due channel a dequeue serves: round robin), the machine
checks that the message returned is the head of an admissible channel, then follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

from lonnymq import CreateStatus, Message, NewMessage, Queue
from lonnymq.errors import MessageError, MessageNotFoundError, StaleMessageError

LOCK_MS = 5_000
CHANNELS = ["a", "b", "p"]
DELAYS = [None, None, -100_000, 0, 12_000, 30_000]  # None: "now" as the queue sees it
KEYS = [None, None, "k1", "k2"]

Conn = psycopg.Connection[Any]


@dataclass
class ModelMessage:
    id: int
    channel: str
    content: bytes
    dequeue_at: int
    dedup_key: str | None
    locked: bool = False
    unlock_at: int | None = None
    attempts: int = 0


@dataclass(frozen=True)
class ModelPolicy:
    max_concurrency: int | None
    release_interval_ms: int | None
    max_size: int | None


@dataclass
class Model:
    """SPEC §2 for one queue, in memory."""

    messages: dict[int, ModelMessage] = field(default_factory=dict)
    policies: dict[str, ModelPolicy] = field(default_factory=dict)
    # When each channel last gave a message from its head (not a recovery), by the queue's
    # clock: ever, and while it had a policy (reset when the policy is cleared).
    last_any: dict[str, int] = field(default_factory=dict)
    last_policy: dict[str, int] = field(default_factory=dict)

    def in_channel(self, channel: str) -> list[ModelMessage]:
        return [m for m in self.messages.values() if m.channel == channel]

    def live_with_key(self, channel: str, key: str | None) -> ModelMessage | None:
        if key is None:
            return None
        return next((m for m in self.in_channel(channel) if m.dedup_key == key), None)

    def head(self, channel: str) -> ModelMessage | None:
        waiting = [m for m in self.in_channel(channel) if not m.locked]
        return min(waiting, key=lambda m: (m.dequeue_at, m.id), default=None)

    def choices(self, now: int, *, strict: bool) -> set[int]:
        """Ids a single dequeue at ``now`` may return. ``strict`` counts every earlier dequeue
        against a release interval (the queue may remember them); otherwise only those made
        while the channel had a policy (the queue must remember these)."""
        locked = [m for m in self.messages.values() if m.locked]
        expired = [m for m in locked if m.unlock_at is not None and m.unlock_at <= now]
        if expired:
            return {min(expired, key=lambda m: (m.unlock_at or 0, m.id)).id}
        found: set[int] = set()
        for channel in {m.channel for m in self.messages.values()}:
            head = self.head(channel)
            if head is None or head.dequeue_at > now:
                continue
            policy = self.policies.get(channel)
            if policy is not None and policy.max_concurrency is not None:
                in_flight = sum(1 for m in self.in_channel(channel) if m.locked)
                if in_flight >= policy.max_concurrency:
                    continue
            if policy is not None and policy.release_interval_ms:
                last = (self.last_any if strict else self.last_policy).get(channel)
                if last is not None and last + policy.release_interval_ms > now:
                    continue
            found.add(head.id)
        return found

    def take(self, message_id: int, now: int, unlock_at: int) -> None:
        """A dequeue at ``now`` locked this message until ``unlock_at``."""
        message = self.messages[message_id]
        if not message.locked:
            self.last_any[message.channel] = now
            if message.channel in self.policies:
                self.last_policy[message.channel] = now
        message.locked = True
        message.unlock_at = unlock_at
        message.attempts += 1


def _pick(data: st.DataObject, items: list[int]) -> int | None:
    """One of ``items`` (None when there is none), drawn with the same shape whatever their
    number: which messages exist and which are locked depend on the real clock (which channel
    a dequeue served), and Hypothesis replays draws by their position. For the same reason no
    rule has a precondition on them: a rule with nothing to act on draws, then does nothing."""
    drawn = data.draw(st.integers(0, 1 << 16))
    return items[drawn % len(items)] if items else None


class QueueMachine(RuleBasedStateMachine):
    """Drives one queue and the model side by side."""

    queue: Queue
    admin: Conn

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.offset = 0
        # The Message objects dequeue handed out, by id (the latest one per message).
        self.held: dict[int, Message] = {}
        self.finished: list[int] = []
        self.content_no = 0

    # -- helpers -------------------------------------------------------------------------

    def sql(self, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cursor = self.admin.execute(
            sql.SQL(text).format(s=sql.Identifier(self.queue.schema)), params
        )
        return cursor.fetchall() if cursor.description else []

    def read_dequeue_at(self, ids: list[int]) -> dict[int, int]:
        rows = self.sql("SELECT id, dequeue_at FROM {s}.message WHERE id = ANY(%s)", (ids,))
        return {int(r[0]): int(r[1]) for r in rows}

    def content(self) -> bytes:
        self.content_no += 1
        return b"c%d" % self.content_no

    def at(self, delay: int | None) -> int | None:
        return None if delay is None else self.queue.now() + delay

    def fake(self, message_id: int, attempts: int) -> Message:
        """A Message claiming ``attempts`` on ``message_id`` (for calls that must be refused)."""
        return Message(
            id=message_id,
            channel="x",
            content=b"",
            state=None,
            num_attempts=attempts,
            dequeue_at=0,
            unlock_at=0,
            queue=self.queue,
        )

    def snapshot(self) -> list[tuple[Any, ...]]:
        return self.sql(
            "SELECT id, is_locked, unlock_at, num_attempts, dequeue_at, state "
            "FROM {s}.message ORDER BY id"
        )

    # -- setup -----------------------------------------------------------------------------

    @initialize()
    def reset(self) -> None:
        self.sql("TRUNCATE {s}.message, {s}.channel, {s}.archive")
        self.queue.set_clock_offset(0)

    # -- creating --------------------------------------------------------------------------

    def expect_create(
        self, channel: str, key: str | None, new_so_far: dict[str, int]
    ) -> tuple[CreateStatus, int | None]:
        live = self.model.live_with_key(channel, key)
        if live is not None:
            return CreateStatus.DEDUPLICATED, live.id
        policy = self.model.policies.get(channel)
        size = len(self.model.in_channel(channel)) + new_so_far.get(channel, 0)
        if policy is not None and policy.max_size is not None and size >= policy.max_size:
            return CreateStatus.DROPPED, None
        return CreateStatus.CREATED, None

    @rule(
        channel=st.sampled_from(CHANNELS),
        delay=st.sampled_from(DELAYS),
        key=st.sampled_from(KEYS),
    )
    def create(self, channel: str, delay: int | None, key: str | None) -> None:
        content = self.content()
        status, known_id = self.expect_create(channel, key, {})
        result = self.queue.create(
            content, channel=channel, dequeue_at=self.at(delay), dedup_key=key
        )
        assert result.status == status, (result, status)
        if status == CreateStatus.DEDUPLICATED:
            assert result.id == known_id
        if status == CreateStatus.CREATED:
            assert result.id is not None
            assert result.id not in self.model.messages
            at = self.read_dequeue_at([result.id])[result.id]
            self.model.messages[result.id] = ModelMessage(result.id, channel, content, at, key)
        if status == CreateStatus.DROPPED:
            assert result.id is None
        expected_size = (
            len(self.model.in_channel(channel)) if channel in self.model.policies else None
        )
        assert result.channel_size == expected_size

    @rule(
        items=st.lists(
            st.tuples(st.sampled_from(CHANNELS), st.sampled_from(DELAYS), st.sampled_from(KEYS)),
            min_size=1,
            max_size=4,
        )
    )
    def create_many(self, items: list[tuple[str, int | None, str | None]]) -> None:
        news = [
            NewMessage(self.content(), channel=c, dequeue_at=self.at(d), dedup_key=k)
            for c, d, k in items
        ]
        results = self.queue.create_many(news)
        assert len(results) == len(news)
        new_so_far: dict[str, int] = {}
        batch_first: dict[tuple[str, str], int | None] = {}  # (channel, key) -> id or dropped
        created: list[tuple[int, NewMessage]] = []
        for new, result in zip(news, results, strict=True):
            channel, key = new.channel or "default", new.dedup_key
            status, known_id = self.expect_create(channel, key, new_so_far)
            if (
                status != CreateStatus.DEDUPLICATED
                and key is not None
                and (channel, key) in batch_first
            ):
                first = batch_first[(channel, key)]
                status = CreateStatus.DROPPED if first is None else CreateStatus.DEDUPLICATED
                known_id = first
            elif status != CreateStatus.DEDUPLICATED:
                new_so_far[channel] = new_so_far.get(channel, 0) + 1
                if key is not None:
                    batch_first[(channel, key)] = (
                        result.id if status == CreateStatus.CREATED else None
                    )
            assert result.status == status, (items, results)
            if status == CreateStatus.DEDUPLICATED:
                assert result.id == known_id
            if status == CreateStatus.CREATED:
                assert result.id is not None
                created.append((result.id, new))
            if status == CreateStatus.DROPPED:
                assert result.id is None
        times = self.read_dequeue_at([i for i, _ in created])
        for message_id, new in created:
            channel = new.channel or "default"
            self.model.messages[message_id] = ModelMessage(
                message_id, channel, new.content, times[message_id], new.dedup_key
            )

    # -- dequeuing -------------------------------------------------------------------------

    def check_taken(self, limit: int) -> None:
        lo = self.queue.now()
        batch = self.queue.dequeue_batch(limit, lock_ms=LOCK_MS)
        hi = self.queue.now()
        assert len(batch.messages) <= limit
        for message in batch.messages:
            allowed = self.model.choices(lo, strict=False) | self.model.choices(hi, strict=False)
            assert message.id in allowed, (message, allowed)
            mine = self.model.messages[message.id]
            now = message.unlock_at - LOCK_MS
            assert lo <= now <= hi
            self.model.take(message.id, now, message.unlock_at)
            assert (message.channel, message.content, message.dequeue_at) == (
                mine.channel,
                mine.content,
                mine.dequeue_at,
            )
            assert message.num_attempts == mine.attempts
            self.held[message.id] = message
        if len(batch.messages) < limit:
            # Nothing that was surely available was left behind.
            assert not self.model.choices(lo, strict=True), (batch, self.model)
        if not batch.messages:
            assert batch.retry_at is None or batch.retry_at >= lo

    @rule()
    def dequeue(self) -> None:
        self.check_taken(1)

    @rule(limit=st.integers(min_value=2, max_value=4))
    def dequeue_many(self, limit: int) -> None:
        self.check_taken(limit)

    # -- holding ---------------------------------------------------------------------------

    def holdable(self) -> list[int]:
        return sorted(i for i, m in self.model.messages.items() if m.locked)

    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        message_id = _pick(data, self.holdable())
        if message_id is None:
            return
        unlock_at = self.held[message_id].heartbeat(lock_ms=LOCK_MS)
        self.model.messages[message_id].unlock_at = unlock_at

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        message_id = _pick(data, self.holdable())
        if message_id is None:
            return
        self.held[message_id].delete()
        del self.model.messages[message_id]
        self.finished.append(message_id)

    @rule(data=st.data(), delay=st.sampled_from(DELAYS), state=st.sampled_from([None, b"s"]))
    def defer(self, data: st.DataObject, delay: int | None, state: bytes | None) -> None:
        message_id = _pick(data, self.holdable())
        if message_id is None:
            return
        self.held[message_id].defer(dequeue_at=self.at(delay), state=state)
        mine = self.model.messages[message_id]
        mine.locked, mine.unlock_at = False, None
        mine.dequeue_at = self.read_dequeue_at([message_id])[message_id]

    @rule(data=st.data(), action=st.sampled_from(["heartbeat", "delete", "defer"]))
    def stale_call(self, data: st.DataObject, action: str) -> None:
        """A call with attempts the caller does not hold (or on a finished message) is
        refused with a typed error and changes nothing."""
        known = sorted(self.model.messages) + self.finished
        message_id = _pick(data, known)
        # Drawn whatever the message's state (see _pick).
        off_by = data.draw(st.sampled_from([1, -1]))
        if message_id is None:
            return
        mine = self.model.messages.get(message_id)
        error: type[MessageError]
        if mine is None:
            attempts, error = 1, MessageNotFoundError
        elif mine.locked:
            attempts = max(1, mine.attempts + off_by)
            if attempts == mine.attempts:
                attempts += 1
            error = StaleMessageError
        else:
            attempts, error = max(1, mine.attempts), StaleMessageError
        before = self.snapshot()
        fake = self.fake(message_id, attempts)
        calls: dict[str, Callable[[], object]] = {
            "heartbeat": lambda: fake.heartbeat(lock_ms=LOCK_MS),
            "delete": fake.delete,
            "defer": lambda: fake.defer(state=b"changed"),
        }
        with pytest.raises(error):
            calls[action]()
        assert self.snapshot() == before

    # -- policies and time -----------------------------------------------------------------

    @rule(
        channel=st.sampled_from(CHANNELS),
        max_concurrency=st.sampled_from([None, 0, 1, 2]),
        release_interval_ms=st.sampled_from([None, 0, 7_500]),
        max_size=st.sampled_from([None, 1, 3]),
    )
    def set_policy(
        self,
        channel: str,
        max_concurrency: int | None,
        release_interval_ms: int | None,
        max_size: int | None,
    ) -> None:
        self.queue.channel(channel).set_policy(
            max_concurrency=max_concurrency,
            release_interval_ms=release_interval_ms,
            max_size=max_size,
        )
        self.model.policies[channel] = ModelPolicy(max_concurrency, release_interval_ms, max_size)

    @rule(channel=st.sampled_from(CHANNELS))
    def clear_policy(self, channel: str) -> None:
        self.queue.channel(channel).clear_policy()
        self.model.policies.pop(channel, None)
        self.model.last_policy.pop(channel, None)

    @rule(ms=st.sampled_from([1_000, 6_000, 15_000]))
    def advance_clock(self, ms: int) -> None:
        self.offset += ms
        self.queue.set_clock_offset(self.offset)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        assert self.queue.verify() == []

    @invariant()
    def same_messages(self) -> None:
        rows = self.sql("SELECT id, channel, is_locked, num_attempts FROM {s}.message ORDER BY id")
        mine = [
            (m.id, m.channel, m.locked, m.attempts)
            for m in sorted(self.model.messages.values(), key=lambda m: m.id)
        ]
        assert [tuple(r) for r in rows] == mine


def test_queue_follows_the_model(queue: Queue, admin: Conn) -> None:
    # A subclass bound to this test's queue: one schema for every example, emptied by reset.
    machine = type("BoundQueueMachine", (QueueMachine,), {"queue": queue, "admin": admin})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=50,
            stateful_step_count=50,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
