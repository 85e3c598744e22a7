"""Queue events (the NOTIFY stream) and message outcomes, as ``events()`` and ``wait()``
return them; parsing only, no I/O."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

__all__ = ["Event", "MessageOutcome"]


@dataclass(frozen=True, slots=True)
class Event:
    """One wake-up event: ``type`` is ``created``, ``deferred`` or ``ready``; the channel
    ``channel`` can give a message from ``dequeue_at`` on (``id`` may be ``None`` for
    ``ready``)."""

    type: str
    id: int | None
    channel: str
    dequeue_at: int


@dataclass(frozen=True, slots=True)
class MessageOutcome:
    """Where a message is, as ``wait()`` returns it.

    ``status`` is ``finished`` (archived: ``outcome`` is ``completed``, ``failed``, …, with
    ``error``, ``num_attempts`` and ``finished_at``), ``unknown`` (gone but not archived: it
    finished while the archive was off, or never existed), or while it is live ``waiting`` or
    ``locked``.
    """

    id: int
    status: str
    outcome: str | None
    error: str | None
    num_attempts: int | None
    finished_at: int | None

    @property
    def done(self) -> bool:
        """Whether the message has left the queue."""
        return self.status in ("finished", "unknown")


def parse_event(payload: str) -> Event:
    """An event from its NOTIFY payload."""
    raw = json.loads(payload)
    return Event(
        type=str(raw["type"]),
        id=raw.get("id"),
        channel=str(raw["channel"]),
        dequeue_at=int(raw["dequeue_at"]),
    )


def outcome(message_id: int, row: Sequence[Any]) -> MessageOutcome:
    status, result, error, num_attempts, finished_at = row
    return MessageOutcome(message_id, status, result, error, num_attempts, finished_at)


def listen_statement(channel: str) -> sql.Composed:
    """``LISTEN`` on an event channel (quoted as an identifier)."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def poll_interval(round_: int) -> float:
    """Seconds between two status checks of ``wait()``: 10 ms doubling up to 0.2 s."""
    return float(min(0.2, 0.01 * 2 ** min(round_, 10)))
