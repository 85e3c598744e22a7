"""The exceptions lonnymq raises.

Every error is a :class:`LonnyMQError`; refusals by the queue carry their own SQLSTATE
(class ``LQ``) and map to exactly one class::

    LonnyMQError
    ├── InvalidArgumentError (also a ValueError)     LQ003
    │   ├── InvalidPolicyError                       LQ004
    │   ├── InvalidChannelError                      LQ005
    │   └── PayloadTooLargeError                     LQ006
    ├── MessageError
    │   ├── MessageNotFoundError                     LQ001
    │   ├── StaleMessageError                        LQ002
    │   └── MessageLockedError                       LQ007
    ├── ChannelFullError                             a message that may not be dropped met max_size
    ├── SchemaError
    │   ├── SchemaNotInstalledError
    │   └── SchemaVersionError
    ├── DatabaseError                                any other database error
    │   ├── DatabaseUnavailableError                 connection failed or lost
    │   └── PermissionDeniedError                    42501: the role may not do this
    └── EmbeddedServerError

A refusal changes nothing: the queue is as it was before the call.
"""

from __future__ import annotations

import psycopg

__all__ = [
    "ChannelFullError",
    "DatabaseError",
    "DatabaseUnavailableError",
    "EmbeddedServerError",
    "InvalidArgumentError",
    "InvalidChannelError",
    "InvalidPolicyError",
    "LonnyMQError",
    "MessageError",
    "MessageLockedError",
    "MessageNotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "SchemaError",
    "SchemaNotInstalledError",
    "SchemaVersionError",
    "StaleMessageError",
    "translate",
]


class LonnyMQError(Exception):
    """Something lonnymq could not do."""

    sqlstate: str | None = None


class InvalidArgumentError(LonnyMQError, ValueError):
    """An argument has the wrong type or is out of range; nothing was changed."""

    sqlstate = "LQ003"


class InvalidPolicyError(InvalidArgumentError):
    """A channel policy value is out of range (the policy was not changed), or a policy
    refuses what was asked: a schedule when the schedules' channel is full."""

    sqlstate = "LQ004"


class InvalidChannelError(InvalidArgumentError):
    """A channel name is empty, too long or not text."""

    sqlstate = "LQ005"


class PayloadTooLargeError(InvalidArgumentError):
    """A content or state is larger than the queue accepts (64 MiB)."""

    sqlstate = "LQ006"


class MessageError(LonnyMQError):
    """An operation on one message was refused."""


class MessageNotFoundError(MessageError):
    """The message does not exist: it was already finished, or never created."""

    sqlstate = "LQ001"


class StaleMessageError(MessageError):
    """You no longer hold this message's lock: it expired and the message was dequeued again,
    or it went back to its channel. Nothing was changed; do not report the work as done."""

    sqlstate = "LQ002"


class MessageLockedError(MessageError):
    """The message is locked: a worker holds it, and only a waiting message may be discarded
    or made due now. Nothing was changed."""

    sqlstate = "LQ007"


class ChannelFullError(LonnyMQError):
    """A channel at its ``max_size`` refused a message that must not be dropped (a dead-letter
    copy); nothing was changed: the message is still where it was, and still held."""


class SchemaError(LonnyMQError):
    """The queue's schema is missing or at a version this package cannot use."""


class SchemaNotInstalledError(SchemaError):
    """The queue is not installed in this schema: call ``install()`` (or ``lonnymq install``)."""


class SchemaVersionError(SchemaError):
    """The schema was migrated by a newer lonnymq than this one: upgrade the package."""


class DatabaseError(LonnyMQError):
    """PostgreSQL reported an error that is not one of the queue's refusals."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class DatabaseUnavailableError(DatabaseError):
    """The connection to PostgreSQL failed or was lost; the operation may be retried."""


class TransactionConflictError(DatabaseError):
    """PostgreSQL rolled the transaction back because it conflicted with a concurrent one (a
    deadlock, SQLSTATE 40P01, or a serialization failure, 40001). Nothing it did was kept:
    run the whole transaction again."""


class PermissionDeniedError(DatabaseError):
    """The connected role may not do this: the queue's owner grants a role the operations of
    one kind with ``Queue.grant(role, "producer" | "worker" | "admin")``. Nothing was changed."""


class EmbeddedServerError(LonnyMQError):
    """The embedded PostgreSQL server could not be started."""


_BY_SQLSTATE: dict[str, type[LonnyMQError]] = {
    cls.sqlstate: cls
    for cls in (
        MessageNotFoundError,
        StaleMessageError,
        MessageLockedError,
        InvalidArgumentError,
        InvalidPolicyError,
        InvalidChannelError,
        PayloadTooLargeError,
    )
    if cls.sqlstate is not None
}

# insufficient_privilege: the role lacks a grant (or tried to reach a table directly).
_PERMISSION_DENIED = "42501"

# deadlock_detected, serialization_failure: rolled back for a concurrent transaction.
_CONFLICT = {"40P01", "40001"}

# Missing schema, table or function: the queue was never installed here.
_NOT_INSTALLED = {"3F000", "42P01", "42883"}


def _primary_message(err: psycopg.Error) -> str:
    diag = err.diag
    return diag.message_primary or str(err).strip() or type(err).__name__


def translate(err: psycopg.Error, *, schema: str | None = None) -> LonnyMQError:
    """Turn a driver error into the lonnymq exception that describes it."""
    sqlstate = err.sqlstate
    message = _primary_message(err)
    if sqlstate is not None and sqlstate in _BY_SQLSTATE:
        return _BY_SQLSTATE[sqlstate](message)
    if sqlstate in _NOT_INSTALLED:
        where = f"schema {schema!r}" if schema is not None else "this schema"
        return SchemaNotInstalledError(
            f"lonnymq is not installed in {where} ({message}); call install() first "
            "(or run `lonnymq install`)"
        )
    if sqlstate == _PERMISSION_DENIED:
        return PermissionDeniedError(
            f"{message}: the role connected to the queue may not do this. The queue's owner "
            f"grants a role what a producer, worker or admin needs with "
            f"queue.grant(role, kind) or `lonnymq grant ROLE KIND`",
            sqlstate,
        )
    if sqlstate in _CONFLICT:
        return TransactionConflictError(
            f"{message}: the transaction was rolled back (a conflict with a concurrent one); "
            "run it again",
            sqlstate,
        )
    if isinstance(err, psycopg.OperationalError) and sqlstate is None:
        return DatabaseUnavailableError(message)
    if sqlstate is not None and sqlstate[:2] in {"08", "57"}:
        return DatabaseUnavailableError(message, sqlstate)
    return DatabaseError(message, sqlstate)
