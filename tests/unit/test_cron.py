"""The cron parser and the firing decision of schedules (no database)."""

from __future__ import annotations

import contextlib
import functools
import itertools
from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lonnymq.errors import InvalidArgumentError
from lonnymq.schedule import Cron, ScheduleSpec, plan_firing


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        ("*/5 * * * *", "2024-01-01T00:00:00", "2024-01-01T00:05:00"),
        ("*/5 * * * *", "2024-01-01T00:04:59.999", "2024-01-01T00:05:00"),
        ("0 9 * * mon-fri", "2024-01-05T09:00:00", "2024-01-08T09:00:00"),  # Fri → Mon
        ("30 2 1,15 * *", "2024-01-02T00:00:00", "2024-01-15T02:30:00"),
        ("0 0 29 2 *", "2024-03-01T00:00:00", "2028-02-29T00:00:00"),  # leap days only
        ("0 12 * jan-mar/2 *", "2024-01-31T12:00:00", "2024-03-01T12:00:00"),
        ("15 10/6 * * *", "2024-01-01T16:15:00", "2024-01-01T22:15:00"),
        ("0 0 * * 7", "2024-01-01T00:00:00", "2024-01-07T00:00:00"),  # 7 is Sunday
        # Both day fields restricted: either matches (the 13th or any Friday).
        ("0 0 13 * fri", "2024-01-01T00:00:00", "2024-01-05T00:00:00"),
        # A day field starting with "*" is not restricted, yet its step still counts: both
        # fields must match (the odd days; Sun/Tue/Thu/Sat; Mondays that are the 1st, 11th,
        # 21st or 31st).
        ("0 0 */2 * *", "2024-01-01T00:00:00", "2024-01-03T00:00:00"),
        ("0 0 * * */2", "2024-01-02T00:00:00", "2024-01-04T00:00:00"),  # Tue → Thu
        ("0 0 */10 * mon", "2024-01-01T00:00:00", "2024-03-11T00:00:00"),
        # Rare ones, years away: a leap day on a Sunday; the 1st or 26th of July on a Tuesday
        # (9:00 to 17:59); 1 February on a Sunday; the last time a year can hold.
        ("0 0 29 2 */7", "2026-06-01T00:00:00", "2032-02-29T00:00:00"),
        ("* 9-17 */25 7 2-2", "2026-06-01T00:00:00", "2031-07-01T09:00:00"),
        ("0 0 */31 2 sun", "2026-06-01T00:00:00", "2032-02-01T00:00:00"),
        ("59 23 31 12 *", "9999-12-31T23:58:00", "9999-12-31T23:59:00"),
    ],
)
def test_next_after(expression: str, after: str, expected: str) -> None:
    assert Cron.parse(expression).next_after(ms(after)) == ms(expected)


def test_latest_at_or_before_includes_the_instant_itself() -> None:
    cron = Cron.parse("*/5 * * * *")
    assert cron.latest_at_or_before(ms("2024-01-01T00:05:00")) == ms("2024-01-01T00:05:00")
    assert cron.latest_at_or_before(ms("2024-01-01T00:09:59")) == ms("2024-01-01T00:05:00")


def test_latest_at_or_before_looks_back_years() -> None:
    cron = Cron.parse("0 0 29 2 */7")  # a leap day on a Sunday
    assert cron.latest_at_or_before(ms("2026-06-01T00:00:00")) == ms("2004-02-29T00:00:00")
    assert cron.latest_at_or_before(ms("2032-02-29T00:00:00")) == ms("2032-02-29T00:00:00")


def test_no_firing_outside_the_years_a_date_can_have() -> None:
    cron = Cron.parse("0 0 1 1 *")
    assert cron.next_after(ms("9999-01-01T00:00:00")) is None
    assert cron.latest_at_or_before(ms("0001-01-01T00:00:00") - 1) is None
    assert cron.next_after(10**30) is None
    assert cron.latest_at_or_before(-(10**30)) is None


START = date(2026, 6, 1)


