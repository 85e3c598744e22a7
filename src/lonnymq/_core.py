"""What the sync and async facades share and that does no I/O: argument checks, the named
statements, and turning rows into results."""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import time
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import migrate
from .errors import (
    InvalidArgumentError,
    InvalidChannelError,
    InvalidPolicyError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SchemaVersionError,
)
from .schedule import SCHEDULE_CHANNEL
from .types import (
    AckStatus,
    ChannelStats,
    CreateResult,
    CreateStatus,
    Discrepancy,
    NewMessage,
    Outcome,
    OutcomeKind,
    Policy,
    RoleKind,
)

DEFAULT_CHANNEL = "default"
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_LOCK_MS = 7 * 24 * 3600 * 1000
MAX_BATCH = 100_000
MAX_DEQUEUE_LIMIT = 10_000
TIME_BOUND_MS = 10**15
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_SCHEMA_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


# -- argument checks ---------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_schema(schema: object) -> str:
    """A schema name: an identifier of letters, digits and underscores (at most 63)."""
    if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
        raise InvalidArgumentError(
            f"schema must be 1 to 63 letters, digits or underscores, not starting with a "
            f"digit; got {schema!r}"
        )
    if schema.lower().startswith("pg_"):
        raise InvalidArgumentError(f"schema names starting with 'pg_' are reserved: {schema!r}")
    return schema


def _encodable(value: str) -> bool:
    """Whether ``value`` has a UTF-8 form (lone surrogates have none)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_clean_text(value: str) -> bool:
    """Whether PostgreSQL text can hold ``value``: no NUL, and a UTF-8 form."""
    return "\x00" not in value and _encodable(value)


def check_channel(channel: object) -> str:
    if channel is None:
        return DEFAULT_CHANNEL
    if not isinstance(channel, str):
        raise InvalidChannelError(f"channel must be a str, got {type(channel).__name__}")
    if not 1 <= len(channel) <= 255:
        raise InvalidChannelError(f"channel name must be 1 to 255 characters, got {len(channel)}")
    if "\x00" in channel or not _encodable(channel):
        raise InvalidChannelError("channel name must be valid Unicode text without NUL characters")
    return channel


def check_target_channel(channel: object) -> str:
    """A channel to create messages in: a channel name, not the schedules' own channel."""
    name = check_channel(channel)
    if name == SCHEDULE_CHANNEL:
        raise InvalidChannelError(
            f"channel {SCHEDULE_CHANNEL!r} is reserved for schedules' drivers: "
            "use schedule() to add one"
        )
    return name


def check_payload(name: str, value: object, *, optional: bool) -> bytes | None:
    if value is None and optional:
        return None
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidArgumentError(
            f"{name} must be bytes, got {type(value).__name__}"
            + (" (encode text first, e.g. s.encode())" if isinstance(value, str) else "")
        )
    data = bytes(value)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLargeError(f"{name} must be at most 64 MiB, got {len(data)} bytes")
    return data


def check_time(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidArgumentError(
            f"{name} must be an int (ms since the Unix epoch), got {type(value).__name__}"
        )
    assert isinstance(value, int)
    if not -TIME_BOUND_MS <= value <= TIME_BOUND_MS:
        raise InvalidArgumentError(f"{name} must be within +/-10^15 ms, got {value}")
    return value


def check_dedup_key(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentError(f"dedup_key must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= 255 or "\x00" in value or not _encodable(value):
        raise InvalidArgumentError(
            "dedup_key must be 1 to 255 characters of valid Unicode text, without NUL"
        )
    return value


def check_lock_ms(value: object) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_LOCK_MS:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"lock_ms must be an int between 1 and {MAX_LOCK_MS} (7 days), got {value!r}"
        )
    assert isinstance(value, int)
    return value


def check_limit(value: object) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_DEQUEUE_LIMIT:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"limit must be an int between 1 and {MAX_DEQUEUE_LIMIT}, got {value!r}"
        )
    assert isinstance(value, int)
    return value


def check_claim(message_id: object, num_attempts: object) -> tuple[int, int]:
    if not _is_int(message_id) or not 1 <= message_id <= INT64_MAX:  # type: ignore[operator]
        raise InvalidArgumentError(f"message id must be a positive int, got {message_id!r}")
    if not _is_int(num_attempts) or not 1 <= num_attempts <= INT32_MAX:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"num_attempts must be the positive int dequeue returned, got {num_attempts!r}"
        )
    return message_id, num_attempts  # type: ignore[return-value]


