"""The demo pipeline (``lonnymq demo``): Spark and Python workers around two queues.

1. Spark generates a day of orders for five tenants, one of them most of the traffic, and
   writes them to a Parquet file (the dataset).
2. Spark ingests it (``df.write.format("lonnymq")``): the orders that need a confirmation
   e-mail into per-tenant channels of the *notifications* queue, whose channels have policies,
   and every order into per-tenant channels of the *orders* queue (each queue just before it
   is drained).
3. Two kinds of worker drain them, one queue after the other (so that each is measured on
   its own): a Python :class:`~lonnymq.worker.Worker` sends the notifications (some fail once
   and are retried with backoff, a few fail for good), and a Spark streaming query
   (``spark.readStream.format("lonnymq")``, Trigger.AvailableNow) processes the orders into a
   Parquet table.
4. Spark reads both archives (``spark.read.format("lonnymq")``, ``table=archive``) and reports
   per tenant: throughput, latency percentiles, retries and fairness (when each tenant was
   done, against one FIFO queue at the same rate), as a table and a PNG chart.

It then checks that every message was finished exactly once, that nothing was lost and that
every policy held; the exit code is 0 only when all of that is true.

This module imports no pyspark (the Spark steps are in :mod:`lonnymq.spark.demo`, imported
once the prerequisites are known to be there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ._core import with_client_timeouts
from ._demo_model import (
    MAX_ATTEMPTS,
    NOTIFY_MIN_CENTS,
    TENANTS,
    QueueReport,
    policies,
    policy_text,
    send_failure,
)
from .embedded import resolve_dsn
from .queue import Message, Queue
from .worker import Backoff, Worker

__all__ = ["run_demo"]

NOTIFY_SCHEMA = "lonnymq_demo"
ORDERS_SCHEMA = "lonnymq_demo_orders"
JAVA_MIN = 17
SEND_S = 0.002
"""How long sending one notification takes (the handler's "work")."""


@dataclass(frozen=True)
class Check:
    """One of the demo's checks."""

    name: str
    ok: bool
    detail: str


# -- prerequisites -------------------------------------------------------------------------


class MissingPrerequisite(Exception):
    """What the demo needs and does not find, with what to do about it."""


def java_version() -> tuple[str, int]:
    """The ``java`` Spark will start (``$JAVA_HOME/bin/java``, else on ``PATH``) and its
    major version; :class:`MissingPrerequisite` when there is none or it is too old."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    how = (
        "Install a JDK or JRE 17 or newer (Debian/Ubuntu: sudo apt-get install "
        "openjdk-17-jre-headless; macOS: brew install openjdk@17) and put its java on PATH or "
        "point JAVA_HOME at it, then run the demo again."
    )
    if not java or not Path(java).exists():
        where = f"JAVA_HOME={java_home} has no bin/java" if java_home else "no java on PATH"
        raise MissingPrerequisite(
            f"the demo runs Spark, which needs Java {JAVA_MIN}+ ({where}).\n{how}"
        )
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as err:
        raise MissingPrerequisite(f"could not run {java}: {err}.\n{how}") from None
    text = out.stderr + out.stdout
    found = re.search(r'version "(\d+)(?:\.(\d+))?[^"]*"', text)
    if found is None:
        raise MissingPrerequisite(f"could not tell the version of {java}:\n{text.strip()}\n{how}")
    major = int(found.group(1))
    if major == 1 and found.group(2):  # "1.8.0_392" is Java 8
        major = int(found.group(2))
    if major < JAVA_MIN:
        raise MissingPrerequisite(
            f"the demo runs Spark, which needs Java {JAVA_MIN}+; {java} is Java {major}.\n{how}"
        )
    return java, major


def check_packages(*, dashboard: bool = False) -> None:
    """pyspark, pyarrow and matplotlib: the ``demo`` extra; with ``dashboard``, also the
    ``dashboard`` extra (which the ``demo`` extra includes)."""
    wanted = ["pyspark", "pyarrow", "matplotlib"]
    if dashboard:
        wanted += ["starlette", "jinja2", "uvicorn"]
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingPrerequisite(
            f"the demo needs {', '.join(missing)}: pip install 'lonnymq[demo]' "
            f"(./scripts/demo.sh installs it into .venv)"
        )


# -- what the user sees while it runs ------------------------------------------------------


@contextmanager
def _every(seconds: float, tick: Callable[[], None]) -> Iterator[None]:
    """Call ``tick`` every ``seconds`` from a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(seconds):
            tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Display:
    """Progress on a terminal (rich spinners and bars), plain timestamped lines otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._started = time.monotonic()
        self.console: Any = None
        if self.tty:
            from rich.console import Console

            self.console = Console(highlight=False)

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def line(self, text: str) -> None:
        stamp = f"[{self.elapsed():6.1f}s]"
        if self.console is not None:
            self.console.print(f"[dim]{stamp}[/dim] {text}", markup=True)
        else:
            print(f"{stamp} {_plain(text)}", flush=True)

    @contextmanager
    def step(self, doing: str) -> Iterator[list[str]]:
        """A step: a spinner while it runs, then one line with what it did (the caller
        appends it to the yielded list)."""
        started = time.monotonic()
        done: list[str] = []
        if self.console is not None:
            with self.console.status(f"{doing} …"):
                yield done
        else:
            yield done
        took = time.monotonic() - started
        self.line(f"{done[0] if done else doing} [dim]({took:.1f}s)[/dim]")

    @contextmanager
    def bars(self, tracks: Sequence[tuple[str, int, Callable[[], int]]]) -> Iterator[None]:
        """Progress of work running meanwhile: per track its label, total and a function
        returning how much is done (polled from a thread)."""

        def poll(track: tuple[str, int, Callable[[], int]]) -> int:
            try:
                return min(track[1], track[2]())
            except Exception:  # progress is best effort: the work reports its own errors
                return 0

        if self.console is not None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            progress = Progress(
                TextColumn("{task.description:<34}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            tasks = [progress.add_task(label, total=total) for label, total, _ in tracks]

            def show() -> None:
                for task, track in zip(tasks, tracks, strict=True):
                    progress.update(task, completed=poll(track))

            with progress:
                try:
                    with _every(0.3, show):
                        yield
                finally:
                    show()  # the final counts, while the bars are still on screen
            return

        def report() -> None:
            parts = []
            for track in tracks:
                label, total, _ = track
                n = poll(track)
                parts.append(f"{label} {n:,}/{total:,} ({100 * n / max(total, 1):.0f}%)")
            self.line(" · ".join(parts))

        with _every(5, report):
            yield

    def table(
        self, title: str, headers: list[str], rows: list[list[str]], *, text_columns: int = 1
    ) -> None:
        """Left-aligned text in the first ``text_columns`` columns, numbers in the rest."""
        if self.console is not None:
            from rich.table import Table

            table = Table(*headers, title=title, title_justify="left")
            for column in table.columns[text_columns:]:
                column.justify = "right"
            for row in rows:
                table.add_row(*row)
            self.console.print()
            self.console.print(table)
            return
        print(f"\n{title}")
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
        for line in [headers, *rows]:
            cells = [
                cell.ljust(w) if i < text_columns else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            ]
            print("  ".join(cells).rstrip())
        sys.stdout.flush()


def _plain(text: str) -> str:
    """Rich markup removed."""
    return re.sub(r"\[/?(?:dim|bold|green|red|yellow|cyan)\]", "", text)


# -- the Python worker's side --------------------------------------------------------------


class NotificationHandler:
    """Sends one notification (it sleeps ``SEND_S``) and keeps what the worker did per
    channel: how many ran at once, and how often each message was completed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.completions: Counter[int] = Counter()
        self.finished = 0

    def __call__(self, message: Message) -> None:
        order = json.loads(message.content)
        channel = message.channel
        with self._lock:
            self.in_flight[channel] += 1
            self.max_in_flight[channel] = max(self.max_in_flight[channel], self.in_flight[channel])
        try:
            time.sleep(SEND_S)
            failure = send_failure(order["order_id"], order["customer_id"], message.num_attempts)
            if failure is not None:
                raise failure
        finally:
            with self._lock:  # before the worker gives the message's slot back
                self.in_flight[channel] -= 1
        with self._lock:
            self.completions[message.id] += 1


@contextmanager
def _worker_log(path: Path) -> Iterator[None]:
    """The worker's log (a line per failed attempt) goes to ``path``, not the terminal."""
    logger = logging.getLogger("lonnymq.worker")
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _reset_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _left(queue: Queue) -> int:
    return sum(s.size for s in queue.stats())


# -- the pipeline --------------------------------------------------------------------------


def run_demo(
    *,
    dsn: str | None,
    rows: int,
    workers: int,
    out: str | os.PathLike[str],
    batch: int,
    dashboard: int | None = None,
) -> int:
    """Run the demo pipeline; returns the process exit code (0 when every check held).
    ``dashboard``: serve both queues' dashboard, read-only, on that port of 127.0.0.1 (0: any
    free port) while the demo runs."""
    display = Display()
    try:
        check_packages(dashboard=dashboard is not None)
        java, major = java_version()
    except MissingPrerequisite as err:
        print(f"lonnymq demo: {err}", file=sys.stderr)
        return 1
    from .spark import demo as spark_demo

    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    display.line(
        f"[bold]lonnymq demo[/bold]: {rows:,} orders, {workers} Python handlers, "
        f"Spark micro-batches of {batch:,}; output in {out_dir}"
    )
    with display.step("Starting PostgreSQL") as step:
        embedded = not (dsn or os.environ.get("LONNYMQ_DSN"))
        dsn = with_client_timeouts(resolve_dsn(dsn))
        for schema in (NOTIFY_SCHEMA, ORDERS_SCHEMA):
            _reset_schema(dsn, schema)
        with psycopg.connect(dsn) as conn:
            version = conn.info.server_version
        step.append(
            f"PostgreSQL {version // 10000}.{version % 10000} "
            f"({'embedded' if embedded else 'LONNYMQ_DSN'}); schemas {NOTIFY_SCHEMA} "
            f"(notifications) and {ORDERS_SCHEMA} (orders) created with an archive"
        )
        with Queue(dsn, schema=NOTIFY_SCHEMA) as q:
            q.install(archive=True)
        with Queue(dsn, schema=ORDERS_SCHEMA) as q:
            q.install(archive=True)

    with contextlib.ExitStack() as stack:
        if dashboard is not None:
            from .dashboard._serve import Background

            served = Background(dsn, [NOTIFY_SCHEMA, ORDERS_SCHEMA], port=dashboard, read_only=True)
            stack.callback(served.close)
            display.line(f"The dashboard (read-only) is on {served.url} while the demo runs")
        with display.step("Starting Spark") as step:
            spark = spark_demo.start_spark(out_dir / "spark.log")
            step.append(
                f"Spark {spark.version} on local[2] (Java {major}, {java}); "
                f"its log: {out_dir / 'spark.log'}"
            )
        stack.callback(spark_demo.stop_spark, spark)
        return _pipeline(
            spark=spark,
            spark_demo=spark_demo,
            display=display,
            dsn=dsn,
            rows=rows,
            workers=workers,
            out_dir=out_dir,
            batch=batch,
        )


def _pipeline(
    *,
    spark: Any,
    spark_demo: Any,
    display: Display,
    dsn: str,
    rows: int,
    workers: int,
    out_dir: Path,
    batch: int,
) -> int:
    checks: list[Check] = []
    with display.step("Generating the dataset") as step:
        dataset = spark_demo.generate_orders(spark, rows, out_dir / "orders.parquet")
        shares = ", ".join(f"{t} {100 * n / max(rows, 1):.0f}%" for t, n in dataset.orders.items())
        step.append(
            f"Spark generated {dataset.rows:,} orders ({shares}) into {dataset.path.name}; "
            f"{sum(dataset.notifications.values()):,} of {NOTIFY_MIN_CENTS // 100:,} or more "
            f"need a confirmation e-mail"
        )
    checks.append(Check("dataset", dataset.rows == rows, f"{dataset.rows:,} rows"))

    policy = policies(workers, dataset.notifications)
    notify_q = Queue(dsn, schema=NOTIFY_SCHEMA, pool_size=workers + 4)
    orders_q = Queue(dsn, schema=ORDERS_SCHEMA, pool_size=2)
    with notify_q, orders_q:
        for tenant, p in policy.items():
            if p:
                notify_q.channel(tenant).set_policy(
                    max_concurrency=p.get("max_concurrency"),
                    release_interval_ms=p.get("release_interval_ms"),
                    max_size=p.get("max_size"),
                )
        display.line(
            "Notification channel policies: "
            + "; ".join(f"{t} {policy_text(p)}" for t, p in policy.items() if p)
        )
        with display.step("Ingesting notifications") as step:
            notified = spark_demo.ingest_notifications(spark, dataset, dsn, NOTIFY_SCHEMA)
            step.append(
                f"Spark enqueued {notified.created:,} notifications into {NOTIFY_SCHEMA} "
                f"({notified.dropped:,} dropped by max_size)"
            )
        offered = sum(dataset.notifications.values())
        capped = next(t.name for t in TENANTS if t.policy == "max_size")
        capped_size = next(s.size for s in notify_q.stats() if s.channel == capped)
        max_size = policy[capped]["max_size"]
        checks.append(
            Check(
                "max_size held",
                notified.created + notified.dropped == offered
                and capped_size == min(max_size, dataset.notifications[capped])
                and set(notified.dropped_channels) <= {capped},
                f"{capped} holds {capped_size} of {dataset.notifications[capped]} "
                f"(max_size={max_size}); {notified.dropped} dropped, all from it",
            )
        )

        handler = NotificationHandler()
        worker = Worker(
            notify_q,
            handler,
            concurrency=workers,
            lock_ms=30_000,
            # Reported every 2 s (not the default 10 s): the dashboard's served per second
            # and shares of service follow the run closely.
            heartbeat_ms=2_000,
            max_attempts=MAX_ATTEMPTS,
            backoff=Backoff(base_ms=200, max_ms=1_000),
        )
        display.line(f"A Python Worker ({workers} handlers) sends the notifications")
        track = ("notifications · Python Worker", notified.created)
        started = time.monotonic()
        with (
            _worker_log(out_dir / "worker.log"),
            display.bars([(*track, lambda: worker.stats.completed + worker.stats.failed)]),
        ):
            worker.run(handle_signals=False, until_idle=True)
        display.line(
            f"Sent {worker.stats.completed:,} notifications in {time.monotonic() - started:.1f}s "
            f"({worker.stats.retried:,} retried, {worker.stats.failed:,} failed for good; "
            f"the worker's log: worker.log)"
        )

        with display.step("Ingesting orders") as step:
            ingested = spark_demo.ingest_orders(spark, dataset, dsn, ORDERS_SCHEMA)
            step.append(f"Spark enqueued {ingested.created:,} orders into {ORDERS_SCHEMA}")
        stream = spark_demo.OrderStream(
            spark,
            dsn,
            ORDERS_SCHEMA,
            path=out_dir / "processed-orders.parquet",
            batch=batch,
            on_restart=lambda why: display.line(
                f"[yellow]The streaming query failed to start ({why}); started again from "
                f"its checkpoint[/yellow]"
            ),
        )
        display.line(
            f"A Spark streaming query (Trigger.AvailableNow) processes the orders into "
            f"{stream.path.name}"
        )
        started = time.monotonic()
        with display.bars([("orders · Spark streaming query", ingested.created, stream.processed)]):
            try:
                stream.start()
                stream.wait()
            finally:
                stream.stop()
        display.line(
            f"Processed {stream.processed():,} orders in {time.monotonic() - started:.1f}s "
            f"({stream.batches()} micro-batches)"
        )

        with display.step("Reading the archives") as step:
            notify_archive = spark_demo.read_archive(spark, dsn, NOTIFY_SCHEMA)
            orders_archive = spark_demo.read_archive(spark, dsn, ORDERS_SCHEMA)
            reports = [
                spark_demo.archive_report(
                    notify_archive, NOTIFY_SCHEMA, "Notifications (Python Worker)", policy
                ),
                spark_demo.archive_report(
                    orders_archive, ORDERS_SCHEMA, "Orders (Spark streaming query)", {}
                ),
            ]
            fates = spark_demo.notification_fates(notify_archive)
            notify_archive.unpersist()
            orders_archive.unpersist()
            processed = spark_demo.processed_totals(spark, stream.path)
            step.append(
                f"Spark read {sum(r.messages for r in reports):,} archived messages and "
                f"{processed.rows:,} processed orders"
            )
        left_notify, left_orders = _left(notify_q), _left(orders_q)

    checks += _checks(
        dataset=dataset,
        notified=notified,
        ingested=ingested,
        reports=reports,
        fates=fates,
        processed=processed,
        handler=handler,
        policy=policy,
        left_notify=left_notify,
        left_orders=left_orders,
    )
    for report in reports:
        _print_report(display, report)
    chart = out_dir / "report.png"
    _chart(reports, chart, rows)
    (out_dir / "report.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "workers": workers,
                "batch": batch,
                "runtime_s": round(display.elapsed(), 1),
                "queues": [asdict(r) for r in reports],
                "checks": [asdict(c) for c in checks],
            },
            indent=1,
        )
    )
    print()
    for check in checks:
        mark = "[green]ok[/green]  " if check.ok else "[red]FAIL[/red]"
        text = f"{mark} {check.name}: {check.detail}"
        if display.console is not None:
            display.console.print(text)
        else:
            print(_plain(text.replace("[red]FAIL[/red]", "FAIL")))
    ok = all(c.ok for c in checks)
    display.line(
        f"Chart: {chart}; numbers: {out_dir / 'report.json'}. "
        + ("All checks held." if ok else "[red]A check FAILED[/red] (see above).")
    )
    return 0 if ok else 1


