"""What a worker decides without I/O: retry delays and error text."""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["Backoff", "error_text"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before a retry: ``base_ms * factor ** (attempt - 1)``, capped at ``max_ms``.

    With ``jitter`` (the default) the delay is drawn between half and all of that, so that
    messages that failed together do not all come back together.
    """

    base_ms: int = 1_000
    max_ms: int = 300_000
    factor: float = 2.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.max_ms < self.base_ms or self.factor < 1:
            raise InvalidArgumentError(
                "Backoff needs 0 <= base_ms <= max_ms and factor >= 1, got "
                f"base_ms={self.base_ms}, max_ms={self.max_ms}, factor={self.factor}"
            )

    def delay_ms(self, attempts: int, rng: random.Random | None = None) -> int:
        """The delay after the ``attempts``-th failed attempt."""
        exponent = max(attempts - 1, 0)
        raw = float(self.max_ms) if exponent > 64 else self.base_ms * self.factor**exponent
        capped = min(float(self.max_ms), raw)
        if not self.jitter:
            return int(capped)
        return int((rng or random).uniform(capped / 2, capped))


def error_text(error: BaseException) -> str:
    """The error as the archive keeps it: type, message and traceback."""
    return "".join(traceback.format_exception(error)).strip()
