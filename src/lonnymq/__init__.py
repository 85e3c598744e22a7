"""lonnymq: a fair, durable message queue that lives inside PostgreSQL.

All queue logic is plpgsql installed into a schema you name; this package is a thin, typed
binding over it (sync :class:`Queue` and asyncio :class:`AsyncQueue`), plus a worker runtime
(:mod:`lonnymq.worker`), periodic schedules, an embedded PostgreSQL for zero-setup use, and the
``lonnymq`` command.
"""

from importlib import metadata as _metadata

from . import errors
from .archive import ArchivedMessage, ReplayResult
from .errors import (
    ChannelFullError,
    DatabaseError,
    DatabaseUnavailableError,
    EmbeddedServerError,
    InvalidArgumentError,
    InvalidChannelError,
    InvalidPolicyError,
    LonnyMQError,
    MessageError,
    MessageLockedError,
    MessageNotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SchemaError,
    SchemaNotInstalledError,
    SchemaVersionError,
    StaleMessageError,
    TransactionConflictError,
)
from .events import Event, MessageOutcome
from .metrics import OperationStats
from .queue import Channel, Message, Queue
from .queue_async import AsyncChannel, AsyncMessage, AsyncQueue
from .schedule import Firing, Schedule
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
    Policy,
    RoleGrant,
    RoleKind,
    Settings,
)

try:
    # pyproject.toml holds the one version literal; the installed metadata carries it.
    __version__ = _metadata.version("lonnymq")
except _metadata.PackageNotFoundError:  # the source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "AckStatus",
    "ArchivedMessage",
    "AsyncChannel",
    "AsyncMessage",
    "AsyncQueue",
    "Channel",
    "ChannelFullError",
    "ChannelStats",
    "CreateResult",
    "CreateStatus",
    "DatabaseError",
    "DatabaseUnavailableError",
    "DequeueBatch",
    "Discrepancy",
    "EmbeddedServerError",
    "Event",
    "Firing",
    "InvalidArgumentError",
    "InvalidChannelError",
    "InvalidPolicyError",
    "LonnyMQError",
    "Message",
    "MessageError",
    "MessageLockedError",
    "MessageNotFoundError",
    "MessageOutcome",
    "NewMessage",
    "OperationStats",
    "Outcome",
    "OutcomeKind",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "Policy",
    "Queue",
    "ReplayResult",
    "RoleGrant",
    "RoleKind",
    "Schedule",
    "SchemaError",
    "SchemaNotInstalledError",
    "SchemaVersionError",
    "Settings",
    "StaleMessageError",
    "TransactionConflictError",
    "errors",
]
