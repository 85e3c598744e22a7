"""Helpers of the concurrency tests: run a call in a thread, and wait until a backend is
blocked on a lock."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg


def wait_until_blocked(admin: psycopg.Connection[Any], pid: int) -> None:
    """Return once backend ``pid`` waits for a heavyweight lock."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for a lock")


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread; its result (or the exception it raised) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # reported by the test's assertions
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def log_plans(
    conn: psycopg.Connection[Any], on_plan: Callable[[str, dict[str, Any]], None]
) -> None:
    """Have ``conn`` hand the plan of every statement it runs, those inside functions too, to
    ``on_plan(query, plan)`` (``auto_explain``, in JSON, as LOG notices)."""

    def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        head, sep, body = (diagnostic.message_primary or "").partition("plan:")
        if sep and head.startswith("duration:"):
            document = json.loads(body)
            on_plan(document["Query Text"], document["Plan"])

    conn.add_notice_handler(on_notice)
    for setting in (
        "LOAD 'auto_explain'",
        "SET auto_explain.log_min_duration = 0",
        "SET auto_explain.log_nested_statements = on",
        "SET auto_explain.log_format = json",
        "SET client_min_messages = log",
    ):
        conn.execute(setting)
