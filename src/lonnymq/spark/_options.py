"""The data source's options, checked once on the driver and kept as small frozen objects
that travel to the executors with the pickled reader or writer.

Spark hands options over as a case-insensitive mapping; it is only ever read with ``get`` (a
``dict()`` copy would lose the case-insensitivity). Every refusal is an
:class:`~lonnymq.errors.InvalidArgumentError` whose message names the option.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .. import _core
from ..embedded import DSN_ENV
from ..errors import InvalidArgumentError

__all__ = [
    "Connection",
    "ContentFormat",
    "OnFull",
    "ReadOptions",
    "StreamReadOptions",
    "Table",
    "WriteMode",
    "WriteOptions",
    "check_known",
    "connection_options",
    "read_options",
    "stream_read_options",
    "write_options",
]

DEFAULT_LOCK_MS = 60_000
DEFAULT_MAX_MESSAGES = 1_000
# Trigger.AvailableNow: how long a plan that finds nothing waits for messages up to the
# horizon that a channel's policy holds back (availableNowWaitMs).
DEFAULT_AVAILABLE_NOW_WAIT_MS = 60_000
MAX_AVAILABLE_NOW_WAIT_MS = 3_600_000
# Trigger.AvailableNow and ReadAllAvailable ask for "everything": plan at most this many per
# micro-batch all the same, so that one batch stays a bounded transaction.
MAX_MESSAGES_PER_BATCH = 100_000
DEFAULT_PARTITIONS = 2
MAX_PARTITIONS = 1_024

# Options Spark itself may add to the mapping, which are not ours to refuse.
_SPARK_OPTIONS = {"path", "paths", "checkpointlocation", "queryname"}

# Read only by the test suite: make write tasks fail after staging (see write_options), the
# first attempt only or, with the second, every attempt.
TEST_FAIL_OPTION = "_testFailAfterWrite"
TEST_FAIL_EVERY_OPTION = "_testFailEveryAttempt"


class Table(StrEnum):
    """What a batch read reads."""

    MESSAGE = "message"
    ARCHIVE = "archive"


class ContentFormat(StrEnum):
    """Where a write takes each message's content from."""

    COLUMN = "column"
    """One binary or string column (``contentColumn``)."""
    JSON = "json"
    """The columns not mapped to channel, dequeue_at or dedup_key, as one JSON object."""


class WriteMode(StrEnum):
    """How a batch write enqueues."""

    STAGED = "staged"
    """Tasks stage, the driver's commit enqueues: all or nothing, once per task retry."""
    DIRECT = "direct"
    """Tasks enqueue their rows themselves: no staging, but not all or nothing, and a retried
    task is harmless only through its rows' dedup keys, which are required."""


class OnFull(StrEnum):
    """What a write does when channels at their ``max_size`` refuse messages."""

    FAIL = "fail"
    """Fail the job; with mode=staged nothing of it is enqueued (mode=direct keeps the rows
    its tasks enqueued)."""
    COUNT = "count"
    """Enqueue the rest, and count the refused messages in the write's result."""


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the queue is: a libpq connection string and the queue's schema."""

    dsn: str
    schema: str


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """A write's column mapping and policies (batch and streaming)."""

    conn: Connection
    channel: str | None
    channel_column: str | None
    content_column: str | None
    content_format: ContentFormat
    dequeue_at_column: str | None
    dedup_key_column: str | None
    json_columns: tuple[str, ...]
    on_full: OnFull
    mode: WriteMode
    write_id: str | None
    sink_id: str | None
    fail_after_write: int | None
    fail_every_attempt: bool = False


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """A batch read: which table, how many partitions, and an optional exported snapshot."""

    conn: Connection
    table: Table
    partitions: int
    snapshot: str | None
    fetch_size: int


@dataclass(frozen=True, slots=True)
class StreamReadOptions:
    """A streaming read: its consumer name, lock duration, batch size, partitions, and how
    long Trigger.AvailableNow waits for messages a channel's policy holds back."""

    conn: Connection
    consumer: str
    lock_ms: int
    max_messages: int
    partitions: int
    available_now_wait_ms: int


def _bad(option: str, expected: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"lonnymq option {option!r} must be {expected}, got {value!r}")


