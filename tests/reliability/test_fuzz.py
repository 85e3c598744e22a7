"""Bad input, fuzzed: every public function and every SQL function of the schema, called with
wrong types, out-of-range numbers, huge payloads, odd channel names, NUL bytes, lone
surrogates, unicode and injection strings.

The only outcomes allowed are success or a typed refusal: a :class:`LonnyMQError` that is a
queue refusal (never a bare :class:`DatabaseError`, which would mean the server met input the
Python layer should have refused), never a ``TypeError``/``AttributeError``/psycopg error leaking
out. After a refusal every row of every table of the schema is as it was.

The SQL functions are found in ``pg_proc`` of the installed schema, so a new one is fuzzed
without editing this file. The SQL API (the functions the bindings call) refuses arguments
of the right type with the queue's own SQLSTATEs (``LQ...``) only; a value of the wrong type
is refused by its cast (a data exception); helpers may also meet a data or integrity error.
Never an internal error, a crashed backend or a change of state. See docs/robustness.md for
the table of what is tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import math
import re
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from lonnymq import AsyncMessage, AsyncQueue, Message, NewMessage, Queue
from lonnymq._core import statement_texts
from lonnymq.cli import main as cli_main
from lonnymq.errors import DatabaseError, InvalidArgumentError, LonnyMQError
from lonnymq.worker import AsyncWorker, Backoff, Worker

Conn = psycopg.Connection[Any]
HOUR_MS = 3_600_000

# -- hostile values ----------------------------------------------------------------------

INJECTIONS = [
    "'; DROP TABLE message; --",
    '"); DELETE FROM channel; --',
    "x' OR '1'='1",
    "a\"b'c",
    "$1",
    "%s",
    "%(channel)s",
    "{schema}",
    "\\",
    "\\x00",
    "lonnymq.schedules",
    "public.message",
]
ODD_TEXT = [
    "",
    " ",
    "a" * 255,
    "a" * 256,
    "a" * 100_000,
    "\x00",
    "a\x00b",
    "\ud800",
    "x\udcff",
    "é",
    "\U0001f600" * 255,
    "\U0001f600" * 256,
    "\u202e\ufeff",
    "\n\t\r",
    *INJECTIONS,
]
ODD_INTS = [
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    10**15,
    10**15 + 1,
    -(10**15) - 1,
    10**30,
]
WRONG_TYPES: list[object] = [
    None,
    True,
    False,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    Decimal("1"),
    "1",
    b"1",
    bytearray(b"x"),
    [1],
    {"a": 1},
    (1,),
    object(),
]

_surrogates = st.characters(categories=["Cs"])
hostile_text = st.one_of(
    st.sampled_from(ODD_TEXT),
    st.text(max_size=20),
    st.lists(st.one_of(st.characters(), _surrogates), max_size=8).map("".join),
)
hostile_ints = st.one_of(st.sampled_from(ODD_INTS), st.integers())
wrong_types = st.sampled_from(WRONG_TYPES)
anything = st.one_of(hostile_ints, wrong_types, hostile_text, st.binary(max_size=8))

FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def maybe(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any] = anything) -> Any:
    """Sometimes a valid value (so that successes happen too), mostly a hostile one."""
    return st.one_of(valid, hostile, hostile)


# -- the world every call is made against ------------------------------------------------


def snapshot_query(admin: Conn, schema: str) -> sql.Composed:
    """One query returning every row of every table of ``schema`` as text."""
    tables = [
        row[0]
        for row in admin.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY 1",
            [schema],
        ).fetchall()
    ]
    assert tables, f"no tables in {schema}"
    query = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {name}::text, t::text FROM {s}.{t} t").format(
            name=sql.Literal(table), s=sql.Identifier(schema), t=sql.Identifier(table)
        )
        for table in tables
    )
    return query


@dataclasses.dataclass
class World:
    """A queue with waiting, held and archived messages, a policy and a schedule."""

    queue: Queue
    admin: Conn
    held: Message
    waiting_id: int
    archived_id: int
    _query: sql.Composed | None = None

    def snapshot(self) -> list[tuple[str, str]]:
        """Every row of every table of the schema, as text, sorted."""
        if self._query is None:
            self._query = snapshot_query(self.admin, self.queue.schema)
        return sorted(self.admin.execute(self._query).fetchall())

    def verify_clean(self) -> bool:
        return self.queue.verify() == []

    def attempt(self, call: Callable[[], object]) -> object:
        """Run ``call``: success, or a queue refusal that left every table alone."""
        before = self.snapshot()
        try:
            result = call()
        except LonnyMQError as caught:
            err = caught
        else:
            return result
        check_refusal(err)
        assert self.snapshot() == before, f"state changed by a refusal: {err!r}"
        return err


def check_refusal(err: LonnyMQError) -> None:
    """A refusal names the problem, and is not a server error the binding let through."""
    assert str(err), f"{type(err).__name__} without a message"
    assert type(err) is not DatabaseError, f"untranslated server error: {err!r} ({err.sqlstate})"


@pytest.fixture
def world(queue: Queue, admin: Conn) -> World:
    """A world of its own, for the fuzz tests (their successes change it)."""
    return _build_world(queue, admin)


@pytest.fixture(scope="module")
def shared_world(dsn: str) -> Iterator[World]:
    """One world for the tests that only make refusals (which must change nothing)."""
    schema = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(dsn, autocommit=True) as admin, Queue(dsn, schema=schema) as queue:
        try:
            yield _build_world(queue, admin)
        finally:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


def _build_world(queue: Queue, admin: Conn) -> World:
    queue.install(archive=True)
    queue.channel("p").set_policy(max_concurrency=5, release_interval_ms=0, max_size=100)
    first = queue.create(b"a1", channel="a", dequeue_at=1)
    done = queue.create(b"d1", channel="d", dequeue_at=2)
    waiting = queue.create(b"p1", channel="p", dequeue_at=10**14, dedup_key="k")
    queue.schedule("nightly", cron="0 3 * * *", content=b"s")
    held = queue.dequeue(lock_ms=HOUR_MS)
    assert held is not None
    assert held.id == first.id
    finished = queue.dequeue(lock_ms=HOUR_MS)
    assert finished is not None
    assert finished.id == done.id
    finished.fail(error="boom")
    archived = queue.archived(outcome="failed")
    assert [a.id for a in archived] == [done.id]
    assert waiting.id is not None
    return World(queue, admin, held, waiting.id, archived[0].id)


def _message(world: World, message_id: Any, attempts: Any) -> Any:
    return dataclasses.replace(world.held, id=message_id, num_attempts=attempts)


# -- Queue, Channel, Message -------------------------------------------------------------

channels = maybe(st.sampled_from([None, "a", "new", "p"]), st.one_of(hostile_text, anything))
payloads = maybe(st.binary(max_size=64), anything)
times = maybe(st.sampled_from([None, 0, 1, 10**12]), hostile_ints)
lock_ms = maybe(st.sampled_from([1, 1000, HOUR_MS]), hostile_ints)
limits = maybe(st.sampled_from([1, 5, 10_000]), hostile_ints)


@FUZZ
@given(content=payloads, channel=channels, dequeue_at=times, dedup_key=channels, prio=times)
def test_fuzz_create(
    world: World, *, content: Any, channel: Any, dequeue_at: Any, dedup_key: Any, prio: Any
) -> None:
    world.attempt(
        lambda: world.queue.create(
            content, channel=channel, dequeue_at=dequeue_at, dedup_key=dedup_key, priority=prio
        )
    )
    world.attempt(lambda: world.queue.channel(channel).create(content, dedup_key=dedup_key))


new_messages = st.builds(
    NewMessage, content=payloads, channel=channels, dequeue_at=times, dedup_key=channels
)


@FUZZ
@given(items=st.one_of(st.lists(st.one_of(new_messages, anything), max_size=4), anything))
def test_fuzz_create_many(world: World, *, items: Any) -> None:
    world.attempt(lambda: world.queue.create_many(items))


@FUZZ
@given(limit=limits, lock=lock_ms, done=st.lists(anything, max_size=3))
def test_fuzz_dequeue(world: World, *, limit: Any, lock: Any, done: Any) -> None:
    world.attempt(lambda: world.queue.dequeue(lock_ms=lock))
    world.attempt(lambda: world.queue.dequeue_many(limit, lock_ms=lock))
    world.attempt(lambda: world.queue.dequeue_batch(limit, lock_ms=lock))
    world.attempt(lambda: world.queue.complete_and_dequeue(done, limit, lock_ms=lock))


ids = maybe(st.sampled_from([1, 2, 3]), hostile_ints)


@settings(FUZZ, max_examples=8)
@given(
    message_id=ids,
    attempts=maybe(st.just(1), hostile_ints),
    lock=lock_ms,
    dequeue_at=times,
    state=maybe(st.none() | st.binary(max_size=8)),
    error=maybe(st.text(max_size=8), st.one_of(hostile_text, anything)),
    channel=channels,
    not_a_message=anything,
)
def test_fuzz_message_operations(
    world: World,
    *,
    message_id: Any,
    attempts: Any,
    lock: Any,
    dequeue_at: Any,
    state: Any,
    error: Any,
    channel: Any,
    not_a_message: Any,
) -> None:
    queue = world.queue
    calls: list[Callable[[Any], object]] = [
        lambda m: queue.heartbeat(m, lock_ms=lock),
        lambda m: queue.defer(m, dequeue_at=dequeue_at, state=state),
        lambda m: queue.fail(m, error=error),
        lambda m: queue.dead_letter(m, channel=channel, error=error),
        queue.delete,
        lambda m: queue.delete_many([m]),
        lambda m: queue.defer_many([m], dequeue_at=dequeue_at),
        queue.message_status,
        queue.fire_schedule,
    ]
    for message in (_message(world, message_id, attempts), not_a_message):
        for call in calls:
            world.attempt(functools.partial(call, message))
    held = _message(world, message_id, attempts)
    world.attempt(lambda: held.heartbeat(lock_ms=lock))
    world.attempt(lambda: held.defer(dequeue_at=dequeue_at, state=state))
    world.attempt(lambda: held.fail(error=error))
    world.attempt(held.delete)
    world.attempt(lambda: queue.delete_many(not_a_message))
    world.attempt(lambda: queue.defer_many(not_a_message))
    world.attempt(lambda: queue.message_status(message_id))


@FUZZ
@given(
    channel=channels,
    concurrency=maybe(st.none() | st.integers(0, 10), hostile_ints | wrong_types),
    interval=maybe(st.none() | st.integers(0, 1000), hostile_ints | wrong_types),
    size=maybe(st.none() | st.integers(0, 1000), hostile_ints | wrong_types),
)
def test_fuzz_channel(
    world: World, *, channel: Any, concurrency: Any, interval: Any, size: Any
) -> None:
    def policy() -> None:
        handle = world.queue.channel(channel)
        handle.set_policy(max_concurrency=concurrency, release_interval_ms=interval, max_size=size)
        handle.stats()
        handle.clear_policy()

    world.attempt(policy)


# Five fields drawn from what cron syntax is made of, plus digits that are not ASCII.
_cron_field = st.text(alphabet="0123456789*/-,²٣ajnsu", min_size=1, max_size=6)
cron_like = st.lists(_cron_field, min_size=4, max_size=6).map(" ".join)


@FUZZ
@given(
    name=maybe(st.sampled_from(["nightly", "hourly"]), st.one_of(hostile_text, anything)),
    cron=maybe(
        st.sampled_from(["*/5 * * * *", "0 3 * * *"]),
        st.one_of(
            hostile_text,
            anything,
            st.sampled_from(
                ["* * * * * *", "61 * * * *", "*/0 * * * *", "0 0 31 2 *", "-1 * * * *"]
            ),
            cron_like,
        ),
    ),
    content=payloads,
    channel=channels,
)
def test_fuzz_schedules(world: World, *, name: Any, cron: Any, content: Any, channel: Any) -> None:
    world.attempt(lambda: world.queue.schedule(name, cron=cron, content=content, channel=channel))
    world.attempt(lambda: world.queue.unschedule(name))
    world.attempt(world.queue.schedules)


@FUZZ
@given(
    outcome=maybe(
        st.sampled_from([None, "failed", "completed"]), st.one_of(hostile_text, anything)
    ),
    channel=channels,
    before_id=maybe(st.none() | st.integers(1, 10), hostile_ints),
    limit=limits,
    archive_ids=st.one_of(st.lists(maybe(st.integers(1, 5), hostile_ints), max_size=3), anything),
)
def test_fuzz_archive_and_replay(
    world: World, *, outcome: Any, channel: Any, before_id: Any, limit: Any, archive_ids: Any
) -> None:
    queue = world.queue
    world.attempt(
        lambda: queue.archived(outcome=outcome, channel=channel, before_id=before_id, limit=limit)
    )
    world.attempt(lambda: queue.replay(archive_ids))


@settings(FUZZ, max_examples=8)
@given(
    offset=maybe(st.sampled_from([0, 1000]), hostile_ints),
    archive=maybe(st.none() | st.booleans()),
    event_channel=maybe(st.none() | st.just("lonnymq_ev"), st.one_of(hostile_text, anything)),
    pool_size=maybe(st.integers(1, 3), hostile_ints | wrong_types),
    schema=st.one_of(hostile_text, anything),
    timeout=st.one_of(hostile_ints, wrong_types),
    dsn_value=st.one_of(wrong_types.filter(lambda v: v is not None), st.binary(max_size=4)),
    conn=st.one_of(wrong_types.filter(lambda v: v is not None), hostile_text),
)
def test_fuzz_queue_and_settings(
    world: World,
    *,
    offset: Any,
    archive: Any,
    event_channel: Any,
    pool_size: Any,
    schema: Any,
    timeout: Any,
    dsn_value: Any,
    conn: Any,
) -> None:
    queue = world.queue
    world.attempt(lambda: queue.set_clock_offset(offset))
    world.attempt(lambda: queue.set_clock_offset(0))
    world.attempt(lambda: queue.install(archive=archive))
    world.attempt(queue.settings)
    world.attempt(queue.stats)
    world.attempt(queue.verify)

    def other_queue(schema: Any) -> None:
        # A hostile schema is refused before anything is sent; a valid one is never used.
        with Queue(queue.dsn, schema=schema, event_channel=event_channel, pool_size=pool_size):
            pass

    world.attempt(lambda: other_queue(schema))
    world.attempt(lambda: Queue(dsn_value, schema=queue.schema))  # never connects
    world.attempt(lambda: queue.create(b"x", conn=conn))
    world.attempt(lambda: queue.install(conn=conn))
    world.attempt(lambda: other_queue(queue.schema))
    # A finished message: an accepted timeout returns at once.
    world.attempt(lambda: queue.wait(world.held.id + 1, timeout=timeout))


def _handler(message: Message | AsyncMessage) -> None:
    return None


worker_options = st.fixed_dictionaries(
    {},
    optional={
        "concurrency": maybe(st.integers(1, 8), hostile_ints | wrong_types),
        "lock_ms": maybe(st.integers(100, 60_000), hostile_ints | wrong_types),
        "heartbeat_ms": maybe(st.none() | st.integers(1, 99), hostile_ints | wrong_types),
        "max_attempts": maybe(st.integers(1, 9), hostile_ints | wrong_types),
        "dead_letter_channel": channels,
        "grace_s": maybe(st.floats(0, 60), hostile_ints | wrong_types),
        "idle_ms": maybe(st.integers(1, 9999), hostile_ints | wrong_types),
        "backoff": maybe(st.none() | st.just(Backoff()), wrong_types),
    },
)
backoff_options = st.fixed_dictionaries(
    {},
    optional={
        "base_ms": maybe(st.integers(0, 1000), hostile_ints | wrong_types),
        "max_ms": maybe(st.integers(1000, 10_000), hostile_ints | wrong_types),
        "factor": maybe(st.floats(1, 4), hostile_ints | wrong_types),
        "jitter": maybe(st.booleans(), wrong_types),
    },
)


@FUZZ
@given(
    options=worker_options,
    backoff=backoff_options,
    handler=maybe(st.just(_handler)),
    queue_arg=maybe(st.just("world"), wrong_types),
)
def test_fuzz_worker_arguments(
    world: World, *, options: dict[str, Any], backoff: dict[str, Any], handler: Any, queue_arg: Any
) -> None:
    target = world.queue if queue_arg == "world" else queue_arg

    def build() -> None:
        made = Backoff(**backoff)
        made.delay_ms(3)
        Worker(target, handler, **options)

    world.attempt(build)


@settings(FUZZ, max_examples=10)
@given(options=worker_options)
def test_fuzz_async_worker_arguments(
    dsn: str, schema_name: str, *, options: dict[str, Any]
) -> None:
    async def build() -> None:
        async with AsyncQueue(dsn, schema=schema_name) as queue:
            try:
                AsyncWorker(queue, _handler, **options)
            except LonnyMQError as err:
                check_refusal(err)

    asyncio.run(build())


@settings(FUZZ, max_examples=8)
@given(
    channel=channels,
    content=payloads,
    limit=limits,
    lock=lock_ms,
    message_id=ids,
    attempts=maybe(st.just(1), hostile_ints),
    timeout=st.one_of(hostile_ints, wrong_types),
)
def test_fuzz_async_queue(
    world: World,
    *,
    channel: Any,
    content: Any,
    limit: Any,
    lock: Any,
    message_id: Any,
    attempts: Any,
    timeout: Any,
) -> None:
    queue = world.queue

    async def run(call: Callable[[AsyncQueue], Any]) -> object:
        async with AsyncQueue(queue.dsn, schema=queue.schema, pool_size=1) as aq:
            return await call(aq)

    def attempt(call: Callable[[AsyncQueue], Any]) -> None:
        world.attempt(lambda: asyncio.run(run(call)))

    attempt(lambda aq: aq.create(content, channel=channel))
    attempt(lambda aq: aq.dequeue_many(limit, lock_ms=lock))
    attempt(lambda aq: aq.channel(channel).set_policy(max_size=limit))
    attempt(lambda aq: aq.archived(channel=channel, limit=limit))

    def held(aq: AsyncQueue) -> AsyncMessage:
        fields = dataclasses.asdict(dataclasses.replace(world.held, queue=None))  # type: ignore[arg-type]
        fields.update(id=message_id, num_attempts=attempts, queue=aq)
        return AsyncMessage(**fields)

    attempt(lambda aq: aq.heartbeat(held(aq), lock_ms=lock))
    attempt(lambda aq: held(aq).defer(dequeue_at=limit))
    attempt(lambda aq: aq.delete_many([held(aq)]))
    attempt(lambda aq: aq.wait(world.held.id + 1, timeout=timeout))


# -- payload size --------------------------------------------------------------------------


def test_payload_over_the_limit_is_refused_everywhere(world: World) -> None:
    huge = b"x" * (70 * 1024 * 1024)
    queue = world.queue
    for call in (
        lambda: queue.create(huge),
        lambda: queue.create_many([NewMessage(b"ok"), NewMessage(huge)]),
        lambda: queue.defer(world.held, state=huge),
        lambda: queue.schedule("big", cron="* * * * *", content=huge),
    ):
        err = world.attempt(call)
        assert isinstance(err, InvalidArgumentError), err


# -- the command line --------------------------------------------------------------------

cli_text = st.one_of(
    st.sampled_from([s for s in ODD_TEXT if "\x00" not in s and len(s) < 1000]),
    st.text(max_size=10).filter(lambda s: "\x00" not in s),
    st.sampled_from(["1", "0", "-1", str(2**63), str(-(2**63) - 1), "1e3", "nan", "0x10"]),
)


def _cli_argvs(schema: str) -> st.SearchStrategy[list[str]]:
    def opt(name: str) -> st.SearchStrategy[list[str]]:
        return st.one_of(st.just([]), cli_text.map(lambda v: [f"--{name}={v}"]))

    def join(*parts: st.SearchStrategy[list[str]]) -> st.SearchStrategy[list[str]]:
        return st.tuples(*parts).map(lambda ps: [a for p in ps for a in p])

    fixed = st.just
    commands = st.one_of(
        join(
            fixed(["create"]),
            st.lists(cli_text, min_size=1, max_size=2),
            opt("channel"),
            opt("dequeue-at"),
            opt("delay-ms"),
            opt("dedup-key"),
        ),
        join(
            fixed(["policy", "set"]),
            cli_text.map(lambda c: [c]),
            opt("max-concurrency"),
            opt("release-interval-ms"),
            opt("max-size"),
        ),
        join(fixed(["policy", "clear"]), cli_text.map(lambda c: [c])),
        join(fixed(["policy", "show"]), st.lists(cli_text, max_size=1)),
        join(
            fixed(["schedule", "add"]),
            cli_text.map(lambda c: [c]),
            cli_text.map(lambda c: [f"--cron={c}"]),
            opt("channel"),
            opt("content"),
        ),
        join(fixed(["schedule", "remove"]), cli_text.map(lambda c: [c])),
        join(fixed(["archive", "list"]), opt("outcome"), opt("channel"), opt("limit")),
        join(fixed(["archive", "replay"]), st.lists(cli_text, max_size=2)),
        join(fixed(["top", "--iterations=1", "--json"]), opt("interval")),
    )
    schemas = st.one_of(st.just(schema), st.just(schema), cli_text)
    return st.tuples(schemas, commands).map(lambda sc: ["--schema", sc[0], *sc[1]])


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_fuzz_cli(world: World, data: st.DataObject) -> None:
    argv = data.draw(_cli_argvs(world.queue.schema))
    before = world.snapshot()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(["--dsn", world.queue.dsn, *argv])
        except SystemExit as exit_:  # argparse: a value of the wrong form
            code = exit_.code if isinstance(exit_.code, int) else 2
            assert code == 2, err.getvalue()
    assert code in (0, 1, 2), (argv, code, err.getvalue())
    assert "Traceback" not in err.getvalue()
    if code != 0:
        assert err.getvalue().strip(), argv
        assert "DatabaseError" not in err.getvalue(), err.getvalue()
        assert world.snapshot() == before, argv


# -- the SQL functions, called directly ---------------------------------------------------

# Types the generator knows; an argument of another type (a row type) is passed as NULL.
_SQL_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bigint": st.one_of(
        st.none(),
        st.sampled_from([-(2**63), -(10**15) - 1, -1, 0, 1, 2, 3, 10**15 + 1, 2**63 - 1]),
        st.integers(-(2**63), 2**63 - 1),
    ),
    "integer": st.one_of(
        st.none(),
        st.sampled_from([-(2**31), -1, 0, 1, 2, 10_001, 2**31 - 1]),
        st.integers(-(2**31), 2**31 - 1),
    ),
    "text": st.one_of(
        st.none(),
        st.sampled_from(
            [s for s in ODD_TEXT if "\x00" not in s and "\ud800" not in s and "\udcff" not in s]
            + ["completed", "failed", "message", "archive"]
        ),
        st.text(
            st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12
        ),
    ),
    "bytea": st.one_of(st.none(), st.binary(max_size=16), st.just(b"\x00" * 3)),
    "boolean": st.one_of(st.none(), st.booleans()),
}
_WRONG_SQL_TEXT = ["abc", "1.5", "99999999999999999999999", "", "{1,2", "NaN", "t", "-", "1e400"]


def _sql_value(type_name: str) -> st.SearchStrategy[Any]:
    if type_name.endswith("[]"):
        element = _SQL_VALUES.get(type_name[:-2])
        if element is None:
            return st.none()
        return st.one_of(st.none(), st.lists(element, max_size=4))
    return _SQL_VALUES.get(type_name, st.none())


@dataclasses.dataclass(frozen=True)
class SqlFunction:
    name: str
    arg_types: tuple[str, ...]

    def call(self, schema: str, wrong: set[int]) -> sql.Composed:
        args = [
            sql.SQL("%s::{}").format(sql.SQL(t))
            if t in _SQL_VALUES or t[:-2] in _SQL_VALUES
            else sql.SQL("NULL::{s}.{t}{array}").format(
                s=sql.Identifier(schema),
                t=sql.Identifier(t.split(".")[-1].removesuffix("[]")),
                array=sql.SQL("[]" if t.endswith("[]") else ""),
            )
            for i, t in enumerate(self.arg_types)
        ]
        return sql.SQL("SELECT * FROM {s}.{f}({args})").format(
            s=sql.Identifier(schema), f=sql.Identifier(self.name), args=sql.SQL(", ").join(args)
        )


# Owner-only maintenance routines that run DDL on purpose (GRANT, REVOKE, ALTER FUNCTION) with
# the names they are given; only the owner may call them, and role_grant/role_revoke (fuzzed)
# check a role before handing it over. tests/security covers them.
MAINTENANCE = {"secure_functions", "role_strip", "role_apply"}


def sql_functions(admin: Conn, schema: str) -> list[SqlFunction]:
    """Every function of the schema that can be called directly (not the trigger ones, nor
    the maintenance routines)."""
    rows = admin.execute(
        "SELECT p.proname, array(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t)"
        " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.prorettype <> 'trigger'::regtype AND p.prokind = 'f'"
        " ORDER BY p.proname, p.oid",
        [schema],
    ).fetchall()
    return [
        SqlFunction(name, tuple(t.removeprefix(schema + ".") for t in types))
        for name, types in rows
        if name not in MAINTENANCE
    ]


def entry_points() -> set[str]:
    """The functions the bindings call (the named statements of the Python and Spark
    layers): the schema's SQL API. The others are helpers those call."""
    names: set[str] = set()
    for package, path in (("lonnymq", "sql/statements.sql"), ("lonnymq.spark", "statements.sql")):
        for text in statement_texts(package, path).values():
            names.update(re.findall(r"\{schema\}\.(\w+)\(", text))
    return names