def _checks(
    *,
    dataset: Any,
    notified: Any,
    ingested: Any,
    reports: list[QueueReport],
    fates: Any,
    processed: Any,
    handler: NotificationHandler,
    policy: dict[str, dict[str, int]],
    left_notify: int,
    left_orders: int,
) -> list[Check]:
    notify, orders = reports
    checks = []
    twice = [i for i, n in handler.completions.items() if n > 1]
    checks.append(
        Check(
            "notifications finished exactly once",
            notify.messages == notified.created
            and left_notify == 0
            and not twice
            and fates.distinct_keys == notify.messages
            and fates.mismatched == 0,
            f"{notify.messages:,} archived of {notified.created:,} enqueued, {left_notify} left; "
            f"completed twice: {len(twice)}; outcome other than its fate: {fates.mismatched}",
        )
    )
    for tenant in notify.tenants:
        limits = policy.get(tenant.tenant, {})
        if "max_concurrency" in limits:
            seen = handler.max_in_flight[tenant.tenant]
            checks.append(
                Check(
                    "max_concurrency held",
                    seen <= limits["max_concurrency"],
                    f"{tenant.tenant}: at most {seen} handlers at once "
                    f"(max_concurrency={limits['max_concurrency']})",
                )
            )
        if "release_interval_ms" in limits:
            gap = tenant.min_gap_ms
            checks.append(
                Check(
                    "release_interval_ms held",
                    gap is None or gap >= limits["release_interval_ms"],
                    f"{tenant.tenant}: smallest gap between two dequeues {gap} ms "
                    f"(release_interval_ms={limits['release_interval_ms']})",
                )
            )
    expected = dataset.orders
    checks.append(
        Check(
            "orders processed exactly once",
            orders.messages == ingested.created == dataset.rows
            and left_orders == 0
            and processed.rows == processed.distinct_orders == dataset.rows
            and processed.by_tenant == dataset.revenue,
            f"{orders.messages:,} archived of {ingested.created:,} enqueued, {left_orders} left; "
            f"{processed.rows:,} processed ({processed.distinct_orders:,} distinct); "
            f"orders and revenue per tenant "
            f"{'match' if processed.by_tenant == dataset.revenue else 'DIFFER from'} the dataset "
            f"({sum(expected.values()):,} orders)",
        )
    )
    return checks


