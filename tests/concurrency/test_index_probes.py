"""Every step of ``message_dequeue_many`` is an index probe, whatever the shape of the backlog.

The statements run inside the plpgsql function, so their plans are captured with
``auto_explain`` (``log_nested_statements``) on a dedicated connection: each LOG notice carries
one statement's plan in JSON. For every shape of seed 003's pathological cases (and a few more)
the table holds about 10^5 messages, filled with set-based SQL and ANALYZEd, and the tests
assert that:

- no plan touching ``message`` or ``channel`` has a Seq Scan, a Bitmap Heap Scan or a Sort;
- each known dequeue step uses its index (``message_unlock_ix``, ``channel_ready_ix``,
  ``message_channel_head_ix``, the primary keys) and the steps the shape needs all ran;
- the dequeues returned exactly the messages a plain (slow, obviously right) query names;
- the plans hold both for the custom plans of the first executions and for generic plans.

Timings of 200 dequeues per shape are printed (``pytest -s``), never asserted: the machine is
noisy and timings belong in the benchmark.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import Queue

N = 100_000
# Plans are captured in two passes, each on a new connection (a fresh plan cache): the first
# with the planner's default settings, the second with full scans and sorts disabled, which
# proves that each statement *can* be answered by its index probe even where the planner
# prefers to read a tiny table whole. In each pass the first 5 calls run custom plans, later
# ones may switch to the cached generic plan, and the last ones force the generic plan.
DEFAULT_PASS = (7, 2)
FORCED_PASS = (2, 2)
CAPTURE_CALLS = sum(DEFAULT_PASS) + sum(FORCED_PASS)
FORCE_INDEX = ("enable_seqscan", "enable_sort", "enable_bitmapscan")
# The planner reads a channel table of a few pages whole (and sorts its handful of rows)
# rather than probe channel_ready_ix: constant cost, so it is let through in the default pass
# up to this size. Beyond it, and in the forced pass, channel must be probed like message.
TINY_TABLE_PAGES = 8
TIMED_CALLS = 200
LOCK_MS = 30_000

TABLES = frozenset({"message", "channel"})
SCAN_NODES = frozenset({"Index Scan", "Index Only Scan"})
BAD_NODES = frozenset(
    {"Seq Scan", "Bitmap Heap Scan", "Bitmap Index Scan", "Sort", "Incremental Sort"}
)

# Each statement of message_dequeue_many is recognised by a fragment of its text; the value
# names, per table, the indexes it may be probed with (a statement that locks a row found by a
# sub-select probes the sub-select's index and then the primary key).
STEPS: dict[str, tuple[str, dict[str, frozenset[str]]]] = {
    "recover": (
        "e.is_locked AND e.unlock_at <= v_now",
        {"message": frozenset({"message_unlock_ix", "message_pkey"})},
    ),
    "pick_channel": ("c.next_dequeue_at <= v_now", {"channel": frozenset({"channel_ready_ix"})}),
    "lock_head": (
        "h.channel = v_channel.name",
        {"message": frozenset({"message_channel_head_ix", "message_pkey"})},
    ),
    "update_channel": (
        "n.channel = c.name",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix"}),
        },
    ),
    "retry_at": (
        "SELECT least(",
        {
            "channel": frozenset({"channel_ready_ix"}),
            "message": frozenset({"message_unlock_ix"}),
        },
    ),
}
HEAD_STEPS = frozenset({"recover", "pick_channel", "lock_head", "update_channel"})


@dataclass(frozen=True)
class Shape:
    """A backlog: SQL to fill it, a reference query naming the messages dequeue must return
    (in order), and the dequeue steps its plans must show."""

    name: str
    fill: tuple[str, ...]
    reference: str
    steps: frozenset[str]


def _insert(
    channel: str,
    *,
    count: int = N,
    dequeue_at: str = "epoch() - 1000",
    locked: str = "FALSE",
    unlock_at: str = "NULL",
) -> str:
    """An INSERT of ``count`` messages; expressions may use ``g`` (1..count)."""
    return f"""
        INSERT INTO message (channel, content, dequeue_at, created_at, is_locked, unlock_at,
                             locked_at, num_attempts)
        SELECT {channel}, convert_to('m' || g, 'UTF8'), {dequeue_at}, epoch(), {locked},
               CASE WHEN {locked} THEN ({unlock_at})::BIGINT END,
               CASE WHEN {locked} THEN epoch() - 300000 END,
               CASE WHEN {locked} THEN 1 ELSE 0 END
        FROM generate_series(1, {count}) AS g
    """


# The channel rows the SQL functions would keep for the messages inserted directly: size,
# in-flight count (kept only under a concurrency limit) and the head's dequeue time (policy
# rows inserted beforehand are kept).
REBUILD_CHANNELS = """
    INSERT INTO channel AS c (name, current_size, current_concurrency, next_dequeue_at, turn)
    SELECT m.channel, count(*), count(*) FILTER (WHERE m.is_locked),
           min(m.dequeue_at) FILTER (WHERE NOT m.is_locked), nextval('channel_turn_seq')
    FROM message m
    GROUP BY m.channel
    ON CONFLICT (name) DO UPDATE SET
        current_size = excluded.current_size,
        current_concurrency = excluded.current_concurrency,
        next_dequeue_at = excluded.next_dequeue_at,
        turn = excluded.turn;
    UPDATE channel SET current_concurrency = 0 WHERE max_concurrency IS NULL