def allowed_sqlstate(sqlstate: str | None, *, entry_point: bool, wrong_type: bool) -> bool:
    """An entry point called with arguments of the right type refuses only with the queue's
    own SQLSTATEs. A value of the wrong type is refused by its cast (a data exception, class
    22). A helper, which trusts its callers' checks, may also meet a data or integrity error
    (classes 22, 23); never an internal error (XX000) or anything else."""
    if sqlstate is None:
        return False
    if sqlstate.startswith("LQ"):
        return True
    if wrong_type or not entry_point:
        return sqlstate[:2] == "22" or (not entry_point and sqlstate[:2] == "23")
    return False


@pytest.fixture
def sql_world(world: World) -> tuple[World, list[SqlFunction]]:
    functions = sql_functions(world.admin, world.queue.schema)
    assert len(functions) > 20
    return world, functions


@settings(FUZZ, max_examples=5)
@given(data=st.data())
def test_fuzz_sql_functions(
    sql_world: tuple[World, list[SqlFunction]], data: st.DataObject
) -> None:
    world, functions = sql_world
    schema = world.queue.schema
    world.admin.execute("SET statement_timeout = '20s'")  # a hang is a failure, not a stall
    pid = world.admin.info.backend_pid
    api = entry_points()
    for function in functions:
        wrong: set[int] = set()
        if len(function.arg_types) > 0 and data.draw(st.booleans(), label="wrong type"):
            wrong = {data.draw(st.integers(0, len(function.arg_types) - 1), label="which")}
        params = [
            data.draw(st.sampled_from(_WRONG_SQL_TEXT)) if i in wrong else data.draw(_sql_value(t))
            for i, t in enumerate(function.arg_types)
            if t in _SQL_VALUES or t[:-2] in _SQL_VALUES
        ]
        before = world.snapshot()
        err: psycopg.Error | None = None
        try:
            world.admin.execute(function.call(schema, wrong), params).fetchall()
        except psycopg.Error as caught:
            err = caught
        if err is not None:
            assert allowed_sqlstate(
                err.sqlstate, entry_point=function.name in api, wrong_type=bool(wrong)
            ), f"{function.name}{tuple(params)!r}: {err.sqlstate} {err.diag.message_primary}"
            assert world.snapshot() == before, f"{function.name}{tuple(params)!r} changed state"
        assert world.admin.info.backend_pid == pid
        assert world.admin.execute("SELECT 1").fetchone() == (1,)