def _ms(value: float) -> str:
    return f"{value / 1000:.2f}s" if value >= 1000 else f"{value:.0f}ms"


def _print_report(display: Display, report: QueueReport) -> None:
    headers = [
        "tenant", "policy", "messages", "failed", "retries", "msg/s",
        "p50", "p95", "p99", "done at", "FIFO est.",
    ]  # fmt: skip
    rows = [
        [
            t.tenant,
            t.policy,
            f"{t.messages:,}",
            f"{t.failed:,}",
            f"{t.retries:,}",
            f"{t.throughput:,.0f}",
            _ms(t.p50_ms),
            _ms(t.p95_ms),
            _ms(t.p99_ms),
            f"{t.done_s:.1f}s",
            f"{t.fifo_done_s:.1f}s",
        ]
        for t in report.tenants
    ]
    rows.append(
        [
            "all",
            "",
            f"{report.messages:,}",
            f"{sum(t.failed for t in report.tenants):,}",
            f"{sum(t.retries for t in report.tenants):,}",
            f"{report.throughput:,.0f}",
            "",
            "",
            "",
            f"{report.span_s:.1f}s",
            f"{report.span_s:.1f}s",
        ]
    )
    display.table(f"{report.title}: {report.schema}.archive", headers, rows, text_columns=2)


