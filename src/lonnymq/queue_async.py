"""The asyncio API: :class:`AsyncQueue`, :class:`AsyncChannel` and :class:`AsyncMessage`.

This file is the source of ``queue.py`` (the sync API): ``tools/async_to_sync.py`` derives
it, and CI checks that the two agree. Keep the code here in the shapes that script knows.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from time import perf_counter
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from . import _core, migrate
from .embedded import embedded_dsn, resolve_dsn
from .errors import InvalidArgumentError, SchemaVersionError, translate
from .metrics import OperationStats, Recorder
from .types import (
    AckStatus,
    ChannelStats,
    CreateResult,
    DequeueBatch,
    NewMessage,
    Settings,
)

__all__ = ["AsyncChannel", "AsyncMessage", "AsyncQueue"]

Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class AsyncMessage:
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
    queue: AsyncQueue = field(repr=False, compare=False)

    async def delete(self, *, conn: AsyncConnection[Any] | None = None) -> None:
        """Finish the message (it is done) and free its channel slot."""
        await self.queue.delete(self, conn=conn)

    async def fail(self, *, error: str, conn: AsyncConnection[Any] | None = None) -> None:
        """Finish the message as failed (archived with ``error`` when the archive is on)."""
        await self.queue.fail(self, error=error, conn=conn)

    async def defer(
        self,
        *,
        dequeue_at: int | None = None,
        state: bytes | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> None:
        """Give the message back, to be dequeued again at ``dequeue_at`` (default now).

        The attempt count is kept; ``state``, when given, replaces the saved state.
        """
        await self.queue.defer(self, dequeue_at=dequeue_at, state=state, conn=conn)

    async def heartbeat(self, *, lock_ms: int, conn: AsyncConnection[Any] | None = None) -> int:
        """Extend the lock to now + ``lock_ms``; returns the new unlock time (ms)."""
        return await self.queue.heartbeat(self, lock_ms=lock_ms, conn=conn)


class AsyncChannel:
    """A channel of a queue: a fair, policy-controlled sub-queue (``queue.channel(name)``)."""

    def __init__(self, queue: AsyncQueue, name: str) -> None:
        self._queue = queue
        self.name = _core.check_channel(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    async def set_policy(
        self,
        *,
        max_concurrency: int | None = None,
        release_interval_ms: int | None = None,
        max_size: int | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> None:
        """Set the channel's policy (``None`` = unlimited); it applies at once.

        ``max_concurrency``: messages locked at once (0 pauses the channel);
        ``release_interval_ms``: minimum gap between two dequeues; ``max_size``: messages held
        (a create beyond it is ``dropped``). The policy stays when the channel empties.
        """
        policy = _core.check_policy(max_concurrency, release_interval_ms, max_size)
        await self._queue._fetch(
            "channel_policy_set",
            {
                "channel": self.name,
                "max_concurrency": policy.max_concurrency,
                "release_interval_ms": policy.release_interval_ms,
                "max_size": policy.max_size,
            },
            conn,
        )

    async def clear_policy(self, *, conn: AsyncConnection[Any] | None = None) -> None:
        """Remove the channel's policy: unlimited from now on."""
        await self._queue._fetch("channel_policy_clear", {"channel": self.name}, conn)

    async def create(
        self,
        content: bytes,
        *,
        dequeue_at: int | None = None,
        dedup_key: str | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> CreateResult:
        """Create a message in this channel; see :meth:`AsyncQueue.create`."""
        return await self._queue.create(
            content, channel=self.name, dequeue_at=dequeue_at, dedup_key=dedup_key, conn=conn
        )

    async def stats(self, *, conn: AsyncConnection[Any] | None = None) -> ChannelStats | None:
        """This channel's stats, or ``None`` when it holds nothing and has no policy."""
        for stats in await self._queue.stats(conn=conn):
            if stats.channel == self.name:
                return stats
        return None


class AsyncQueue:
    """A queue installed in one PostgreSQL schema.

    ``dsn`` is any libpq connection string; ``None`` uses ``$LONNYMQ_DSN`` or, when that is
    unset too, the embedded server. Operations borrow a connection from a pool (each one its
    own transaction), or run on the caller's connection inside the caller's transaction when
    given ``conn=``.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "lonnymq",
        event_channel: str | None = None,
        pool_size: int = 10,
    ) -> None:
        self._schema = _core.check_schema(schema)
        self._event_channel = _core.check_event_channel(event_channel)
        if not isinstance(pool_size, int) or pool_size < 1:
            raise InvalidArgumentError(f"pool_size must be a positive int, got {pool_size!r}")
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: AsyncConnectionPool | None = None
        self._pool_lock = asyncio.Lock()
        self._closed = False
        self._sql = _core.Statements(self._schema)
        self._recorder = Recorder()

    @classmethod
    def embedded(
        cls,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        schema: str = "lonnymq",
        event_channel: str | None = None,
        pool_size: int = 10,
    ) -> Self:
        """A queue on the embedded PostgreSQL in ``data_dir`` (started if needed)."""
        return cls(
            embedded_dsn(data_dir),
            schema=schema,
            event_channel=event_channel,
            pool_size=pool_size,
        )

    @property
    def schema(self) -> str:
        """The schema the queue lives in."""
        return self._schema

    @property
    def dsn(self) -> str:
        """The connection string in use (resolved on first use when none was given)."""
        if self._dsn is None:
            self._dsn = resolve_dsn(None)
        return self._dsn

    def __repr__(self) -> str:
        return f"{type(self).__name__}(schema={self._schema!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool. The queue cannot be used afterwards."""
        self._closed = True
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    # -- the one place that runs SQL -----------------------------------------------------

    async def _get_pool(self) -> AsyncConnectionPool:
        if self._pool is not None:
            return self._pool
        async with self._pool_lock:
            if self._closed:
                raise InvalidArgumentError("this queue was closed")
            if self._pool is None:
                pool = AsyncConnectionPool(
                    self.dsn,
                    min_size=1,
                    max_size=self._pool_size,
                    kwargs={"autocommit": True},
                    open=False,
                    name=f"lonnymq-{self._schema}",
                )
                try:
                    await pool.open(wait=True, timeout=30)
                except psycopg.Error as err:
                    raise translate(err, schema=self._schema) from err
                except Exception as err:
                    await pool.close()
                    raise translate(
                        psycopg.OperationalError(f"cannot connect to PostgreSQL: {err}"),
                        schema=self._schema,
                    ) from err
                self._pool = pool
            return self._pool

    async def _fetch(
        self, name: str, params: dict[str, Any], conn: AsyncConnection[Any] | None
    ) -> list[Row]:
        """Run the named statement (on ``conn``, or on a pooled connection) and return rows."""
        started = perf_counter()
        ok = False
        try:
            if conn is not None:
                cursor = await conn.execute(self._sql[name], params, binary=True)
                rows = await cursor.fetchall()
            else:
                pool = await self._get_pool()
                async with pool.connection() as pooled:
                    cursor = await pooled.execute(self._sql[name], params, binary=True)
                    rows = await cursor.fetchall()
            ok = True
            return rows
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err
        finally:
            self._recorder.record(name, perf_counter() - started, ok=ok)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection[Any]]:
        """A pooled connection inside a transaction, committed when the block ends (rolled
        back on error): pass it as ``conn=`` to make several operations atomic."""
        pool = await self._get_pool()
        try:
            async with pool.connection() as pooled, pooled.transaction():
                yield pooled
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err

    def operation_stats(self) -> list[OperationStats]:
        """Calls, errors and time spent per SQL operation since this queue was opened."""
        return self._recorder.snapshot()

    # -- install -------------------------------------------------------------------------

    async def install(
        self, *, archive: bool | None = None, conn: AsyncConnection[Any] | None = None
    ) -> int:
        """Create or upgrade the queue's schema; returns the schema version.

        Safe to call at every start and from several processes at once. The queue's
        ``event_channel``, when set, is recorded so that operations publish wake-up events on
        it; ``archive`` turns the archive of finished messages on or off (``None`` keeps it).
        """
        if archive is not None and not isinstance(archive, bool):
            raise InvalidArgumentError(f"archive must be a bool, got {archive!r}")
        if conn is not None:
            return await self._install_on(conn, archive)
        pool = await self._get_pool()
        async with pool.connection() as pooled:
            return await self._install_on(pooled, archive)

    async def _install_on(self, conn: AsyncConnection[Any], archive: bool | None) -> int:
        started = perf_counter()
        ok = False
        try:
            async with conn.transaction():
                await conn.execute(migrate.lock_statement(), {"schema": self._schema})
                for statement in migrate.prepare_statements(self._schema):
                    await conn.execute(statement)
                cursor = await conn.execute(migrate.applied_statement(self._schema))
                row = await cursor.fetchone()
                current = int(row[0]) if row is not None else 0
                latest = migrate.latest_version()
                if current > latest:
                    raise SchemaVersionError(
                        f"schema {self._schema!r} is at version {current}, newer than this "
                        f"lonnymq knows ({latest}): upgrade the lonnymq package"
                    )
                for migration in migrate.migrations():
                    if migration.version <= current:
                        continue
                    await conn.execute(migrate.search_path_statement(self._schema))
                    await conn.execute(migration.sql.encode())
                    await conn.execute(migrate.record_statement(self._schema, migration))
                    current = migration.version
                if self._event_channel is not None or archive is not None:
                    await conn.execute(
                        self._sql["config_set"],
                        {"event_channel": self._event_channel, "archive": archive},
                    )
            ok = True
            return current
        except psycopg.Error as err:
            raise translate(err, schema=self._schema) from err
        finally:
            self._recorder.record("install", perf_counter() - started, ok=ok)

    async def settings(self, *, conn: AsyncConnection[Any] | None = None) -> Settings:
        """The installation's settings (event channel, archive)."""
        rows = await self._fetch("config_get", {}, conn)
        event_channel, archive = rows[0]
        return Settings(event_channel=event_channel, archive=bool(archive))

    # -- operations ----------------------------------------------------------------------

    async def now(self, *, conn: AsyncConnection[Any] | None = None) -> int:
        """The queue clock: ms since the Unix epoch, read from the database."""
        rows = await self._fetch("epoch", {}, conn)
        return int(rows[0][0])

    async def create(
        self,
        content: bytes,
        *,
        channel: str | None = None,
        dequeue_at: int | None = None,
        dedup_key: str | None = None,
        priority: int | None = None,
        conn: AsyncConnection[Any] | None = None,
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
            "channel": _core.check_channel(channel),
            "dequeue_at": _core.check_time("dequeue_at", at),
            "dedup_key": _core.check_dedup_key(dedup_key),
        }
        rows = await self._fetch("message_create", params, conn)
        return _core.create_result(rows[0])

    async def create_many(
        self, items: Iterable[NewMessage], *, conn: AsyncConnection[Any] | None = None
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
        rows = await self._fetch("message_create_many", params, conn)
        return [_core.create_result(row) for row in rows]

    async def dequeue(
        self, *, lock_ms: int, conn: AsyncConnection[Any] | None = None
    ) -> AsyncMessage | None:
        """Lock the next message for ``lock_ms`` ms, or return ``None`` when none is ready."""
        batch = await self.dequeue_batch(1, lock_ms=lock_ms, conn=conn)
        return batch.messages[0] if batch.messages else None

    async def dequeue_many(
        self, limit: int, *, lock_ms: int, conn: AsyncConnection[Any] | None = None
    ) -> list[AsyncMessage]:
        """Lock up to ``limit`` messages at once, honouring every channel's policy."""
        batch = await self.dequeue_batch(limit, lock_ms=lock_ms, conn=conn)
        return batch.messages

    async def dequeue_batch(
        self, limit: int, *, lock_ms: int, conn: AsyncConnection[Any] | None = None
    ) -> DequeueBatch[AsyncMessage]:
        """Like :meth:`dequeue_many`, and when none is ready, also when to try again."""
        params = {"limit": _core.check_limit(limit), "lock_ms": _core.check_lock_ms(lock_ms)}
        rows = await self._fetch("message_dequeue_many", params, conn)
        if len(rows) == 1 and rows[0][0] is None:
            return DequeueBatch(messages=[], retry_at=rows[0][7])
        return DequeueBatch(messages=[self._message(row) for row in rows], retry_at=None)

    async def complete_and_dequeue(
        self,
        done: Sequence[AsyncMessage],
        limit: int = 1,
        *,
        lock_ms: int,
        conn: AsyncConnection[Any] | None = None,
    ) -> DequeueBatch[AsyncMessage]:
        """Finish the messages you hold in ``done`` and lock up to ``limit`` new ones, in one
        transaction: a worker's steady state then costs one commit per cycle instead of two.

        ``completed`` of the result has one status per message of ``done`` (a lost lock is
        ``stale`` and left alone, as in :meth:`delete_many`); the rest is as
        :meth:`dequeue_batch`.
        """
        claims = _core.check_claims(done)
        params = {
            "ids": [c[0] for c in claims],
            "num_attempts": [c[1] for c in claims],
            "limit": _core.check_limit(limit),
            "lock_ms": _core.check_lock_ms(lock_ms),
        }
        rows = await self._fetch("message_complete_and_dequeue", params, conn)
        completed = [row for row in rows if row[1] not in ("locked", "empty")]
        taken = [row[:1] + row[2:] for row in rows if row[1] == "locked"]
        empty = [row for row in rows if row[1] == "empty"]
        return DequeueBatch(
            messages=[self._message(row) for row in taken],
            retry_at=empty[0][8] if empty else None,
            completed=_core.ack_statuses(completed),
        )

    def _message(self, row: Row) -> AsyncMessage:
        message_id, channel, content, state, num_attempts, dequeue_at, unlock_at, _ = row
        return AsyncMessage(
            id=message_id,
            channel=channel,
            content=bytes(content),
            state=_core.optional_bytes(state),
            num_attempts=num_attempts,
            dequeue_at=dequeue_at,
            unlock_at=unlock_at,
            queue=self,
        )

    async def heartbeat(
        self, message: AsyncMessage, *, lock_ms: int, conn: AsyncConnection[Any] | None = None
    ) -> int:
        """Extend the lock of a message you hold to now + ``lock_ms``; returns the unlock time."""
        message_id, attempts = _core.check_claim(message.id, message.num_attempts)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "lock_ms": _core.check_lock_ms(lock_ms),
        }
        rows = await self._fetch("message_heartbeat", params, conn)
        return int(rows[0][0])

    async def delete(
        self, message: AsyncMessage, *, conn: AsyncConnection[Any] | None = None
    ) -> None:
        """Finish a message you hold and free its channel slot."""
        message_id, attempts = _core.check_claim(message.id, message.num_attempts)
        params = {"id": message_id, "num_attempts": attempts, "outcome": "completed", "error": None}
        await self._fetch("message_delete", params, conn)

    async def fail(
        self, message: AsyncMessage, *, error: str, conn: AsyncConnection[Any] | None = None
    ) -> None:
        """Finish a message you hold as failed: it leaves the queue (and is archived with
        outcome ``failed`` and ``error`` when the archive is on)."""
        message_id, attempts = _core.check_claim(message.id, message.num_attempts)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "outcome": "failed",
            "error": _core.check_error_text(error),
        }
        await self._fetch("message_delete", params, conn)

    async def defer(
        self,
        message: AsyncMessage,
        *,
        dequeue_at: int | None = None,
        state: bytes | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> None:
        """Give back a message you hold; see :meth:`AsyncMessage.defer`."""
        message_id, attempts = _core.check_claim(message.id, message.num_attempts)
        params = {
            "id": message_id,
            "num_attempts": attempts,
            "dequeue_at": _core.check_time("dequeue_at", dequeue_at),
            "state": _core.check_payload("state", state, optional=True),
        }
        await self._fetch("message_defer", params, conn)

    async def delete_many(
        self, messages: Sequence[AsyncMessage], *, conn: AsyncConnection[Any] | None = None
    ) -> list[AckStatus]:
        """Finish many messages in one call; one status per message, in order.

        A message whose lock was lost is reported ``stale`` and left alone; the others are
        still finished.
        """
        claims = _core.check_claims(messages)
        if not claims:
            return []
        params = {"ids": [c[0] for c in claims], "num_attempts": [c[1] for c in claims]}
        return _core.ack_statuses(await self._fetch("message_delete_many", params, conn))

    async def defer_many(
        self,
        messages: Sequence[AsyncMessage],
        *,
        dequeue_at: int | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> list[AckStatus]:
        """Give back many messages in one call (all to ``dequeue_at``, default now)."""
        claims = _core.check_claims(messages)
        if not claims:
            return []
        at = _core.check_time("dequeue_at", dequeue_at)
        params = {
            "ids": [c[0] for c in claims],
            "num_attempts": [c[1] for c in claims],
            "dequeue_ats": [at] * len(claims),
            "states": None,
        }
        return _core.ack_statuses(await self._fetch("message_defer_many", params, conn))

    def channel(self, name: str) -> AsyncChannel:
        """A handle on one channel (to set its policy, or create in it)."""
        return AsyncChannel(self, name)

    async def stats(self, *, conn: AsyncConnection[Any] | None = None) -> list[ChannelStats]:
        """Every channel that holds messages or has a policy, by name."""
        rows = await self._fetch("channel_stats", {}, conn)
        return [_core.channel_stats(row) for row in rows]

    async def set_clock_offset(
        self, offset_ms: int, *, conn: AsyncConnection[Any] | None = None
    ) -> int:
        """Move the queue clock by ``offset_ms`` for everyone (tests only); returns the new now."""
        params = {"offset_ms": _core.check_time("offset_ms", offset_ms)}
        rows = await self._fetch("clock_offset_set", params, conn)
        return int(rows[0][0])