def test_sql_function_list_is_complete(sql_world: tuple[World, list[SqlFunction]]) -> None:
    """The fuzz above reaches the functions the Python layer calls (so the query finds them)."""
    _, functions = sql_world
    names = {f.name for f in functions}
    api = entry_points()
    assert {
        "message_create",
        "message_dequeue_many",
        "message_delete",
        "schedule_set",
        "archive_replay",
        "channel_policy_set",
        "spark_batch_plan",
    } <= api
    assert api <= names


def test_hostile_schema_names_install_nothing(dsn: str, admin: Conn) -> None:
    before = admin.execute("SELECT count(*) FROM pg_namespace").fetchone()
    for schema in [*INJECTIONS, *ODD_TEXT[:12], *WRONG_TYPES]:
        with pytest.raises(InvalidArgumentError):
            Queue(dsn, schema=schema).install()  # type: ignore[arg-type]
    assert admin.execute("SELECT count(*) FROM pg_namespace").fetchone() == before


# -- every odd text in every text argument (no sampling: each one, each time) ---------------


def test_every_odd_text_in_every_text_argument(world: World) -> None:
    queue = world.queue
    held = world.held
    for text in ODD_TEXT:
        for call in (
            lambda t=text: queue.create(b"x", channel=t),
            lambda t=text: queue.create(b"x", channel="a", dedup_key=t),
            lambda t=text: queue.create_many([NewMessage(b"x", channel=t, dedup_key=t)]),
            lambda t=text: queue.channel(t).set_policy(max_size=5),
            lambda t=text: queue.channel(t).clear_policy(),
            lambda t=text: queue.schedule(t, cron="0 3 * * *", content=b"s"),
            lambda t=text: queue.schedule("n", cron=t, content=b"s"),
            lambda t=text: queue.schedule("n", cron="0 3 * * *", content=b"s", channel=t),
            lambda t=text: queue.unschedule(t),
            lambda t=text: queue.archived(outcome=t),
            lambda t=text: queue.archived(channel=t),
            lambda t=text: queue.dead_letter(_message(world, held.id, 99), channel=t, error=t),
            lambda t=text: queue.fail(_message(world, held.id, 99), error=t),
        ):
            world.attempt(call)


