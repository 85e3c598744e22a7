"""Result and input types shared by the sync and async APIs (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

__all__ = [
    "AckStatus",
    "ChannelStats",
    "CreateResult",
    "CreateStatus",
    "DequeueBatch",
    "Discrepancy",
    "NewMessage",
    "Outcome",
    "OutcomeKind",
    "Policy",
    "RoleGrant",
    "RoleKind",
    "Settings",
]

M = TypeVar("M")


class CreateStatus(StrEnum):
    """What ``create`` did with a message."""

    CREATED = "created"
    """The message was added."""
    DEDUPLICATED = "deduplicated"
    """A live message of the channel has the same dedup key; its id is returned."""
    DROPPED = "dropped"
    """The channel is at its ``max_size``; nothing was added."""


class AckStatus(StrEnum):
    """The outcome of one message in ``delete_many`` / ``defer_many`` / ``heartbeat_many``."""

    OK = "ok"
    STALE = "stale"
    """The lock was lost (see :class:`~lonnymq.errors.StaleMessageError`); nothing changed."""
    NOT_FOUND = "not_found"
    """The message no longer exists."""
    BUSY = "busy"
    """``heartbeat_many`` only: another transaction holds the message's row right now (your
    own, finishing it, say), so its lock was not extended this time; nothing changed."""
    FULL = "full"
    """``settle`` only: a dead letter's channel is at its ``max_size``; nothing changed (the
    message is still held, and comes back when its lock expires)."""


class RoleKind(StrEnum):
    """What a PostgreSQL role granted with ``grant`` may do; each kind can do what the one
    before it can."""

    PRODUCER = "producer"
    """Create messages (also through a Spark write) and follow them to their outcome."""
    WORKER = "worker"
    """Also dequeue, heartbeat, defer, delete and fail messages; what a ``Worker`` needs."""
    ADMIN = "admin"
    """Also policies, settings, schedules, the archive, ``verify`` and the clock."""


@dataclass(frozen=True, slots=True)
class RoleGrant:
    """A role granted a kind on a queue (``grants()``); ``granted_at`` in ms, queue clock."""

    role: str
    kind: RoleKind
    granted_at: int


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message to create with ``create_many``.

    ``dequeue_at`` is in ms since the Unix epoch (database clock); ``None`` means now. A
    historic value (even 0 or negative) puts the message ahead of its channel's waiting ones.
    ``priority`` is as in ``create``: sugar for ``dequeue_at=priority`` (0 to 1,000,000, lower
    first), not to be combined with ``dequeue_at``.
    """

    content: bytes
    channel: str | None = None
    dequeue_at: int | None = None
    dedup_key: str | None = None
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class CreateResult:
    """The result of creating one message.

    ``id`` is the new message's id (or, when deduplicated, the live one's; ``None`` when
    dropped). ``channel_size`` is the number of messages the channel holds afterwards, for
    a channel with a policy (its counters are exact); ``None`` for a channel without one,
    which keeps no counter so that creating in it costs no channel-row write
    (``stats()`` counts those).
    """

    status: CreateStatus
    id: int | None
    channel_size: int | None


@dataclass(frozen=True, slots=True)
class Settings:
    """An installation's settings: the NOTIFY channel for events (``None``: events off) and
    whether finished messages are archived."""

    event_channel: str | None
    archive: bool


@dataclass(frozen=True, slots=True)
class Policy:
    """A channel policy; ``None`` means unlimited."""

    max_concurrency: int | None = None
    release_interval_ms: int | None = None
    max_size: int | None = None


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """One channel as ``stats()`` sees it.

    ``size`` counts every message of the channel (waiting and in flight); ``in_flight`` the
    locked ones (expired locks included until recovered); ``next_dequeue_at`` is when the
    channel may next give a message (``None``: nothing waiting).
    """

    channel: str
    size: int
    in_flight: int
    next_dequeue_at: int | None
    policy: Policy


@dataclass(frozen=True, slots=True)
class Discrepancy:
    """One inconsistency ``verify()`` found between a channel's row and its messages.

    ``kind`` names the check (``size_mismatch``, ``in_flight_mismatch``, ``channel_missing``,
    ``head_unscheduled``, ``head_late``, ``head_hidden``, ``orphan_channel``, ``stray_policy``,
    ``bad_lock``);
    ``expected`` and ``actual`` are the values it compared (``None`` where there is none);
    ``detail`` says it in a sentence.
    """

    channel: str
    kind: str
    expected: int | None
    actual: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class DequeueBatch(Generic[M]):
    """Messages from ``dequeue_batch``, and when to try again if there were none.

    ``retry_at`` (ms, database clock) is set only when ``messages`` is empty: the earliest
    time a message may become available (a waiting message falls due, or a lock expires). It
    is ``None`` when no servable channel has anything waiting and no message is locked.
    ``completed`` holds, for ``complete_and_dequeue`` and ``settle``, one status per message
    it finished (or reported) first, in order.
    """

    messages: list[M]
    retry_at: int | None
    completed: list[AckStatus] = field(default_factory=list)


class OutcomeKind(StrEnum):
    """What ``settle`` does with a message you hold."""

    COMPLETED = "completed"
    """Finish it."""
    FAILED = "failed"
    """Finish it as failed (archived with ``error`` when the archive is on)."""
    DEFERRED = "deferred"
    """Give it back until ``dequeue_at`` (default now), ``state`` replacing its saved state
    when given; it keeps its attempt count."""
    DEAD_LETTERED = "dead_lettered"
    """Create a copy of its content in ``channel`` and finish it as failed with ``error``."""


@dataclass(frozen=True, slots=True)
class Outcome(Generic[M]):
    """The outcome of one message you hold, for ``settle``: build it with :meth:`complete`,
    :meth:`fail`, :meth:`defer` or :meth:`dead_letter`."""

    message: M
    kind: OutcomeKind
    dequeue_at: int | None = None
    state: bytes | None = None
    error: str | None = None
    channel: str | None = None

    @classmethod
    def complete(cls, message: M) -> Outcome[M]:
        """The message is done."""
        return cls(message, OutcomeKind.COMPLETED)

    @classmethod
    def fail(cls, message: M, *, error: str) -> Outcome[M]:
        """The message failed for good, with ``error``."""
        return cls(message, OutcomeKind.FAILED, error=error)

    @classmethod
    def defer(
        cls, message: M, *, dequeue_at: int | None = None, state: bytes | None = None
    ) -> Outcome[M]:
        """Give the message back until ``dequeue_at`` (ms, default now); ``state``, when
        given, replaces its saved state."""
        return cls(message, OutcomeKind.DEFERRED, dequeue_at=dequeue_at, state=state)

    @classmethod
    def dead_letter(cls, message: M, *, channel: str, error: str) -> Outcome[M]:
        """Move the message to ``channel`` (a copy of its content) and fail it with ``error``."""
        return cls(message, OutcomeKind.DEAD_LETTERED, error=error, channel=channel)
