"""Bad input: every public operation refuses it with the right typed error and a useful
message, and the queue is exactly as it was before the call.

The same refusals are checked one level down, by calling the SQL functions directly and
looking at the SQLSTATE (LQ001..LQ006).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from lonnymq import AsyncQueue, CreateStatus, Message, NewMessage, Queue, _core
from lonnymq.errors import (
    DatabaseUnavailableError,
    InvalidArgumentError,
    InvalidChannelError,
    InvalidPolicyError,
    LonnyMQError,
    MessageNotFoundError,
    PayloadTooLargeError,
    StaleMessageError,
)

MAX_PAYLOAD = 64 * 1024 * 1024
MAX_LOCK_MS = 7 * 24 * 3600 * 1000
HOUR_MS = 3_600_000
UNKNOWN_ID = 10**12
ONE_YEAR_MS = 365 * 24 * 3600 * 1000

Conn = psycopg.Connection[Any]


# -- the world every refusal is tried against -------------------------------------------


@dataclasses.dataclass
class World:
    """A queue with waiting, held and stale messages and a channel policy."""

    queue: Queue
    admin: Conn
    held: Message  # locked for an hour, attempt 1
    stale: Message  # attempt 1 of a message whose lock expired and that was taken again
    current: Message  # attempt 2 of the same message as ``stale``
    waiting_id: int  # a message that was never dequeued

    def snapshot(self) -> tuple[object, ...]:
        """Everything a refusal must leave alone: stats and the schema's tables."""
        ident = sql.Identifier(self.queue.schema)

        def rows(query: str) -> list[tuple[Any, ...]]:
            return self.admin.execute(sql.SQL(query).format(ident)).fetchall()

        return (
            self.queue.stats(),
            rows("SELECT * FROM {}.message ORDER BY id"),
            rows("SELECT * FROM {}.channel ORDER BY name"),
            rows("SELECT * FROM {}.config"),
            rows("SELECT * FROM {}.archive ORDER BY id"),
        )

    def message(self, **changes: Any) -> Message:
        """A copy of ``held`` with some fields replaced (for made-up ids and attempts)."""
        return dataclasses.replace(self.held, **changes)

    def call_sql(self, text: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """Run ``SELECT * FROM <text>`` with ``{s}`` standing for the quoted schema."""
        query = sql.SQL("SELECT * FROM " + text).format(s=sql.Identifier(self.queue.schema))
        return self.admin.execute(query, params).fetchall()


def _build_world(queue: Queue, admin: Conn) -> World:
    queue.channel("p").set_policy(max_concurrency=5, release_interval_ms=0, max_size=100)
    first = queue.create(b"a1", channel="a", dequeue_at=1)
    expiring_id = queue.create(b"b1", channel="b", dequeue_at=2).id
    waiting_id = queue.create(b"p1", channel="p", dequeue_at=3, dedup_key="k").id
    queue.create(b"a2", channel="a")
    held = queue.dequeue(lock_ms=HOUR_MS)
    assert held is not None
    assert held.id == first.id
    stale = queue.dequeue(lock_ms=1)
    assert stale is not None
    assert stale.id == expiring_id
    time.sleep(0.02)
    current = queue.dequeue(lock_ms=HOUR_MS)  # recovers the expired lock first
    assert current is not None
    assert (current.id, current.num_attempts) == (stale.id, 2)
    assert waiting_id is not None
    return World(queue, admin, held, stale, current, waiting_id)


@pytest.fixture
def world(queue: Queue, admin: Conn) -> World:
    """A world of its own, for tests that change it."""
    return _build_world(queue, admin)


@pytest.fixture(scope="module")
def shared_world(dsn: str) -> Iterator[World]:
    """One world for the refusal tables: a refusal changes nothing, so the tests can share it
    (each still compares the state before and after its own call)."""
    schema = f"t_bad_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(dsn, autocommit=True) as admin, Queue(dsn, schema=schema) as queue:
        queue.install()
        try:
            yield _build_world(queue, admin)
        finally:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(scope="module")
def big_payload() -> bytes:
    """One byte over the 64 MiB limit (built once)."""
    return bytes(MAX_PAYLOAD + 1)


# Each operation takes the world and one bad value; the table below says which values each
# operation gets and what it must raise.
Op = Callable[[World, Any], object]

OPS: dict[str, Op] = {
    # lock_ms
    "dequeue.lock_ms": lambda w, v: w.queue.dequeue(lock_ms=v),
    "dequeue_many.lock_ms": lambda w, v: w.queue.dequeue_many(1, lock_ms=v),
    "dequeue_batch.lock_ms": lambda w, v: w.queue.dequeue_batch(1, lock_ms=v),
    "heartbeat.lock_ms": lambda w, v: w.queue.heartbeat(w.held, lock_ms=v),
    "message.heartbeat.lock_ms": lambda w, v: w.held.heartbeat(lock_ms=v),
    # limit
    "dequeue_many.limit": lambda w, v: w.queue.dequeue_many(v, lock_ms=1000),
    "dequeue_batch.limit": lambda w, v: w.queue.dequeue_batch(v, lock_ms=1000),
    # content and state
    "create.content": lambda w, v: w.queue.create(v),
    "channel.create.content": lambda w, v: w.queue.channel("a").create(v),
    "create_many.content": lambda w, v: w.queue.create_many([NewMessage(b"ok"), NewMessage(v)]),
    "defer.state": lambda w, v: w.queue.defer(w.held, state=v),
    # channel names
    "create.channel": lambda w, v: w.queue.create(b"x", channel=v),
    "create_many.channel": lambda w, v: w.queue.create_many(
        [NewMessage(b"ok"), NewMessage(b"x", channel=v)]
    ),
    "set_policy.channel": lambda w, v: w.queue.channel(v).set_policy(max_size=1),
    "clear_policy.channel": lambda w, v: w.queue.channel(v).clear_policy(),
    # dedup keys
    "create.dedup_key": lambda w, v: w.queue.create(b"x", dedup_key=v),
    "create_many.dedup_key": lambda w, v: w.queue.create_many(
        [NewMessage(b"ok"), NewMessage(b"x", dedup_key=v)]
    ),
    # dequeue_at and priority
    "create.dequeue_at": lambda w, v: w.queue.create(b"x", dequeue_at=v),
    "create_many.dequeue_at": lambda w, v: w.queue.create_many(
        [NewMessage(b"ok"), NewMessage(b"x", dequeue_at=v)]
    ),
    "defer.dequeue_at": lambda w, v: w.queue.defer(w.held, dequeue_at=v),
    "defer_many.dequeue_at": lambda w, v: w.queue.defer_many([w.held], dequeue_at=v),
    "create.priority": lambda w, v: w.queue.create(b"x", priority=v),
    "create.priority+dequeue_at": lambda w, v: w.queue.create(b"x", priority=1, dequeue_at=v),
    # create_many's items
    "create_many.items": lambda w, v: w.queue.create_many(v),
    # claims: v is a dict of Message fields to replace in the held message
    "delete": lambda w, v: w.queue.delete(w.message(**v)),
    "defer": lambda w, v: w.queue.defer(w.message(**v)),
    "heartbeat": lambda w, v: w.queue.heartbeat(w.message(**v), lock_ms=1000),
    "delete_many": lambda w, v: w.queue.delete_many([w.held, w.message(**v)]),
    "delete_many.messages": lambda w, v: w.queue.delete_many(v),
    "defer_many.messages": lambda w, v: w.queue.defer_many(v),
    "defer_many": lambda w, v: w.queue.defer_many([w.held, w.message(**v)]),
    "message.delete": lambda w, v: w.message(**v).delete(),
    "message.defer": lambda w, v: w.message(**v).defer(dequeue_at=0, state=b"s"),
    "message.heartbeat": lambda w, v: w.message(**v).heartbeat(lock_ms=1000),
    # claims on the world's stale and never-dequeued messages (v unused)
    "delete.stale": lambda w, v: w.queue.delete(w.stale),
    "defer.stale": lambda w, v: w.queue.defer(w.stale),
    "heartbeat.stale": lambda w, v: w.queue.heartbeat(w.stale, lock_ms=1000),
    "message.delete.stale": lambda w, v: w.stale.delete(),
    "message.defer.stale": lambda w, v: w.stale.defer(),
    "message.heartbeat.stale": lambda w, v: w.stale.heartbeat(lock_ms=1000),
    "delete.waiting": lambda w, v: w.queue.delete(w.message(id=w.waiting_id)),
    "defer.waiting": lambda w, v: w.queue.defer(w.message(id=w.waiting_id)),
    "heartbeat.waiting": lambda w, v: w.queue.heartbeat(w.message(id=w.waiting_id), lock_ms=1),
    # policies: v is (channel, field, value)
    "set_policy": lambda w, v: w.queue.channel(v[0]).set_policy(**{v[1]: v[2]}),
    # the clock
    "set_clock_offset": lambda w, v: w.queue.set_clock_offset(v),
}

LOCK_MS_OPS = [name for name in OPS if name.endswith(".lock_ms")]
CLAIM_OPS = ["delete", "defer", "heartbeat", "delete_many", "defer_many"]
SINGLE_CLAIM_OPS = ["delete", "defer", "heartbeat"] + [f"message.{n}" for n in CLAIM_OPS[:3]]
SURROGATE = "\ud800"  # Python strings can hold a lone surrogate; text cannot store it
ONE_YEAR_PLUS = ONE_YEAR_MS + 1

# (operations, bad values, error, text the message must contain)
# fmt: off
TABLE: list[tuple[list[str], list[Any], type[LonnyMQError], str]] = [
    (LOCK_MS_OPS, [0, -1, MAX_LOCK_MS + 1, 10**30, 1.5, "1000", True, None],
     InvalidArgumentError, "lock_ms"),
    (["dequeue_many.limit", "dequeue_batch.limit"], [0, -1, 10_001, 10**12, 1.5, "1", True, None],
     InvalidArgumentError, "limit"),
    (["create.content", "channel.create.content", "create_many.content"],
     ["text", None, 123, [1, 2]], InvalidArgumentError, "content must be bytes"),
    (["create.content"], ["text"], InvalidArgumentError, "encode"),
    (["defer.state"], ["text", 123], InvalidArgumentError, "state must be bytes"),
    (["create.channel", "create_many.channel", "set_policy.channel", "clear_policy.channel"],
     ["", "c" * 256, "a\x00b", 5, b"abc", "a" + SURROGATE], InvalidChannelError,
     "channel"),
    (["create.dedup_key", "create_many.dedup_key"],
     ["", "k" * 256, 5, b"k", "a\x00b", SURROGATE], InvalidArgumentError, "dedup_key"),
    (["create.dequeue_at", "create_many.dequeue_at", "defer.dequeue_at",
      "defer_many.dequeue_at"],
     [1.5, "1", True, 10**15 + 1, -(10**15) - 1, 2**63, float("nan")], InvalidArgumentError,
     "dequeue_at"),
    (["create.priority"], [-1, 1_000_001, 1.0, True, "1"], InvalidArgumentError, "priority"),
    (["create.priority+dequeue_at"], [5, 0], InvalidArgumentError, "priority and dequeue_at"),
    (["create_many.items"],
     [NewMessage(b"x"), b"x", "x", [b"x"], [NewMessage(b"x"), "x"]], InvalidArgumentError,
     "NewMessage"),
    (["create_many.items"], [[NewMessage(b"x")] * 100_001], InvalidArgumentError, "100000"),
    (["create_many.items"], [None, 5], InvalidArgumentError, "iterable of NewMessage"),
    (["delete_many.messages", "defer_many.messages"], [None, 5, b"x"], InvalidArgumentError,
     "sequence of messages"),
    (CLAIM_OPS, [{"id": v} for v in [0, -1, 2**63, True, "1", 1.5, None]],
     InvalidArgumentError, "message id"),
    (CLAIM_OPS, [{"num_attempts": v} for v in [0, -1, 2**31, True, None, "1"]],
     InvalidArgumentError, "num_attempts"),
    (SINGLE_CLAIM_OPS, [{"id": UNKNOWN_ID}], MessageNotFoundError, "does not exist"),
    (SINGLE_CLAIM_OPS, [{"num_attempts": 7}], StaleMessageError, "attempt 1"),
    ([f"{n}.stale" for n in SINGLE_CLAIM_OPS], [None], StaleMessageError, "attempt 2"),
    (["delete.waiting", "defer.waiting", "heartbeat.waiting"], [None], StaleMessageError,
     "not locked"),
    (["set_policy"],
     [(channel, field, value)
      for channel in ("p", "a")
      for field, too_big in [("max_concurrency", 2**31),
                             ("release_interval_ms", ONE_YEAR_PLUS),
                             ("max_size", 2**63)]
      for value in [-1, -(10**20), too_big, 1.5, "1", True]],
     InvalidPolicyError, ""),
    (["set_clock_offset"], [1.5, "1", True, 10**15 + 1, -(10**15) - 1], InvalidArgumentError,
     "offset_ms"),
]
# fmt: on


def _cases() -> list[Any]:
    cases = []
    for ops, values, error, match in TABLE:
        for op in ops:
            for value in values:
                shown = repr(value)
                if len(shown) > 30:
                    shown = shown[:30] + "..."
                expected = match or value[1]  # policies: the message names the field
                cases.append(pytest.param(op, value, error, expected, id=f"{op}={shown}"))
    return cases


@pytest.mark.parametrize(("op", "value", "error", "match"), _cases())
def test_refused_with_typed_error_and_nothing_changes(
    shared_world: World, op: str, value: Any, error: type[LonnyMQError], match: str
) -> None:
    world = shared_world
    before = world.snapshot()
    assert before[1], "the world must hold messages for the comparison to mean anything"
    with pytest.raises(LonnyMQError) as caught:
        OPS[op](world, value)
    assert type(caught.value) is error
    assert match in str(caught.value)
    assert world.snapshot() == before


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda q, b: q.create(b), id="create"),
        pytest.param(lambda q, b: q.channel("a").create(b), id="channel.create"),
        pytest.param(lambda q, b: q.create_many([NewMessage(b"ok"), NewMessage(b)]), id="many"),
    ],
)
def test_content_over_64_mib_is_payload_too_large(
    shared_world: World, big_payload: bytes, call: Callable[[Queue, bytes], object]
) -> None:
    world = shared_world
    before = world.snapshot()
    with pytest.raises(PayloadTooLargeError, match="64 MiB"):
        call(world.queue, big_payload)
    assert world.snapshot() == before


