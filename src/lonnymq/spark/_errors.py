"""Errors of the Spark data source (part of the lonnymq error tree)."""

from __future__ import annotations

from ..errors import LonnyMQError

__all__ = ["ConsumerBusyError", "SparkWriteError"]


class SparkWriteError(LonnyMQError):
    """A Spark write failed at its commit. With mode=staged (the default) nothing of it was
    enqueued; with mode=direct, what its tasks enqueued stays enqueued."""


class ConsumerBusyError(LonnyMQError):
    """Another running streaming query uses this consumer name: give each query its own."""
