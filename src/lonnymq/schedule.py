"""Periodic schedules: cron expressions, schedule specs and the firing decision (no I/O).

A schedule is one *driver* message in the reserved channel :data:`SCHEDULE_CHANNEL`, whose
dedup key is the schedule's name and whose content is its :class:`ScheduleSpec`. A worker that
dequeues a driver calls ``queue.fire_schedule(driver)``, which, in one transaction, creates the
task message (dedup key ``schedule:<name>@<fire time>``) and defers the driver to the next
firing with the fire time saved as its state. The defer is fenced by the driver's lock, so a
worker whose lock expired cannot fire a second time: its whole transaction rolls back.

Missed firings (no worker ran, or the driver came back late) fire **once**, for the latest
time that was due, never as a burst; times before the schedule was set never fire.

Cron expressions have five fields, in UTC: minute (0-59), hour (0-23), day of month (1-31),
month (1-12 or jan-dec), day of week (0-7 or sun-sat; 0 and 7 are Sunday). Each field is
``*``, a value, a range ``a-b``, a step ``*/n``, ``a-b/n`` or ``a/n``, or a comma list of
these. As in classic cron, when both day fields are restricted a day matching either fires.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from .errors import InvalidArgumentError

__all__ = ["SCHEDULE_CHANNEL", "Cron", "Firing", "Schedule", "ScheduleSpec", "plan_firing"]

SCHEDULE_CHANNEL = "lonnymq.schedules"
"""The reserved channel that holds the schedules' driver messages."""

