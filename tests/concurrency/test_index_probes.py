"""Every step of ``message_dequeue_many`` (``message_take_one`` for a single message, the general
loop ``message_dequeue_loop`` otherwise) is an index probe, whatever the shape of the backlog.

The statements run inside the plpgsql function, so their plans are captured with
``auto_explain`` (``log_nested_statements``) on a dedicated connection: each LOG notice carries
one statement's plan in JSON. For every shape of seed 003's pathological cases (and a few more)
the table holds about 10^5 messages, filled with set-based SQL and ANALYZEd, and the tests
assert that:

- no plan touching ``message`` or ``channel`` has a Seq Scan, a Bitmap Heap Scan or a Sort;
- every statement touching them is a known dequeue step (a new statement must be added to
  ``STEPS`` with its index), each uses its index (``message_unlock_ix``, ``channel_ready_ix``,
  ``message_channel_head_ix``, the primary keys) and the steps the shape needs all ran: the
  policy path (``update_channel``), sending a channel without a policy to the back
  (``turn_back``, and ``channel_rotate`` once a channel is drained, ``channel_rotate_many``
  for a batch's), and the ride-along path when another session holds the channel's row;
- the dequeues returned exactly the messages a plain (slow, obviously right) query names;
- the plans hold both for the custom plans of the first executions and for generic plans.

Timings of 200 dequeues per shape are printed (``pytest -s``), never asserted: the machine is
noisy and timings belong in the benchmark.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from lonnymq import NewMessage, Queue

sys.path.insert(0, str(Path(__file__).parent))
from lock_helpers import log_plans

N = 100_000
# Plans are captured in two passes, each on a new connection (a fresh plan cache): the first
# with the planner's default settings, the second with full scans and sorts disabled, which
# proves that each statement *can* be answered by its index probe even where the planner
# prefers to read a tiny table whole. In each pass the first 5 calls run custom plans, later
# ones may switch to the cached generic plan, and the last ones force the generic plan.
DEFAULT_PASS = (7, 2)
FORCED_PASS = (2, 2)
# Each plan mode of each pass ends with batch dequeues (limit BATCH_LIMIT), which take the
# batch paths (several channels' heads in one statement, or riding along for several).
BATCH_CALLS = 2
BATCH_LIMIT = 4
CAPTURE_CALLS = sum(DEFAULT_PASS) + sum(FORCED_PASS) + 2 * 2 * BATCH_CALLS * BATCH_LIMIT
FORCE_INDEX = ("enable_seqscan", "enable_sort", "enable_bitmapscan")
# The planner reads a channel table of a few pages whole (and sorts its handful of rows)
# rather than probe channel_ready_ix: constant cost, so it is let through in the default pass
# up to this size. Beyond it, and in the forced pass, channel must be probed like message.
TINY_TABLE_PAGES = 8
TIMED_CALLS = 200
LOCK_MS = 30_000

TABLES = frozenset({"message", "channel"})
SCAN_NODES = frozenset({"Index Scan", "Index Only Scan"})
SORT_NODES = frozenset({"Sort", "Incremental Sort"})
BAD_NODES = frozenset(
    {"Seq Scan", "Bitmap Heap Scan", "Bitmap Index Scan", "Sort", "Incremental Sort"}
)

# Each statement of a dequeue is recognised by a fragment of its text; the value
# names, per table, the indexes it may be probed with (a statement that locks a row found by a
# sub-select probes the sub-select's index and then the primary key).
# Fragments are tried in order (the first match names the step).
STEPS: dict[str, tuple[str, dict[str, frozenset[str]]]] = {
    "recover": (
        "e.is_locked AND e.unlock_at <= p_now",
        {"message": frozenset({"message_unlock_ix", "message_pkey"})},
    ),
    # Every due channel's row is held: which one is busy (no lock taken).
    "find_busy": ("SELECT c.name FROM channel c", {"channel": frozenset({"channel_ready_ix"})}),
    "pick_channel": ("c.next_dequeue_at <= v_now", {"channel": frozenset({"channel_ready_ix"})}),
    # channel_ready_floor(): about once a second, the first servable channel from the low end.
    "ready_sweep": (
        "LIMIT 1), p_now - 2000)",
        {"channel": frozenset({"channel_ready_ix"})},
    ),
    # Does the busy channel have a policy (and, if so, the NOWAIT poll of its row)?
    "busy_policy": ("c.name = v_busy", {"channel": frozenset({"channel_pkey"})}),
    # Ride along: the busy channel's next waiting head, without its row (read in the same
    # statement, for where its waiting messages begin).
    "ride_along": (
        "h.channel = v_busy",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix", "message_pkey"}),
        },
    ),
    # The batch path: the heads of several channels without a policy, in one statement.
    "spread_heads": (
        "m.channel = f.name AND NOT m.is_locked",
        {"message": frozenset({"message_channel_head_ix", "message_pkey"})},
    ),
    # ... riding along on several busy channels (their rows read in the same statement).
    "ride_many": (
        "m.channel = b.name AND NOT m.is_locked",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix", "message_pkey"}),
        },
    ),
    # ... and those channels to the back, from their next waiting heads.
    "spread_turn_back": (
        "s.channel = f.name AND NOT s.is_locked",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix"}),
        },
    ),
    # ... and those of them it drained or whose next head is not due (channel_rotate_many):
    # their next heads read again after their locks, their rows moved or deleted.
    "spread_rotate": (
        "s.channel = r.name AND NOT s.is_locked",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix"}),
        },
    ),
    # A channel's first waiting message, from where its row says they begin (channel_first).
    "first_waiting": (
        "x.channel = p_channel AND NOT x.is_locked",
        {"message": frozenset({"message_channel_head_ix"})},
    ),
    "first_waiting_row": (
        "channel_first_from(c.name, c.head_at",
        {"channel": frozenset({"channel_pkey"})},
    ),
    # channel_head_advance(): that mark moved up to the first waiting message.
    "advance_head": ("SET head_at = f.dequeue_at", {"channel": frozenset({"channel_pkey"})}),
    "lock_head": (
        "h.channel = v_channel.name",
        {"message": frozenset({"message_channel_head_ix", "message_pkey"})},
    ),
    # message_take_one (a dequeue of one message): the channel whose head it took goes to the
    # back in the statement that reads its next head.
    "turn_back": (
        "t.channel = v_channel.name AND NOT t.is_locked",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix"}),
        },
    ),
    "update_channel": (
        "n.channel = c.name",
        {
            "channel": frozenset({"channel_pkey"}),
            "message": frozenset({"message_channel_head_ix"}),
        },
    ),
    # channel_rotate() (a channel without a policy): its next waiting head, then its row is
    # updated or, once drained, deleted.
    "rotate_head": (
        "r.channel = p_channel AND NOT r.is_locked",
        {"message": frozenset({"message_channel_head_ix"})},
    ),
    "rotate_channel": ("c.name = p_channel", {"channel": frozenset({"channel_pkey"})}),
    "retry_at": (
        "SELECT least(",
        {
            "channel": frozenset({"channel_ready_ix"}),
            "message": frozenset({"message_unlock_ix"}),
        },
    ),
}
# Sequences a dequeue reads (a Seq Scan of one is the read of its one value).
SEQUENCES = frozenset(
    {"lock_gate_seq", "lock_sweep_seq", "message_id_seq", "ready_floor_seq", "ready_sweep_seq"}
)
# A channel without a policy goes to the back (channel_rotate when its next head is not due
# or it has none); one with a policy has its row updated in place. The look for an expired lock
# ("recover") runs once the lock gate opens, about once a second, not in every take: a shape
# with expired locks requires it; in the others its plans are checked when it runs.
HEAD_STEPS = frozenset({"pick_channel", "lock_head", "spread_heads", "turn_back"})
ROTATE_STEPS = frozenset({"rotate_head", "rotate_channel"})
POLICY_HEAD_STEPS = frozenset({"pick_channel", "lock_head", "update_channel"})
RIDE_ALONG_STEPS = frozenset({"pick_channel", "find_busy", "busy_policy", "ride_along"})


@dataclass(frozen=True)
class Shape:
    """A backlog: SQL to fill it, a reference query naming the messages dequeue must return
    (in order), and the dequeue steps its plans must show."""

    name: str
    fill: tuple[str, ...]
    reference: str
    steps: frozenset[str]
    # Channel rows another session holds (FOR UPDATE, as a dequeue does) while dequeuing.
    held: tuple[str, ...] = ()


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


# The channel rows the SQL functions would keep for the messages inserted directly: the
# head's dequeue time for every channel with a waiting message (a channel without a policy
# has a row only then), and, for channels with a policy (rows inserted beforehand), the size
# and the in-flight count (kept only under a concurrency limit).
REBUILD_CHANNELS = """
    INSERT INTO channel AS c (name, next_dequeue_at, turn)
    SELECT m.channel, min(m.dequeue_at) FILTER (WHERE NOT m.is_locked),
           nextval('channel_turn_seq')
    FROM message m
    GROUP BY m.channel
    HAVING bool_or(NOT m.is_locked)
    ON CONFLICT (name) DO UPDATE SET
        next_dequeue_at = excluded.next_dequeue_at,
        turn = excluded.turn;
    UPDATE channel c SET
        current_size = s.size,
        current_concurrency = CASE WHEN c.max_concurrency IS NULL THEN 0 ELSE s.in_flight END
    FROM (
        SELECT m.channel, count(*) AS size, count(*) FILTER (WHERE m.is_locked) AS in_flight
        FROM message m GROUP BY m.channel
    ) s
    WHERE s.channel = c.name AND c.has_policy
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
    # (a+) the same with a policy: the channel's row is updated in place, counters and all.
    Shape(
        "one_policy_channel_ready",
        (
            "INSERT INTO channel (name, has_policy, max_concurrency, max_size)"
            " VALUES ('big', TRUE, 1000000, 1000000)",
            _insert("'big'"),
        ),
        "SELECT id FROM message ORDER BY dequeue_at, id",
        POLICY_HEAD_STEPS,
    ),
    # (a++) the same without a policy while another session holds the channel's row (as a
    # dequeue in progress does): every dequeue rides along and takes the next head.
    Shape(
        "one_channel_row_held",
        (_insert("'big'"),),
        "SELECT id FROM message ORDER BY dequeue_at, id",
        RIDE_ALONG_STEPS,
        held=("big",),
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
            _insert("'ready'", count=100),
        ),
        "SELECT id FROM message WHERE channel = 'ready' ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (b') the same, all in one channel: the ready ones have the highest ids.
    Shape(
        "future_ahead_same_channel",
        (
            _insert("'mixed'", dequeue_at=f"epoch() + {HOUR} + g"),
            _insert("'mixed'", count=100),
        ),
        "SELECT id FROM message WHERE dequeue_at <= epoch() ORDER BY dequeue_at, id",
        HEAD_STEPS,
    ),
    # (c) 10^5 channels with one message each (the earliest channel leaves first).
    Shape(
        "many_channels",
        (_insert("'c' || g", dequeue_at="epoch() - 1000000 + g"),),
        "SELECT id FROM message ORDER BY dequeue_at, id",
        HEAD_STEPS | ROTATE_STEPS | {"spread_rotate"},
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
            _insert("'ready'", count=100),
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
        frozenset({"pick_channel", "retry_at"}),
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


def _step_of(plan: Plan) -> str | None:
    query = " ".join(plan.query.split())
    for step, (fragment, _) in STEPS.items():
        if fragment in query:
            return step
    return None


def _sorts_a_cte(node: dict[str, Any]) -> bool:
    return any(n["Node Type"] == "CTE Scan" for n in _nodes(node, subplans=False))


def _reprobes_an_array(node: dict[str, Any]) -> bool:
    """A join whose inner side probes a table for every id of an array (``= ANY``) once per
    outer row, filtering the pairs after: n * n index entries for n ids."""
    if node["Node Type"] != "Nested Loop" or len(node.get("Plans", ())) != 2:
        return False
    inner = node["Plans"][1]
    return (
        inner.get("Relation Name") in TABLES
        and "ANY (" in inner.get("Index Cond", "")
        and "Join Filter" in node
    )


def _problems(plan: Plan, *, tolerated: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with one plan: a statement that is no known step, a full scan or a sort,
    a step probing the wrong index, or a join probing an array's ids once per row.

    A Seq Scan of a table in ``tolerated`` (and a Sort of only its rows) is let through: the
    planner rightly reads a table of a page or two rather than probe its index. So is one of a
    sequence (the lock gate's: one value, read in place). So is a Sort
    of the rows of a CTE (``WITH taken AS (UPDATE ... RETURNING ...) SELECT ... ORDER BY``):
    it orders what the CTE's own plan, checked node by node, found by its probes.
    """
    nodes = list(_nodes(plan.root))
    if not any(node.get("Relation Name") in TABLES for node in nodes):
        return []
    step = _step_of(plan)
    expected = STEPS[step][1] if step is not None else {}
    problems: list[str] = []
    if step is None:
        problems.append("statement is no known dequeue step: add it to STEPS with its index")
    for node in nodes:
        kind = node["Node Type"]
        relation = node.get("Relation Name")
        below = {n["Relation Name"] for n in _nodes(node, subplans=False) if "Relation Name" in n}
        if _reprobes_an_array(node):
            problems.append(f"{kind} probing {', '.join(sorted(below))} for a whole array per row")
        if kind in SORT_NODES and not below and _sorts_a_cte(node):
            continue
        if kind in BAD_NODES and not (below and below <= tolerated | SEQUENCES):
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


def _dequeue(
    conn: psycopg.Connection[Any], schema: str, limit: int = 1
) -> list[tuple[int | None, int | None]]:
    """One dequeue: (id, retry_at) of each row message_dequeue_many(limit, ...) returns."""
    rows = conn.execute(
        _schema_sql("SELECT id, retry_at FROM {}.message_dequeue_many(%s, %s)", schema),
        (limit, LOCK_MS),
    ).fetchall()
    assert 1 <= len(rows) <= limit
    return [(row[0], row[1]) for row in rows]


def _capture(
    dsn: str, schema: str, calls: tuple[int, int], *, force_index: bool
) -> tuple[list[Plan], list[tuple[int | None, int | None]]]:
    """Dequeue with auto_explain on (``calls``: default, then forced generic plan calls;
    each followed by BATCH_CALLS batch dequeues); the nested plans and the dequeue results."""
    plans: list[Plan] = []
    results: list[tuple[int | None, int | None]] = []

    with psycopg.connect(dsn, autocommit=True) as conn:
        log_plans(conn, lambda query, root: plans.append(Plan(query, root)))
        if force_index:
            for name in FORCE_INDEX:
                conn.execute(f"SET {name} = off")
        default_calls, generic_calls = calls
        for _ in range(default_calls):
            results += _dequeue(conn, schema)
        for _ in range(BATCH_CALLS):
            results += _dequeue(conn, schema, BATCH_LIMIT)
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for _ in range(generic_calls):
            results += _dequeue(conn, schema)
        for _ in range(BATCH_CALLS):
            results += _dequeue(conn, schema, BATCH_LIMIT)
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
            ((message_id, _retry_at),) = _dequeue(conn, schema)
            got += message_id is not None
        return time.perf_counter() - started, got


def _counter_mismatches(admin: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Channels whose row disagrees with the message table: a channel with a policy whose size
    or in-flight counter is off, or a channel without one that has a waiting message but no
    row saying it is due by then (its row may say too early, never too late)."""
    return admin.execute(
        """
        SELECT coalesce(c.name, m.channel), c.has_policy, c.current_size, c.current_concurrency,
               c.next_dequeue_at, m.size, m.in_flight, m.head_at
        FROM channel c
        FULL JOIN (
            SELECT channel, count(*) AS size, count(*) FILTER (WHERE is_locked) AS in_flight,
                   min(dequeue_at) FILTER (WHERE NOT is_locked) AS head_at
            FROM message GROUP BY channel
        ) m ON m.channel = c.name
        WHERE CASE
            WHEN c.has_policy THEN
                c.current_size IS DISTINCT FROM coalesce(m.size, 0)
                OR c.current_concurrency IS DISTINCT FROM CASE
                    WHEN c.max_concurrency IS NULL THEN 0 ELSE coalesce(m.in_flight, 0) END
            ELSE m.head_at IS NOT NULL
                AND (c.next_dequeue_at IS NULL
                     OR c.next_dequeue_at > greatest(m.head_at, epoch()))
            END
        LIMIT 10
        """
    ).fetchall()


@contextmanager
def _holding(dsn: str, schema: str, channels: tuple[str, ...]) -> Iterator[None]:
    """Hold the rows of ``channels`` (FOR UPDATE, in an open transaction, as a dequeue in
    progress does) until the block ends; then roll back."""
    if not channels:
        yield
        return
    with psycopg.connect(dsn) as holder:
        held = holder.execute(
            _schema_sql("SELECT name FROM {}.channel WHERE name = ANY(%s) FOR UPDATE", schema),
            [list(channels)],
        ).fetchall()
        assert sorted(row[0] for row in held) == sorted(channels)
        try:
            yield
        finally:
            holder.rollback()


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

    with _holding(dsn, queue.schema, shape.held):
        plans, results = _capture(dsn, queue.schema, DEFAULT_PASS, force_index=False)
        forced_plans, forced_results = _capture(dsn, queue.schema, FORCED_PASS, force_index=True)
        seconds, got = _time_dequeues(dsn, queue.schema)
    _check_plans(plans, shape.steps, tolerated)
    _check_plans(forced_plans, shape.steps, frozenset())
    # The look for expired locks is planned for its arguments even where the session asks for
    # generic plans: where it starts is folded into its index scan's bounds, never left as a
    # filter (OR) that a scan from the lowest expiry applies to every entry it walks.
    for plan in plans + forced_plans:
        if _step_of(plan) == "recover":
            filters = [n.get("Filter", "") for n in _nodes(plan.root)]
            assert not any(" OR " in f for f in filters), _describe(plan)

    # The dequeues returned what the reference query names, in order.
    results += forced_results
    got_ids = [message_id for message_id, _ in results if message_id is not None]
    assert got_ids == expected_ids
    if not expected_ids:
        assert {retry_at for _, retry_at in results} == {next_at}

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
        query="SELECT * FROM channel c WHERE c.next_dequeue_at   <= v_now",
        root={
            "Node Type": "Sort",
            "Plans": [{"Node Type": "Seq Scan", "Relation Name": "channel"}],
        },
    )
    assert _problems(channel_plan) == [
        "[pick_channel] Sort on channel",
        "[pick_channel] Seq Scan on channel",
    ]
    assert _problems(channel_plan, tolerated=frozenset({"channel"})) == []
    # A statement on the tables that is no known step is reported, even as an index probe;
    # one that touches neither table (an advisory lock call) is not.
    unknown = Plan(
        query="SELECT * FROM channel WHERE name = 'x'",
        root={"Node Type": "Index Scan", "Relation Name": "channel", "Index Name": "channel_pkey"},
    )
    assert _problems(unknown) == [
        "[unknown step] statement is no known dequeue step: add it to STEPS with its index"
    ]
    cte_sort = Plan(
        query="WITH taken AS (UPDATE message m ... h.channel = v_busy ...) SELECT ... ORDER BY",
        root={
            "Node Type": "Sort",
            "Plans": [
                {
                    "Node Type": "ModifyTable",
                    "Relation Name": "message",
                    "Parent Relationship": "InitPlan",
                    "Plans": [{"Node Type": "Seq Scan", "Relation Name": "message"}],
                },
                {"Node Type": "CTE Scan", "Parent Relationship": "Outer"},
            ],
        },
    )
    assert _problems(cte_sort) == ["[ride_along] Seq Scan on message"]
    bitmap = Plan(
        query="h.channel = v_busy",
        root={
            "Node Type": "Bitmap Heap Scan",
            "Relation Name": "message",
            "Plans": [{"Node Type": "Bitmap Index Scan", "Index Name": "message_channel_head_ix"}],
        },
    )
    assert _problems(bitmap) == [
        "[ride_along] Bitmap Heap Scan on message",
        "[ride_along] Bitmap Index Scan on -",
    ]
    advisory = Plan(
        query="SELECT pg_try_advisory_xact_lock(channel_key(p_channel))",
        root={"Node Type": "Result"},
    )
    assert _problems(advisory) == []
    wrong_index = Plan(
        query="e.is_locked AND e.unlock_at <= p_now",
        root={"Node Type": "Index Scan", "Relation Name": "message", "Index Name": "x_ix"},
    )
    assert _problems(wrong_index) == [
        "[recover] Index Scan on message using x_ix, not message_pkey or message_unlock_ix"
    ]


# A function probing for heads: an ordered head lookup with a LIMIT, or SKIP LOCKED.
HEAD_PROBE = re.compile(
    r"ORDER BY \w+\.(dequeue_at|unlock_at), \w+\.id\s+LIMIT|SKIP LOCKED", re.IGNORECASE
)


def test_every_function_probing_for_heads_plans_no_bitmap(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """The planner, expecting a row or two from old statistics, may read all of a
    channel's entries through a bitmap and sort them; every function that looks for heads
    runs with bitmap scans off, and the setting is gone once it returns."""
    rows = admin.execute(
        "SELECT p.proname, p.proconfig, p.prosrc FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [queue.schema],
    ).fetchall()
    probing = {
        name for name, _, source in rows if HEAD_PROBE.search(re.sub(r"--[^\n]*", "", source or ""))
    }
    # SKIP LOCKED on rows found by primary key only, no head probed.
    probing -= {"message_heartbeat_many"}
    assert {"message_take_one", "message_dequeue_loop", "channel_first_from"} <= probing
    off = {name for name, config, _ in rows if "enable_bitmapscan=off" in (config or [])}
    assert probing <= off, f"probing for heads without enable_bitmapscan=off: {probing - off}"
    # A single take keeps its statements' generic plans: with the channel table's statistics
    # moving, the plan cache chose to plan its look for the due channel anew in ~40% of takes.
    generic = {n for n, config, _ in rows if "plan_cache_mode=force_generic_plan" in (config or [])}
    assert "message_take_one" in generic
    # ... but the look for expired locks it calls is planned for its arguments: where it
    # starts must be a bound of its index scan, which a generic plan would make a filter.
    custom = {n for n, config, _ in rows if "plan_cache_mode=force_custom_plan" in (config or [])}
    assert "message_recover" in custom
    queue.create(b"x", channel="a")
    with psycopg.connect(dsn, autocommit=True) as conn:
        taken = conn.execute(
            sql.SQL("SELECT id FROM {}.message_dequeue_many(1, 1000)").format(
                sql.Identifier(queue.schema)
            )
        ).fetchall()
        assert len(taken) == 1
        assert conn.execute("SHOW enable_bitmapscan").fetchone() == ("on",)
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("auto",)


# Every function of the schema runs with enable_seqscan off but these, each for its
# reason. A new function fails the test below until it is given the setting or a place here.
SEQSCAN_ALLOWED = {
    # No table of their own: checks, wrappers of functions that have the setting, arithmetic.
    "arg_check", "arg_check_channel", "arg_check_claim", "arg_check_dedup_key",
    "arg_check_lock_ms", "arg_check_payload", "arg_check_range", "arg_check_time",
    "arg_check_worker_id", "channel_hash", "channel_key",
    "channel_servable_at", "message_check_new", "message_complete_and_dequeue", "message_defer",
    "message_delete", "message_dequeue", "message_dequeue_many", "message_finish",
    "message_requeue", "schedule_check_name",
    # The one-row config (epoch and event_publish run with jit off), the migration table, the
    # two-row record of maintain()'s vacuums, and the compaction (it copies a whole table).
    "epoch", "event_publish", "channel_announce", "config_get", "config_set", "clock_offset_set",
    "maintenance_compact", "maintenance_due", "maintenance_vacuumed", "schema_version",
    # Reports, administration and repair: the planner's choice, for the sizes they read.
    "archive_list", "archive_replay", "channel_stats", "queue_verify", "schedule_list",
    "schedule_remove", "schedule_set", "schema_functions", "secure_functions",
    # A worker's reports of itself, once a heartbeat round, into the table of the last hour's
    # workers (a few rows).
    "worker_report", "worker_stopped",
}  # fmt: skip
# Set-based paths planned for their own sizes (Spark), and role administration.
SEQSCAN_ALLOWED_PREFIXES = ("spark_", "role_")


def test_keyed_lookups_stay_index_probes_on_a_tiny_table(
    make_queue: Any, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """A session plans each statement once, and on a `channel` table of one page a lookup
    by name is planned as a sequential scan and kept as one while the table grows. Every
    function of a message's way through the queue runs with sequential scans and JIT off (a
    statement left to a sequential scan is costed past jit_above_cost), and every operation,
    run again and again on one connection (custom plans, then generic ones) while the tables
    are known (vacuumed) to hold a page each, reads `channel` and `message` through their
    indexes only; the settings are gone once each call returns."""
    queue = make_queue()
    rows = admin.execute(
        "SELECT p.proname, p.proconfig FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [queue.schema],
    ).fetchall()
    names = {name for name, _ in rows}
    assert names >= SEQSCAN_ALLOWED, f"no such function: {sorted(SEQSCAN_ALLOWED - names)}"
    off = {name for name, config in rows if "enable_seqscan=off" in (config or [])}
    missing = {
        name
        for name in names - off - SEQSCAN_ALLOWED
        if not name.startswith(SEQSCAN_ALLOWED_PREFIXES)
    }
    assert not missing, f"without enable_seqscan=off: {sorted(missing)}"
    assert {"message_create", "message_finish_try", "channel_wake", "message_take_one"} <= off
    no_jit = {name for name, config in rows if "jit=off" in (config or [])}
    assert off | {"epoch", "event_publish"} <= no_jit, sorted(off - no_jit)

    queue.channel("limited").set_policy(max_concurrency=5, max_size=1_000)
    queue.create(b"seed", channel="seed")
    for table in ("channel", "message"):
        # Known small to the planner (never vacuumed, a table counts as 10 pages), and kept
        # so while the test runs (the embedded server runs autovacuum).
        relation = sql.Identifier(queue.schema, table)
        admin.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(relation))
        admin.execute(sql.SQL("VACUUM ANALYZE {}").format(relation))
    with psycopg.connect(dsn) as conn:
        for round_ in range(8):
            for channel in ("free", "limited"):
                queue.create(b"x", channel=channel, conn=conn)
                queue.create(b"k", channel=channel, dedup_key=f"k{round_}", conn=conn)
            queue.create_many(
                [NewMessage(b"m", channel=c) for c in ("free", "limited", "other")], conn=conn
            )
            held = queue.dequeue_many(3, lock_ms=LOCK_MS, conn=conn)
            assert held
            queue.heartbeat_many(held, lock_ms=LOCK_MS, conn=conn)
            held[0].heartbeat(lock_ms=LOCK_MS, conn=conn)
            assert queue.message_status(held[0].id, conn=conn) is not None
            queue.defer(held[0], conn=conn)
            queue.defer_many(held[1:2], conn=conn)
            queue.delete_many(held[2:], conn=conn)
            one = queue.dequeue(lock_ms=LOCK_MS, conn=conn)
            assert one is not None
            more = queue.complete_and_dequeue([one], limit=2, lock_ms=LOCK_MS, conn=conn)
            for message in more.messages:
                message.delete(conn=conn)
        scans = conn.execute(
            "SELECT relname, seq_scan FROM pg_stat_xact_user_tables"
            " WHERE schemaname = %s AND relname IN ('channel', 'message') ORDER BY relname",
            [queue.schema],
        ).fetchall()
        assert scans == [("channel", 0), ("message", 0)]
        assert conn.execute("SHOW enable_seqscan").fetchone() == ("on",)
        assert conn.execute("SHOW jit").fetchone() == admin.execute("SHOW jit").fetchone()
    # Small enough that the planner, left to itself, reads the channel table whole.
    pages = admin.execute(
        "SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int",
        [f'"{queue.schema}".channel'],
    ).fetchone()
    assert pages is not None
    assert pages[0] <= TINY_TABLE_PAGES


def _rescans_an_array(node: dict[str, Any]) -> bool:
    """A sub-select run once per outer row (a correlated SubPlan, not hashed) that reads a
    function's rows (an array unnested) each time: n * m for arrays of n and m."""
    return (
        node.get("Parent Relationship") == "SubPlan"
        and not str(node.get("Subplan Name", "")).startswith("hashed")
        and any(n["Node Type"] == "Function Scan" for n in _nodes(node))
    )


RIDE_CHANNELS = 2_000
RIDE_LIMIT = 300
# Step 2b: a batch riding along, in one statement, on several busy channels.
RIDE_MANY = (
    "unnest(v_ride, v_ride_at, v_ride_id) WITH ORDINALITY AS f(name, head_at, head_id, ord)"
    " CROSS JOIN LATERAL"
)


def test_a_batch_riding_along_on_many_channels_counts_each_once(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """A batch riding along on busy channels (their rows held by another dequeue) once counted
    (an earlier design) what each channel gave by reading the whole batch once per channel. No
    statement of such a take reads an array once per row of another, in custom or generic plans,
    and the take returns what it should: every channel's first head, then their seconds."""
    admin.execute(_schema_sql("SET search_path = {}", queue.schema))
    with admin.transaction():
        admin.execute(_insert(f"'r' || (g % {RIDE_CHANNELS})", count=2 * RIDE_CHANNELS))
        admin.execute(REBUILD_CHANNELS)
    admin.execute("ANALYZE message")
    admin.execute("ANALYZE channel")
    everyone = tuple(f"r{i}" for i in range(RIDE_CHANNELS))
    plans: list[Plan] = []
    taken: list[list[int]] = []

    with _holding(dsn, queue.schema, everyone), psycopg.connect(dsn, autocommit=True) as conn:
        log_plans(conn, lambda query, root: plans.append(Plan(query, root)))
        # Custom plans first, then (plpgsql caches it after five calls) the generic plan.
        for mode in ["auto"] * 6 + ["force_generic_plan"] * 2:
            conn.execute(f"SET plan_cache_mode = {mode}")
            with conn.transaction(force_rollback=True):
                rows = conn.execute(
                    _schema_sql("SELECT id FROM {}.message_dequeue_many(%s, %s)", queue.schema),
                    (RIDE_LIMIT, LOCK_MS),
                ).fetchall()
            taken.append([row[0] for row in rows])

    rides = [plan for plan in plans if RIDE_MANY in " ".join(plan.query.split())]
    assert len(rides) >= 8, "no batch rode along on several channels"
    rescans = [_describe(plan) for plan in plans if any(map(_rescans_an_array, _nodes(plan.root)))]
    assert not rescans, "\n\n".join(rescans)
    # Each take (rolled back) is the same: both messages of the first channel in turn (the
    # one-channel ride-along takes what it has), then the first head of each next channel
    # in turn, one each (the share of each of the RIDE_LIMIT - 2 channels ridden along on).
    heads = admin.execute(
        "SELECT array_agg(m.id ORDER BY m.dequeue_at, m.id) FROM message m"
        " JOIN channel c ON c.name = m.channel"
        " GROUP BY c.name, c.next_dequeue_at, c.turn ORDER BY c.next_dequeue_at, c.turn"
    ).fetchall()
    expected = heads[0][0] + [row[0][0] for row in heads[1 : RIDE_LIMIT - 1]]
    assert len(expected) == RIDE_LIMIT
    for ids in taken:
        assert ids == expected
