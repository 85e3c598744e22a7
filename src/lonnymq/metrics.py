"""Observability: counts and timings of every SQL operation (kept by the one place that runs
them), a worker's counters and latency histograms, the Prometheus endpoint that serves them,
and a JSON log formatter."""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["JsonFormatter", "MetricsServer", "OperationStats", "Recorder", "WorkerMetrics"]


@dataclass(frozen=True, slots=True)
class OperationStats:
    """Totals for one named operation since the queue was opened."""

    name: str
    calls: int
    errors: int
    seconds: float

    @property
    def mean_ms(self) -> float:
        """Mean duration of a call in milliseconds (0 when never called)."""
        return 1000 * self.seconds / self.calls if self.calls else 0.0


class Recorder:
    """Thread-safe totals per operation; ``snapshot()`` reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}

    def record(self, name: str, seconds: float, *, ok: bool) -> None:
        with self._lock:
            entry = self._totals.setdefault(name, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += 0 if ok else 1
            entry[2] += seconds

    def snapshot(self) -> list[OperationStats]:
        with self._lock:
            return [
                OperationStats(name, int(calls), int(errors), seconds)
                for name, (calls, errors, seconds) in sorted(self._totals.items())
            ]


# -- worker metrics and the Prometheus endpoint -------------------------------------------

HANDLER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_CHANNEL_LABELS = 1_000
"""Channels beyond this many get the label ``other``: per-user channels must not blow up the
number of series."""


class WorkerMetrics:
    """A worker's counters and handler latency histograms per channel (thread-safe).

    ``count(event, channel)`` counts ``dequeued``, ``completed``, ``handler_error``,
    ``retried``, ``failed``, ``dead_lettered``, ``lost``, ``given_back`` and ``fired``;
    ``observe(channel, seconds)`` records a handler's run time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        # Per channel: the hits of each bucket alone (a run counts in the first bucket it fits:
        # the rendering adds them up), then the sum, then the count.
        self._histograms: dict[str, list[float]] = {}
        self._channels: set[str] = set()
        self.running = 0

    def _label(self, channel: str) -> str:
        if channel in self._channels:
            return channel
        if len(self._channels) >= MAX_CHANNEL_LABELS:
            return "other"
        self._channels.add(channel)
        return channel

    def count(self, event: str, channel: str, n: int = 1) -> None:
        with self._lock:
            key = (event, self._label(channel))
            self._counts[key] = self._counts.get(key, 0) + n

    def observe(self, channel: str, seconds: float) -> None:
        with self._lock:
            label = self._label(channel)
            entry = self._histograms.setdefault(label, [0.0] * (len(HANDLER_BUCKETS) + 2))
            bucket = bisect.bisect_left(HANDLER_BUCKETS, seconds)
            if bucket < len(HANDLER_BUCKETS):
                entry[bucket] += 1
            entry[-2] += seconds
            entry[-1] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        """``{(event, channel): count}`` so far."""
        with self._lock:
            return dict(self._counts)

    def render(
        self,
        operations: list[OperationStats] | Callable[[], list[OperationStats]],
        channels: list[tuple[str, int, int]] | None,
    ) -> str:
        """The Prometheus text format: these counters, the SQL ``operations`` and, when given,
        ``channels`` as ``(name, size, in_flight)``.

        Pass ``operations`` as a callable (``queue.operation_stats``) to have it read after
        these counters: every outcome counted then has its SQL call in the totals (a list read
        before may miss calls made since by a running worker)."""
        out: list[str] = []

        def family(name: str, kind: str, help: str) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            counts = sorted(self._counts.items())
            histograms = sorted((k, list(v)) for k, v in self._histograms.items())
            running = self.running
        if callable(operations):
            operations = operations()
        family("lonnymq_worker_messages_total", "counter", "Messages by what the worker did.")
        for (event, channel), n in counts:
            out.append(
                f"lonnymq_worker_messages_total{{channel={_quote(channel)},"
                f"event={_quote(event)}}} {n}"
            )
        family("lonnymq_handler_seconds", "histogram", "Handler run time.")
        for channel, entry in histograms:
            label = f"channel={_quote(channel)}"
            hits = 0.0
            for bound, alone in zip(HANDLER_BUCKETS, entry, strict=False):
                hits += alone
                out.append(f'lonnymq_handler_seconds_bucket{{{label},le="{bound}"}} {int(hits)}')
            out.append(f'lonnymq_handler_seconds_bucket{{{label},le="+Inf"}} {int(entry[-1])}')
            out.append(f"lonnymq_handler_seconds_sum{{{label}}} {entry[-2]}")
            out.append(f"lonnymq_handler_seconds_count{{{label}}} {int(entry[-1])}")
        family("lonnymq_worker_running", "gauge", "Handlers running in this worker.")
        out.append(f"lonnymq_worker_running {running}")
        family("lonnymq_sql_calls_total", "counter", "SQL operations run.")
        for op in operations:
            out.append(f"lonnymq_sql_calls_total{{operation={_quote(op.name)}}} {op.calls}")
        family("lonnymq_sql_errors_total", "counter", "SQL operations that failed.")
        for op in operations:
            out.append(f"lonnymq_sql_errors_total{{operation={_quote(op.name)}}} {op.errors}")
        family("lonnymq_sql_seconds_total", "counter", "Time spent in SQL operations.")
        for op in operations:
            out.append(f"lonnymq_sql_seconds_total{{operation={_quote(op.name)}}} {op.seconds}")
        if channels is not None:
            family("lonnymq_channel_size", "gauge", "Messages held by the channel.")
            for name, size, _ in channels[:MAX_CHANNEL_LABELS]:
                out.append(f"lonnymq_channel_size{{channel={_quote(name)}}} {size}")
            family("lonnymq_channel_in_flight", "gauge", "Messages of the channel locked now.")
            for name, _, in_flight in channels[:MAX_CHANNEL_LABELS]:
                out.append(f"lonnymq_channel_in_flight{{channel={_quote(name)}}} {in_flight}")
        return "\n".join(out) + "\n"


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'"{escaped}"'


class MetricsServer:
    """A tiny HTTP endpoint serving ``render()`` as Prometheus text on ``/metrics`` from a
    daemon thread. ``port=0`` picks a free port (read it from :attr:`port`)."""

    def __init__(self, render: Callable[[], str], *, port: int, host: str = "0.0.0.0") -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                try:
                    body = render().encode()
                except Exception as err:  # a scrape must not kill the worker
                    self.send_error(500, str(err))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgumentError(f"metrics port must be an int from 0 to 65535, got {port!r}")
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as err:
            raise InvalidArgumentError(f"cannot serve metrics on port {port}: {err}") from err
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="lonnymq-metrics"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


# -- structured logs -----------------------------------------------------------------------

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: time, level, logger, message and the record's extra
    fields (the worker adds ``message_id``, ``channel``, ``attempt``)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
