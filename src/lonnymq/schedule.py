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
these; a number has at most 9 digits (leading zeros aside). As in classic cron, when both
day fields are restricted a day matching either fires. A malformed field raises
:class:`InvalidArgumentError` naming it. An expression that can never fire (``0 0 30 2 *``) is
refused; a rare one (``0 0 29 2 sun``, a leap day on a Sunday) finds its next time however far
off: the calendar repeats every 400 years, so a search of one cycle is exact.
"""

from __future__ import annotations

import base64
import calendar
import json
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from datetime import date, timedelta

from .errors import InvalidArgumentError

__all__ = ["SCHEDULE_CHANNEL", "Cron", "Firing", "Schedule", "ScheduleSpec", "plan_firing"]

SCHEDULE_CHANNEL = "lonnymq.schedules"
"""The reserved channel that holds the schedules' driver messages."""

MAX_NAME = 200
_MINUTE_MS = 60_000
_MAX_DIGITS = 9  # a longer number in a cron field is refused (steps included)
_SHOWN = 40  # characters of a cron expression or token quoted in an error message
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
# The Gregorian calendar repeats every 400 years (146,097 days, a whole number of weeks), and so
# does the set of days an expression fires on: a search over 400 years of months finds a
# firing if there is one at all.
_CYCLE_MONTHS = 400 * 12
_LONGEST = {m: calendar.monthrange(2000, m)[1] for m in range(1, 13)}  # 2000: a leap year

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _is_number(token: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes "²" (which ``int`` refuses) and "٣"."""
    return token.isascii() and token.isdigit()


def _to_int(digits: str) -> int | None:
    """The value of ASCII ``digits``, or ``None`` when it has more than _MAX_DIGITS (leading
    zeros aside): ``int`` refuses more than 4,300 with a bare ValueError, and no field
    needs a number that long."""
    significant = digits.lstrip("0") or "0"
    return int(significant) if len(significant) <= _MAX_DIGITS else None


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut short when it is long."""
    if len(text) <= _SHOWN:
        return repr(text)
    return f"{text[:_SHOWN]!r}... ({len(text)} characters)"


def _parse_field(text: str, name: str, low: int, high: int, names: list[str]) -> frozenset[int]:
    def value(token: str) -> int:
        lowered = token.lower()
        if lowered in names:
            return names.index(lowered) + (1 if name == "month" else 0)
        if not _is_number(token):
            raise InvalidArgumentError(f"cron {name}: {_shown(token)} is not a number")
        number = _to_int(token)
        if number is None or not low <= number <= high:
            shown = _shown(token) if number is None else number
            raise InvalidArgumentError(f"cron {name}: {shown} is outside {low}-{high}")
        return number

    values: set[int] = set()
    for part in text.split(","):
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            number = _to_int(step_text) if _is_number(step_text) else None
            if not number:
                raise InvalidArgumentError(f"cron {name}: bad step in {_shown(part)}")
            step = number
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = value(first), value(last)
            if start > end:
                raise InvalidArgumentError(f"cron {name}: empty range {_shown(base)}")
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
    # Derived in __post_init__ for the search: sorted times, and the days as bit masks.
    _minutes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _hours: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _day_mask: int = field(init=False, repr=False, compare=False)
    _weekday_masks: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _months: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "_minutes", tuple(sorted(self.minutes)))
        set_(self, "_hours", tuple(sorted(self.hours)))
        set_(self, "_day_mask", sum(1 << d for d in self.days))
        # _weekday_masks[w]: the days of a month whose 1st is weekday w (0 Sunday) that fall
        # on one of the weekdays.
        set_(
            self,
            "_weekday_masks",
            tuple(
                sum(1 << d for d in range(1, 32) if (first + d - 1) % 7 in self.weekdays)
                for first in range(7)
            ),
        )
        # The months that can hold a firing at all: within the 400-year cycle every date of
        # a month (29 February too) falls on every weekday, so a month can when one of the
        # days fits in it and (a day must match both fields) there is a weekday, or (either
        # field will do) there is a weekday or one of the days fits. Leaving the others out
        # keeps the search short, and empty for an expression that never fires (day 30 in
        # February).
        both = self.any_day or self.any_weekday
        months = set()
        for month in self.months:
            fits = any(d <= _LONGEST[month] for d in self.days)
            if (fits and bool(self.weekdays)) if both else (fits or bool(self.weekdays)):
                months.add(month)
        set_(self, "_months", frozenset(months))

    @classmethod
    def parse(cls, expression: str) -> Cron:
        """Parse ``expression``; a malformed one raises :class:`InvalidArgumentError`."""
        if not isinstance(expression, str):
            raise InvalidArgumentError(f"cron must be a str, got {type(expression).__name__}")
        fields = expression.split()
        if len(fields) != 5:
            raise InvalidArgumentError(
                f"cron needs 5 fields (minute hour day month weekday), got {_shown(expression)}"
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
        # Exact, not a guess: the search covers a whole 400-year cycle of the calendar.
        if cron.next_after(0) is None:
            raise InvalidArgumentError(f"cron {_shown(expression)} never fires")
        return cron

    def _month_mask(self, year: int, month: int) -> int:
        """The days of ``month`` that fire, as bits (bit ``d`` for day ``d``)."""
        monday_first, length = calendar.monthrange(year, month)
        first = (monday_first + 1) % 7  # cron counts from Sunday
        in_month = (1 << (length + 1)) - 2
        by_weekday = self._weekday_masks[first]
        # As cron has it: when either day field starts with "*" (a step like "*/2" too), a
        # day must match both; when neither does, either.
        if self.any_day or self.any_weekday:
            return self._day_mask & by_weekday & in_month
        return (self._day_mask | by_weekday) & in_month

    def _next_day(self, day: date) -> date | None:
        """The first day on or after ``day`` that fires, or ``None`` (none before year
        10000, or none at all)."""
        if not self._months:
            return None
        year, month, floor = day.year, day.month, day.day
        for _ in range(_CYCLE_MONTHS + 1):
            if month in self._months:
                mask = self._month_mask(year, month) >> floor << floor
                if mask:
                    return date(year, month, (mask & -mask).bit_length() - 1)
            year, month, floor = (year + 1, 1, 1) if month == 12 else (year, month + 1, 1)
            if year > date.max.year:
                return None
        return None

    def _previous_day(self, day: date) -> date | None:
        """The last day on or before ``day`` that fires, or ``None`` (none after year 1, or
        none at all)."""
        if not self._months:
            return None
        year, month, ceiling = day.year, day.month, day.day
        for _ in range(_CYCLE_MONTHS + 1):
            if month in self._months:
                mask = self._month_mask(year, month) & ((2 << ceiling) - 1)
                if mask:
                    return date(year, month, mask.bit_length() - 1)
            year, month, ceiling = (year - 1, 12, 31) if month == 1 else (year, month - 1, 31)
            if year < date.min.year:
                return None
        return None

    def _first_time(self, hour: int, minute: int) -> tuple[int, int] | None:
        """The first (hour, minute) of a firing day at or after ``hour:minute``."""
        i = bisect_left(self._hours, hour)
        if i < len(self._hours) and self._hours[i] == hour:
            j = bisect_left(self._minutes, minute)
            if j < len(self._minutes):
                return hour, self._minutes[j]
            i += 1
        return (self._hours[i], self._minutes[0]) if i < len(self._hours) else None

    def _last_time(self, hour: int, minute: int) -> tuple[int, int] | None:
        """The last (hour, minute) of a firing day at or before ``hour:minute``."""
        i = bisect_right(self._hours, hour) - 1
        if i >= 0 and self._hours[i] == hour:
            j = bisect_right(self._minutes, minute) - 1
            if j >= 0:
                return hour, self._minutes[j]
            i -= 1
        return (self._hours[i], self._minutes[-1]) if i >= 0 else None

    def next_after(self, ms: int) -> int | None:
        """The first firing strictly after ``ms`` (ms since the epoch), however far off;
        ``None`` only when there is none before year 10000."""
        start = _from_minutes(ms // _MINUTE_MS + 1)
        if start is None:
            return None
        day, hour, minute = start
        found = self._next_day(day)
        if found == day:
            time = self._first_time(hour, minute)
            if time is not None:
                return _to_ms(day, *time)
            # Its times today are past: the next day that fires.
            found = None if day == date.max else self._next_day(day + timedelta(days=1))
        return None if found is None else _to_ms(found, self._hours[0], self._minutes[0])

    def latest_at_or_before(self, ms: int) -> int | None:
        """The last firing at or before ``ms``, however long ago; ``None`` only when there is
        none after year 1."""
        end = _from_minutes(ms // _MINUTE_MS)
        if end is None:
            return None
        day, hour, minute = end
        found = self._previous_day(day)
        if found == day:
            time = self._last_time(hour, minute)
            if time is not None:
                return _to_ms(day, *time)
            # Its times today are still to come: the last day before that fired.
            found = None if day == date.min else self._previous_day(day - timedelta(days=1))
        return None if found is None else _to_ms(found, self._hours[-1], self._minutes[-1])


def _from_minutes(minutes: int) -> tuple[date, int, int] | None:
    """The day, hour and minute ``minutes`` after the epoch; ``None`` outside years 1-9999."""
    days, of_day = divmod(minutes, 24 * 60)
    ordinal = _EPOCH_ORDINAL + days
    if not date.min.toordinal() <= ordinal <= date.max.toordinal():
        return None
    return date.fromordinal(ordinal), of_day // 60, of_day % 60


def _to_ms(day: date, hour: int, minute: int) -> int:
    return ((day.toordinal() - _EPOCH_ORDINAL) * 24 * 60 + hour * 60 + minute) * _MINUTE_MS


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
