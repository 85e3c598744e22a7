"""The archive of finished messages, as ``archived()`` and ``replay()`` return it (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ArchivedMessage", "ReplayResult"]


@dataclass(frozen=True, slots=True)
class ArchivedMessage:
    """A finished message: its ``outcome`` (``completed``, ``failed``), the ``error`` text of a
    failure, attempts, timings, and ``replayed_as`` (the message a replay created, if any)."""

    id: int
    channel: str
    content: bytes
    state: bytes | None
    num_attempts: int
    outcome: str
    error: str | None
    created_at: int
    finished_at: int
    replayed_as: int | None


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One archived message given to ``replay()``: ``status`` is ``replayed`` (``id`` is the
    new message), ``already`` (replayed before: ``id`` is that message), ``dropped`` (its
    channel is full) or ``not_found``."""

    archive_id: int
    status: str
    id: int | None


def archived_message(row: Sequence[Any]) -> ArchivedMessage:
    (message_id, channel, content, state, attempts, outcome, error, created, finished, replayed) = (
        row
    )
    return ArchivedMessage(
        id=message_id,
        channel=channel,
        content=bytes(content),
        state=None if state is None else bytes(state),
        num_attempts=attempts,
        outcome=outcome,
        error=error,
        created_at=created,
        finished_at=finished,
        replayed_as=replayed,
    )


def replay_result(row: Sequence[Any]) -> ReplayResult:
    return ReplayResult(archive_id=row[0], status=row[1], id=row[2])