# -- regressions: each a bug the fuzzing found ---------------------------------------------


@pytest.mark.parametrize("not_a_message", [None, 5, "1", b"x", {"id": 1}])
def test_a_value_that_is_not_a_message_is_refused(shared_world: World, not_a_message: Any) -> None:
    world = shared_world
    queue = world.queue
    for call in (
        lambda: queue.heartbeat(not_a_message, lock_ms=1000),
        lambda: queue.delete(not_a_message),
        lambda: queue.fail(not_a_message, error="e"),
        lambda: queue.defer(not_a_message),
        lambda: queue.dead_letter(not_a_message, channel="dl", error="e"),
        lambda: queue.fire_schedule(not_a_message),
    ):
        before = world.snapshot()
        with pytest.raises(InvalidArgumentError, match="message"):
            call()
        assert world.snapshot() == before


def test_schedule_name_that_is_not_unicode_text_is_refused(shared_world: World) -> None:
    world = shared_world
    before = world.snapshot()
    for name in ("\ud800", "x\udcff"):
        with pytest.raises(InvalidArgumentError, match="schedule name"):
            world.queue.schedule(name, cron="* * * * *", content=b"x")
        with pytest.raises(InvalidArgumentError, match="schedule name"):
            world.queue.unschedule(name)
    assert world.snapshot() == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_ms": None},
        {"base_ms": "1"},
        {"max_ms": 1.5},
        {"max_ms": 2**70},
        {"factor": math.nan},
        {"factor": math.inf},
        {"factor": "2"},
        {"jitter": None},
    ],
)
def test_backoff_with_a_bad_value_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="Backoff"):
        Backoff(**kwargs)