def check_known(options: Mapping[str, str], known: set[str], direction: str) -> None:
    """Refuse option names this direction does not know (typos would be silently ignored)."""
    lowered = {name.lower() for name in known} | _SPARK_OPTIONS
    unknown = sorted(key for key in options if key.lower() not in lowered)
    if unknown:
        raise InvalidArgumentError(
            f"unknown lonnymq option(s) {', '.join(map(repr, unknown))} for {direction}; "
            f"known options: {', '.join(sorted(n for n in known if not n.startswith('_')))}"
        )


def _text(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _bad(name, "a non-empty string", value)
    if not _core.is_clean_text(value):
        raise _bad(name, "text without NUL or lone surrogates", value)
    return value


def _int(options: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    value = options.get(name)
    if value is None:
        return default
    try:
        number = int(str(value).strip())
    except ValueError:
        raise _bad(name, f"an integer between {low} and {high}", value) from None
    if not low <= number <= high:
        raise _bad(name, f"an integer between {low} and {high}", value)
    return number


def _choice(options: Mapping[str, str], name: str, kind: type[StrEnum], default: StrEnum) -> str:
    value = options.get(name)
    if value is None:
        return str(default)
    allowed = [str(member) for member in kind]
    if str(value).lower() not in allowed:
        raise _bad(name, " or ".join(map(repr, allowed)), value)
    return str(value).lower()


COMMON_OPTIONS = {"dsn", "schema"}


def connection_options(options: Mapping[str, str]) -> Connection:
    """``dsn`` (default ``$LONNYMQ_DSN`` of the driver) and ``schema`` (default ``lonnymq``)."""
    dsn = _text(options, "dsn") or os.environ.get(DSN_ENV)
    if not dsn:
        raise InvalidArgumentError(
            f"lonnymq option 'dsn' is required (a libpq connection string such as "
            f"'postgresql://user@host/db'), or set {DSN_ENV} in the environment the Spark "
            f"driver was started from"
        )
    from psycopg import conninfo

    try:
        conninfo.conninfo_to_dict(dsn)
    except Exception as err:
        raise InvalidArgumentError(
            f"lonnymq option 'dsn' is not a valid libpq connection string: {err}"
        ) from None
    schema = _text(options, "schema") or "lonnymq"
    try:
        _core.check_schema(schema)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"lonnymq option 'schema': {err}") from None
    return Connection(dsn=dsn, schema=schema)


WRITE_OPTIONS = COMMON_OPTIONS | {
    "channel",
    "channelColumn",
    "contentColumn",
    "contentFormat",
    "dequeueAtColumn",
    "dedupKeyColumn",
    "onFull",
    TEST_FAIL_OPTION,
    TEST_FAIL_EVERY_OPTION,
}
BATCH_WRITE_OPTIONS = WRITE_OPTIONS | {"writeId", "mode"}
STREAM_WRITE_OPTIONS = WRITE_OPTIONS | {"sinkId"}


@dataclass(frozen=True, slots=True)
class ColumnInfo:
    """A DataFrame column as the writer sees it: its name and a coarse type."""

    name: str
    kind: str  # "string", "binary", "integer", "timestamp" or "other"


def _mapped(
    options: Mapping[str, str],
    option: str,
    *,
    default: str,
    columns: dict[str, ColumnInfo],
    kinds: set[str],
    describe: str,
    strict_default: bool,
) -> str | None:
    """The column an option maps (its default only when that column exists, by its exact
    name: a ``Channel`` field of a JSON content stays data). A name given in the option
    matches as Spark resolves names by default: exactly, else ignoring case (two columns that
    differ only in case, neither an exact match, are ambiguous). With ``strict_default``, a
    column that differs from the default only in case is refused rather than left out
    (its rows would all go to one channel, or lose their dedup keys, without a word)."""
    explicit = _text(options, option)
    name = explicit or default
    found = columns.get(name)
    if found is None and explicit is None and strict_default:
        near = [c.name for c in columns.values() if c.name.lower() == default.lower()]
        if near:
            raise InvalidArgumentError(
                f"the DataFrame has column {near[0]!r}, which differs from lonnymq's default "
                f"{default!r} only in case: name it with option {option!r} (names given in "
                "options match ignoring case), or rename it"
            )
    if found is None and explicit is not None:
        folded = [c for c in columns.values() if c.name.lower() == name.lower()]
        if len(folded) > 1:
            raise InvalidArgumentError(
                f"lonnymq option {option!r}: column {name!r} is ambiguous, the DataFrame has "
                f"{' and '.join(repr(c.name) for c in folded)}; name one exactly"
            )
        found = folded[0] if folded else None
    if found is None:
        if explicit is not None:
            raise InvalidArgumentError(
                f"lonnymq option {option!r} names column {explicit!r}, which the DataFrame "
                f"does not have (columns: {', '.join(columns) or 'none'})"
            )
        return None
    if found.kind not in kinds:
        raise InvalidArgumentError(
            f"column {found.name!r} (lonnymq option {option!r}) must be {describe}, "
            f"got a {found.kind} column"
        )
    return found.name


def write_options(
    options: Mapping[str, str], columns: list[ColumnInfo], *, streaming: bool
) -> WriteOptions:
    """Check a write's options against the DataFrame's columns."""
    check_known(
        options,
        STREAM_WRITE_OPTIONS if streaming else BATCH_WRITE_OPTIONS,
        "df.writeStream" if streaming else "df.write",
    )
    conn = connection_options(options)
    by_name = {c.name: c for c in columns}
    content_format = ContentFormat(
        _choice(options, "contentFormat", ContentFormat, ContentFormat.COLUMN)
    )
    # In the column format a column unmapped is dropped: one that is a default's name but for
    # its case is a mistake to refuse. In JSON, it is a field of the content.
    strict = content_format is ContentFormat.COLUMN
    channel = _text(options, "channel")
    if channel is not None:
        try:
            _core.check_target_channel(channel)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"lonnymq option 'channel': {err}") from None
        if _text(options, "channelColumn") is not None:
            raise InvalidArgumentError(
                "lonnymq options 'channel' (one channel for every row) and 'channelColumn' "
                "(a channel per row) cannot be combined"
            )
        channel_column = None
    else:
        channel_column = _mapped(
            options,
            "channelColumn",
            default="channel",
            columns=by_name,
            kinds={"string"},
            describe="a string column",
            strict_default=strict,
        )
    dequeue_at_column = _mapped(
        options,
        "dequeueAtColumn",
        default="dequeue_at",
        columns=by_name,
        kinds={"integer", "timestamp"},
        describe="an integer (ms since the Unix epoch) or timestamp column",
        strict_default=strict,
    )
    dedup_key_column = _mapped(
        options,
        "dedupKeyColumn",
        default="dedup_key",
        columns=by_name,
        kinds={"string"},
        describe="a string column",
        strict_default=strict,
    )
    content_column: str | None = None
    json_columns: tuple[str, ...] = ()
    if content_format is ContentFormat.COLUMN:
        content_column = _mapped(
            options,
            "contentColumn",
            default="content",
            columns=by_name,
            kinds={"binary", "string"},
            describe="a binary or string column",
            strict_default=strict,
        )
        if content_column is None:
            raise InvalidArgumentError(
                "lonnymq needs the message content: the DataFrame has no 'content' column; "
                "name one with option 'contentColumn', or set contentFormat=json to send the "
                "other columns as a JSON object"
            )
    else:
        if _text(options, "contentColumn") is not None:
            raise InvalidArgumentError(
                "lonnymq option 'contentColumn' does not apply with contentFormat=json"
            )
        taken = {channel_column, dequeue_at_column, dedup_key_column}
        json_columns = tuple(c.name for c in columns if c.name not in taken)
        if not json_columns:
            raise InvalidArgumentError(
                "contentFormat=json needs at least one column besides channel, dequeue_at and "
                "dedup_key"
            )
    mode = WriteMode(_choice(options, "mode", WriteMode, WriteMode.STAGED))
    if mode is WriteMode.DIRECT:
        if dedup_key_column is None:
            raise InvalidArgumentError(
                "lonnymq option mode=direct needs a dedup key per row (a 'dedup_key' column, "
                "or option 'dedupKeyColumn'): it is what makes a retried task harmless"
            )
        if options.get("writeId") is not None:
            raise InvalidArgumentError(
                "lonnymq option 'writeId' needs mode=staged (a direct write records no commit)"
            )
    return WriteOptions(
        conn=conn,
        channel=channel,
        channel_column=channel_column,
        content_column=content_column,
        content_format=content_format,
        dequeue_at_column=dequeue_at_column,
        dedup_key_column=dedup_key_column,
        json_columns=json_columns,
        on_full=OnFull(_choice(options, "onFull", OnFull, OnFull.FAIL)),
        mode=mode,
        write_id=None if streaming else _identifier(options, "writeId"),
        sink_id=_identifier(options, "sinkId") if streaming else None,
        fail_after_write=(
            None
            if options.get(TEST_FAIL_OPTION) is None
            else _int(options, TEST_FAIL_OPTION, 0, 0, 1_000_000)
        ),
        fail_every_attempt=(_text(options, TEST_FAIL_EVERY_OPTION) or "").lower() == "true",
    )


