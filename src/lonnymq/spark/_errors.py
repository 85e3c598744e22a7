"""Errors of the Spark data source (part of the lonnymq error tree)."""

from __future__ import annotations

from ..errors import LonnyMQError

__all__ = ["ConsumerBusyError", "ConsumerOwnedError", "SparkWriteError"]


class SparkWriteError(LonnyMQError):
    """A Spark write failed at its commit. With mode=staged (the default) nothing of it was
    enqueued; with mode=direct, what its tasks enqueued stays enqueued."""


class ConsumerBusyError(LonnyMQError):
    """Another running streaming query uses this consumer name: give each query its own."""


class ConsumerOwnedError(LonnyMQError):
    """The consumer belongs to another checkpoint (a query from a new checkpoint took it over),
    or this checkpoint is a copy that another run has gone past: going on would finish the
    other's planned batches as delivered. Give the query its own consumer name, or start it
    from a new checkpoint."""
