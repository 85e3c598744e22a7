"""lonnymq: a fair, durable message queue that lives inside PostgreSQL.

All queue logic is plpgsql installed into a schema you name; this package is a thin, typed
binding over it (sync :class:`Queue` and asyncio :class:`AsyncQueue`), plus a worker runtime
(:mod:`lonnymq.worker`), periodic schedules, an embedded PostgreSQL for zero-setup use, and the
``lonnymq`` command.
"""

from . import errors
from .archive import ArchivedMessage, ReplayResult
from .errors import (
    InvalidArgumentError,
    LonnyMQError,
    MessageNotFoundError,
    PermissionDeniedError,
    StaleMessageError,
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
    Policy,
    RoleGrant,
    RoleKind,
    Settings,
)

__version__ = "0.1.0"

__all__ = [
    "AckStatus",
    "ArchivedMessage",
    "AsyncChannel",
    "AsyncMessage",
    "AsyncQueue",
    "Channel",
    "ChannelStats",
    "CreateResult",
    "CreateStatus",
    "DequeueBatch",
    "Discrepancy",
    "Event",
    "Firing",
    "InvalidArgumentError",
    "LonnyMQError",
    "Message",
    "MessageNotFoundError",
    "MessageOutcome",
    "NewMessage",
    "OperationStats",
    "PermissionDeniedError",
    "Policy",
    "Queue",
    "ReplayResult",
    "RoleGrant",
    "RoleKind",
    "Schedule",
    "Settings",
    "StaleMessageError",
    "errors",
]
