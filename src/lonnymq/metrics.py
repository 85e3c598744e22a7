"""Counts and timings of every SQL operation, kept by the one place that runs them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["OperationStats", "Recorder"]


@dataclass(frozen=True, slots=True)
class OperationStats:
    """Totals for one named operation since the queue was opened."""

    name: str
    calls: int
    errors: int
    seconds: float

    @property
    def mean_ms(self) -> float:
        """Mean duration of a call in milliseconds (0 when never called)."""
        return 1000 * self.seconds / self.calls if self.calls else 0.0


class Recorder:
    """Thread-safe totals per operation; ``snapshot()`` reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}

    def record(self, name: str, seconds: float, *, ok: bool) -> None:
        with self._lock:
            entry = self._totals.setdefault(name, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += 0 if ok else 1
            entry[2] += seconds

    def snapshot(self) -> list[OperationStats]:
        with self._lock:
            return [
                OperationStats(name, int(calls), int(errors), seconds)
                for name, (calls, errors, seconds) in sorted(self._totals.items())
            ]