def test_backoff_with_a_huge_factor_caps_instead_of_overflowing() -> None:
    backoff = Backoff(base_ms=1000, max_ms=60_000, factor=1e300, jitter=False)
    assert [backoff.delay_ms(n) for n in (1, 2, 3, 70)] == [1000, 60_000, 60_000, 60_000]


@pytest.mark.parametrize(
    ("queue_arg", "options", "match"),
    [
        (None, {}, "queue"),
        ("postgresql://", {}, "queue"),
        ("world", {"grace_s": math.nan}, "grace_s"),
        ("world", {"grace_s": math.inf}, "grace_s"),
        ("world", {"dead_letter_channel": ""}, "channel"),
    ],
)
def test_worker_with_a_bad_argument_is_refused(
    shared_world: World, queue_arg: Any, options: dict[str, Any], match: str
) -> None:
    world = shared_world
    target = world.queue if queue_arg == "world" else queue_arg
    with pytest.raises(InvalidArgumentError, match=match):
        Worker(target, _handler, **options)


def test_async_worker_wants_an_async_queue(shared_world: World) -> None:
    world = shared_world
    with pytest.raises(InvalidArgumentError, match="AsyncQueue"):
        AsyncWorker(world.queue, _handler)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1, "1", True])
def test_wait_with_a_timeout_that_is_not_a_finite_number_is_refused(
    shared_world: World, timeout: Any
) -> None:
    world = shared_world
    # Before the check, nan made the wait on a waiting message never return.
    with pytest.raises(InvalidArgumentError, match="timeout"):
        world.queue.wait(world.waiting_id, timeout=timeout)


