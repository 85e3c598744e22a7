"""Dequeue throughput while another session holds a snapshot open, and after it ends: lonnymq
against the raw ``SELECT … FOR UPDATE SKIP LOCKED`` queue of ``lonnymq bench``, on one
PostgreSQL, under the same conditions.

    lonnymq bench --long-txn [--hold 180] [--quick]
    python benchmarks/long_txn.py [--dsn DSN] [--hold 180] [--baseline 60] [--after 60]
                                  [--window 10] [--clients 4] [--out DIR] [--quick]

Without ``--dsn`` it uses ``$LONNYMQ_DSN``, else starts the embedded PostgreSQL (autovacuum on)
and stops it at the end.

Both queues run the same steady load, driven by pgbench (the scripts of ``lonnymq bench``):
``--clients`` producers and as many consumers, one message per call; lonnymq's consumers are
durable (each ``complete_and_dequeue`` finishes the message the previous call locked and locks
the next) and its producers spread messages over 100 channels. The queues take turns in
windows of ``--window`` seconds (raw, lonnymq, lonnymq, raw, …), so both see the same server,
the same neighbours and the same age of the held snapshot. Phases:

- ``baseline``: nothing holds a snapshot (``--baseline`` seconds);
- ``hold``: another session has run a query in a REPEATABLE READ transaction and idles in it
  (``--hold`` seconds, the same for both queues since they alternate inside it);
- ``after``: the holder has committed; autovacuum may run (``--after`` seconds);
- ``vacuumed``: after a manual ``VACUUM`` of the queue tables (``--after`` seconds).

Each window records messages consumed per second (messages created, from the id sequence,
minus the growth of the backlog: raw deletes, lonnymq finishes), dequeue latency p50/p99
(pgbench's per-transaction log of the consumers), dead tuples (``pgstattuple``'s count, and
the statistics' ``n_dead_tup``), table and index sizes and the age of the oldest snapshot in
the database, and the pages (buffers) that the first index probe of a dequeue touches
(``EXPLAIN (ANALYZE, BUFFERS)``, no locks taken). Prints a table per phase with hold/baseline
and lonnymq/raw ratios; writes ``long_txn.json`` and ``long_txn.png`` to ``--out`` (default
``benchmarks/results``). The schemas are dropped at the end; ``pgstattuple`` is created in the
raw queue's schema when the database does not have it yet (and so dropped with it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .bench import RAW_DDL, SCRIPTS, pgbench_path
from .embedded import resolve_dsn
from .errors import InvalidArgumentError
from .queue import Queue

__all__ = ["DEFAULT", "QUICK", "Settings", "main", "run_long_txn"]

CHANNELS = 100
LOCK_MS = 60_000
QUEUES = ("raw", "lonnymq")
PHASES = ("baseline", "hold", "after", "vacuumed")
APP = "lonnymq_long_txn"


@dataclass(frozen=True)
class Settings:
    """Durations (seconds) and load of one run."""

    baseline: float
    hold: float
    after: float
    window: float
    clients: int
    prefill: int

    def __post_init__(self) -> None:
        for name in ("baseline", "hold", "after", "window"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgumentError(
                    f"{name} must be a positive number of seconds, got {value}"
                )
        if self.clients < 1:
            raise InvalidArgumentError(f"clients must be at least 1, got {self.clients}")
        if self.prefill < 0:
            raise InvalidArgumentError(f"prefill must not be negative, got {self.prefill}")


DEFAULT = Settings(baseline=60, hold=180, after=60, window=10, clients=4, prefill=20_000)
QUICK = Settings(baseline=2, hold=2, after=2, window=1, clients=2, prefill=2_000)


class LongTxnBench:
    """One run against one server."""

    def __init__(
        self, dsn: str, settings: Settings, schema: str, log: Callable[[str], None] = print
    ) -> None:
        self.dsn = dsn
        self.settings = settings
        self.schema = schema
        self.raw_schema = f"{schema}_raw"
        self.log = log
        self.pgbench = pgbench_path()
        self.tmp = Path(tempfile.mkdtemp(prefix="lonnymq-long-txn-"))
        names = {
            "s": sql.Identifier(self.schema).as_string(),
            "r": sql.Identifier(self.raw_schema).as_string(),
        }
        self.scripts: dict[str, tuple[Path, Path]] = {}
        for kind in QUEUES:
            pair = []
            for step in ("create", "take"):
                path = self.tmp / f"{kind}_{step}.sql"
                path.write_text(SCRIPTS[(kind, step, 1)].format(**names))
                pair.append(path)
            self.scripts[kind] = (pair[0], pair[1])
        self.tables = {
            "raw": [(self.raw_schema, "raw_queue")],
            "lonnymq": [(self.schema, "message"), (self.schema, "channel")],
        }
        self.started = time.monotonic()
        self.windows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.seq = 0
        self.stattuple_schema = self.raw_schema
        self.running: list[subprocess.Popen[str]] = []

    # -- setup ---------------------------------------------------------------------------

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, application_name=APP)

    def setup(self) -> None:
        with self._admin() as conn:
            names = {
                "s": sql.Identifier(self.schema).as_string(),
                "r": sql.Identifier(self.raw_schema).as_string(),
            }
            conn.execute(RAW_DDL.format(**names).encode())
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(self._s()))
        with Queue(self.dsn, schema=self.schema) as queue:
            queue.install()
        with self._admin() as conn:
            conn.execute(
                sql.SQL("CREATE EXTENSION IF NOT EXISTS pgstattuple SCHEMA {}").format(
                    sql.Identifier(self.raw_schema)
                )
            )
            found = conn.execute(
                "SELECT n.nspname FROM pg_extension e "
                "JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'pgstattuple'"
            ).fetchone()
            assert found is not None
            self.stattuple_schema = str(found[0])
            # A backlog, so that consumers never find an empty queue.
            count = self.settings.prefill
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.raw_queue (payload) "
                    "SELECT '\\x00'::bytea FROM generate_series(1, %s)"
                ).format(sql.Identifier(self.raw_schema)),
                (count,),
            )
            conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {}.message_create_many("
                    "ARRAY(SELECT 'c' || (1 + (g %% %s::int)) "
                    "FROM generate_series(1, %s::int) g), "
                    "array_fill('\\x00'::bytea, ARRAY[%s::int]), NULL, NULL)"
                ).format(self._s()),
                (CHANNELS, count, count),
            )
            self._vacuum(conn, analyze=True)

    def teardown(self) -> None:
        for proc in self.running:  # interrupted: stop pgbench before dropping its tables
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        with self._admin() as conn:
            for schema in (self.schema, self.raw_schema):
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )

    def _s(self) -> sql.Identifier:
        return sql.Identifier(self.schema)

    def _vacuum(self, conn: psycopg.Connection[Any], *, analyze: bool = False) -> None:
        verb = sql.SQL("VACUUM (ANALYZE)" if analyze else "VACUUM")
        for kind in QUEUES:
            for schema, table in self.tables[kind]:
                conn.execute(sql.SQL("{} {}").format(verb, sql.Identifier(schema, table)))

    # -- measuring -----------------------------------------------------------------------

    def _stats(self, conn: psycopg.Connection[Any], kind: str) -> dict[str, Any]:
        """Messages so far, dead and live tuples, sizes and vacuums of ``kind``'s tables.

        Messages created are read from the id sequence and messages left from the table, not
        from the cumulative statistics: those can be reset by anyone (``pg_stat_reset``), and
        a shared server sees that. Dead tuples are counted by ``pgstattuple`` (a scan), and
        the statistics' estimate (``n_dead_tup``) is kept next to them.
        """
        out: dict[str, Any] = {}
        for schema, table in self.tables[kind]:
            name = sql.Identifier(schema, table)
            row = conn.execute(
                "SELECT n_dead_tup, pg_relation_size(relid), pg_indexes_size(relid), "
                "last_autovacuum, last_vacuum, autovacuum_count "
                "FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
                (schema, table),
            ).fetchone()
            if row is None:
                raise RuntimeError(f"no statistics for {schema}.{table}")
            exact = conn.execute(
                sql.SQL("SELECT tuple_count, dead_tuple_count FROM {}.pgstattuple(%s)").format(
                    sql.Identifier(self.stattuple_schema)
                ),
                (name.as_string(conn),),
            ).fetchone()
            assert exact is not None
            out[table] = {
                "live_tuples": exact[0],
                "dead_tuples": exact[1],
                "n_dead_tup": row[0],
                "heap_bytes": row[1],
                "index_bytes": row[2],
                "last_autovacuum": row[3].isoformat() if row[3] else None,
                "last_vacuum": row[4].isoformat() if row[4] else None,
                "autovacuum_count": row[5],
            }
        main_schema, main_table = self.tables[kind][0]
        seq = conn.execute(
            "SELECT pg_get_serial_sequence(%s, 'id')",
            (sql.Identifier(main_schema, main_table).as_string(conn),),
        ).fetchone()
        assert seq is not None
        assert seq[0]
        created = conn.execute(
            sql.SQL("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {}").format(
                sql.SQL(seq[0])
            )
        ).fetchone()
        assert created is not None
        out[main_table]["created"] = int(created[0])
        return out

    def _probes(self, conn: psycopg.Connection[Any], kind: str) -> dict[str, Any]:
        """Pages read and time of the index probe each dequeue starts with (EXPLAIN ANALYZE,
        without taking locks): the dead entries a dequeue wades through show up here."""
        if kind == "raw":
            probes = {
                "head": sql.SQL("SELECT id FROM {} ORDER BY id LIMIT 1").format(
                    sql.Identifier(self.raw_schema, "raw_queue")
                )
            }
        else:
            probes = {
                "ready_channel": sql.SQL(
                    "SELECT name FROM {} WHERE next_dequeue_at IS NOT NULL AND "
                    "(max_concurrency IS NULL OR current_concurrency < max_concurrency) "
                    "ORDER BY next_dequeue_at, turn LIMIT 1"
                ).format(sql.Identifier(self.schema, "channel")),
                "channel_head": sql.SQL(
                    "SELECT id FROM {} WHERE channel = 'c1' AND NOT is_locked "
                    "ORDER BY dequeue_at, id LIMIT 1"
                ).format(sql.Identifier(self.schema, "message")),
            }
        out: dict[str, Any] = {}
        for name, query in probes.items():
            row = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}").format(query)
            ).fetchone()
            assert row is not None
            plan = row[0][0]
            top = plan["Plan"]
            out[name] = {
                "pages": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
                "ms": plan.get("Execution Time"),
            }
        return out

    def _oldest_xmin_age(self, conn: psycopg.Connection[Any]) -> int | None:
        row = conn.execute(
            "SELECT max(age(backend_xmin)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND backend_xmin IS NOT NULL"
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else None

    def _pgbench(self, script: Path, tag: str, log_prefix: Path | None) -> subprocess.Popen[str]:
        args = [
            self.pgbench, "-n", "-c", str(self.settings.clients), "-j", "1",
            "-T", str(max(1, round(self.settings.window))), "-f", str(script),
            "-D", f"channels={CHANNELS}", "-D", "id=0", "-D", "na=0", self.dsn,
        ]  # fmt: skip
        if log_prefix is not None:
            args[1:1] = ["-l", f"--log-prefix={log_prefix}"]
        env = {**os.environ, "PGAPPNAME": f"{APP}_{tag}"}
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=self.tmp
        )
        self.running = [p for p in self.running if p.poll() is None] + [proc]
        return proc

    def _wait_gone(self, conn: psycopg.Connection[Any], tag: str) -> None:
        """Wait until pgbench's backends have exited: they flush their statistics first."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (f"{APP}_{tag}",),
            ).fetchone()
            if row and row[0] == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("pgbench's backends did not exit within 60 s")

    def window(self, kind: str, phase: str) -> dict[str, Any]:
        """Run ``kind``'s producers and consumers for one window and record what happened."""
        self.seq += 1
        tag = f"{self.seq}"
        prefix = self.tmp / f"lat_{tag}"
        create, take = self.scripts[kind]
        with self._admin() as conn:
            before = self._stats(conn, kind)
            start = time.monotonic()
            consumer = self._pgbench(take, tag, prefix)
            producer = self._pgbench(create, tag, None)
            for proc in (producer, consumer):
                output, _ = proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"pgbench failed:\n{output[-2000:]}")
            elapsed = time.monotonic() - start
            self._wait_gone(conn, tag)
            after = self._stats(conn, kind)
            xmin_age = self._oldest_xmin_age(conn)
            probes = self._probes(conn, kind)
        main = self.tables[kind][0][1]
        produced = after[main]["created"] - before[main]["created"]
        consumed = produced - (after[main]["live_tuples"] - before[main]["live_tuples"])
        latencies = _read_latencies(prefix)
        seconds = float(max(1, round(self.settings.window)))
        record = {
            "queue": kind,
            "phase": phase,
            "t": start - self.started,
            "wall_seconds": elapsed,
            "seconds": seconds,
            "consumed": consumed,
            "produced": produced,
            "msgs_per_s": consumed / seconds,
            "latencies_ms": latencies,
            "oldest_xmin_age": xmin_age,
            "probes": probes,
            "tables": after,
        }
        self.windows.append(record)
        dead = sum(t["dead_tuples"] for t in after.values())
        lat = _percentiles(latencies)
        pages = "/".join(str(p["pages"]) for p in probes.values())
        self.log(
            f"  {record['t']:7.1f}s  {phase:<9} {kind:<8} {record['msgs_per_s']:>9,.0f} msg/s  "
            f"p50 {_ms(lat['p50_ms']):>8} ms  p99 {_ms(lat['p99_ms']):>8} ms  dead {dead:>9,}  "
            f"probe pages {pages:>9}  xmin age {xmin_age if xmin_age is not None else '-'}"
        )
        return record

    def phase(self, name: str, seconds: float) -> None:
        """Alternate the queues for ``seconds`` (at least one window each)."""
        pairs = max(1, round(seconds / (2 * self.settings.window)))
        for i in range(pairs):
            order = QUEUES if (len(self.windows) // 2) % 2 == 0 else QUEUES[::-1]
            for kind in order:
                self.window(kind, name)
            del i

    def event(self, name: str, **extra: Any) -> None:
        self.events.append({"event": name, "t": time.monotonic() - self.started} | extra)

    def run(self) -> dict[str, Any]:
        s = self.settings
        self.setup()
        self.started = time.monotonic()
        self.log("baseline:")
        self.phase("baseline", s.baseline)
        self.log(f"hold: another session idles in a REPEATABLE READ transaction ({s.hold:.0f}s)")
        with psycopg.connect(self.dsn, application_name=f"{APP}_holder") as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM pg_class").fetchone()  # takes the snapshot
            self.event("hold start")
            held_from = time.monotonic()
            self.phase("hold", s.hold)
            holder.commit()
            self.event("hold end", seconds=time.monotonic() - held_from)
        self.log("after: the holder committed; autovacuum may run")
        self.phase("after", s.after)
        with self._admin() as conn:
            started = time.monotonic()
            self._vacuum(conn)
            self.event("vacuum", seconds=time.monotonic() - started)
        self.log(f"vacuumed: VACUUM of the queue tables took {self.events[-1]['seconds']:.1f}s")
        self.phase("vacuumed", s.after)
        return self.report()

    # -- report --------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        summary: dict[str, dict[str, Any]] = {}
        for kind in QUEUES:
            summary[kind] = {}
            for phase in PHASES:
                rows = [w for w in self.windows if w["queue"] == kind and w["phase"] == phase]
                summary[kind][phase] = _summarise(rows)
            holds = [w for w in self.windows if w["queue"] == kind and w["phase"] == "hold"]
            summary[kind]["hold_end"] = _summarise(holds[-1:])
        ratios: dict[str, Any] = {}
        for kind in QUEUES:
            base = summary[kind]["baseline"]["msgs_per_s"]
            ratios[kind] = {
                phase: (summary[kind][phase]["msgs_per_s"] / base if base else None)
                for phase in (*PHASES[1:], "hold_end")
            }
        ratios["lonnymq_to_raw"] = {
            phase: (
                summary["lonnymq"][phase]["msgs_per_s"] / summary["raw"][phase]["msgs_per_s"]
                if summary["raw"][phase]["msgs_per_s"]
                else None
            )
            for phase in (*PHASES, "hold_end")
        }
        with self._admin() as conn:
            version = conn.execute("SHOW server_version").fetchone()
            server = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', "
                    "'autovacuum_naptime', 'autovacuum_vacuum_cost_delay', "
                    "'idle_in_transaction_session_timeout')"
                ).fetchall()
            )
        return {
            "settings": {
                "baseline": self.settings.baseline,
                "hold": self.settings.hold,
                "after": self.settings.after,
                "window": self.settings.window,
                "clients": self.settings.clients,
                "prefill": self.settings.prefill,
                "channels": CHANNELS,
            },
            "server_version": version[0] if version else None,
            "server_settings": server,
            "events": self.events,
            "windows": [
                {k: v for k, v in w.items() if k != "latencies_ms"}
                | _percentiles(w["latencies_ms"])
                for w in self.windows
            ],
            "summary": summary,
            "ratios": ratios,
        }


