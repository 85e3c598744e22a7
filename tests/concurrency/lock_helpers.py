"""Helpers of the concurrency tests: run a call in a thread, and wait until a backend is
blocked on a lock."""

from __future__ import annotations

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