def _chart(reports: list[QueueReport], path: Path, rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(
        zip(
            [t.name for t in TENANTS],
            ["#d1495b", "#edae49", "#66a182", "#00798c", "#8d96a3"],
            strict=True,
        )
    )
    fig, axes = plt.subplots(2, len(reports), figsize=(6.5 * len(reports), 8.5))
    for column, report in enumerate(reports):
        ax = axes[0][column]
        for tenant in report.tenants:
            points = report.timeline.get(tenant.tenant, [])
            if not points:
                continue
            xs = [0.0] + [t for t, _ in points]
            ys = [0.0] + [100 * n / max(tenant.messages, 1) for _, n in points]
            ax.step(xs, ys, where="post", label=tenant.tenant, color=colors.get(tenant.tenant))
        ax.plot([0, report.span_s], [0, 100], "--", color="#888", label="one FIFO queue (est.)")
        ax.set_title(f"{report.title}\nshare of each tenant's messages finished")
        ax.set_xlabel("seconds after the drain started")
        ax.set_ylabel("% finished")
        ax.set_ylim(0, 102)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)

        ax = axes[1][column]
        names = [t.tenant for t in report.tenants]
        width = 0.27
        for i, (label, key) in enumerate([("p50", "p50_ms"), ("p95", "p95_ms"), ("p99", "p99_ms")]):
            values = [getattr(t, key) / 1000 for t in report.tenants]
            ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("latency, seconds (created → finished)")
        ax.set_title("latency per tenant")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"lonnymq demo: {rows:,} orders")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