def check_message(message: object, *, schema: str) -> tuple[int, int]:
    """(id, num_attempts) of a message you hold, checked (anything else is refused), for the
    queue in ``schema``."""
    if not hasattr(message, "id") or not hasattr(message, "num_attempts"):
        raise InvalidArgumentError(
            f"expected a message returned by dequeue, got {type(message).__name__}"
        )
    claim = check_claim(message.id, message.num_attempts)
    _check_same_queue(message, schema)
    return claim


def _check_same_queue(message: object, schema: str) -> None:
    """Refuse a message taken from the queue of another schema: ids are numbered per queue,
    so its id would name an unrelated message of this one (and finish it)."""
    origin = getattr(getattr(message, "queue", None), "schema", None)
    if isinstance(origin, str) and origin != schema:
        raise InvalidArgumentError(
            f"message {getattr(message, 'id', None)} was taken from the queue in schema "
            f"{origin!r}, not this one ({schema!r}): finish it with the queue it came from"
        )


def check_claims(messages: object, *, schema: str) -> list[tuple[int, int]]:
    """(id, num_attempts) of each message of a batch, checked, for the queue in ``schema``."""
    if isinstance(messages, bytes | str) or not isinstance(messages, Iterable):
        raise InvalidArgumentError(
            f"expected a sequence of messages, got {type(messages).__name__}"
        )
    claims = []
    for message in messages:
        message_id = getattr(message, "id", None)
        num_attempts = getattr(message, "num_attempts", None)
        claims.append(check_claim(message_id, num_attempts))
        _check_same_queue(message, schema)
    if len(claims) > MAX_BATCH:
        raise InvalidArgumentError(f"at most {MAX_BATCH} messages per call, got {len(claims)}")
    return claims


def check_policy(max_concurrency: object, release_interval_ms: object, max_size: object) -> Policy:
    def bounded(name: str, value: object, upper: int, hint: str = "") -> int | None:
        if value is None:
            return None
        if not _is_int(value) or not 0 <= value <= upper:  # type: ignore[operator]
            raise InvalidPolicyError(
                f"{name} must be None or an int between 0 and {upper}{hint}, got {value!r}"
            )
        return value  # type: ignore[return-value]

    return Policy(
        max_concurrency=bounded(
            "max_concurrency", max_concurrency, INT32_MAX, " (0 pauses the channel)"
        ),
        release_interval_ms=bounded(
            "release_interval_ms", release_interval_ms, 365 * 24 * 3600 * 1000, " (1 year)"
        ),
        max_size=bounded("max_size", max_size, INT64_MAX),
    )


def check_new_messages(items: Iterable[NewMessage]) -> list[NewMessage]:
    if isinstance(items, NewMessage | bytes | str) or not isinstance(items, Iterable):
        raise InvalidArgumentError(
            f"create_many takes an iterable of NewMessage, got {type(items).__name__}"
        )
    checked: list[NewMessage] = []
    for item in items:
        if not isinstance(item, NewMessage):
            raise InvalidArgumentError(
                f"create_many takes NewMessage items, got {type(item).__name__}"
            )
        checked.append(
            NewMessage(
                content=check_payload("content", item.content, optional=False),  # type: ignore[arg-type]
                channel=check_target_channel(item.channel),
                dequeue_at=check_time(
                    "dequeue_at", priority_to_dequeue_at(item.priority, item.dequeue_at)
                ),
                dedup_key=check_dedup_key(item.dedup_key),
            )
        )
        if len(checked) > MAX_BATCH:
            raise InvalidArgumentError(f"at most {MAX_BATCH} messages per create_many call")
    return checked