@functools.cache
def _calendar() -> tuple[dict[tuple[int, int, int], date], dict[tuple[int, int, int], date]]:
    """Every (month, day, weekday) the calendar has, with the first day it comes on after
    START and the last before: the calendar repeats every 400 years, so one cycle each way
    holds them all."""
    after: dict[tuple[int, int, int], date] = {}
    before: dict[tuple[int, int, int], date] = {}
    for offset in range(146_097):
        for day, seen in (
            (START + timedelta(offset), after),
            (START - timedelta(offset + 1), before),
        ):
            seen.setdefault((day.month, day.day, day.isoweekday() % 7), day)
    return after, before


_WEEKDAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
# Expressions whose day must match both fields, each a rare pick of the calendar: a single
# day of a month on a Sunday ("*/7" is Sunday alone, and starts with "*"), or the days a step
# "*/n" gives (1, 1+n, ...) on each weekday.
_RARE = [pytest.param(f"{d}", {d}, "*/7", {0}, id=f"{d} */7") for d in range(1, 32)] + [
    pytest.param(f"*/{n}", set(range(1, 32, n)), name, {w}, id=f"*/{n} {name}")
    for n in (28, 29, 30, 31)
    for w, name in enumerate(_WEEKDAYS)
]


def _at(day: date) -> int:
    return ms(day.isoformat())


@pytest.mark.parametrize(("day_field", "days", "weekday_field", "weekdays"), _RARE)
def test_parse_refuses_exactly_what_never_fires_and_finds_the_rarest(
    day_field: str, days: set[int], weekday_field: str, weekdays: set[int]
) -> None:
    first_after, last_before = _calendar()
    for month in range(1, 13):
        expression = f"0 0 {day_field} {month} {weekday_field}"
        keys = [(month, d, w) for d, w in itertools.product(days, weekdays)]
        after = [first_after[k] for k in keys if k in first_after]
        before = [last_before[k] for k in keys if k in last_before]
        if not after:
            with pytest.raises(InvalidArgumentError, match="never fires"):
                Cron.parse(expression)
            continue
        cron = Cron.parse(expression)
        assert cron.next_after(_at(START) - 1) == _at(min(after)), expression
        assert cron.latest_at_or_before(_at(START) - 1) == _at(max(before)), expression


def _field(low: int, high: int) -> st.SearchStrategy[str]:
    value = st.integers(low, high)
    step = st.integers(1, high)
    one = st.one_of(
        st.just("*"),
        step.map(lambda n: f"*/{n}"),
        value.map(str),
        st.tuples(value, value, step).map(
            lambda t: f"{min(t[:2])}-{max(t[:2])}" + (f"/{t[2]}" if t[2] > 1 else "")
        ),
    )
    return st.lists(one, min_size=1, max_size=3).map(",".join)


_HORIZON_DAYS = 3 * 366


