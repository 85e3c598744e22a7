"""The schedules page: each schedule with its cron, channel, content, next and last firing,
and whether a worker fires it now; paged by name; hostile values escaped; an unreadable
driver shown as such."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import Queue

from .conftest import Served, get
from .test_browser import LOCK_MS, WAIT_S, _cells, _no_alert

HOSTILE = "<script>alert('s')</script>"
ESCAPED = "&lt;script&gt;alert(&#39;s&#39;)&lt;/script&gt;"


def _names(body: str) -> list[str]:
    return re.findall(r'<tr class="schedule-row">\s*<td class="name">([^<]*)</td>', body)


def test_each_schedule_shows_its_cron_next_and_last_firing(
    serve: Callable[..., Served], queue: Queue
) -> None:
    queue.schedule("tick", cron="* * * * *", content=b"task", channel="tasks")
    queue.schedule(HOSTILE, cron="0 3 * * *", content=HOSTILE.encode(), channel=HOSTILE)
    queue.set_clock_offset(61_000)
    driver = queue.dequeue(lock_ms=LOCK_MS)
    assert driver is not None
    assert driver.channel == "lonnymq.schedules"
    fired = queue.fire_schedule(driver).fire_at
    assert fired is not None
    served = serve()
    status, body = get(served, "/schedules")
    assert status == 200, body
    assert _names(body) == [ESCAPED, "tick"]
    assert HOSTILE not in body
    rows = body.split('<tr class="schedule-row">')[1:]
    hostile, tick = rows
    assert '<td class="cron">0 3 * * *</td>' in hostile
    assert f'<td class="payload">{ESCAPED}</td>' in hostile
    assert '<td class="last">never</td>' in hostile
    assert '<td class="cron">* * * * *</td>' in tick
    assert 'href="/channel?name=tasks">tasks</a>' in tick
    assert '<td class="payload">task</td>' in tick
    last = datetime.fromtimestamp(fired / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert f'<td class="last">{last} (' in tick
    assert re.search(r'<td class="next">\d{4}-\d\d-\d\d \d\d:\d\d:00 \(in ', tick)


def test_schedules_are_paged_by_name(serve: Callable[..., Served], queue: Queue) -> None:
    names = [f"s{i:03d}" for i in range(55)]
    for name in names:
        queue.schedule(name, cron="0 0 * * *", content=b"x")
    served = serve()
    _, first = get(served, "/schedules")
    assert _names(first) == names[:50]
    following = re.search(r'<a id="next-page" href="([^"]*)">', first)
    assert following is not None
    _, second = get(served, following.group(1))
    assert _names(second) == names[50:]
    assert 'id="next-page"' not in second
    assert 'id="first-page"' in second
    _, none = get(served, "/schedules?after=zzz")
    assert 'id="no-schedules"' in none


def test_an_unreadable_driver_is_shown_as_such(
    serve: Callable[..., Served], queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.schedule("broken", cron="0 0 * * *", content=b"x")
    admin.execute(
        sql.SQL("UPDATE {}.message SET content = %s WHERE channel = 'lonnymq.schedules'").format(
            sql.Identifier(queue.schema)
        ),
        [b"<b>not json</b>"],
    )
    served = serve()
    status, body = get(served, "/schedules")
    assert status == 200
    assert _names(body) == ["broken"]
    assert "not a schedule spec" in body


@pytest.mark.browser
def test_the_schedules_page_renders_in_a_browser(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    queue.schedule(HOSTILE, cron="*/5 * * * *", content=b"job", channel="tasks")
    served = serve()
    browser.get(served.url)
    browser.find_element(By.ID, "nav-schedules").click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "schedules"))
    assert _cells(browser, "tr.schedule-row td.name") == [HOSTILE, "tasks"]
    assert _cells(browser, "tr.schedule-row td.cron") == ["*/5 * * * *"]
    assert not browser.find_elements(By.CSS_SELECTOR, "main script")
    _no_alert(browser)
