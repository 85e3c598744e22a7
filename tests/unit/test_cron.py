"""The cron parser and the firing decision of schedules (no database)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

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
    ],
)
def test_next_after(expression: str, after: str, expected: str) -> None:
    assert Cron.parse(expression).next_after(ms(after)) == ms(expected)


def test_latest_at_or_before_includes_the_instant_itself() -> None:
    cron = Cron.parse("*/5 * * * *")
    assert cron.latest_at_or_before(ms("2024-01-01T00:05:00")) == ms("2024-01-01T00:05:00")
    assert cron.latest_at_or_before(ms("2024-01-01T00:09:59")) == ms("2024-01-01T00:05:00")


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
    ],
)
def test_malformed_expressions_are_refused(expression: str) -> None:
    with pytest.raises(InvalidArgumentError):
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
