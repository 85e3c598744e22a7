# Generated from queue_async.py by tools/async_to_sync.py: do not edit.
# Change queue_async.py and run `python tools/async_to_sync.py`.
"""The sync API: :class:`Queue`, :class:`Channel` and :class:`Message`.

Derived from ``queue_async.py``; see the header.
"""

from __future__ import annotations

import math
import os
import select
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import monotonic, perf_counter
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg import Connection, Cursor, sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from . import _core, migrate
from . import archive as _archive
from . import events as _events
from . import schedule as _schedule
from .archive import ArchivedMessage, ReplayResult
from .embedded import check_data_dir, embedded_dsn, resolve_dsn
from .errors import (
    ChannelFullError,
    DatabaseError,
    InvalidArgumentError,
    MessageNotFoundError,
    PermissionDeniedError,
    StaleMessageError,
    translate,
)
from .events import Event, MessageOutcome
from .metrics import OperationStats, Recorder
from .schedule import Firing, Schedule, ScheduleSpec
from .types import (
    AckStatus,
    ChannelStats,
    CreateResult,
    CreateStatus,
    DequeueBatch,
    Discrepancy,
    NewMessage,
    Outcome,
    OutcomeKind,
    RoleGrant,
    RoleKind,
    Settings,
)

__all__ = ["Channel", "Message", "Queue"]

Row = tuple[Any, ...]

RECONNECT_GIVE_UP_S = 5.0
"""Seconds the pool retries one lost connection (1 s backoff, doubling) before giving up."""

DEFAULT_POOL_TIMEOUT_S = 30.0
"""Seconds a call waits for a connection (the server down, or every pooled connection busy)
before it raises ``DatabaseUnavailableError``; ``pool_timeout`` of a queue changes it."""

CONFLICT_RETRIES = 3
"""How many times an operation without ``conn=`` that PostgreSQL rolled back for a concurrent
transaction (a deadlock, a serialization failure) is run again before it raises
``TransactionConflictError``."""


@dataclass(frozen=True, slots=True)
class Message:
    """A locked message, as ``dequeue`` returns it.

    You hold it until ``unlock_at`` (ms, database clock): finish it with :meth:`delete`, give
    it back with :meth:`defer`, or keep it longer with :meth:`heartbeat`. Each of these is
    refused with :class:`~lonnymq.errors.StaleMessageError` once the lock is lost.
    """

    id: int
    channel: str
    content: bytes
    state: bytes | None
    num_attempts: int
    dequeue_at: int
    unlock_at: int
    queue: Queue = field(repr=False, compare=False)

    def delete(self, *, conn: Connection[Any] | None = None) -> None:
        """Finish the message (it is done) and free its channel slot."""
        self.queue.delete(self, conn=conn)

    def fail(self, *, error: str, conn: Connection[Any] | None = None) -> None:
        """Finish the message as failed (archived with ``error`` when the archive is on)."""
        self.queue.fail(self, error=error, conn=conn)

    def defer(
        self,
        *,
        dequeue_at: int | None = None,
        state: bytes | None = None,
        conn: Connection[Any] | None = None,
    ) -> None:
        """Give the message back, to be dequeued again at ``dequeue_at`` (default now).

        The attempt count is kept; ``state``, when given, replaces the saved state.
        """
        self.queue.defer(self, dequeue_at=dequeue_at, state=state, conn=conn)

    def heartbeat(self, *, lock_ms: int, conn: Connection[Any] | None = None) -> int:
        """Extend the lock to now + ``lock_ms``; returns the new unlock time (ms)."""
        return self.queue.heartbeat(self, lock_ms=lock_ms, conn=conn)


_POOLED_SETTINGS = "SET default_transaction_isolation TO 'read committed'"
"""What the queue sets on each pooled connection: its own statements run at READ COMMITTED
whatever the server's or the role's default (see ``_check_isolation``)."""

_RESTORE_STATEMENT = "SET SESSION AUTHORIZATION DEFAULT; RESET ALL; " + _POOLED_SETTINGS
"""What undoes the settings a caller made on a connection that ``transaction()`` lent: the
role the connection logged in as (``RESET ALL`` leaves a ``SET ROLE`` in place), every setting
back to the connection's start (the server's, role's and DSN's values), then the pool's own
settings again."""

_ISOLATION_STATEMENT = "SHOW transaction_isolation"
"""The level the next statement on a connection runs at: of its transaction when one is open,
else the session's default (which the server, the role, the database or the DSN's options
set)."""


def _check_pooled(conn: Connection[Any]) -> None:
    """Refuse a pooled connection that the server closed while it sat idle (a restart, an
    administrator's kill): the pool discards it and hands out another, so the first call after
    the server comes back does not fail. It only polls the socket, no round trip."""
    pgconn = conn.pgconn
    # An idle connection receives nothing but notices, notifications or the server's goodbye
    # (an error message, then the end of the stream: two reads).
    for _ in range(3):
        if pgconn.status != ConnStatus.OK:
            break
        readable, _, _ = select.select([pgconn.socket], [], [], 0)
        if not readable:
            return
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            break
    else:
        return
    raise psycopg.OperationalError("the pooled connection was closed by the server")


def _restore_lent(conn: Connection[Any]) -> None:
    """Undo what a caller may have set on a pooled connection ``transaction()`` lent, before
    the pool hands it out again: psycopg's factories, and the session's settings. One that
    cannot be restored is closed, and the pool replaces it."""
    conn.row_factory = tuple_row
    conn.cursor_factory = Cursor
    if conn.closed:
        return
    try:
        with _cursor(conn) as cursor:
            cursor.execute(_RESTORE_STATEMENT)
    except psycopg.Error:
        conn.close()


def _regrow(pool: ConnectionPool) -> None:
    """The pool gave up on a reconnection (the server stayed down longer than
    ``RECONNECT_GIVE_UP_S``). The pool grows again only when a new caller arrives, so callers
    already waiting would sit out their whole timeout after the server is back: when there
    are any, start a new attempt now (``check()`` grows an empty pool)."""
    if pool.get_stats().get("requests_waiting", 0):
        pool.check()