MAX_NAME = 200
_MINUTE_MS = 60_000
_SEARCH_DAYS = 366 * 5  # an expression that fires less often than this is refused
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _is_number(token: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes "²" (which ``int`` refuses) and "٣"."""
    return token.isascii() and token.isdigit()


def _parse_field(text: str, name: str, low: int, high: int, names: list[str]) -> frozenset[int]:
    def value(token: str) -> int:
        lowered = token.lower()
        if lowered in names:
            return names.index(lowered) + (1 if name == "month" else 0)
        if not _is_number(token):
            raise InvalidArgumentError(f"cron {name}: {token!r} is not a number")
        number = int(token)
        if not low <= number <= high:
            raise InvalidArgumentError(f"cron {name}: {number} is outside {low}-{high}")
        return number

    values: set[int] = set()
    for part in text.split(","):
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not _is_number(step_text) or int(step_text) == 0:
                raise InvalidArgumentError(f"cron {name}: bad step in {part!r}")
            step = int(step_text)
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = value(first), value(last)
            if start > end:
                raise InvalidArgumentError(f"cron {name}: empty range {base!r}")
        else:
            start = value(base)
            end = high if slash else start
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed five-field cron expression (UTC); build it with :meth:`parse`."""

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    any_day: bool
    any_weekday: bool

    @classmethod
    def parse(cls, expression: str) -> Cron:
        """Parse ``expression``; a malformed one raises :class:`InvalidArgumentError`."""
        if not isinstance(expression, str):
            raise InvalidArgumentError(f"cron must be a str, got {type(expression).__name__}")
        fields = expression.split()
        if len(fields) != 5:
            raise InvalidArgumentError(
                f"cron needs 5 fields (minute hour day month weekday), got {expression!r}"
            )
        minute, hour, day, month, weekday = fields
        weekdays = _parse_field(weekday, "weekday", 0, 7, _DAYS)
        cron = cls(
            expression=" ".join(fields),
            minutes=_parse_field(minute, "minute", 0, 59, []),
            hours=_parse_field(hour, "hour", 0, 23, []),
            days=_parse_field(day, "day", 1, 31, []),
            months=_parse_field(month, "month", 1, 12, _MONTHS),
            weekdays=frozenset(d % 7 for d in weekdays),
            any_day=day.startswith("*"),
            any_weekday=weekday.startswith("*"),
        )
        if cron.next_after(0) is None:
            raise InvalidArgumentError(f"cron {expression!r} never fires")
        return cron

    def _day_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        by_date = day.day in self.days
        by_weekday = day.isoweekday() % 7 in self.weekdays
        # As cron has it: when either day field starts with "*" (a step like "*/2" too), a
        # day must match both; when neither does, either.
        if self.any_day or self.any_weekday:
            return by_date and by_weekday
        return by_date or by_weekday

    def _times(self, day: date, *, reverse: bool) -> list[datetime]:
        return [
            datetime(day.year, day.month, day.day, h, m, tzinfo=UTC)
            for h in sorted(self.hours, reverse=reverse)
            for m in sorted(self.minutes, reverse=reverse)
        ]

    def next_after(self, ms: int) -> int | None:
        """The first firing strictly after ``ms`` (ms since the epoch), or ``None``."""
        try:
            start = _EPOCH + timedelta(milliseconds=(ms // _MINUTE_MS + 1) * _MINUTE_MS)
            for offset in range(_SEARCH_DAYS):
                day = start.date() + timedelta(days=offset)
                if self._day_matches(day):
                    for moment in self._times(day, reverse=False):
                        if moment >= start:
                            return _to_ms(moment)
        except OverflowError:
            return None
        return None

    def latest_at_or_before(self, ms: int) -> int | None:
        """The last firing at or before ``ms``, or ``None`` within five years."""
        try:
            end = _EPOCH + timedelta(milliseconds=ms // _MINUTE_MS * _MINUTE_MS)
            for offset in range(_SEARCH_DAYS):
                day = end.date() - timedelta(days=offset)
                if self._day_matches(day):
                    for moment in self._times(day, reverse=True):
                        if moment <= end:
                            return _to_ms(moment)
        except OverflowError:
            return None
        return None


def _to_ms(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def check_name(name: object) -> str:
    """A schedule name: 1 to 200 characters of valid Unicode text without NUL."""
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= MAX_NAME
        or "\x00" in name
        or not _encodable(name)
    ):
        raise InvalidArgumentError(
            f"schedule name must be 1 to {MAX_NAME} characters of valid Unicode text without "
            f"NUL: {name!r}"
        )
    return name


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What schedule ``name`` does: at each ``cron`` time, create ``content`` in ``channel``.

    ``since`` (ms, database clock) is when it was set: earlier times never fire.
    """

    name: str
    cron: str
    channel: str
    content: bytes
    since: int

    def encode(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "cron": self.cron,
                "channel": self.channel,
                "content": base64.b64encode(self.content).decode(),
                "since": self.since,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> ScheduleSpec:
        """The spec a driver carries; :class:`InvalidArgumentError` when it is not one."""
        try:
            raw = json.loads(data)
            return cls(
                name=str(raw["name"]),
                cron=str(raw["cron"]),
                channel=str(raw["channel"]),
                content=base64.b64decode(raw["content"]),
                since=int(raw["since"]),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise InvalidArgumentError(f"not a schedule spec: {err}") from err


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule as ``schedules()`` lists it.

    ``next_at``: when its driver is next due; ``last_fired_at``: the last time it fired
    (``None``: never); ``firing``: a worker holds its driver right now.
    """

    name: str
    cron: str
    channel: str
    content: bytes
    next_at: int
    last_fired_at: int | None
    firing: bool


def same_spec(data: bytes, spec: ScheduleSpec) -> bool:
    """Whether the driver's spec ``data`` does what ``spec`` does (``since`` aside); a driver
    that carries no spec does not."""
    try:
        held = ScheduleSpec.decode(data)
    except InvalidArgumentError:
        return False
    return (held.name, held.cron, held.channel, held.content) == (
        spec.name,
        spec.cron,
        spec.channel,
        spec.content,
    )


@dataclass(frozen=True, slots=True)
class Firing:
    """What processing a driver does: fire for ``fire_at`` (``None``: nothing due) and come
    back at ``next_at``. ``full``: the task's channel was at its ``max_size``, so nothing was
    created and ``fire_at`` is still due: the driver comes back at ``next_at`` (in a second at
    most) to try again, then for the latest time due."""

    fire_at: int | None
    next_at: int
    full: bool = False


def plan_firing(spec: ScheduleSpec, last_fired: int | None, now: int) -> Firing:
    """Decide a driver's turn at ``now``: the latest due time not yet fired (once, however
    many were missed), and the next time after ``now``."""
    cron = Cron.parse(spec.cron)
    due = cron.latest_at_or_before(now)
    floor = spec.since if last_fired is None else max(spec.since, last_fired + 1)
    fire_at = due if due is not None and due >= floor else None
    next_at = cron.next_after(now)
    return Firing(fire_at=fire_at, next_at=next_at if next_at is not None else now + 86_400_000)


FULL_RETRY_MS = 1_000
"""How soon a driver whose task's channel was full comes back to try again."""


def task_dedup_key(name: str, fire_at: int) -> str:
    """The dedup key of the task a firing creates (one task per schedule and time)."""
    return f"schedule:{name}@{fire_at}"


def encode_state(last_fired: int | None) -> bytes | None:
    return None if last_fired is None else str(last_fired).encode()


def decode_state(state: bytes | None) -> int | None:
    if not state:
        return None
    try:
        return int(state.decode())
    except (UnicodeDecodeError, ValueError):
        return None