def priority_to_dequeue_at(priority: object, dequeue_at: object) -> object:
    """``priority=p`` is the historic ``dequeue_at=p``: ahead of every message of today."""
    if priority is None:
        return dequeue_at
    if dequeue_at is not None:
        raise InvalidArgumentError(
            "priority and dequeue_at cannot be combined: a prioritised message is due now"
        )
    if not _is_int(priority) or not 0 <= priority <= 1_000_000:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"priority must be an int between 0 (first) and 1000000, got {priority!r}"
        )
    return priority


# Seconds a new connection may take before it fails, unless the connection string (or
# PGCONNECT_TIMEOUT) says otherwise: libpq waits for ever by default, so a server that accepts
# the connection and never answers would hang the caller.
DEFAULT_CONNECT_TIMEOUT_S = 10
# TCP keepalives, unless the string sets any: libpq leaves their timing to the system (on
# Linux the first probe comes after two hours idle), so a connection whose server vanished
# without closing it (a host lost, a network cut) would look alive for hours. With these, an
# idle one is found dead within a minute.
DEFAULT_KEEPALIVES = {"keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
# Milliseconds sent data may stay unacknowledged before the connection is dropped (libpq 12
# and later): a statement sent to such a server fails after this instead of after the
# system's retransmissions (about 15 minutes), so a worker's heartbeats and reports reconnect.
DEFAULT_TCP_USER_TIMEOUT_MS = 60_000


def with_client_timeouts(dsn: str) -> str:
    """``dsn`` with the client's timeouts added where it and the environment set none:
    ``connect_timeout=DEFAULT_CONNECT_TIMEOUT_S``, the TCP keepalives of
    ``DEFAULT_KEEPALIVES`` and ``tcp_user_timeout``. A string that names a service gets none
    (the service file may set them, and an added setting would override it); one that does
    not parse is returned as it is: the first connection says what is wrong with it."""
    if os.environ.get("PGSERVICE"):
        return dsn
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return dsn
    if "service" in params:
        return dsn
    added: dict[str, int] = {}
    if "connect_timeout" not in params and not os.environ.get("PGCONNECT_TIMEOUT"):
        added["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
    if not any(key.startswith("keepalives") for key in params):
        added.update(DEFAULT_KEEPALIVES)
    if "tcp_user_timeout" not in params and psycopg.pq.version() >= 120000:
        added["tcp_user_timeout"] = DEFAULT_TCP_USER_TIMEOUT_MS
    return make_conninfo(dsn, **added) if added else dsn


def conflict_backoff_s(attempt: int) -> float:
    """Seconds to wait before running again an operation rolled back for a concurrent
    transaction, after ``attempt`` (0, 1, ...) earlier runs: growing, and jittered so that two
    victims of one conflict do not meet again."""
    return 0.01 * 2.0**attempt * random.uniform(0.5, 1.5)


def conflict_pause(attempt: int) -> None:
    """Wait :func:`conflict_backoff_s` seconds (the sync API)."""
    time.sleep(conflict_backoff_s(attempt))


async def conflict_pause_async(attempt: int) -> None:
    """Wait :func:`conflict_backoff_s` seconds without holding a thread (the asyncio API)."""
    await asyncio.sleep(conflict_backoff_s(attempt))


# The tables Queue.maintain() vacuums and compacts, in the order it reports them.
MAINTAINED_TABLES = ("channel", "message")

# The advisory lock that lonnymq.spark.snapshot() holds shared and maintenance_compact() takes
# exclusive (the same expression in the schema's source): no compaction while a snapshot that
# Spark reads the queue in is open.
SNAPSHOT_LOCK_KEY = "pg_catalog.hashtextextended('lonnymq.snapshot', 0)"


def check_max_live(value: object) -> int:
    """``compact``'s ``max_live``: 1 to 1,000,000 rows."""
    if not _is_int(value) or not 1 <= value <= 1_000_000:  # type: ignore[operator]
        raise InvalidArgumentError(f"max_live must be an int between 1 and 1000000, got {value!r}")
    assert isinstance(value, int)
    return value


def check_pool_timeout(value: object) -> float:
    """Seconds a call may wait for a pooled connection: a finite number above 0."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise InvalidArgumentError(
            f"pool_timeout must be a finite number of seconds > 0, got {value!r}"
        )
    return float(value)


def check_settle_limit(value: object) -> int:
    """``settle``'s limit: 0 (take nothing) to ``MAX_DEQUEUE_LIMIT``."""
    return 0 if _is_int(value) and value == 0 else check_limit(value)


def settle_params(outcomes: object, *, schema: str) -> dict[str, list[Any]]:
    """``message_settle``'s arrays for ``outcomes`` (each an :class:`Outcome`), checked."""
    if isinstance(outcomes, bytes | str) or not isinstance(outcomes, Iterable):
        raise InvalidArgumentError(
            f"outcomes must be a sequence of Outcome, got {type(outcomes).__name__}"
        )
    items = list(outcomes)
    for item in items:
        if not isinstance(item, Outcome):
            raise InvalidArgumentError(f"outcomes must be Outcome values, got {item!r}")
    claims = check_claims([item.message for item in items], schema=schema)
    kinds: list[str] = []
    dequeue_ats: list[int | None] = []
    states: list[bytes | None] = []
    errors: list[str | None] = []
    channels: list[str | None] = []
    for item in items:
        kind = item.kind
        if type(kind) is not OutcomeKind:  # a value given by hand, not by Outcome's builders
            try:
                kind = OutcomeKind(kind)
            except ValueError:
                raise InvalidArgumentError(
                    f"outcome kind must be one of {[k.value for k in OutcomeKind]}, "
                    f"got {item.kind!r}"
                ) from None
        kinds.append(kind.value)
        # (None, the usual value, needs no check.)
        dequeue_ats.append(
            None if item.dequeue_at is None else check_time("dequeue_at", item.dequeue_at)
        )
        states.append(
            None if item.state is None else check_payload("state", item.state, optional=True)
        )
        if kind is OutcomeKind.COMPLETED or kind is OutcomeKind.DEFERRED:
            errors.append(None)
            channels.append(None)
        else:
            errors.append(check_error_text(item.error))
            channels.append(
                check_target_channel(item.channel) if kind is OutcomeKind.DEAD_LETTERED else None
            )
    return {
        "ids": [c[0] for c in claims],
        "num_attempts": [c[1] for c in claims],
        "outcomes": kinds,
        "dequeue_ats": dequeue_ats,
        "states": states,
        "errors": errors,
        "channels": channels,
    }


def settle_arrays(params: dict[str, list[Any]]) -> dict[str, Any]:
    """``params`` for the call: each optional array that holds only NULLs sent as NULL (the
    function reads a NULL array as all NULL), which spares encoding it."""
    return {
        name: None
        if name in ("dequeue_ats", "states", "errors", "channels")
        and all(value is None for value in values)
        else values
        for name, values in params.items()
    }


def check_error_text(error: object) -> str:
    """An error description for the archive: text, cut to 64 KiB."""
    if not isinstance(error, str):
        raise InvalidArgumentError(f"error must be a str, got {type(error).__name__}")
    text = error.replace("\x00", "\ufffd")
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:65536]


def check_outcome(value: object) -> str | None:
    """An archive outcome to filter on: 1 to 64 characters of text without NUL."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= 64
        or "\x00" in value
        or not _encodable(value)
    ):
        raise InvalidArgumentError(
            f"outcome must be 1 to 64 characters of valid Unicode text without NUL, got {value!r}"
        )
    return value


def check_event_channel(value: object) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= 63
        or "\x00" in value
        or not _encodable(value)
    ):
        raise InvalidArgumentError(f"event_channel must be 1 to 63 characters, got {value!r}")
    return value


def check_role(role: object) -> str:
    """A PostgreSQL role name: 1 to 63 characters, any of them (it is quoted, never spliced)."""
    if not isinstance(role, str) or not 1 <= len(role) <= 63:
        raise InvalidArgumentError(f"role must be a role name of 1 to 63 characters, got {role!r}")
    if "\x00" in role or not _encodable(role):
        raise InvalidArgumentError("role name must be valid Unicode text without NUL characters")
    return role


def check_role_kind(kind: object) -> RoleKind:
    kinds = ", ".join(k.value for k in RoleKind)
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"kind must be one of {kinds}, got {kind!r}")
    try:
        return RoleKind(kind)
    except ValueError:
        raise InvalidArgumentError(f"kind must be one of {kinds}, got {kind!r}") from None


# -- statements --------------------------------------------------------------------------


@cache
def statement_texts(package: str = "lonnymq", path: str = "sql/statements.sql") -> dict[str, str]:
    """The named statements (``-- name: x`` sections) of a packaged SQL file."""
    text = resources.files(package).joinpath(path).read_text("utf-8")
    statements: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("-- name: "):
            if name is not None:
                statements[name] = "\n".join(lines).strip()
            name, lines = line.removeprefix("-- name: ").strip(), []
        elif name is not None and not line.startswith("--"):
            lines.append(line)
    if name is not None:
        statements[name] = "\n".join(lines).strip()
    return statements


class Statements:
    """The named statements, composed for one schema."""

    def __init__(self, schema: str) -> None:
        ident = sql.Identifier(schema)
        self._composed: dict[str, sql.Composed] = {
            name: sql.SQL(text).format(schema=ident) for name, text in statement_texts().items()
        }

    def __getitem__(self, name: str) -> sql.Composed:
        return self._composed[name]


# -- schema state ------------------------------------------------------------------------


def schema_state(schema: str, row: tuple[Any, ...]) -> tuple[int, list[migrate.Migration], bool]:
    """The version, the migrations to apply and whether the function layer is stale, from
    a row of migrate.state_statement (or installed_statement); refuses what no install
    can upgrade."""
    current, baseline, sha256, recorded_md5, catalog_md5 = row
    current = int(current or 0)
    latest = migrate.latest_version()
    if baseline is not None and baseline != migrate.BASELINE:
        raise SchemaVersionError(
            f"schema {schema!r} was installed by a development build of lonnymq "
            f"from before its first release, which cannot be upgraded: drop the schema "
            f"and install again"
        )
    if current > latest:
        raise SchemaVersionError(
            f"schema {schema!r} is at version {current}, newer than this "
            f"lonnymq knows ({latest}): upgrade the lonnymq package"
        )
    stale = sha256 != migrate.functions_sha256() or recorded_md5 != catalog_md5
    return current, migrate.pending(current), stale


def installed_version(schema: str, row: tuple[Any, ...] | None) -> int:
    """The version of an install that a role that may not change the schema can use, from a
    row of migrate.installed_statement (None: no queue, or a function layer from before);
    refuses when the schema needs an install by its owner."""
    if row is None:
        row = (-1, None, None)
    # The recorded checksum only: this role could not put a changed function back anyway.
    current, pending, stale = schema_state(schema, (*row, None, None))
    if current < 0 or pending or stale:
        raise PermissionDeniedError(
            f"schema {schema!r} needs an install of this lonnymq (migrations up to "
            f"version {migrate.latest_version()} and its functions) and this role may not "
            f"change it: run install() (or `lonnymq install`) as the role that owns the "
            f"queue",
            "42501",
        )
    return current


# -- rows to results ---------------------------------------------------------------------


def create_result(row: Sequence[Any]) -> CreateResult:
    status, message_id, channel_size = row
    return CreateResult(status=CreateStatus(status), id=message_id, channel_size=channel_size)


def ack_statuses(rows: Sequence[Sequence[Any]]) -> list[AckStatus]:
    return [AckStatus(row[1]) for row in rows]


def channel_stats(row: Sequence[Any]) -> ChannelStats:
    channel, size, in_flight, next_at, max_concurrency, interval, max_size = row
    return ChannelStats(
        channel=channel,
        size=size,
        in_flight=in_flight,
        next_dequeue_at=next_at,
        policy=Policy(max_concurrency, interval, max_size),
    )


def discrepancy(row: Sequence[Any]) -> Discrepancy:
    channel, kind, expected, actual, detail = row
    return Discrepancy(channel=channel, kind=kind, expected=expected, actual=actual, detail=detail)


def optional_bytes(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)