def _identifier(options: Mapping[str, str], name: str) -> str | None:
    value = _text(options, name)
    if value is not None and len(value) > 200:
        raise _bad(name, "at most 200 characters", value)
    return value


def writer_id(name: str, value: object) -> str:
    """A ``writeId``/``sinkId`` given as an argument rather than an option, checked alike."""
    checked = _identifier({name: value}, name)  # type: ignore[dict-item]
    if checked is None:
        raise _bad(name, "a non-empty string", value)
    return checked


READ_OPTIONS = COMMON_OPTIONS | {"table", "numPartitions", "snapshot", "fetchSize"}


def read_options(options: Mapping[str, str]) -> ReadOptions:
    """Check a batch read's options."""
    check_known(options, READ_OPTIONS, "spark.read")
    return ReadOptions(
        conn=connection_options(options),
        table=Table(_choice(options, "table", Table, Table.MESSAGE)),
        partitions=_int(options, "numPartitions", DEFAULT_PARTITIONS, 1, MAX_PARTITIONS),
        snapshot=_text(options, "snapshot"),
        fetch_size=_int(options, "fetchSize", 10_000, 1, 1_000_000),
    )


STREAM_READ_OPTIONS = COMMON_OPTIONS | {
    "availableNowWaitMs",
    "consumer",
    "lockMs",
    "maxMessagesPerBatch",
    "numPartitions",
}