def test_cli_content_that_is_not_utf8_is_refused(shared_world: World) -> None:
    world = shared_world
    # "\udcff" is how Python hands over a command-line byte that is not UTF-8.
    before = world.snapshot()
    for argv in (
        ["create", "--channel=c", "ok\udcff"],
        ["schedule", "add", "n", "--cron=* * * * *", "--content=\udcff"],
    ):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli_main(["--dsn", world.queue.dsn, "--schema", world.queue.schema, *argv])
        assert code == 1
        assert "InvalidArgumentError" in err.getvalue()
        assert "UTF-8" in err.getvalue()
    assert world.snapshot() == before


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ("{s}.spark_batch_plan('c', 9223372036854775807, 10, 1000)", "start"),
        ("{s}.spark_sink_prune('s', -9223372036854775808, 5)", None),
        ("{s}.spark_sink_prune('s', 10, -1)", "keep"),
        ("{s}.arg_check(false, 'm', 'no_such_condition')", "m"),
        ("{s}.arg_check(false, NULL, NULL)", "invalid argument"),
    ],
)
def test_sql_functions_refuse_with_queue_sqlstates(
    shared_world: World, call: str, match: str | None
) -> None:
    world = shared_world
    before = world.snapshot()
    query = sql.SQL("SELECT * FROM " + call).format(s=sql.Identifier(world.queue.schema))
    if match is None:  # nothing to prune, and no error
        world.admin.execute(query).fetchall()
    else:
        with pytest.raises(psycopg.Error) as caught:
            world.admin.execute(query).fetchall()
        assert caught.value.sqlstate == "LQ003"
        assert match in (caught.value.diag.message_primary or "")
    assert world.snapshot() == before