def test_state_over_64_mib_is_payload_too_large(shared_world: World, big_payload: bytes) -> None:
    world = shared_world
    before = world.snapshot()
    with pytest.raises(PayloadTooLargeError, match="state must be at most 64 MiB"):
        world.held.defer(state=big_payload)
    assert world.snapshot() == before


def test_payload_too_large_is_an_invalid_argument() -> None:
    assert issubclass(PayloadTooLargeError, InvalidArgumentError)
    assert issubclass(InvalidChannelError, InvalidArgumentError)
    assert issubclass(InvalidPolicyError, InvalidArgumentError)
    assert issubclass(InvalidArgumentError, ValueError)


def test_batch_operations_report_unknown_and_stale_without_raising(
    shared_world: World,
) -> None:
    world = shared_world
    before = world.snapshot()
    unknown = world.message(id=UNKNOWN_ID)
    assert [s.value for s in world.queue.delete_many([unknown, world.stale])] == [
        "not_found",
        "stale",
    ]
    assert [s.value for s in world.queue.defer_many([world.stale, unknown])] == [
        "stale",
        "not_found",
    ]
    assert world.snapshot() == before


def test_one_bad_claim_in_a_batch_leaves_the_good_ones_held(world: World) -> None:
    before = world.snapshot()
    with pytest.raises(InvalidArgumentError, match="message id"):
        world.queue.delete_many([world.held, world.current, world.message(id=0)])
    assert world.snapshot() == before
    # The good claims are still valid afterwards.
    assert [s.value for s in world.queue.delete_many([world.held, world.current])] == [
        "ok",
        "ok",
    ]


