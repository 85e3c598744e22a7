"""lonnymq: a fair, durable message queue that lives inside PostgreSQL.

All queue logic is plpgsql installed into a schema you name; this package is a thin, typed
binding over it (sync :class:`Queue` and asyncio :class:`AsyncQueue`), plus an embedded
PostgreSQL for zero-setup use.
"""

from . import errors
from .errors import (
    InvalidArgumentError,
    LonnyMQError,
    MessageNotFoundError,
    StaleMessageError,
)
from .metrics import OperationStats
from .queue import Channel, Message, Queue
from .queue_async import AsyncChannel, AsyncMessage, AsyncQueue
from .types import (
    AckStatus,
    ChannelStats,
    CreateResult,
    CreateStatus,
    DequeueBatch,
    NewMessage,
    Policy,
    Settings,
)

__version__ = "0.1.0"

__all__ = [
    "AckStatus",
    "AsyncChannel",
    "AsyncMessage",
    "AsyncQueue",
    "Channel",
    "ChannelStats",
    "CreateResult",
    "CreateStatus",
    "DequeueBatch",
    "InvalidArgumentError",
    "LonnyMQError",
    "Message",
    "MessageNotFoundError",
    "NewMessage",
    "OperationStats",
    "Policy",
    "Queue",
    "Settings",
    "StaleMessageError",
    "errors",
]