"""

HOUR = 3_600_000

SHAPES = [
    # (a) 10^5 ready messages in one channel.
    Shape(
        "one_channel_ready",
        (_insert("'big'"),),
        "SELECT id FROM message ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (a') the same channel with 9*10^4 messages in flight ahead of its 10^4 waiting ones.
    Shape(
        "one_channel_mostly_in_flight",
        (
            _insert("'big'", count=90_000, locked="TRUE", unlock_at=f"epoch() + {HOUR}"),
            _insert("'big'", count=10_000),
        ),
        "SELECT id FROM message WHERE NOT is_locked ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (b) 10^5 future-dated messages (lower ids) in one channel, a few ready in another.
    Shape(
        "future_ahead_other_channel",
        (
            _insert("'future'", dequeue_at=f"epoch() + {HOUR} + g"),
            _insert("'ready'", count=20),
        ),
        "SELECT id FROM message WHERE channel = 'ready' ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (b') the same, all in one channel: the ready ones have the highest ids.
    Shape(
        "future_ahead_same_channel",
        (
            _insert("'mixed'", dequeue_at=f"epoch() + {HOUR} + g"),
            _insert("'mixed'", count=20),
        ),
        "SELECT id FROM message WHERE dequeue_at <= epoch() ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (c) 10^5 channels with one message each (the earliest channel leaves first).
    Shape(
        "many_channels",
        (_insert("'c' || g", dequeue_at="epoch() - 1000000 + g"),),
        "SELECT id FROM message ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (d) 10^5 messages whose locks expired: the oldest lock is recovered first.
    Shape(
        "expired_locks",
        (_insert("'c' || g % 100", locked="TRUE", unlock_at="epoch() - 200000 + g"),),
        "SELECT id FROM message ORDER BY unlock_at, id",
        frozenset({"recover"}),
    ),
    # (d') 10^5 messages in flight with live locks, and a few ready in another channel.
    Shape(
        "live_locks",
        (
            _insert("'c' || g % 100", locked="TRUE", unlock_at=f"epoch() + {HOUR} + g"),
            _insert("'ready'", count=20),
        ),
        "SELECT id FROM message WHERE channel = 'ready' ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (e) 10^4 channels saturated at max_concurrency 2, each with 8 ready messages waiting
    # (heads older than any other), and one free channel.
    Shape(
        "saturated_channels",
        (
            """
            INSERT INTO channel (name, has_policy, max_concurrency)
            SELECT 's' || g, TRUE, 2 FROM generate_series(0, 9999) AS g
            """,
            _insert(
                "'s' || g % 10000",
                dequeue_at="epoch() - 100000",
                locked="g <= 20000",
                unlock_at=f"epoch() + {HOUR}",
            ),
            _insert("'free'", count=300, dequeue_at="epoch() - 10"),
        ),
        "SELECT id FROM message WHERE channel = 'free' ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (f) nothing ready: 10^5 future messages in 1000 channels, 10^4 of them in flight; the
    # empty answer's retry_at must be found by index too.
    Shape(
        "nothing_ready",
        (
            _insert(
                "'c' || g % 1000",
                dequeue_at=f"epoch() + {2 * HOUR} + g",
                locked="g <= 10000",
                unlock_at=f"epoch() + {HOUR} + g",
            ),
        ),
        "SELECT id FROM message WHERE FALSE",
        frozenset({"recover", "pick_channel", "retry_at"}),
    ),
]


@dataclass(frozen=True)
class Plan:
    query: str
    root: dict[str, Any]


def _nodes(node: dict[str, Any], *, subplans: bool = True) -> Iterator[dict[str, Any]]:
    """The node and those below it (without sub-selects' plans when ``subplans`` is false)."""
    yield node
    for child in node.get("Plans", ()):
        if subplans or child.get("Parent Relationship") not in {"SubPlan", "InitPlan"}:
            yield from _nodes(child, subplans=subplans)


def _parse_notice(message: str) -> Plan | None:
    """The plan of one auto_explain LOG message (``duration: ... plan:`` + JSON), else None."""
    head, sep, body = message.partition("plan:")
    if not sep or not head.startswith("duration:"):
        return None
    document = json.loads(body)
    return Plan(query=document["Query Text"], root=document["Plan"])


def _step_of(plan: Plan) -> str | None:
    for step, (fragment, _) in STEPS.items():
        if fragment in plan.query:
            return step
    return None


def _problems(plan: Plan, *, tolerated: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with one plan: a full scan or a sort, or a step probing the wrong index.

    A Seq Scan of a table in ``tolerated`` (and a Sort of only its rows) is let through: the
    planner rightly reads a table of a page or two rather than probe its index.
    """
    nodes = list(_nodes(plan.root))
    if not any(node.get("Relation Name") in TABLES for node in nodes):
        return []
    step = _step_of(plan)
    expected = STEPS[step][1] if step is not None else {}
    problems: list[str] = []
    for node in nodes:
        kind = node["Node Type"]
        relation = node.get("Relation Name")
        below = {n["Relation Name"] for n in _nodes(node, subplans=False) if "Relation Name" in n}
        if kind in BAD_NODES and not (below and below <= tolerated):
            problems.append(f"{kind} on {relation or ', '.join(sorted(below)) or '-'}")
        elif relation in TABLES and kind not in SCAN_NODES | {"ModifyTable", *BAD_NODES}:
            problems.append(f"{kind} on {relation}")
        elif kind in SCAN_NODES and relation in expected:
            index = node.get("Index Name")
            if index not in expected[relation]:
                allowed = " or ".join(sorted(expected[relation]))
                problems.append(f"{kind} on {relation} using {index}, not {allowed}")
    return [f"[{step or 'unknown step'}] {p}" for p in problems]


def _describe(plan: Plan) -> str:
    def render(node: dict[str, Any], depth: int) -> list[str]:
        label = node["Node Type"]
        if "Index Name" in node:
            label += f" using {node['Index Name']}"
        if "Relation Name" in node:
            label += f" on {node['Relation Name']}"
        lines = ["  " * depth + label]
        for child in node.get("Plans", ()):
            lines.extend(render(child, depth + 1))
        return lines

    return "\n".join([" ".join(plan.query.split()), *render(plan.root, 1)])


def _schema_sql(template: str, schema: str) -> sql.Composed:
    return sql.SQL(template).format(sql.Identifier(schema))


def _fill(admin: psycopg.Connection[Any], schema: str, shape: Shape) -> float:
    started = time.perf_counter()
    admin.execute(_schema_sql("SET search_path = {}", schema))
    with admin.transaction():
        for statement in shape.fill:
            admin.execute(statement)
        admin.execute(REBUILD_CHANNELS)
    admin.execute("ANALYZE message")
    admin.execute("ANALYZE channel")
    return time.perf_counter() - started


def _dequeue(conn: psycopg.Connection[Any], schema: str) -> tuple[int | None, int | None]:
    """One dequeue: (id, retry_at) of the single row message_dequeue_many(1, ...) returns."""
    rows = conn.execute(
        _schema_sql("SELECT id, retry_at FROM {}.message_dequeue_many(1, %s)", schema),
        (LOCK_MS,),
    ).fetchall()
    assert len(rows) == 1
    return rows[0][0], rows[0][1]


def _capture(
    dsn: str, schema: str, calls: tuple[int, int], *, force_index: bool
) -> tuple[list[Plan], list[tuple[int | None, int | None]]]:
    """Dequeue with auto_explain on (``calls``: default, then forced generic plan calls);
    the nested plans and the dequeue results."""
    plans: list[Plan] = []
    results: list[tuple[int | None, int | None]] = []

    def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        plan = _parse_notice(diagnostic.message_primary or "")
        if plan is not None:
            plans.append(plan)

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(on_notice)
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_nested_statements = on",
            "SET auto_explain.log_analyze = off",
            "SET auto_explain.log_format = json",
            "SET client_min_messages = log",
        ):
            conn.execute(setting)
        if force_index:
            for name in FORCE_INDEX:
                conn.execute(f"SET {name} = off")
        default_calls, generic_calls = calls
        for _ in range(default_calls):
            results.append(_dequeue(conn, schema))
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for _ in range(generic_calls):
            results.append(_dequeue(conn, schema))
    return plans, results


def _check_plans(plans: list[Plan], steps: frozenset[str], tolerated: frozenset[str]) -> None:
    assert plans, "auto_explain logged no plan"
    problems = [
        (p, _describe(plan)) for plan in plans for p in _problems(plan, tolerated=tolerated)
    ]
    assert not problems, "\n\n".join(f"{p}\n{d}" for p, d in problems)
    seen = {_step_of(plan) for plan in plans}
    assert steps <= seen, f"steps never planned: {sorted(steps - seen)}"


def _time_dequeues(dsn: str, schema: str) -> tuple[float, int]:
    """Seconds for TIMED_CALLS dequeues on a plain connection, and how many got a message."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = 0
        started = time.perf_counter()
        for _ in range(TIMED_CALLS):
            message_id, _retry_at = _dequeue(conn, schema)
            got += message_id is not None
        return time.perf_counter() - started, got


def _counter_mismatches(admin: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Channels whose size or in-flight counter disagrees with the message table."""
    return admin.execute(
        """
        SELECT c.name, c.current_size, c.current_concurrency, m.size, m.in_flight
        FROM channel c
        FULL JOIN (
            SELECT channel, count(*) AS size, count(*) FILTER (WHERE is_locked) AS in_flight
            FROM message GROUP BY channel
        ) m ON m.channel = c.name
        WHERE c.current_size IS DISTINCT FROM coalesce(m.size, 0)
           OR c.current_concurrency IS DISTINCT FROM CASE
               WHEN c.max_concurrency IS NULL THEN 0 ELSE coalesce(m.in_flight, 0) END
        LIMIT 10
        """
    ).fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_every_dequeue_step_is_an_index_probe(
    shape: Shape,
    queue: Queue,
    admin: psycopg.Connection[Any],
    dsn: str,
) -> None:
    fill_seconds = _fill(admin, queue.schema, shape)
    (total,) = admin.execute("SELECT count(*) FROM message").fetchone() or (0,)
    assert total >= N
    expected_ids = [
        row[0] for row in admin.execute(f"{shape.reference} LIMIT {CAPTURE_CALLS}").fetchall()
    ]
    (next_at,) = admin.execute(
        "SELECT least((SELECT min(dequeue_at) FROM message WHERE NOT is_locked),"
        " (SELECT min(unlock_at) FROM message WHERE is_locked))"
    ).fetchone() or (None,)

    (channel_pages,) = admin.execute(
        "SELECT pg_relation_size('channel') / current_setting('block_size')::INT"
    ).fetchone() or (0,)
    tolerated = frozenset({"channel"}) if channel_pages <= TINY_TABLE_PAGES else frozenset()

    plans, results = _capture(dsn, queue.schema, DEFAULT_PASS, force_index=False)
    _check_plans(plans, shape.steps, tolerated)
    forced_plans, forced_results = _capture(dsn, queue.schema, FORCED_PASS, force_index=True)
    _check_plans(forced_plans, shape.steps, frozenset())

    # The dequeues returned what the reference query names, in order.
    results += forced_results
    got_ids = [message_id for message_id, _ in results if message_id is not None]
    assert got_ids == expected_ids
    if not expected_ids:
        assert {retry_at for _, retry_at in results} == {next_at}

    seconds, got = _time_dequeues(dsn, queue.schema)
    print(
        f"\n[{shape.name}] fill {fill_seconds:.2f}s, channel table {channel_pages} pages; "
        f"{TIMED_CALLS} dequeues in "
        f"{seconds * 1000:.0f} ms ({seconds * 1000 / TIMED_CALLS:.3f} ms each, "
        f"{got} returned a message)"
    )
    assert _counter_mismatches(admin) == []


def test_plan_checker_flags_a_seq_scan_and_a_sort(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """The checker itself: the plan of a query that must scan and sort is reported."""
    admin.execute(_schema_sql("SET search_path = {}", queue.schema))
    admin.execute(_insert("'x'", count=100))
    admin.execute("ANALYZE message")
    row = admin.execute("EXPLAIN (FORMAT JSON) SELECT * FROM message ORDER BY content").fetchone()
    assert row is not None
    document = row[0]
    plan = Plan(query="SELECT * FROM message ORDER BY content", root=document[0]["Plan"])
    problems = _problems(plan)
    assert any("Seq Scan on message" in p for p in problems)
    assert any("Sort" in p for p in problems)
    # A tiny channel table may be read whole, the message table never.
    assert _problems(plan, tolerated=frozenset({"channel"})) == problems
    channel_plan = Plan(
        query="SELECT * FROM channel",
        root={
            "Node Type": "Sort",
            "Plans": [{"Node Type": "Seq Scan", "Relation Name": "channel"}],
        },
    )
    assert _problems(channel_plan) == [
        "[unknown step] Sort on channel",
        "[unknown step] Seq Scan on channel",
    ]
    assert _problems(channel_plan, tolerated=frozenset({"channel"})) == []
    wrong_index = Plan(
        query="e.is_locked AND e.unlock_at <= v_now",
        root={"Node Type": "Index Scan", "Relation Name": "message", "Index Name": "x_ix"},
    )
    assert _problems(wrong_index) == [
        "[recover] Index Scan on message using x_ix, not message_pkey or message_unlock_ix"
    ]