# -- schema names ------------------------------------------------------------------------

BAD_SCHEMAS: list[object] = [
    'x"; DROP TABLE y; --',
    "has space",
    'quo"te',
    "it's",
    "1abc",
    "pg_x",
    "PG_catalog",
    "a" * 64,
    "",
    "a-b",
    "é",
    "abc\n",
    None,
    5,
    b"abc",
]


@pytest.mark.parametrize("queue_class", [Queue, AsyncQueue])
@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=[repr(s)[:24] for s in BAD_SCHEMAS])
def test_bad_schema_name_is_refused(
    dsn: str, admin: Conn, queue_class: type[Queue] | type[AsyncQueue], schema: object
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        queue_class(dsn, schema=cast(Any, schema))
    assert type(caught.value) is InvalidArgumentError
    assert "schema" in str(caught.value)
    if isinstance(schema, str):
        found = admin.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema]
        ).fetchone()
        assert found == (0,)


BAD_POOL_TIMEOUTS: list[object] = [0, -1, 0.0, float("nan"), float("inf"), True, "5", None]


@pytest.mark.parametrize("queue_class", [Queue, AsyncQueue])
@pytest.mark.parametrize("value", BAD_POOL_TIMEOUTS, ids=[repr(v) for v in BAD_POOL_TIMEOUTS])
def test_bad_pool_timeout_is_refused(
    dsn: str, queue_class: type[Queue] | type[AsyncQueue], value: object
) -> None:
    with pytest.raises(InvalidArgumentError, match="pool_timeout"):
        queue_class(dsn, schema="never_installed_here", pool_timeout=cast(Any, value))