def _reference(cron: Cron, minute: int, *, forward: bool) -> int | None:
    """The firing next after (at or before) minute ``minute`` since the epoch, found by trying
    each day of _HORIZON_DAYS and each time of it in turn; None when not within them."""
    step = 1 if forward else -1
    start = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(minutes=minute)
    for offset in range(_HORIZON_DAYS):
        day = start.date() + timedelta(days=offset * step)
        if day.month not in cron.months:
            continue
        by_day, by_weekday = day.day in cron.days, day.isoweekday() % 7 in cron.weekdays
        both = cron.any_day or cron.any_weekday
        if not (by_day and by_weekday if both else by_day or by_weekday):
            continue
        times = sorted(itertools.product(cron.hours, cron.minutes), reverse=not forward)
        for hour, minute_of_hour in times:
            moment = datetime(day.year, day.month, day.day, hour, minute_of_hour, tzinfo=UTC)
            if (moment >= start) if forward else (moment <= start):
                return int(moment.timestamp()) * 1000
    return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    fields=st.tuples(_field(0, 59), _field(0, 23), _field(1, 31), _field(1, 12), _field(0, 7)),
    at=st.integers(ms("1900-01-01T00:00:00"), ms("2400-01-01T00:00:00")),
)
def test_next_and_latest_agree_with_trying_every_day(fields: tuple[str, ...], at: int) -> None:
    try:
        cron = Cron.parse(" ".join(fields))
    except InvalidArgumentError:
        return  # never fires (checked exactly above)
    horizon = _HORIZON_DAYS * 86_400_000
    expected = _reference(cron, at // 60_000 + 1, forward=True)
    found = cron.next_after(at)
    assert found is not None
    assert (found == expected) if expected is not None else (found > at + horizon - 86_400_000)
    expected = _reference(cron, at // 60_000, forward=False)
    found = cron.latest_at_or_before(at)
    assert found is not None
    assert (found == expected) if expected is not None else (found < at - horizon + 86_400_000)


@pytest.mark.parametrize(
    "expression",
    [
        "* * * *",
        "* * * * * *",
        "60 * * * *",
        "* 24 * * *",
        "* * 0 * *",
        "* * * 13 *",
        "* * * * 8",
        "*/0 * * * *",
        "5-1 * * * *",
        "x * * * *",
        "0 0 30 2 *",  # never fires
        "0 0 31 4,6,9,11 *",  # never fires
        "0 0 30-31 2 */7",  # never fires
    ],
)
def test_malformed_expressions_are_refused(expression: str) -> None:
    with pytest.raises(InvalidArgumentError):
        Cron.parse(expression)


_LONG = "9" * 5000  # past the 4,300 digits Python's int() takes from a string


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        (f"*/{_LONG} * * * *", "minute"),
        (f"{_LONG} * * * *", "minute"),
        (f"0 1-{_LONG} * * *", "hour"),
        (f"0 0 1-{_LONG} * *", "day"),
        (f"0 0 * {_LONG}/2 *", "month"),
        (f"0 0 * * 1-5/{_LONG}", "weekday"),
        ("*/1234567890 * * * *", "minute"),  # ten digits: too long a number too
    ],
    ids=["step", "value", "hour range", "day range", "month", "weekday step", "ten digits"],
)
def test_a_number_too_long_is_refused_naming_its_field(expression: str, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^cron {field}: ") as caught:
        Cron.parse(expression)
    assert len(str(caught.value)) < 120  # the number is not quoted whole


def test_numbers_may_have_leading_zeros_and_steps_nine_digits() -> None:
    assert Cron.parse("*/" + "0" * 5000 + "5 * * * *").minutes == frozenset(range(0, 60, 5))
    assert Cron.parse("*/123456789 * * * *").minutes == frozenset({0})


_cron_text = st.lists(
    st.one_of(
        st.sampled_from([*"*/-, 0123456789", "mon", "jan", "\t", "\u00b2"]),
        st.text(min_size=1, max_size=3),
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(expression=st.one_of(st.text(), _cron_text))
def test_any_text_parses_or_raises_invalid_argument(expression: str) -> None:
    with contextlib.suppress(InvalidArgumentError):
        Cron.parse(expression)


def test_cron_must_be_text() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        Cron.parse(5)  # type: ignore[arg-type]


def _spec(since: str) -> ScheduleSpec:
    return ScheduleSpec("s", "*/5 * * * *", "c", b"x", since=ms(since))


def test_a_due_time_fires_once() -> None:
    firing = plan_firing(_spec("2024-01-01T00:01:00"), None, ms("2024-01-01T00:05:00.200"))
    assert firing.fire_at == ms("2024-01-01T00:05:00")
    assert firing.next_at == ms("2024-01-01T00:10:00")
    again = plan_firing(_spec("2024-01-01T00:01:00"), firing.fire_at, ms("2024-01-01T00:06:00"))
    assert again.fire_at is None


def test_missed_firings_fire_once_for_the_latest_time() -> None:
    firing = plan_firing(
        _spec("2024-01-01T00:01:00"), ms("2024-01-01T00:05:00"), ms("2024-01-01T03:02:00")
    )
    assert firing.fire_at == ms("2024-01-01T03:00:00")
    assert firing.next_at == ms("2024-01-01T03:05:00")


def test_times_before_the_schedule_was_set_never_fire() -> None:
    firing = plan_firing(_spec("2024-01-01T00:05:30"), None, ms("2024-01-01T00:06:00"))
    assert firing.fire_at is None
    assert firing.next_at == ms("2024-01-01T00:10:00")


def test_spec_round_trips_and_garbage_is_refused() -> None:
    spec = _spec("2024-01-01T00:00:00")
    assert ScheduleSpec.decode(spec.encode()) == spec
    with pytest.raises(InvalidArgumentError, match="not a schedule spec"):
        ScheduleSpec.decode(b"hello")