def stream_read_options(options: Mapping[str, str]) -> StreamReadOptions:
    """Check a streaming read's options; ``consumer`` is required."""
    check_known(options, STREAM_READ_OPTIONS, "spark.readStream")
    conn = connection_options(options)
    consumer = _text(options, "consumer")
    if consumer is None:
        raise InvalidArgumentError(
            "lonnymq option 'consumer' is required for spark.readStream: a name for this "
            "query's planned batches (keep it across restarts; two running queries must not "
            "share it)"
        )
    if len(consumer) > 255:
        raise _bad("consumer", "at most 255 characters", consumer)
    return StreamReadOptions(
        conn=conn,
        consumer=consumer,
        lock_ms=_int(options, "lockMs", DEFAULT_LOCK_MS, 1_000, _core.MAX_LOCK_MS),
        max_messages=_int(
            options, "maxMessagesPerBatch", DEFAULT_MAX_MESSAGES, 1, MAX_MESSAGES_PER_BATCH
        ),
        partitions=_int(options, "numPartitions", DEFAULT_PARTITIONS, 1, MAX_PARTITIONS),
        available_now_wait_ms=_available_now_wait_ms(options),
    )


def _available_now_wait_ms(options: Mapping[str, str]) -> int:
    return _int(
        options,
        "availableNowWaitMs",
        DEFAULT_AVAILABLE_NOW_WAIT_MS,
        0,
        MAX_AVAILABLE_NOW_WAIT_MS,
    )


ALL_OPTIONS = BATCH_WRITE_OPTIONS | STREAM_WRITE_OPTIONS | READ_OPTIONS | STREAM_READ_OPTIONS


def check_all(options: Mapping[str, str]) -> Connection:
    """What can be checked before the direction is known (when the data source is created):
    option names, and the value of every option given."""
    check_known(options, ALL_OPTIONS, "format('lonnymq')")
    conn = connection_options(options)
    _choice(options, "table", Table, Table.MESSAGE)
    _choice(options, "contentFormat", ContentFormat, ContentFormat.COLUMN)
    _choice(options, "onFull", OnFull, OnFull.FAIL)
    _choice(options, "mode", WriteMode, WriteMode.STAGED)
    _int(options, "numPartitions", DEFAULT_PARTITIONS, 1, MAX_PARTITIONS)
    _int(options, "fetchSize", 10_000, 1, 1_000_000)
    _int(options, "lockMs", DEFAULT_LOCK_MS, 1_000, _core.MAX_LOCK_MS)
    _int(options, "maxMessagesPerBatch", DEFAULT_MAX_MESSAGES, 1, MAX_MESSAGES_PER_BATCH)
    _available_now_wait_ms(options)
    for name in ("consumer", "snapshot", "channel", "writeId", "sinkId"):
        _text(options, name)
    return conn