@pytest.mark.parametrize("schema", ["a" * 63, "_x1", "Mixed_Case_9"])
def test_good_schema_names_are_accepted(dsn: str, schema: str) -> None:
    assert Queue(dsn, schema=schema).schema == schema


# -- the edges of what is accepted (so that the refusals above are not blanket ones) ------


def test_boundary_values_are_accepted(world: World) -> None:
    queue = world.queue
    results = [
        queue.create(b"x", channel="c" * 255),
        queue.create(b"x", channel="\U0001f600" * 255, dedup_key="\U0001f600" * 255),
        queue.create(b"x", channel="e", dedup_key="k" * 255),
        queue.create(b"x", channel="e", dequeue_at=10**15),
        queue.create(b"x", channel="e", dequeue_at=-(10**15)),
        queue.create(b"x", channel="e", priority=0),
        queue.create(b"x", channel="e", priority=1_000_000),
    ]
    assert [r.status for r in results] == [CreateStatus.CREATED] * len(results)
    names = {s.channel for s in queue.stats()}
    assert {"c" * 255, "\U0001f600" * 255, "e"} <= names
    assert queue.dequeue_batch(10_000, lock_ms=MAX_LOCK_MS).messages
    assert queue.heartbeat(world.held, lock_ms=1) > 0
    queue.channel("e").set_policy(
        max_concurrency=2**31 - 1, release_interval_ms=ONE_YEAR_MS, max_size=2**63 - 1
    )
    queue.channel("e").set_policy(max_concurrency=0, release_interval_ms=0, max_size=0)
    queue.set_clock_offset(10**15)
    queue.set_clock_offset(0)


def test_async_queue_checks_arguments_too(dsn: str) -> None:
    import asyncio

    async def main() -> None:
        async with AsyncQueue(dsn, schema="never_installed_here") as queue:
            with pytest.raises(InvalidArgumentError, match="lock_ms"):
                await queue.dequeue(lock_ms=0)
            with pytest.raises(InvalidArgumentError, match="limit"):
                await queue.dequeue_many(0, lock_ms=1000)
            with pytest.raises(InvalidChannelError):
                await queue.create(b"x", channel="")
            with pytest.raises(InvalidPolicyError):
                await queue.channel("a").set_policy(max_size=-1)

    asyncio.run(main())


# -- the SQL functions themselves --------------------------------------------------------

SqlParams = Callable[[World], tuple[object, ...]]

BIG_SQL = "convert_to(repeat('x', 67108865), 'UTF8')"  # 64 MiB + 1, built by the server