class Channel:
    """A channel of a queue: a fair, policy-controlled sub-queue (``queue.channel(name)``)."""

    def __init__(self, queue: Queue, name: str) -> None:
        self._queue = queue
        self.name = _core.check_channel(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def set_policy(
        self,
        *,
        max_concurrency: int | None = None,
        release_interval_ms: int | None = None,
        max_size: int | None = None,
        conn: Connection[Any] | None = None,
    ) -> None:
        """Set the channel's policy (``None`` = unlimited); it applies at once.

        ``max_concurrency``: messages locked at once (0 pauses the channel);
        ``release_interval_ms``: minimum gap between two dequeues; ``max_size``: messages held
        (a create beyond it is ``dropped``). The policy stays when the channel empties.
        """
        policy = _core.check_policy(max_concurrency, release_interval_ms, max_size)
        self._queue._fetch(
            "channel_policy_set",
            {
                "channel": self.name,
                "max_concurrency": policy.max_concurrency,
                "release_interval_ms": policy.release_interval_ms,
                "max_size": policy.max_size,
            },
            conn,
        )

    def clear_policy(self, *, conn: Connection[Any] | None = None) -> None:
        """Remove the channel's policy: unlimited from now on."""
        self._queue._fetch("channel_policy_clear", {"channel": self.name}, conn)

    def create(
        self,
        content: bytes,
        *,
        dequeue_at: int | None = None,
        dedup_key: str | None = None,
        priority: int | None = None,
        conn: Connection[Any] | None = None,
    ) -> CreateResult:
        """Create a message in this channel; see :meth:`Queue.create`."""
        return self._queue.create(
            content,
            channel=self.name,
            dequeue_at=dequeue_at,
            dedup_key=dedup_key,
            priority=priority,
            conn=conn,
        )

    def stats(self, *, conn: Connection[Any] | None = None) -> ChannelStats | None:
        """This channel's stats, or ``None`` when it holds nothing and has no policy."""
        for stats in self._queue.stats(conn=conn):
            if stats.channel == self.name:
                return stats
        return None


class Queue:
    """A queue installed in one PostgreSQL schema.

    ``dsn`` is any libpq connection string; ``None`` uses ``$LONNYMQ_DSN`` or, when that is
    unset too, the embedded server. Operations borrow a connection from a pool (each one its
    own transaction), or run on the caller's connection inside the caller's transaction when
    given ``conn=``. A call waits at most ``pool_timeout`` seconds for a connection (the
    server down, or all ``pool_size`` connections busy), then raises
    ``DatabaseUnavailableError``.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "lonnymq",
        event_channel: str | None = None,
        pool_size: int = 10,
        pool_timeout: float = DEFAULT_POOL_TIMEOUT_S,
    ) -> None:
        if dsn is not None and (not isinstance(dsn, str) or "\x00" in dsn):
            raise InvalidArgumentError(
                f"dsn must be None or a connection string without NUL, got {type(dsn).__name__}"
            )
        self._schema = _core.check_schema(schema)
        self._event_channel = _core.check_event_channel(event_channel)
        if not isinstance(pool_size, int) or pool_size < 1:
            raise InvalidArgumentError(f"pool_size must be a positive int, got {pool_size!r}")
        self._dsn = None if dsn is None else _core.with_client_timeouts(dsn)
        # Set by embedded(): the data directory whose server to start at first use.
        self._data_dir: Path | None = None
        self._pool_size = pool_size
        self._pool_timeout = _core.check_pool_timeout(pool_timeout)
        self._pool: ConnectionPool | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        # Set once maintain() was refused: it is not asked again (each refusal is an error in
        # the server's log, and a worker would ask every second).
        self._maintain_refused = False
        # Set once settle() was refused (a worker role granted before it existed): it then
        # reports through the calls that role may make.
        self._settle_refused = False
        self._sql = _core.Statements(self._schema)
        self._recorder = Recorder()
        # The pool's connections (configured at READ COMMITTED): an operation passed one as
        # conn= (from transaction(), or inside the queue) does not ask the server its level.
        self._own: weakref.WeakSet[Connection[Any]] = weakref.WeakSet()

    @classmethod
    def embedded(
        cls,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        schema: str = "lonnymq",
        event_channel: str | None = None,
        pool_size: int = 10,
        pool_timeout: float = DEFAULT_POOL_TIMEOUT_S,
    ) -> Self:
        """A queue on the embedded PostgreSQL in ``data_dir``, which the first call that needs
        the database starts if it is not running."""
        queue = cls(
            None,
            schema=schema,
            event_channel=event_channel,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
        )
        queue._data_dir = check_data_dir(data_dir)
        return queue

    @property
    def schema(self) -> str:
        """The schema the queue lives in."""
        return self._schema

    @property
    def dsn(self) -> str:
        """The connection string in use: the one given, with a ``connect_timeout`` of 10 s
        added when neither it nor ``PGCONNECT_TIMEOUT`` sets one, TCP keepalives when it sets
        none and a ``tcp_user_timeout`` of 60 s when it sets none, unless it names a service
        (``service=``, ``PGSERVICE``). With none given it is resolved when
        first needed: read before the first call, it starts the embedded server (if that is
        where it points) in this thread, blocking it while the server starts."""
        if self._dsn is None:
            self._dsn = _core.with_client_timeouts(self._resolve_dsn())
        return self._dsn

    def _resolve_dsn(self) -> str:
        if self._data_dir is not None:
            return embedded_dsn(self._data_dir)
        return resolve_dsn(None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(schema={self._schema!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool. The queue cannot be used afterwards."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- the one place that runs SQL -----------------------------------------------------

    def _get_pool(self) -> ConnectionPool:
        if self._pool is not None:
            return self._pool
        with self._pool_lock:
            if self._closed:
                raise InvalidArgumentError("this queue was closed")
            if self._pool is None:
                if self._dsn is None:
                    # Starting the embedded server takes seconds: off the event loop, if any.
                    resolved = self._resolve_dsn()
                    self._dsn = _core.with_client_timeouts(resolved)
                self._probe()
                pool = ConnectionPool(
                    self.dsn,
                    min_size=1,
                    max_size=self._pool_size,
                    kwargs={"autocommit": True},
                    configure=self._configure_pooled,
                    check=_check_pooled,
                    reconnect_failed=_regrow,
                    # Give up a failing reconnection soon: the next call starts a fresh one
                    # at once, instead of waiting out an ever longer backoff after an outage.
                    reconnect_timeout=RECONNECT_GIVE_UP_S,
                    # How long a call waits for a connection before DatabaseUnavailableError.
                    timeout=self._pool_timeout,
                    open=False,
                    name=f"lonnymq-{self._schema}",
                )
                try:
                    pool.open(wait=True, timeout=self._pool_timeout)
                except psycopg.Error as err:
                    raise translate(err, schema=self._schema) from err
                except Exception as err:
                    pool.close()
                    raise translate(
                        psycopg.OperationalError(f"cannot connect to PostgreSQL: {err}"),
                        schema=self._schema,
                    ) from err
                self._pool = pool
            return self._pool

    def _probe(self) -> None:
        """One connection before the pool's: a connection string, server, database or login
        that cannot work fails at once with the server's own words, not after ``pool_timeout``
        of silent retries."""
        try:
            conninfo_to_dict(self.dsn)
        except psycopg.ProgrammingError as err:
            raise InvalidArgumentError(f"not a valid connection string: {err}") from err
        try:
            probe = Connection.connect(self.dsn, autocommit=True)
        except psycopg.errors.ConnectionTimeout as err:
            raise translate(
                psycopg.OperationalError(
                    f"cannot connect to PostgreSQL: {err} (no answer within connect_timeout); "
                    "check the host and port, or set connect_timeout in the connection string "
                    "to wait longer"
                ),
                schema=self._schema,
            ) from err
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err
        probe.close()

    def _configure_pooled(self, conn: Connection[Any]) -> None:
        conn.execute(_POOLED_SETTINGS)
        self._own.add(conn)

    def _fetch(self, name: str, params: dict[str, Any], conn: Connection[Any] | None) -> list[Row]:
        """Run the named statement (on ``conn``, or on a pooled connection) and return rows."""
        return self._run(self._sql[name], params, conn, label=name)

    def _run(
        self,
        statement: sql.Composed,
        params: dict[str, Any],
        conn: Connection[Any] | None,
        *,
        label: str,
    ) -> list[Row]:
        """Run ``statement`` (on ``conn``, or on a pooled connection) and return its rows (none
        for a statement that returns none); timed in ``operation_stats`` as ``label``."""
        _check_conn(conn)
        ask = conn is not None and conn not in self._own and _check_isolation(conn, label)
        started = perf_counter()
        ok = False
        try:
            if conn is not None:
                with _cursor(conn) as cursor:
                    if ask:
                        _check_server_isolation(cursor, label)
                    cursor.execute(statement, params, binary=True)
                    rows = cursor.fetchall() if cursor.description is not None else []
            else:
                pool = self._get_pool()
                for attempt in range(CONFLICT_RETRIES + 1):
                    try:
                        with pool.connection() as pooled, _cursor(pooled) as cursor:
                            cursor.execute(statement, params, binary=True)
                            rows = cursor.fetchall() if cursor.description is not None else []
                        break
                    except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                        # The statement was its own transaction and was rolled back whole:
                        # nothing it did was kept, so it runs again (a deadlock between
                        # concurrent creates, finishes and a policy change, say).
                        if attempt == CONFLICT_RETRIES:
                            raise
                        _core.conflict_pause(attempt)
            ok = True
            return rows
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err
        finally:
            self._recorder.record(label, perf_counter() - started, ok=ok)

    @contextmanager
    def transaction(self) -> Iterator[Connection[Any]]:
        """A pooled connection inside a transaction, committed when the block ends (rolled
        back on error): pass it as ``conn=`` to make several operations atomic.

        What the block sets on the connection (``row_factory``, ``cursor_factory``, ``SET``)
        is undone when it ends. An error the block raises comes out as it was (your own
        statements' psycopg errors stay psycopg's); a block that caught an error which aborted
        the transaction raises :class:`~lonnymq.errors.DatabaseError` at its end, since
        nothing it did was kept."""
        with self._transaction(lent=True) as conn:
            yield conn

    @contextmanager
    def _transaction(self, *, lent: bool = False) -> Iterator[Connection[Any]]:
        """``transaction()``; ``lent``: the caller had the connection, restore it after."""
        pool = self._get_pool()
        raised: BaseException | None = None
        try:
            with pool.connection() as pooled:
                try:
                    with pooled.transaction():
                        try:
                            yield pooled
                        except BaseException as err:
                            raised = err
                            raise
                        if pooled.info.transaction_status == TransactionStatus.INERROR:
                            # psycopg would send COMMIT, which the server turns into a
                            # ROLLBACK without a word.
                            raise DatabaseError(
                                "the transaction was aborted by an error caught inside the "
                                "transaction() block, and rolled back: nothing it did was kept",
                                "25P02",
                            )
                finally:
                    if lent:
                        _restore_lent(pooled)
        except psycopg.Error as err:
            if err is raised:
                raise
            raise translate(err, schema=self._schema) from err

    def operation_stats(self) -> list[OperationStats]:
        """Calls, errors and time spent per SQL operation since this queue was opened."""
        return self._recorder.snapshot()

    # -- install -------------------------------------------------------------------------

    def install(self, *, archive: bool | None = None, conn: Connection[Any] | None = None) -> int:
        """Create or upgrade the queue's schema; returns the schema version.

        Safe to call at every start and from several processes at once. The queue's
        ``event_channel``, when set, is recorded so that operations publish wake-up events on
        it; ``archive`` turns the archive of finished messages on or off (``None`` keeps it).
        On ``conn`` it runs in the caller's transaction, which the caller commits (in one of
        its own on an autocommit connection).
        """
        if archive is not None and not isinstance(archive, bool):
            raise InvalidArgumentError(f"archive must be a bool, got {archive!r}")
        _check_conn(conn)
        if conn is not None:
            return self._install_on(conn, archive)
        pool = self._get_pool()
        with pool.connection() as pooled:
            return self._install_on(pooled, archive)

    def _migrate_on(self, cursor: Cursor[Row]) -> int:
        """Apply the missing migrations, then the function layer when it is not the source's
        (the caller holds a transaction); the version after."""
        # One round trip: lock, bookkeeping tables, state (the last result).
        cursor.execute(migrate.open_statement(self._schema))
        while cursor.nextset():
            pass
        row = cursor.fetchone()
        assert row is not None
        current, pending, stale = _core.schema_state(self._schema, row)
        if not pending and not stale:
            return current
        cursor.execute(migrate.search_path_show_statement())
        shown = cursor.fetchone()
        assert shown is not None
        cursor.execute(migrate.search_path_statement(self._schema))
        for migration in pending:
            cursor.execute(migration.sql.encode())
            cursor.execute(migrate.record_statement(self._schema, migration))
            current = migration.version
        # After any migration too: it may have added tables that secure_functions() closes.
        for statement in migrate.function_layer_statements(self._schema):
            cursor.execute(statement)
        cursor.execute(migrate.search_path_restore_statement(), {"search_path": shown[0]})
        return current

    def _install_on(self, conn: Connection[Any], archive: bool | None) -> int:
        started = perf_counter()
        ok = False
        try:
            with _atomic(conn), _cursor(conn) as cursor:
                cursor.execute(migrate.may_create_statement(), {"schema": self._schema})
                row = cursor.fetchone()
                if row is not None and row[0] is False:
                    current = self._installed_version(cursor)
                else:
                    current = self._migrate_on(cursor)
                if self._event_channel is not None or archive is not None:
                    # Only a change needs config_set (an admin's function): a granted role
                    # that asks for the settings already in place is not refused.
                    cursor.execute(self._sql["config_get"])
                    settings = cursor.fetchone()
                    assert settings is not None
                    event_channel, archived = settings
                    new_events = self._event_channel is not None and (
                        (self._event_channel or None) != event_channel
                    )
                    if new_events or (archive is not None and archive != archived):
                        cursor.execute(
                            self._sql["config_set"],
                            {"event_channel": self._event_channel, "archive": archive},
                        )
            ok = True
            return current
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err
        finally:
            self._recorder.record("install", perf_counter() - started, ok=ok)

    def _installed_version(self, cursor: Cursor[Row]) -> int:
        """install() for a role that may not change the schema: it succeeds when there is
        nothing to do."""
        try:
            cursor.execute(migrate.installed_statement(self._schema))
            row = cursor.fetchone()
        except (psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedColumn):
            row = None  # a schema without a queue, or with a function layer from before
        return _core.installed_version(self._schema, row)

    def settings(self, *, conn: Connection[Any] | None = None) -> Settings:
        """The installation's settings (event channel, archive)."""
        rows = self._fetch("config_get", {}, conn)
        event_channel, archive = rows[0]
        return Settings(event_channel=event_channel, archive=bool(archive))

    # -- operations ----------------------------------------------------------------------

    def now(self, *, conn: Connection[Any] | None = None) -> int:
        """The queue clock: ms since the Unix epoch, read from the database."""
        rows = self._fetch("epoch", {}, conn)
        return int(rows[0][0])

    def create(
        self,
        content: bytes,
        *,
        channel: str | None = None,
        dequeue_at: int | None = None,
        dedup_key: str | None = None,
        priority: int | None = None,
        conn: Connection[Any] | None = None,
    ) -> CreateResult:
        """Add a message to ``channel`` (default ``"default"``).

        It is not dequeued before ``dequeue_at`` (ms since the epoch; default now). Within a
        channel messages leave in ``(dequeue_at, id)`` order, so ``priority=p`` (a small
        int, lower first) is sugar for the historic ``dequeue_at=p``: it jumps ahead of every
        normal message, and cannot be combined with scheduling for later. With a
        ``dedup_key`` that a live message of the channel already has, nothing is created and
        that message's id is returned (status ``deduplicated``); a channel at its
        ``max_size`` refuses the message (status ``dropped``).
        """
        at = _core.priority_to_dequeue_at(priority, dequeue_at)
        params = {
            "content": _core.check_payload("content", content, optional=False),
            "channel": _core.check_target_channel(channel),
            "dequeue_at": _core.check_time("dequeue_at", at),
            "dedup_key": _core.check_dedup_key(dedup_key),
        }
        rows = self._fetch("message_create", params, conn)
        return _core.create_result(rows[0])

    def create_many(
        self, items: Iterable[NewMessage], *, conn: Connection[Any] | None = None
    ) -> list[CreateResult]:
        """Add many messages in one call (one transaction); results are in input order."""
        checked = _core.check_new_messages(items)
        if not checked:
            return []
        params = {
            "channels": [m.channel for m in checked],
            "contents": [m.content for m in checked],
            "dequeue_ats": [m.dequeue_at for m in checked],
            "dedup_keys": [m.dedup_key for m in checked],
        }
        rows = self._fetch("message_create_many", params, conn)
        return [_core.create_result(row) for row in rows]

    def dequeue(self, *, lock_ms: int, conn: Connection[Any] | None = None) -> Message | None:
        """Lock the next message for ``lock_ms`` ms, or return ``None`` when none is ready."""
        batch = self.dequeue_batch(1, lock_ms=lock_ms, conn=conn)
        return batch.messages[0] if batch.messages else None

    def dequeue_many(
        self, limit: int, *, lock_ms: int, conn: Connection[Any] | None = None
    ) -> list[Message]:
        """Lock up to ``limit`` messages at once, honouring every channel's policy."""
        batch = self.dequeue_batch(limit, lock_ms=lock_ms, conn=conn)
        return batch.messages

    def dequeue_batch(
        self, limit: int, *, lock_ms: int, conn: Connection[Any] | None = None
    ) -> DequeueBatch[Message]:
        """Like :meth:`dequeue_many`, and when none is ready, also when to try again."""
        params = {"limit": _core.check_limit(limit), "lock_ms": _core.check_lock_ms(lock_ms)}
        rows = self._fetch("message_dequeue_many", params, conn)
        if len(rows) == 1 and rows[0][0] is None:
            return DequeueBatch(messages=[], retry_at=rows[0][7])
        return DequeueBatch(messages=[self._message(row) for row in rows], retry_at=None)

    def complete_and_dequeue(
        self,
        done: Sequence[Message],
        limit: int = 1,
        *,
        lock_ms: int,
        conn: Connection[Any] | None = None,
    ) -> DequeueBatch[Message]:
        """Finish the messages you hold in ``done`` and lock up to ``limit`` new ones, in one
        transaction: a worker's steady state then costs one commit per cycle instead of two.

        ``completed`` of the result has one status per message of ``done`` (a lost lock is
        ``stale`` and left alone, as in :meth:`delete_many`); the rest is as
        :meth:`dequeue_batch`.
        """
        claims = _core.check_claims(done, schema=self._schema)
        params = {
            "ids": [c[0] for c in claims],
            "num_attempts": [c[1] for c in claims],
            "limit": _core.check_limit(limit),
            "lock_ms": _core.check_lock_ms(lock_ms),
        }
        rows = self._fetch("message_complete_and_dequeue", params, conn)
        return self._reported(rows)

    def _reported(self, rows: list[Row]) -> DequeueBatch[Message]:
        """The rows of a call that reports, then takes: a status per message reported, then
        'locked' rows, or one 'empty' row with ``retry_at``."""
        completed: list[Row] = []
        messages: list[Message] = []
        retry_at: int | None = None
        for row in rows:
            status = row[1]
            if status == "locked":
                messages.append(self._message(row[:1] + row[2:]))
            elif status == "empty":
                retry_at = row[8]
            else:
                completed.append(row)
        return DequeueBatch(
            messages=messages, retry_at=retry_at, completed=_core.ack_statuses(completed)
        )

    def settle(
        self,
        outcomes: Sequence[Outcome[Message]],
        limit: int = 0,
        *,
        lock_ms: int,
        conn: Connection[Any] | None = None,
    ) -> DequeueBatch[Message]:
        """Report the outcomes of messages you hold and lock up to ``limit`` new ones (none
        when 0), in one call and one transaction: a worker's group commit.

        Each outcome (:class:`~lonnymq.Outcome`: complete, fail, defer with a time and state,
        dead-letter) is fenced by the attempt its message was taken with: ``completed`` of the
        result has one status per outcome, in order, ``stale`` for a message whose lock was
        lost (left alone, as in :meth:`delete_many`) and ``full`` for a dead letter whose
        channel is at its ``max_size`` (the message stays held). The rest is as
        :meth:`dequeue_batch`. A role whose grants predate this call (the queue installed by
        an older lonnymq, then upgraded) reports through the calls its kind may make, one per
        kind of outcome, then dequeues: the same statuses, in several transactions.
        """
        params: dict[str, Any] = _core.settle_params(outcomes, schema=self._schema)
        params["limit"] = _core.check_settle_limit(limit)
        params["lock_ms"] = _core.check_lock_ms(lock_ms)
        if not self._settle_refused or conn is not None:
            try:
                rows = self._fetch("message_settle", _core.settle_arrays(params), conn)
            except PermissionDeniedError:
                if conn is not None:
                    raise
                self._settle_refused = True
            else:
                return self._reported(rows)
        return self._settle_granted(list(outcomes), params)

    def _settle_granted(
        self, outcomes: list[Outcome[Message]], params: dict[str, Any]
    ) -> DequeueBatch[Message]:
        """:meth:`settle` through the calls a worker kind was granted before it existed."""
        statuses: list[AckStatus] = [AckStatus.OK] * len(outcomes)
        for kind, statement in (
            (OutcomeKind.COMPLETED, "message_delete_many"),
            (OutcomeKind.DEFERRED, "message_defer_many"),
        ):
            picked = [i for i, o in enumerate(outcomes) if o.kind is kind]
            if not picked:
                continue
            names = ["ids", "num_attempts"] + (
                ["dequeue_ats", "states"] if kind is OutcomeKind.DEFERRED else []
            )
            args = {name: [params[name][i] for i in picked] for name in names}
            rows = self._fetch(statement, args, None)
            for i, status in zip(picked, _core.ack_statuses(rows), strict=True):
                statuses[i] = status
        for i, outcome in enumerate(outcomes):
            try:
                if outcome.kind is OutcomeKind.FAILED:
                    self.fail(outcome.message, error=params["errors"][i])
                elif outcome.kind is OutcomeKind.DEAD_LETTERED:
                    self.dead_letter(
                        outcome.message, channel=params["channels"][i], error=params["errors"][i]
                    )
            except MessageNotFoundError:
                statuses[i] = AckStatus.NOT_FOUND
            except StaleMessageError:
                statuses[i] = AckStatus.STALE
            except ChannelFullError:
                statuses[i] = AckStatus.FULL
        batch: DequeueBatch[Message] = DequeueBatch(messages=[], retry_at=None)
        if params["limit"]:
            batch = self.dequeue_batch(params["limit"], lock_ms=params["lock_ms"])
        return replace(batch, completed=statuses)

    def _message(self, row: Row) -> Message:
        message_id, channel, content, state, num_attempts, dequeue_at, unlock_at, _ = row
        return Message(
            id=message_id,
            channel=channel,
            content=bytes(content),
            state=_core.optional_bytes(state),
            num_attempts=num_attempts,
            dequeue_at=dequeue_at,
            unlock_at=unlock_at,
            queue=self,
        )

    def heartbeat(
        self, message: Message, *, lock_ms: int, conn: Connection[Any] | None = None
    ) -> int:
        """Extend the lock of a message you hold to now + ``lock_ms``; returns the unlock time."""
        message_id, attempts = _core.check_message(message, schema=self._schema)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "lock_ms": _core.check_lock_ms(lock_ms),
        }
        rows = self._fetch("message_heartbeat", params, conn)
        return int(rows[0][0])

    def delete(self, message: Message, *, conn: Connection[Any] | None = None) -> None:
        """Finish a message you hold and free its channel slot."""
        message_id, attempts = _core.check_message(message, schema=self._schema)
        params = {"id": message_id, "num_attempts": attempts, "outcome": "completed", "error": None}
        self._fetch("message_delete", params, conn)

    def fail(self, message: Message, *, error: str, conn: Connection[Any] | None = None) -> None:
        """Finish a message you hold as failed: it leaves the queue (and is archived with
        outcome ``failed`` and ``error`` when the archive is on)."""
        message_id, attempts = _core.check_message(message, schema=self._schema)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "outcome": "failed",
            "error": _core.check_error_text(error),
        }
        self._fetch("message_delete", params, conn)

    def dead_letter(
        self,
        message: Message,
        *,
        channel: str,
        error: str,
        conn: Connection[Any] | None = None,
    ) -> CreateResult:
        """Move a message you hold to ``channel`` in one transaction: a copy of its content (not
        its state) is created there and the message is finished as failed with ``error``.

        When ``channel`` is at its ``max_size`` nothing is done and :class:`ChannelFullError`
        is raised: the message stays held by you (and comes back when its lock expires)."""
        message_id, _ = _core.check_message(message, schema=self._schema)
        target = _core.check_target_channel(channel)
        text = _core.check_error_text(error)
        if conn is None:
            with self._transaction() as own:
                return self.dead_letter(message, channel=target, error=text, conn=own)
        with _atomic(conn):
            created = self.create(message.content, channel=target, conn=conn)
            if created.status is CreateStatus.DROPPED:
                raise ChannelFullError(
                    f"dead-letter channel {target!r} is at its max_size: message {message_id} "
                    "was not moved and is still held; raise the limit or drain that channel"
                )
            self.fail(message, error=text, conn=conn)
        return created

    def defer(
        self,
        message: Message,
        *,
        dequeue_at: int | None = None,
        state: bytes | None = None,
        conn: Connection[Any] | None = None,
    ) -> None:
        """Give back a message you hold; see :meth:`Message.defer`."""
        message_id, attempts = _core.check_message(message, schema=self._schema)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "dequeue_at": _core.check_time("dequeue_at", dequeue_at),
            "state": _core.check_payload("state", state, optional=True),
        }
        self._fetch("message_defer", params, conn)

    def delete_many(
        self, messages: Sequence[Message], *, conn: Connection[Any] | None = None
    ) -> list[AckStatus]:
        """Finish many messages in one call; one status per message, in order.

        A message whose lock was lost is reported ``stale`` and left alone; the others are
        still finished.
        """
        claims = _core.check_claims(messages, schema=self._schema)
        if not claims:
            return []
        params = {"ids": [c[0] for c in claims], "num_attempts": [c[1] for c in claims]}
        return _core.ack_statuses(self._fetch("message_delete_many", params, conn))

    def heartbeat_many(
        self,
        messages: Sequence[Message],
        *,
        lock_ms: int,
        conn: Connection[Any] | None = None,
    ) -> list[AckStatus]:
        """Extend the locks of many messages you hold to now + ``lock_ms`` in one call; one
        status per message, in order (``stale``: its lock was lost, and it is left alone)."""
        claims = _core.check_claims(messages, schema=self._schema)
        lock = _core.check_lock_ms(lock_ms)
        if not claims:
            return []
        params = {
            "ids": [c[0] for c in claims],
            "num_attempts": [c[1] for c in claims],
            "lock_ms": lock,
        }
        return _core.ack_statuses(self._fetch("message_heartbeat_many", params, conn))

    def defer_many(
        self,
        messages: Sequence[Message],
        *,
        dequeue_at: int | None = None,
        conn: Connection[Any] | None = None,
    ) -> list[AckStatus]:
        """Give back many messages in one call (all to ``dequeue_at``, default now)."""
        claims = _core.check_claims(messages, schema=self._schema)
        if not claims:
            return []
        at = _core.check_time("dequeue_at", dequeue_at)
        params = {
            "ids": [c[0] for c in claims],
            "num_attempts": [c[1] for c in claims],
            "dequeue_ats": [at] * len(claims),
            "states": None,
        }
        return _core.ack_statuses(self._fetch("message_defer_many", params, conn))

    def channel(self, name: str) -> Channel:
        """A handle on one channel (to set its policy, or create in it)."""
        return Channel(self, name)

    def stats(self, *, conn: Connection[Any] | None = None) -> list[ChannelStats]:
        """Every channel that holds messages or has a policy, by name."""
        rows = self._fetch("channel_stats", {}, conn)
        return [_core.channel_stats(row) for row in rows]

    def verify(self, *, conn: Connection[Any] | None = None) -> list[Discrepancy]:
        """Check every channel's row against its messages; one :class:`Discrepancy` per
        problem found, by channel (an empty list: consistent). Read-only: one statement, so
        one snapshot of both tables, taken once it holds their locks. It scans the message
        table: an operator's check."""
        rows = self._fetch("queue_verify", {}, conn)
        return [_core.discrepancy(row) for row in rows]

    def maintain(self, *, compact: bool = True) -> list[str]:
        """VACUUM the queue's high-churn tables (``channel``, ``message``) that hold enough
        dead row versions to slow dequeues down, then (``compact``) :meth:`compact` those
        whose dead rows no VACUUM could remove; returns the names of the tables it vacuumed
        or compacted. Only the dead row versions made since its last VACUUM of a table count:
        those that an older snapshot (a long transaction) kept from that VACUUM are not
        vacuumed for again. Workers call it every ``maintenance_ms``. It needs the tables'
        owner (or a superuser): for a role granted a kind it does nothing and returns ``[]``
        (after one refusal this queue stops asking). No ``conn``: VACUUM cannot run inside a
        transaction."""
        if self._maintain_refused:
            return []
        try:
            rows = self._fetch("maintenance_due", {}, None)
        except PermissionDeniedError:
            self._maintain_refused = True
            return []
        tables = [str(row[0]) for row in rows]
        for table in tables:
            statement = sql.SQL("VACUUM (SKIP_LOCKED) {}").format(
                sql.Identifier(self._schema, table)
            )
            self._run(statement, {}, None, label="vacuum")
            self._fetch("maintenance_vacuumed", {"table_name": table}, None)
        if compact:
            compacted = self.compact()
            tables = [t for t in _core.MAINTAINED_TABLES if t in tables or t in compacted]
        return tables

    def compact(self, *, max_live: int = 10_000) -> list[str]:
        """Rewrite ``channel`` and ``message`` with their live rows only where their dead row
        versions are many (at least 1,000 and 10,000, and four times the live rows) and no
        VACUUM can remove them, as while a long transaction anywhere in the database holds an
        old snapshot; returns the names of the tables it rewrote. Ids, locks, attempts and
        every other column stay as they were. A table with more than ``max_live`` live rows (or
        64 MiB of them) is left alone, and so is ``message`` while a
        :func:`lonnymq.spark.snapshot` block is open (a Spark read never reads ``channel``),
        and every table while a ``pg_dump`` is connected or a transaction has the table open
        (it tries for about 50 ms, never queueing for the lock). A transaction whose snapshot
        predates a rewrite sees the table empty if it reads it only afterwards (see
        "Compacting" in the maintenance guide). Needs the tables' owner: for a role granted a
        kind it does nothing and returns ``[]``, as :meth:`maintain` does."""
        max_live = _core.check_max_live(max_live)
        done: list[str] = []
        for table in _core.MAINTAINED_TABLES:
            if self._maintain_refused:
                break
            try:
                rows = self._fetch(
                    "maintenance_compact", {"table_name": table, "max_live": max_live}, None
                )
            except PermissionDeniedError:
                self._maintain_refused = True
                break
            if rows[0][0] == "compacted":
                done.append(table)
        return done

    def set_clock_offset(self, offset_ms: int, *, conn: Connection[Any] | None = None) -> int:
        """Move the queue clock by ``offset_ms`` for everyone (tests only); returns the new now."""
        params = {"offset_ms": _core.check_time("offset_ms", offset_ms)}
        rows = self._fetch("clock_offset_set", params, conn)
        return int(rows[0][0])

    # -- least privilege -----------------------------------------------------------------

    def grant(self, role: str, kind: RoleKind | str, *, conn: Connection[Any] | None = None) -> int:
        """Let the PostgreSQL role ``role`` do what a ``kind`` needs (``"producer"``,
        ``"worker"`` or ``"admin"``; see :class:`~lonnymq.types.RoleKind`) on this queue, and
        nothing more: any kind it had is replaced. Run it as the role that installed the queue.
        Returns how many of the queue's functions the role may now call. Refused with
        :class:`~lonnymq.errors.InvalidArgumentError` for an unknown kind, or a role that does
        not exist, is a superuser or owns the queue."""
        params = {"role": _core.check_role(role), "kind": _core.check_role_kind(kind).value}
        rows = self._fetch("role_grant", params, conn)
        return int(rows[0][0])

    def revoke(self, role: str, *, conn: Connection[Any] | None = None) -> bool:
        """Take every right on this queue from ``role``; returns whether it had a kind."""
        rows = self._fetch("role_revoke", {"role": _core.check_role(role)}, conn)
        return bool(rows[0][0])

    def grants(self, *, conn: Connection[Any] | None = None) -> list[RoleGrant]:
        """The roles granted a kind on this queue, by name."""
        rows = self._fetch("role_list", {}, conn)
        return [RoleGrant(role=r, kind=RoleKind(k), granted_at=at) for r, k, at in rows]

    # -- schedules -----------------------------------------------------------------------

    def schedule(
        self,
        name: str,
        *,
        cron: str,
        content: bytes,
        channel: str | None = None,
        conn: Connection[Any] | None = None,
    ) -> bool:
        """Create or update the periodic schedule ``name``: at each ``cron`` time (five
        fields, UTC) a worker creates one message ``content`` in ``channel``. Returns
        ``True`` when the schedule is new. The same schedule declared again changes nothing
        (a firing that is due still fires); a changed one counts from now. See
        :mod:`lonnymq.schedule`."""
        name = _schedule.check_name(name)
        parsed = _schedule.Cron.parse(cron)
        target = _core.check_channel(channel)
        if target == _schedule.SCHEDULE_CHANNEL:
            raise InvalidArgumentError(f"channel {target!r} is reserved for schedules")
        payload = _core.check_payload("content", content, optional=False)
        assert payload is not None
        spec = _schedule.ScheduleSpec(name, parsed.expression, target, payload, since=0)
        for row in self._fetch("schedule_list", {}, conn):
            if row[0] == name and _schedule.same_spec(bytes(row[1]), spec):
                # Declared again unchanged (an application starting up): left as it is, so a
                # firing that is due is not skipped.
                return False
        now = self.now(conn=conn)
        next_at = parsed.next_after(now)
        if next_at is None:  # parse() refuses what never fires: only near the year 10000
            raise InvalidArgumentError(f"cron {parsed.expression!r} has no time after now")
        spec = replace(spec, since=now)
        params = {"name": name, "spec": spec.encode(), "next_at": next_at}
        rows = self._fetch("schedule_set", params, conn)
        return bool(rows[0][0] == "created")

    def schedules(self, *, conn: Connection[Any] | None = None) -> list[Schedule]:
        """Every schedule, by name."""
        rows = self._fetch("schedule_list", {}, conn)
        result = []
        for name, spec_data, next_at, state, is_locked in rows:
            spec = ScheduleSpec.decode(bytes(spec_data))
            result.append(
                Schedule(
                    name=name,
                    cron=spec.cron,
                    channel=spec.channel,
                    content=spec.content,
                    next_at=next_at,
                    last_fired_at=_schedule.decode_state(_core.optional_bytes(state)),
                    firing=is_locked,
                )
            )
        return result

    def unschedule(self, name: str, *, conn: Connection[Any] | None = None) -> bool:
        """Remove the schedule ``name`` (a firing in progress rolls back); returns whether it
        existed. Messages it already created stay."""
        rows = self._fetch("schedule_remove", {"name": _schedule.check_name(name)}, conn)
        return bool(rows[0][0])

    def fire_schedule(self, driver: Message, *, conn: Connection[Any] | None = None) -> Firing:
        """Process a schedule's driver message (workers do this for you): in one transaction,
        create the task that is due (at most one, however many firings were missed) and defer
        the driver to the next firing. A driver whose lock was lost raises
        :class:`~lonnymq.errors.StaleMessageError` and fires nothing."""
        _core.check_message(driver, schema=self._schema)
        if getattr(driver, "channel", None) != _schedule.SCHEDULE_CHANNEL:
            raise InvalidArgumentError(f"message {driver.id} is not a schedule's driver")
        spec = ScheduleSpec.decode(driver.content)
        if conn is None:
            with self._transaction() as own:
                return self._fire_on(driver, spec, own)
        with _atomic(conn):
            return self._fire_on(driver, spec, conn)

    def _fire_on(self, driver: Message, spec: ScheduleSpec, conn: Connection[Any]) -> Firing:
        last_fired = _schedule.decode_state(driver.state)
        now = self.now(conn=conn)
        firing = _schedule.plan_firing(spec, last_fired, now)
        if firing.fire_at is not None:
            task = self.create(
                spec.content,
                channel=spec.channel,
                dedup_key=_schedule.task_dedup_key(spec.name, firing.fire_at),
                conn=conn,
            )
            if task.status is CreateStatus.DROPPED:
                # Not fired: the same time stays due, tried again soon (not at the next time:
                # a full channel is a moment's backpressure, not a reason to skip a period).
                firing = replace(
                    firing,
                    next_at=min(firing.next_at, now + _schedule.FULL_RETRY_MS),
                    full=True,
                )
            else:
                last_fired = firing.fire_at
        self.defer(
            driver,
            dequeue_at=firing.next_at,
            state=_schedule.encode_state(last_fired),
            conn=conn,
        )
        return firing

    # -- events, outcomes and the archive ------------------------------------------------

    def events(self, *, timeout: float | None = None) -> Iterator[Event]:
        """Iterate the queue's events as they happen (on a connection of its own), for
        ``timeout`` seconds or until the loop breaks. Needs an installed ``event_channel``."""
        channel = (self.settings()).event_channel
        if channel is None:
            raise InvalidArgumentError(
                "events are off: install the queue with an event_channel to publish them"
            )
        _check_timeout(timeout)
        try:
            with psycopg.Connection.connect(self.dsn, autocommit=True) as conn:
                conn.execute(_events.listen_statement(channel))
                for notify in conn.notifies(timeout=timeout):
                    yield _events.parse_event(notify.payload)
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err

    def message_status(
        self, message_id: int, *, conn: Connection[Any] | None = None
    ) -> MessageOutcome:
        """Where message ``message_id`` is now; see :class:`~lonnymq.events.MessageOutcome`."""
        checked, _ = _core.check_claim(message_id, 1)
        rows = self._fetch("message_status", {"id": checked}, conn)
        return _events.outcome(checked, rows[0])

    def wait(self, message_id: int, *, timeout: float | None = None) -> MessageOutcome | None:
        """Wait until message ``message_id`` is finished and return its outcome (``None``
        when ``timeout`` seconds pass first). It checks the message's row (every 10 ms,
        slowing to 0.2 s) and at once on each queue event when events are on."""
        checked, _ = _core.check_claim(message_id, 1)
        _check_timeout(timeout)
        deadline = None if timeout is None else monotonic() + timeout
        channel = (self.settings()).event_channel
        try:
            with psycopg.Connection.connect(self.dsn, autocommit=True) as conn:
                if channel is not None:
                    conn.execute(_events.listen_statement(channel))
                round_ = 0
                while True:
                    status = self.message_status(checked, conn=conn)
                    if status.done:
                        return status
                    pause = _events.poll_interval(round_)
                    round_ += 1
                    if deadline is not None:
                        left = deadline - monotonic()
                        if left <= 0:
                            return None
                        pause = min(pause, left)
                    for _ in conn.notifies(timeout=pause, stop_after=1):
                        pass
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err

    def archived(
        self,
        *,
        outcome: str | None = None,
        channel: str | None = None,
        before_id: int | None = None,
        limit: int = 100,
        conn: Connection[Any] | None = None,
    ) -> list[ArchivedMessage]:
        """Archived messages, newest first: of one ``outcome`` (e.g. ``"failed"``) and
        ``channel`` when given, with ids below ``before_id`` (to page)."""
        params = {
            "outcome": _core.check_outcome(outcome),
            "channel": None if channel is None else _core.check_channel(channel),
            "before_id": None if before_id is None else _core.check_claim(before_id, 1)[0],
            "limit": _core.check_limit(limit),
        }
        rows = self._fetch("archive_list", params, conn)
        return [_archive.archived_message(row) for row in rows]

    def replay(
        self, archive_ids: Sequence[int], *, conn: Connection[Any] | None = None
    ) -> list[ReplayResult]:
        """Create each archived message again (same channel and content, due now, attempts
        from zero); a message is replayed at most once. Results are in input order."""
        if isinstance(archive_ids, str | bytes) or not isinstance(archive_ids, Sequence):
            raise InvalidArgumentError("archive_ids must be a sequence of message ids")
        ids = [_core.check_claim(i, 1)[0] for i in archive_ids]
        if len(ids) > _core.MAX_BATCH:
            raise InvalidArgumentError(f"at most {_core.MAX_BATCH} ids per call, got {len(ids)}")
        if not ids:
            return []
        rows = self._fetch("archive_replay", {"ids": ids}, conn)
        return [_archive.replay_result(row) for row in rows]