@pytest.mark.parametrize("outcome", ["\x00", "fail\x00ed", "\ud800"])
def test_archive_outcome_that_is_not_text_is_refused(shared_world: World, outcome: str) -> None:
    world = shared_world
    # NUL used to reach the driver and come back as a bare DatabaseError.
    with pytest.raises(InvalidArgumentError, match="outcome"):
        world.queue.archived(outcome=outcome)


def test_injection_strings_are_stored_as_plain_text(world: World) -> None:
    queue = world.queue
    for text in INJECTIONS:
        if text == "lonnymq.schedules":
            continue  # the schedules' reserved channel holds their drivers
        created = queue.create(text.encode(), channel=text, dedup_key=text)
        assert queue.create(b"again", channel=text, dedup_key=text).id == created.id
        assert queue.schedule(text, cron="0 3 * * *", content=b"s", channel=text)
    names = {s.channel for s in queue.stats()}
    assert set(INJECTIONS) <= names
    assert set(INJECTIONS) - {"lonnymq.schedules"} <= {s.name for s in queue.schedules()}
    assert world.verify_clean()


def test_conn_that_is_not_a_connection_is_refused(shared_world: World) -> None:
    # It used to fail inside the call with AttributeError ('str' object has no attribute ...).
    world = shared_world
    queue = world.queue
    before = world.snapshot()
    for conn in ["x", 5, [], object(), world.admin.cursor()]:
        for call in (
            lambda c=conn: queue.create(b"x", conn=c),
            lambda c=conn: queue.install(conn=c),
            lambda c=conn: queue.verify(conn=c),
            lambda c=conn: queue.dequeue(lock_ms=1000, conn=c),
            lambda c=conn: queue.channel("a").set_policy(max_size=1, conn=c),
            lambda c=conn: queue.heartbeat(world.held, lock_ms=1000, conn=c),
            lambda c=conn: queue.dead_letter(world.held, channel="dl", error="e", conn=c),
        ):
            with pytest.raises(InvalidArgumentError, match="conn must be"):
                call()
    assert world.snapshot() == before


def test_async_queue_refuses_a_sync_connection(shared_world: World) -> None:
    async def main() -> None:
        async with AsyncQueue(shared_world.queue.dsn, schema=shared_world.queue.schema) as aq:
            with pytest.raises(InvalidArgumentError, match="AsyncConnection"):
                await aq.create(b"x", conn=shared_world.admin)  # type: ignore[arg-type]

    before = shared_world.snapshot()
    asyncio.run(main())
    assert shared_world.snapshot() == before