def _sql_cases() -> list[Any]:
    def none(w: World) -> tuple[object, ...]:
        return ()

    def held(w: World) -> tuple[object, ...]:
        return (w.held.id,)

    def stale(w: World) -> tuple[object, ...]:
        return (w.stale.id,)

    def waiting(w: World) -> tuple[object, ...]:
        return (w.waiting_id,)

    def unknown(w: World) -> tuple[object, ...]:
        return (UNKNOWN_ID,)

    # fmt: off
    cases: list[tuple[str, str, SqlParams, str, str]] = [
        # dequeue
        ("dq-limit-0", "{s}.message_dequeue_many(0, 1000)", none, "LQ003", "limit"),
        ("dq-limit-neg", "{s}.message_dequeue_many(-1, 1000)", none, "LQ003", "limit"),
        ("dq-limit-big", "{s}.message_dequeue_many(10001, 1000)", none, "LQ003", "limit"),
        ("dq-limit-null", "{s}.message_dequeue_many(NULL, 1000)", none, "LQ003", "limit"),
        ("dq-lock-0", "{s}.message_dequeue_many(1, 0)", none, "LQ003", "lock_ms"),
        ("dq-lock-neg", "{s}.message_dequeue_many(1, -1)", none, "LQ003", "lock_ms"),
        ("dq-lock-big", "{s}.message_dequeue_many(1, 604800001)", none, "LQ003", "lock_ms"),
        ("dq-lock-null", "{s}.message_dequeue_many(1, NULL)", none, "LQ003", "lock_ms"),
        ("dq1-lock-0", "{s}.message_dequeue(0)", none, "LQ003", "lock_ms"),
        # complete_and_dequeue: a bad dequeue argument or claim finishes nothing either
        ("cd-limit-0",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[1], 0, 1000)", held,
         "LQ003", "limit"),
        ("cd-limit-null",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[1], NULL, 1000)", held,
         "LQ003", "limit"),
        ("cd-lock-0",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[1], 1, 0)", held,
         "LQ003", "lock_ms"),
        ("cd-lock-null",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[1], 1, NULL)", held,
         "LQ003", "lock_ms"),
        ("cd-attempts-0",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[0], 1, 1000)", held,
         "LQ003", "num_attempts"),
        ("cd-attempts-neg",
         "{s}.message_complete_and_dequeue(ARRAY[%s]::bigint[], ARRAY[-1], 1, 1000)", held,
         "LQ003", "num_attempts"),
        # create
        ("c-channel-empty", "{s}.message_create('\\x01', '')", none, "LQ005", "channel"),
        ("c-channel-long", "{s}.message_create('\\x01', repeat('c', 256))", none, "LQ005",
         "256 characters"),
        ("c-content-null", "{s}.message_create(NULL)", none, "LQ003", "content"),
        ("c-time-low", "{s}.message_create('\\x01', 'a', -1000000000000001)", none, "LQ003",
         "dequeue_at"),
        ("c-time-high", "{s}.message_create('\\x01', 'a', 1000000000000001)", none, "LQ003",
         "dequeue_at"),
        ("c-dedup-empty", "{s}.message_create('\\x01', 'a', NULL, '')", none, "LQ003",
         "dedup_key"),
        ("c-dedup-long", "{s}.message_create('\\x01', 'a', NULL, repeat('k', 256))", none,
         "LQ003", "dedup_key"),
        ("c-too-large", "{s}.message_create(" + BIG_SQL + ")", none, "LQ006", "64 MiB"),
        # create_many: mismatched arrays, one bad item among good ones
        ("cm-channels-len",
         "{s}.message_create_many(ARRAY['a', 'b'], ARRAY['\\x01']::bytea[], NULL, NULL)",
         none, "LQ003", "same length"),
        ("cm-times-len",
         "{s}.message_create_many(NULL, ARRAY['\\x01', '\\x02']::bytea[], ARRAY[1]::bigint[],"
         " NULL)", none, "LQ003", "same length"),
        ("cm-keys-len",
         "{s}.message_create_many(NULL, ARRAY['\\x01']::bytea[], NULL, ARRAY['k', 'l'])",
         none, "LQ003", "same length"),
        ("cm-contents-null", "{s}.message_create_many(ARRAY['a'], NULL, NULL, NULL)", none,
         "LQ003", "contents"),
        ("cm-bad-channel",
         "{s}.message_create_many(ARRAY['n1', '', 'n3'],"
         " ARRAY['\\x01', '\\x02', '\\x03']::bytea[], NULL, NULL)", none, "LQ005",
         "channel"),
        ("cm-null-content",
         "{s}.message_create_many(ARRAY['n1', 'n2', 'n3'],"
         " ARRAY['\\x01', NULL, '\\x03']::bytea[], NULL, NULL)", none, "LQ003",
         "content"),
        ("cm-bad-key",
         "{s}.message_create_many(ARRAY['n1', 'n2', 'n3'],"
         " ARRAY['\\x01', '\\x02', '\\x03']::bytea[], NULL, ARRAY['k1', 'k2', ''])", none,
         "LQ003", "dedup_key"),
        ("cm-bad-time",
         "{s}.message_create_many(ARRAY['n1', 'n2'], ARRAY['\\x01', '\\x02']::bytea[],"
         " ARRAY[NULL, 1000000000000001]::bigint[], NULL)", none, "LQ003",
         "dequeue_at"),
        # heartbeat
        ("hb-unknown", "{s}.message_heartbeat(%s, 1, 1000)", unknown, "LQ001",
         "does not exist"),
        ("hb-stale", "{s}.message_heartbeat(%s, 1, 1000)", stale, "LQ002", "attempt 2"),
        ("hb-never-dequeued", "{s}.message_heartbeat(%s, 1, 1000)", waiting, "LQ002",
         "not locked"),
        ("hb-lock-0", "{s}.message_heartbeat(%s, 1, 0)", held, "LQ003", "lock_ms"),
        ("hb-attempts-0", "{s}.message_heartbeat(%s, 0, 1000)", held, "LQ003",
         "num_attempts"),
        ("hb-id-null", "{s}.message_heartbeat(NULL, 1, 1000)", none, "LQ003", "id"),
        # delete
        ("del-unknown", "{s}.message_delete(%s, 1)", unknown, "LQ001", "does not exist"),
        ("del-stale", "{s}.message_delete(%s, 1)", stale, "LQ002", "attempt 2"),
        ("del-wrong-attempt", "{s}.message_delete(%s, 2)", held, "LQ002", "attempt 1"),
        ("del-never-dequeued", "{s}.message_delete(%s, 1)", waiting, "LQ002", "not locked"),
        ("del-attempts-0", "{s}.message_delete(%s, 0)", held, "LQ003", "num_attempts"),
        ("del-attempts-null", "{s}.message_delete(%s, NULL)", held, "LQ003", "num_attempts"),
        ("del-id-null", "{s}.message_delete(NULL, 1)", none, "LQ003", "id"),
        ("del-outcome-empty", "{s}.message_delete(%s, 1, '')", held, "LQ003", "outcome"),
        # defer
        ("def-unknown", "{s}.message_defer(%s, 1)", unknown, "LQ001", "does not exist"),
        ("def-stale", "{s}.message_defer(%s, 1)", stale, "LQ002", "attempt 2"),
        ("def-never-dequeued", "{s}.message_defer(%s, 1)", waiting, "LQ002", "not locked"),
        ("def-time", "{s}.message_defer(%s, 1, 1000000000000001)", held, "LQ003",
         "dequeue_at"),
        ("def-state-large", "{s}.message_defer(%s, 1, NULL, " + BIG_SQL + ")", held, "LQ006",
         "64 MiB"),
        # the batch forms
        ("delm-len", "{s}.message_delete_many(ARRAY[%s]::bigint[], ARRAY[1, 1])", held,
         "LQ003", "same length"),
        ("delm-null", "{s}.message_delete_many(NULL, NULL)", none, "LQ003", "ids"),
        ("delm-null-id", "{s}.message_delete_many(ARRAY[%s, NULL]::bigint[], ARRAY[1, 1])",
         held, "LQ003", "id"),
        ("delm-attempts-0", "{s}.message_delete_many(ARRAY[%s]::bigint[], ARRAY[0])", held,
         "LQ003", "num_attempts"),
        ("defm-len",
         "{s}.message_defer_many(ARRAY[%s]::bigint[], ARRAY[1], ARRAY[1, 2]::bigint[])",
         held, "LQ003", "same length"),
        ("defm-attempts-len", "{s}.message_defer_many(ARRAY[%s]::bigint[], ARRAY[1, 1])",
         held, "LQ003", "same length"),
        ("defm-time",
         "{s}.message_defer_many(ARRAY[%s]::bigint[], ARRAY[1],"
         " ARRAY[1000000000000001]::bigint[])", held, "LQ003", "dequeue_at"),
        # policies
        ("pol-concurrency", "{s}.channel_policy_set('p', -1)", none, "LQ004",
         "max_concurrency"),
        ("pol-interval-neg", "{s}.channel_policy_set('p', NULL, -1)", none, "LQ004",
         "release_interval_ms"),
        ("pol-interval-big", "{s}.channel_policy_set('p', NULL, 31536000001)", none, "LQ004",
         "release_interval_ms"),
        ("pol-size", "{s}.channel_policy_set('p', NULL, NULL, -1)", none, "LQ004",
         "max_size"),
        ("pol-size-new", "{s}.channel_policy_set('new', NULL, NULL, -1)", none, "LQ004",
         "max_size"),
        ("pol-channel-empty", "{s}.channel_policy_set('', 1)", none, "LQ005", "channel"),
        ("pol-channel-null", "{s}.channel_policy_set(NULL, 1)", none, "LQ005", "channel"),
        ("pol-channel-long", "{s}.channel_policy_set(repeat('c', 256), 1)", none, "LQ005",
         "channel"),
        ("clear-channel-empty", "{s}.channel_policy_clear('')", none, "LQ005", "channel"),
        ("clear-channel-null", "{s}.channel_policy_clear(NULL)", none, "LQ005", "channel"),
        # settings and clock
        ("clock-high", "{s}.clock_offset_set(1000000000000001)", none, "LQ003", "offset_ms"),
        ("clock-low", "{s}.clock_offset_set(-1000000000000001)", none, "LQ003", "offset_ms"),
        ("config-event-long", "{s}.config_set(repeat('e', 64))", none, "LQ003",
         "event_channel"),
    ]
    # fmt: on
    return [
        pytest.param(text, params, state, match, id=cid)
        for cid, text, params, state, match in cases
    ]