# The operations whose channel bookkeeping reads other sessions' latest commits: at
# REPEATABLE READ or SERIALIZABLE they would see an older state of the channel rows and could
# leave a ready message behind no channel row, where no dequeue finds it (creates, dequeues,
# defers), or a channel's counters wrong for good: a policy set counts the channel's messages
# (and clear reads its row), and finishing a message (delete, fail, delete_many, unschedule)
# reads whether its channel has a policy to decide whether to count it out, so a policy set
# after the snapshot would be missed.
_READ_COMMITTED_ONLY = frozenset(
    {
        "message_create",
        "message_create_many",
        "message_dequeue_many",
        "message_complete_and_dequeue",
        "message_defer",
        "message_defer_many",
        "message_delete",
        "message_delete_many",
        "channel_policy_set",
        "channel_policy_clear",
        "schedule_set",
        "schedule_remove",
        "archive_replay",
    }
)


def _check_isolation(conn: Connection[Any], label: str) -> bool:
    """Refuse a caller's ``conn`` for an operation of ``_READ_COMMITTED_ONLY`` when psycopg
    starts its transactions above READ COMMITTED; return whether the server must be asked.

    ``conn.isolation_level`` answers only for a connection that is not in autocommit mode
    (psycopg then begins every transaction at that level). Unset, the level is the session's
    default, which the DSN's options or ``ALTER ROLE/DATABASE ... SET`` may have raised; in
    autocommit mode a statement runs at that default, or at whatever a ``BEGIN`` of the
    caller's chose: psycopg's attribute shows none of these, the server does."""
    if label not in _READ_COMMITTED_ONLY:
        return False
    level = conn.isolation_level
    if level is None or conn.autocommit:
        return True
    if level > psycopg.IsolationLevel.READ_COMMITTED:
        raise _isolation_refused(label, level.name.replace("_", " "))
    return False