def _read_latencies(prefix: Path) -> list[float]:
    """Per-transaction latencies (ms) from pgbench's ``-l`` log files for ``prefix``."""
    out: list[float] = []
    for path in prefix.parent.glob(prefix.name + ".*"):
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3:
                out.append(int(fields[2]) / 1000)
        path.unlink()
    return out


def _percentiles(latencies: list[float]) -> dict[str, float | None]:
    """p50 and p99 of ``latencies`` (ms); None when pgbench logged none (a window in which a
    loaded machine let no call finish)."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    p50 = statistics.median(latencies)
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else p50
    return {"p50_ms": p50, "p99_ms": p99}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    consumed = sum(r["consumed"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    latencies = [x for r in rows for x in r["latencies_ms"]]
    last = rows[-1]["tables"] if rows else {}
    return {
        "windows": len(rows),
        "consumed": consumed,
        "seconds": seconds,
        "msgs_per_s": consumed / seconds if seconds else 0.0,
        **_percentiles(latencies),
        "dead_tuples": {name: t["dead_tuples"] for name, t in last.items()},
        "n_dead_tup": {name: t["n_dead_tup"] for name, t in last.items()},
        "heap_bytes": {name: t["heap_bytes"] for name, t in last.items()},
        "index_bytes": {name: t["index_bytes"] for name, t in last.items()},
    }


def table(report: dict[str, Any]) -> str:
    """The per-phase table: rate, ratio to the baseline, latency, dead tuples, sizes."""
    lines = [
        f"{'phase':<9} {'queue':<8} {'msg/s':>8} {'x base':>7} {'x raw':>6} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'dead tuples':>12} {'heap+idx MB':>12}"
    ]
    summary, ratios = report["summary"], report["ratios"]
    for phase in (*PHASES[:2], "hold_end", *PHASES[2:]):
        for kind in QUEUES:
            row = summary[kind][phase]
            base = 1.0 if phase == "baseline" else ratios[kind][phase]
            vs_raw = ratios["lonnymq_to_raw"][phase] if kind == "lonnymq" else 1.0
            dead = sum(row["dead_tuples"].values())
            size = (sum(row["heap_bytes"].values()) + sum(row["index_bytes"].values())) / 2**20
            lines.append(
                f"{phase:<9} {kind:<8} {row['msgs_per_s']:>8,.0f} {_ratio(base):>7} "
                f"{_ratio(vs_raw):>6} {_ms(row['p50_ms']):>8} {_ms(row['p99_ms']):>8} {dead:>12,} "
                f"{size:>12.1f}"
            )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Throughput and dead tuples over time, per queue; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for kind, color in zip(QUEUES, ("#888888", "#3b7dd8"), strict=True):
        rows = [w for w in report["windows"] if w["queue"] == kind]
        xs = [w["t"] + w["wall_seconds"] / 2 for w in rows]
        label = "raw SKIP LOCKED" if kind == "raw" else f"lonnymq, {CHANNELS} channels"
        top.plot(xs, [w["msgs_per_s"] for w in rows], "o-", color=color, label=label, ms=3)
        bottom.plot(
            xs,
            [sum(t["dead_tuples"] for t in w["tables"].values()) for w in rows],
            "o-",
            color=color,
            label=label,
            ms=3,
        )
    events = {e["event"]: e["t"] for e in report["events"]}
    for ax in (top, bottom):
        if "hold start" in events and "hold end" in events:
            ax.axvspan(events["hold start"], events["hold end"], color="#f2c14e", alpha=0.25)
        if "vacuum" in events:
            ax.axvline(events["vacuum"], color="#c0392b", linestyle="--")
    top.set_ylabel("messages consumed / s")
    top.set_yscale("log")
    top.set_title(
        "Steady load while a REPEATABLE READ transaction idles (shaded); dashed: manual VACUUM"
    )
    top.legend()
    bottom.set_ylabel("dead tuples (pgstattuple)")
    bottom.set_xlabel("seconds since the start")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_long_txn(
    dsn: str,
    settings: Settings = DEFAULT,
    *,
    out: str | os.PathLike[str] = "benchmarks/results",
    schema: str = "lonnymq_long_txn",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark; print the table, write ``long_txn.json`` and ``long_txn.png`` to
    ``out`` and return the report."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = LongTxnBench(dsn, settings, schema, log)
    started = time.perf_counter()
    log(
        f"long transaction bench: {settings.clients} producers + {settings.clients} consumers "
        f"per queue, windows of {settings.window:g}s, hold {settings.hold:g}s"
    )
    with bench._admin() as conn:
        autovacuum = conn.execute("SHOW autovacuum").fetchone()
    log(f"autovacuum: {autovacuum[0] if autovacuum else '?'}")
    try:
        report = bench.run()
    finally:
        bench.teardown()
        shutil.rmtree(bench.tmp, ignore_errors=True)
    report["seconds"] = time.perf_counter() - started
    log("\n" + table(report))
    (out_dir / "long_txn.json").write_text(json.dumps(report, indent=2))
    if plot(report, out_dir / "long_txn.png"):
        log(f"wrote {out_dir / 'long_txn.png'}")
    log(f"wrote {out_dir / 'long_txn.json'} ({report['seconds']:.0f}s)")
    return report


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/long_txn.py``: every duration and size as an option."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dsn", help="default: $LONNYMQ_DSN, else an embedded server (stopped at the end)"
    )
    parser.add_argument("--hold", type=float, default=DEFAULT.hold, help="seconds held")
    parser.add_argument("--baseline", type=float, default=DEFAULT.baseline)
    parser.add_argument("--after", type=float, default=DEFAULT.after, help="each after phase")
    parser.add_argument("--window", type=float, default=DEFAULT.window, help="seconds each")
    parser.add_argument("--clients", type=int, default=DEFAULT.clients, help="per side")
    parser.add_argument("--prefill", type=int, default=DEFAULT.prefill, help="backlog per queue")
    parser.add_argument("--schema", default="lonnymq_long_txn")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        settings = QUICK
    else:
        try:
            settings = Settings(
                args.baseline, args.hold, args.after, args.window, args.clients, args.prefill
            )
        except InvalidArgumentError as err:
            parser.error(str(err))
    run_long_txn(resolve_dsn(args.dsn), settings, out=args.out, schema=args.schema)
    return 0