@pytest.mark.parametrize(("text", "params", "sqlstate", "match"), _sql_cases())
def test_sql_function_refuses_with_sqlstate(
    shared_world: World, text: str, params: SqlParams, sqlstate: str, match: str
) -> None:
    world = shared_world
    before = world.snapshot()
    with pytest.raises(psycopg.Error) as caught:
        world.call_sql(text, params(world))
    assert caught.value.sqlstate == sqlstate
    assert match in (caught.value.diag.message_primary or "")
    assert world.snapshot() == before


def test_sql_create_many_with_a_bad_item_stores_nothing_from_the_batch(world: World) -> None:
    before = world.snapshot()
    with pytest.raises(psycopg.Error) as caught:
        world.call_sql(
            "{s}.message_create_many(%s::text[], %s::bytea[], %s::bigint[], %s::text[])",
            (
                ["n1", "n2", "a", "n3"],
                [b"1", b"2", b"3", b"4"],
                [None, None, None, None],
                ["k1", "k2", "k3", "k" * 256],
            ),
        )
    assert caught.value.sqlstate == "LQ003"
    assert world.snapshot() == before
    # The same batch without the bad key goes in whole.
    rows = world.call_sql(
        "{s}.message_create_many(%s::text[], %s::bytea[], NULL, %s::text[])",
        (["n1", "n2", "a", "n3"], [b"1", b"2", b"3", b"4"], ["k1", "k2", "k3", "k4"]),
    )
    assert [r[0] for r in rows] == ["created"] * 4


# -- fuzzing -----------------------------------------------------------------------------

