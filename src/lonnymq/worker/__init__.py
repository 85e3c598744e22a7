"""The worker runtime: run a handler on every message, correctly by default.

A :class:`Worker` dequeues in batches to fill its free slots, runs the handler in a thread
per message (at most ``concurrency`` at once), renews each lock well before it expires, finishes
messages whose handler returned, retries those that raised (deferred with backoff, their
saved state kept) and, after ``max_attempts``, finishes them as failed (archived with the
error) or moves them to a dead-letter channel. It sleeps exactly until the next message is
due, and wakes at once on a NOTIFY when the queue publishes events. On SIGTERM/SIGINT it stops
dequeuing, lets running handlers finish within ``grace_s`` and gives back the rest, so no lock
is left to expire.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg
from psycopg import sql

from ..errors import (
    DatabaseUnavailableError,
    InvalidArgumentError,
    LonnyMQError,
    StaleMessageError,
)
from ..queue import Message, Queue
from ._policy import Backoff, error_text

__all__ = ["Backoff", "Worker", "WorkerStats"]

log = logging.getLogger("lonnymq.worker")

Handler = Callable[[Message], object]


@dataclass
class WorkerStats:
    """What a worker did during one ``run``."""

    completed: int = 0
    retried: int = 0
    failed: int = 0
    dead_lettered: int = 0
    lost: int = 0
    given_back: int = 0


@dataclass(eq=False)
class _Task:
    message: Message
    lost: bool = False
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs ``handler(message)`` for the messages of ``queue``; see the module docstring."""

    def __init__(
        self,
        queue: Queue,
        handler: Handler,
        *,
        concurrency: int = 4,
        lock_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        max_attempts: int = 5,
        backoff: Backoff | None = None,
        dead_letter_channel: str | None = None,
        grace_s: float = 30.0,
        idle_ms: int = 5_000,
    ) -> None:
        if not callable(handler):
            raise InvalidArgumentError("handler must be callable")
        for name, value, low in (
            ("concurrency", concurrency, 1),
            ("lock_ms", lock_ms, 100),
            ("max_attempts", max_attempts, 1),
            ("idle_ms", idle_ms, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        heartbeat = heartbeat_ms if heartbeat_ms is not None else lock_ms // 3
        if not isinstance(heartbeat, int) or not 1 <= heartbeat < lock_ms:
            raise InvalidArgumentError(
                f"heartbeat_ms must be an int between 1 and lock_ms, got {heartbeat_ms!r}"
            )
        if grace_s < 0:
            raise InvalidArgumentError(f"grace_s must be >= 0, got {grace_s!r}")
        self.queue = queue
        self.handler = handler
        self.concurrency = concurrency
        self.lock_ms = lock_ms
        self.heartbeat_ms = heartbeat
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.dead_letter_channel = (
            queue.channel(dead_letter_channel).name if dead_letter_channel is not None else None
        )
        self.grace_s = grace_s
        self.idle_ms = idle_ms
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[int, _Task] = {}
        self._rng = random.Random()
        self._clock_offset_ms = 0

    # -- control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no more dequeues; running handlers get ``grace_s``."""
        self._stopping.set()
        self._wake.set()

    def run(self, *, handle_signals: bool = True, until_idle: bool = False) -> WorkerStats:
        """Work until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until nothing
        is waiting or running). Returns what was done."""
        self._stopping.clear()
        previous = self._install_signals() if handle_signals else {}
        helpers = [threading.Thread(target=self._heartbeats, daemon=True, name="lonnymq-hb")]
        event_channel = self._event_channel()
        if event_channel is not None:
            helpers.append(
                threading.Thread(
                    target=self._listen, args=(event_channel,), daemon=True, name="lonnymq-ev"
                )
            )
        for helper in helpers:
            helper.start()
        try:
            self._clock_offset_ms = self._measure_clock()
            self._loop(until_idle)
        finally:
            self._stopping.set()
            self._shutdown()
            self._wake.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.stats

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received signal %s: stopping", signum)
            self.stop()

        previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        return previous

    # -- the dequeue loop ----------------------------------------------------------------

    def _measure_clock(self) -> int:
        """Database clock minus local clock (ms), so that sleeps follow the queue's clock."""
        return self.queue.now() - int(time.time() * 1000)

    def _db_now(self) -> int:
        return int(time.time() * 1000) + self._clock_offset_ms

    def _loop(self, until_idle: bool) -> None:
        failures = 0
        while not self._stopping.is_set():
            with self._lock:
                free = self.concurrency - len(self._running)
            if free <= 0:
                self._wake.wait(self.idle_ms / 1000)
                self._wake.clear()
                continue
            try:
                batch = self.queue.dequeue_batch(free, lock_ms=self.lock_ms)
                failures = 0
            except DatabaseUnavailableError as err:
                failures += 1
                delay = min(30.0, 0.1 * 2**failures)
                log.warning("database unavailable (%s); retrying in %.1fs", err, delay)
                self._stopping.wait(delay)
                continue
            if batch.messages:
                for message in batch.messages:
                    task = _Task(message)
                    with self._lock:
                        self._running[message.id] = task
                    # Daemon threads: a handler that outlives the grace period (its message
                    # already given back) must not keep the process alive.
                    threading.Thread(
                        target=self._execute, args=(task,), daemon=True, name="lonnymq-handler"
                    ).start()
                continue
            with self._lock:
                idle = not self._running
            if until_idle and idle and batch.retry_at is None:
                return
            wait_ms = self.idle_ms
            if batch.retry_at is not None:
                wait_ms = max(0, min(wait_ms, batch.retry_at - self._db_now()))
            self._wake.wait(wait_ms / 1000)
            self._wake.clear()

    # -- one message -----------------------------------------------------------------------

    def _execute(self, task: _Task) -> None:
        message = task.message
        error: BaseException | None = None
        try:
            self.handler(message)
        except Exception as exc:  # the handler's failure is the message's outcome
            error = exc
        try:
            with self._lock:
                skip = task.abandoned or task.lost
            if skip:
                log.warning(
                    "message %s: handler ended after its lock was %s; result not reported",
                    message.id,
                    "given back" if task.abandoned else "lost",
                )
                return
            self._report(message, error)
        except StaleMessageError:
            # The handler may have deferred or finished the message itself.
            log.info("message %s was no longer held when its handler returned", message.id)
        except LonnyMQError as err:
            log.error(
                "message %s: could not report the outcome (%s); its lock will "
                "expire and it will be retried",
                message.id,
                err,
            )
        finally:
            with self._lock:
                self._running.pop(message.id, None)
            task.done.set()
            self._wake.set()

    def _report(self, message: Message, error: BaseException | None) -> None:
        if error is None:
            message.delete()
            self._count("completed")
            return
        text = error_text(error)
        if message.num_attempts < self.max_attempts:
            delay = self.backoff.delay_ms(message.num_attempts, self._rng)
            message.defer(dequeue_at=self._db_now() + delay)
            log.info(
                "message %s failed (attempt %s), retry in %s ms: %s",
                message.id,
                message.num_attempts,
                delay,
                error,
            )
            self._count("retried")
            return
        if self.dead_letter_channel is not None:
            with self.queue.transaction() as conn:
                self.queue.create(message.content, channel=self.dead_letter_channel, conn=conn)
                self.queue.fail(message, error=text, conn=conn)
            self._count("dead_lettered")
        else:
            message.fail(error=text)
            self._count("failed")
        log.error(
            "message %s failed for good after %s attempts: %s",
            message.id,
            message.num_attempts,
            error,
        )

    def _count(self, outcome: str) -> None:
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)

    # -- helpers ---------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        """Renew every running message's lock each ``heartbeat_ms`` (a third of the lock by
        default), so a long handler keeps its message; a lost lock is flagged."""
        while True:
            if self._stopping.is_set():
                # Keep renewing during the grace period, until the last handler is done.
                with self._lock:
                    if not self._running:
                        return
                time.sleep(self.heartbeat_ms / 1000)
            else:
                self._stopping.wait(self.heartbeat_ms / 1000)
            with self._lock:
                tasks = [t for t in self._running.values() if not (t.lost or t.abandoned)]
            for task in tasks:
                if task.done.is_set():
                    continue
                try:
                    task.message.heartbeat(lock_ms=self.lock_ms)
                except StaleMessageError:
                    with self._lock:
                        task.lost = True
                    self._count("lost")
                    log.warning("message %s: lock lost while its handler runs", task.message.id)
                except LonnyMQError as err:
                    log.warning("message %s: heartbeat failed (%s)", task.message.id, err)

    def _event_channel(self) -> str | None:
        try:
            return self.queue.settings().event_channel
        except LonnyMQError as err:
            log.warning("could not read the queue's settings (%s): polling only", err)
            return None

    def _listen(self, channel: str) -> None:
        """Wake the dequeue loop on every event of the queue's NOTIFY channel."""
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.queue.dsn, autocommit=True) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._wake.set()
            except psycopg.Error as err:
                log.warning("event listener lost its connection (%s); reconnecting", err)
                self._stopping.wait(1.0)

    def _shutdown(self) -> None:
        """Give running handlers ``grace_s`` to finish, then give their messages back."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return
            time.sleep(0.02)
        with self._lock:
            tasks = [t for t in self._running.values() if not t.done.is_set()]
            for task in tasks:
                task.abandoned = True
        for task in tasks:
            try:
                task.message.defer()
                self._count("given_back")
                log.warning(
                    "message %s given back: its handler outlived the grace period", task.message.id
                )
            except LonnyMQError as err:
                log.error(
                    "message %s could not be given back (%s); its lock will expire",
                    task.message.id,
                    err,
                )