@pytest.mark.parametrize("dsn_value", [5, b"host=localhost", "\x00", "host=x\x00y", ["a"]])
def test_dsn_that_is_not_a_connection_string_is_refused(dsn_value: Any) -> None:
    # A non-str dsn used to be found out only after a 30 s pool timeout; a NUL cut the string.
    for queue_class in (Queue, AsyncQueue):
        with pytest.raises(InvalidArgumentError, match="dsn"):
            queue_class(dsn_value, schema="never_used")


@pytest.mark.parametrize("data_dir", [5, b"/tmp/x", "a\x00b", ["a"]])
def test_embedded_data_dir_that_is_not_a_path_is_refused(data_dir: Any) -> None:
    # It used to fail with TypeError or ValueError from pathlib.
    for queue_class in (Queue, AsyncQueue):
        with pytest.raises(InvalidArgumentError, match="data_dir"):
            queue_class.embedded(data_dir)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lock_ms": 10**20}, "lock_ms"),
        ({"lock_ms": 7 * 24 * 3600 * 1000 + 1}, "lock_ms"),
        ({"idle_ms": 2**63}, "idle_ms"),
        ({"concurrency": 10_001}, "concurrency"),
        ({"max_attempts": 2**31}, "max_attempts"),
        ({"grace_s": 1e300}, "grace_s"),
    ],
)
def test_worker_option_beyond_its_bound_is_refused(
    shared_world: World, options: dict[str, Any], match: str
) -> None:
    # lock_ms=10**20 used to be accepted; the heartbeat thread then died with OverflowError.
    with pytest.raises(InvalidArgumentError, match=match):
        Worker(shared_world.queue, _handler, **options)


@pytest.mark.parametrize("port", ["-5", "65536", "99999"])
def test_cli_worker_metrics_port_out_of_range_is_refused(shared_world: World, port: str) -> None:
    # It used to end in an OverflowError traceback from bind().
    world = shared_world
    argv = ["--dsn", world.queue.dsn, "--schema", world.queue.schema, "worker", "json:dumps"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main([*argv, f"--metrics-port={port}", "--until-idle"])
    assert code == 1
    assert "metrics port" in err.getvalue()


def test_sql_payload_over_the_limit_is_refused_by_the_batch_and_schedule_functions(
    shared_world: World,
) -> None:
    world = shared_world
    big = "convert_to(repeat('x', 67108865), 'UTF8')"  # 64 MiB + 1, built by the server
    before = world.snapshot()
    for call in (
        "{s}.message_create_many(ARRAY['a'], ARRAY[" + big + "], NULL, NULL)",
        "{s}.schedule_set('big', " + big + ", 1)",
        "{s}.message_defer_many(ARRAY[%s]::bigint[], ARRAY[1], NULL, ARRAY[" + big + "])",
    ):
        query = sql.SQL("SELECT * FROM " + call).format(s=sql.Identifier(world.queue.schema))
        params = [world.held.id] if "%s" in call else []
        with pytest.raises(psycopg.Error) as caught:
            world.admin.execute(query, params).fetchall()
        assert caught.value.sqlstate == "LQ006"
    assert world.snapshot() == before


@pytest.mark.parametrize("cron", ["² * * * *", "*/² * * * *", "1-² * * * *", "٣ * * * *"])
def test_cron_with_digits_that_are_not_ascii_is_refused(shared_world: World, cron: str) -> None:
    # "²".isdigit() is true but int("²") fails: a bare ValueError escaped the parser.
    before = shared_world.snapshot()
    with pytest.raises(InvalidArgumentError, match="cron minute"):
        shared_world.queue.schedule("n", cron=cron, content=b"x")
    assert shared_world.snapshot() == before


@pytest.mark.parametrize(
    "options", [["--interval=nan"], ["--interval=1e300"], ["--interval=0"], ["--iterations=-1"]]
)
def test_cli_top_with_a_bad_interval_or_count_is_refused(
    shared_world: World, options: list[str]
) -> None:
    # nan ended in ValueError and 1e300 in OverflowError from time.sleep; -1 did nothing.
    world = shared_world
    argv = ["--dsn", world.queue.dsn, "--schema", world.queue.schema, "top", "--json"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main([*argv, "--iterations=2", *options])
    assert code == 1
    assert "InvalidArgumentError" in err.getvalue()


def test_spark_helpers_refuse_bad_arguments(shared_world: World) -> None:
    # purge_staging(older_than_ms=2**63) and write_result("\x00") came back from the server as
    # bare DatabaseErrors, write_result("\ud800") as UnicodeEncodeError; True passed as 1 ms.
    from lonnymq import spark
    from lonnymq.spark._options import check_all

    world = shared_world
    where = {"dsn": world.queue.dsn, "schema": world.queue.schema}
    before = world.snapshot()
    for older_than_ms in (2**63, -1, True, 1.5, "1"):
        with pytest.raises(InvalidArgumentError, match="older_than_ms"):
            spark.purge_staging(older_than_ms=older_than_ms, **where)  # type: ignore[arg-type]
    for write_id in ("\x00", "a\x00", "\ud800", "", 5, None, "w" * 201):
        with pytest.raises(InvalidArgumentError, match="writeId"):
            spark.write_result(write_id, **where)  # type: ignore[arg-type]
    for option in ("consumer", "channel", "writeId", "sinkId", "snapshot"):
        for value in ("a\x00b", "\udcff"):
            with pytest.raises(InvalidArgumentError, match=option):
                check_all({"dsn": world.queue.dsn, option: value})
    assert spark.write_result("never-written", **where) is None
    assert world.snapshot() == before