# Arbitrary text including lone surrogates, which Python strings can hold and text cannot.
_any_text = st.lists(st.one_of(st.characters(), st.characters(categories=["Cs"]))).map("".join)
_names = st.one_of(
    st.none(),
    _any_text,
    st.text(min_size=250, max_size=260),
    st.integers(),
    st.binary(max_size=4),
)
_times = st.one_of(
    st.none(),
    st.integers(),
    st.integers(min_value=-(10**15), max_value=10**15),
    st.floats(),
    st.booleans(),
)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(channel=_names, dedup_key=_names, dequeue_at=_times)
def test_fuzz_create_succeeds_or_raises_lonnymq_error(
    queue: Queue, channel: Any, dedup_key: Any, dequeue_at: Any
) -> None:
    try:
        result = queue.create(b"x", channel=channel, dedup_key=dedup_key, dequeue_at=dequeue_at)
    except LonnyMQError:
        return
    assert result.status in {CreateStatus.CREATED, CreateStatus.DEDUPLICATED}
    stats = queue.channel(channel if channel is not None else "default").stats()
    assert stats is not None
    assert stats.size >= 1


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    channel=_names,
    max_concurrency=_times,
    release_interval_ms=_times,
    max_size=_times,
)
def test_fuzz_set_policy_succeeds_or_raises_lonnymq_error(
    queue: Queue, channel: Any, max_concurrency: Any, release_interval_ms: Any, max_size: Any
) -> None:
    try:
        queue.channel(channel).set_policy(
            max_concurrency=max_concurrency,
            release_interval_ms=release_interval_ms,
            max_size=max_size,
        )
    except LonnyMQError:
        return
    stats = queue.channel(channel).stats()
    assert stats is not None
    assert (
        stats.policy.max_concurrency,
        stats.policy.release_interval_ms,
        stats.policy.max_size,
    ) == (max_concurrency, release_interval_ms, max_size)


@pytest.mark.parametrize("queue_class", [Queue, AsyncQueue])
def test_a_connection_that_cannot_work_fails_at_once_with_its_cause(
    dsn: str, queue_class: type[Queue] | type[AsyncQueue]
) -> None:
    """Not after pool_timeout (30 s) of silent retries that end in "pool initialization
    incomplete"."""
    unknown_db = make_conninfo(dsn, dbname="lonnymq_no_such_database")
    cases: list[tuple[str, type[Exception], str]] = [
        ("not a dsn", InvalidArgumentError, "not a valid connection string"),
        (unknown_db, DatabaseUnavailableError, "lonnymq_no_such_database"),
    ]

    def stats(target: str) -> None:
        if queue_class is Queue:
            with Queue(target, schema="never_installed_here") as queue:
                queue.stats()
            return

        async def call() -> None:
            async with AsyncQueue(target, schema="never_installed_here") as queue:
                await queue.stats()

        asyncio.run(call())

    for target, error, words in cases:
        started = time.monotonic()
        with pytest.raises(error, match=words):
            stats(target)
        assert time.monotonic() - started < 10


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: a hung server, as libpq sees it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


ADDED = {
    "connect_timeout": "10",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "60000",
}


def test_client_timeouts_are_added_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    monkeypatch.delenv("PGSERVICE", raising=False)
    assert conninfo_to_dict(Queue("host=h dbname=d").dsn) == {"host": "h", "dbname": "d", **ADDED}
    # A service file may set its own: an added setting would override it.
    assert Queue("service=billing").dsn == "service=billing"
    assert conninfo_to_dict(Queue("postgresql://u@h:5/d").dsn) == {
        "user": "u",
        "host": "h",
        "port": "5",
        "dbname": "d",
        **ADDED,
    }
    # What the string sets is kept; any keepalive setting leaves all of them to it.
    assert conninfo_to_dict(
        Queue("host=h connect_timeout=3 keepalives=0 tcp_user_timeout=5").dsn
    ) == {"host": "h", "connect_timeout": "3", "keepalives": "0", "tcp_user_timeout": "5"}
    assert conninfo_to_dict(Queue("host=h keepalives_idle=7").dsn) == {
        "host": "h",
        "keepalives_idle": "7",
        "connect_timeout": "10",
        "tcp_user_timeout": "60000",
    }
    assert Queue("not a dsn").dsn == "not a dsn"  # refused at first use, with its cause
    monkeypatch.setenv("PGSERVICE", "billing")
    assert Queue("host=h dbname=d").dsn == "host=h dbname=d"
    monkeypatch.delenv("PGSERVICE")
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "4")
    without_connect = {k: v for k, v in ADDED.items() if k != "connect_timeout"}
    assert conninfo_to_dict(Queue("host=h dbname=d").dsn) == {
        "host": "h",
        "dbname": "d",
        **without_connect,
    }


@contextlib.contextmanager
def _tcp_relay(dsn: str) -> Iterator[str]:
    """A connection string reaching the server of ``dsn`` over TCP on 127.0.0.1, through a
    relay (the embedded server listens on a Unix socket only)."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "/tmp")
    port = int(params.get("port") or 5432)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()
    sockets: list[socket.socket] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client = listener.accept()[0]
            except TimeoutError:
                continue
            if host.startswith("/"):
                server = socket.socket(socket.AF_UNIX)
                server.connect(f"{host}/.s.PGSQL.{port}")
            else:
                server = socket.create_connection((host, port))
            sockets.extend((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    params.update(host="127.0.0.1", port=str(listener.getsockname()[1]))
    params.pop("hostaddr", None)
    try:
        yield make_conninfo("", **params)
    finally:
        stop.set()
        thread.join()
        for sock in sockets:
            sock.close()
        listener.close()


def test_the_pools_tcp_connections_carry_the_keepalives(
    dsn: str, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings reach the sockets: an idle connection whose server vanished is found
    dead in about a minute, not after the system's two hours."""
    monkeypatch.delenv("PGSERVICE", raising=False)
    bare = {k: v for k, v in conninfo_to_dict(dsn).items() if not k.startswith("keepalives")}
    bare.pop("tcp_user_timeout", None)
    with (
        _tcp_relay(make_conninfo("", **bare)) as relayed,
        Queue(relayed, schema=schema_name) as queue,
        queue.transaction() as conn,
        socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock,
    ):
        assert sock.family == socket.AF_INET
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000