def _check_server_isolation(cursor: Cursor[Row], label: str) -> None:
    """Refuse the cursor's connection for ``label`` when the server says its next statement
    would run above READ COMMITTED (PostgreSQL runs READ UNCOMMITTED as READ COMMITTED). One
    round trip."""
    cursor.execute(_ISOLATION_STATEMENT)
    row = cursor.fetchone()
    level = str(row[0]) if row is not None else ""
    if level not in ("read committed", "read uncommitted"):
        raise _isolation_refused(label, level.upper())


def _isolation_refused(label: str, level: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{label} must run at READ COMMITTED, and conn is at {level}: "
        "use a connection at READ COMMITTED (the default) for queue operations"
    )


@contextmanager
def _atomic(conn: Connection[Any]) -> Iterator[None]:
    """Make the block's statements on a caller's ``conn`` one transaction. On an autocommit
    connection outside a transaction each statement would commit on its own: the block gets a
    BEGIN and a COMMIT of its own (a ROLLBACK when it raises). Otherwise it runs in the
    caller's transaction, the open one or the one its first statement opens, which the caller
    commits or rolls back: never committed here."""
    _check_conn(conn)
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        with conn.transaction():
            yield
    else:
        yield


def _cursor(conn: Connection[Any]) -> Cursor[Row]:
    """A cursor of the queue's own on ``conn``: plain tuples, parameters bound by the server,
    whatever ``row_factory`` or ``cursor_factory`` a caller gave the connection (a dict_row,
    a ClientCursor or a RawCursor would change what the queue's statements send and read)."""
    return Cursor(conn, row_factory=tuple_row)


def _check_conn(conn: object) -> None:
    if conn is not None and not isinstance(conn, Connection):
        raise InvalidArgumentError(
            f"conn must be None or a psycopg Connection, got {type(conn).__name__}"
        )


def _check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 <= timeout < math.inf
    ):
        raise InvalidArgumentError(
            f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}"
        )