@pytest.mark.parametrize("queue_class", [Queue, AsyncQueue])
def test_a_server_that_never_answers_fails_after_the_connect_timeout(
    queue_class: type[Queue] | type[AsyncQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a connect timeout libpq waits for ever: the call hung until killed. (The
    default is shortened to 2 s here, to spare the suite 10 s.)"""
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    monkeypatch.delenv("PGSERVICE", raising=False)
    monkeypatch.setattr(_core, "DEFAULT_CONNECT_TIMEOUT_S", 2)

    def stats(target: str) -> None:
        if queue_class is Queue:
            with Queue(target) as queue:
                queue.stats()
            return

        async def call() -> None:
            async with AsyncQueue(target) as queue:
                await queue.stats()

        asyncio.run(call())

    with _silent_server() as port:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailableError, match=r"no answer within connect_timeout"):
            stats(f"host=127.0.0.1 port={port} dbname=x user=x")
        assert time.monotonic() - started < 60


def test_spark_snapshot_gives_up_on_a_server_that_never_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """spark.snapshot() gets the connect timeout too (it connected with the bare string and
    waited for ever)."""
    from lonnymq import spark

    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    monkeypatch.delenv("PGSERVICE", raising=False)
    monkeypatch.setattr(_core, "DEFAULT_CONNECT_TIMEOUT_S", 2)  # the default, shortened
    outcome: list[BaseException] = []

    def take() -> None:
        try:
            with spark.snapshot(f"host=127.0.0.1 port={port} dbname=x user=x"):
                pass
        except BaseException as err:
            outcome.append(err)

    with _silent_server() as port:
        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        thread.join(timeout=20)
        assert not thread.is_alive(), "snapshot() still connecting after 20 s"
    assert outcome


def _held_rows(queue: Queue, admin: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL("SELECT id, content, is_locked, num_attempts, dequeue_at FROM {}.message").format(
            sql.Identifier(queue.schema)
        )
    ).fetchall()


FOREIGN_CALLS: dict[str, Callable[[Queue, Message], object]] = {
    "delete": lambda q, m: q.delete(m),
    "fail": lambda q, m: q.fail(m, error="x"),
    "defer": lambda q, m: q.defer(m),
    "heartbeat": lambda q, m: q.heartbeat(m, lock_ms=1_000),
    "dead_letter": lambda q, m: q.dead_letter(m, channel="dead", error="x"),
    "delete_many": lambda q, m: q.delete_many([m]),
    "defer_many": lambda q, m: q.defer_many([m]),
    "heartbeat_many": lambda q, m: q.heartbeat_many([m], lock_ms=1_000),
    "complete_and_dequeue": lambda q, m: q.complete_and_dequeue([m], lock_ms=1_000),
}


@pytest.mark.parametrize("call", list(FOREIGN_CALLS))
def test_a_message_of_another_queue_is_refused(
    make_queue: Callable[..., Queue],
    other_schema: str,
    admin: psycopg.Connection[Any],
    call: str,
) -> None:
    """Each queue numbers its messages from 1: a message taken from another schema's queue
    named this queue's message of the same id and attempt count, and finished it."""
    billing = make_queue(archive=True)
    emails = make_queue(schema=other_schema)
    billing.create(b"charge customer 42")
    emails.create(b"send welcome mail")
    charge = billing.dequeue(lock_ms=60_000)
    mail = emails.dequeue(lock_ms=60_000)
    assert charge is not None
    assert mail is not None
    assert (charge.id, charge.num_attempts) == (mail.id, mail.num_attempts)
    before = _held_rows(billing, admin), _held_rows(emails, admin)
    with pytest.raises(InvalidArgumentError, match=f"schema {other_schema!r}, not this one"):
        FOREIGN_CALLS[call](billing, mail)
    assert (_held_rows(billing, admin), _held_rows(emails, admin)) == before
    # A second Queue object on the same schema is the same queue.
    with Queue(billing.dsn, schema=billing.schema) as same:
        same.delete(charge)
    assert _held_rows(billing, admin) == []


def test_an_async_queue_refuses_a_message_of_another_queue(
    dsn: str, make_queue: Callable[..., Queue], other_schema: str, admin: psycopg.Connection[Any]
) -> None:
    billing = make_queue()
    emails = make_queue(schema=other_schema)
    billing.create(b"charge")
    emails.create(b"mail")

    async def run() -> None:
        async with AsyncQueue(dsn, schema=emails.schema) as aemails:
            mail = await aemails.dequeue(lock_ms=60_000)
            assert mail is not None
            async with AsyncQueue(dsn, schema=billing.schema) as abilling:
                with pytest.raises(InvalidArgumentError, match="finish it with the queue"):
                    await abilling.delete_many([mail])
                with pytest.raises(InvalidArgumentError, match="finish it with the queue"):
                    await abilling.delete(mail)

    asyncio.run(run())
    assert len(_held_rows(billing, admin)) == 1
