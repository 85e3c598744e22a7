"""The dashboard in headless Chromium: live numbers move as messages are created, taken and
finished; the channels page sorts, pages and searches; a channel's page lists its waiting and
locked messages; hostile values show as text and run nothing. The overview and channels
screenshots in the docs are taken here."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import psycopg
import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import NewMessage, Queue

from .conftest import IMAGES, Served

pytestmark = pytest.mark.browser

WAIT_S = 30.0
LOCK_MS = 600_000


# Read in one script: the page replaces these elements in place while it refreshes, and an
# element found, then read, may be gone in between.
def _read(browser: Any, element_id: str) -> list[str] | Literal[False]:
    text = browser.execute_script(
        "const e = document.getElementById(arguments[0]); return e && e.innerText.trim();",
        element_id,
    )
    return False if text is None else [str(text)]


def _text(browser: Any, element_id: str) -> str:
    """The element's text, once the page has it (a click may still be loading the page)."""
    found: list[str] = WebDriverWait(browser, WAIT_S).until(
        lambda b: _read(b, element_id), f"no #{element_id} on the page"
    )
    return found[0]


def _confirm(browser: Any) -> str:
    """Confirm the question the page asks, and wait for what came of it; the question."""
    question = _text(browser, "question")
    browser.find_element(By.ID, "confirm").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda b: b.find_elements(By.ID, "done") or b.find_elements(By.ID, "error")
    )
    return question


def _cells(browser: Any, selector: str) -> list[str]:
    return list(
        browser.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText.trim());",
            selector,
        )
    )


def _wait_text(browser: Any, element_id: str, expected: str) -> None:
    """Wait until the element shows ``expected`` (the page refreshes it in place)."""
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _text(b, element_id) == expected,
        f"#{element_id} never showed {expected!r}",
    )


def _names(browser: Any) -> list[str]:
    return _cells(browser, "tr.channel-row td.name")


def _click(browser: Any, selector: str, text: str | None = None) -> None:
    """Click the first element matching ``selector`` (and showing ``text``), in one script:
    the channels table is replaced every 2 seconds, and an element found, then clicked, may
    be gone in between."""
    clicked = browser.execute_script(
        "const e = [...document.querySelectorAll(arguments[0])]"
        ".find(e => arguments[1] === null || e.innerText.trim() === arguments[1]);"
        "if (e) { e.click(); } return Boolean(e);",
        selector,
        text,
    )
    assert clicked, f"nothing to click at {selector} {text or ''}"


def _wait_names(browser: Any, expected: list[str]) -> None:
    """Wait until the channels listed are ``expected`` (a click loads the next page)."""
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _names(b) == expected, f"the page never listed {expected[:3]}..."
    )


def _screenshot(browser: Any, name: str, tmp_path: Path) -> None:
    """Take the page's screenshot; write it into the docs' images when
    LONNYMQ_DOCS_SCREENSHOTS=1 (whole: two test runs side by side each replace it, never
    write into it together), otherwise under the test's own directory."""
    png = browser.get_screenshot_as_png()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000
    target = IMAGES if os.environ.get("LONNYMQ_DOCS_SCREENSHOTS") == "1" else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    partial = target / f".{name}.{os.getpid()}"
    partial.write_bytes(png)
    os.replace(partial, target / name)


def _no_alert(browser: Any) -> None:
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert  # noqa: B018


def test_overview_numbers_move_as_messages_come_and_go(
    browser: Any,
    serve: Callable[..., Served],
    archiving_queue: Queue,
    dsn: str,
    tmp_path: Path,
) -> None:
    served = serve()
    browser.get(served.url)
    _wait_text(browser, "waiting", "0")
    archiving_queue.create_many(
        [NewMessage(b"job %d" % i, channel=f"tenant-{i % 3}") for i in range(30)]
    )
    archiving_queue.create(
        b"later", channel="tenant-0", dequeue_at=archiving_queue.now() + 3_600_000
    )
    _wait_text(browser, "waiting", "31")
    _wait_text(browser, "due", "30")
    _wait_text(browser, "scheduled", "1")
    _wait_text(browser, "locked", "0")
    assert _text(browser, "failed-rate") == "0.0"
    # A worker's connection: it takes and finishes, then publishes its row counts at once.
    with psycopg.connect(dsn, autocommit=True) as worker:
        held = archiving_queue.dequeue_many(12, lock_ms=LOCK_MS, conn=worker)
        assert len(held) == 12
        _wait_text(browser, "locked", "12")
        _wait_text(browser, "waiting", "19")
        archiving_queue.delete_many(held[:8], conn=worker)
        for message in held[8:10]:
            archiving_queue.fail(message, error="boom", conn=worker)
        worker.execute("SELECT pg_stat_force_next_flush()")
        worker.execute("SELECT 1")
        _wait_text(browser, "locked", "2")
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _text(b, "finished-rate") not in ("-", "0.0"),
        "the finish rate never moved",
    )
    assert float(_text(browser, "finished-rate")) > 0
    # Two failures archived in the last 10 s: 0.2 per second.
    _wait_text(browser, "failed-rate", "0.2")
    assert browser.find_elements(By.ID, "finished-line")
    _screenshot(browser, "dashboard-overview.png", tmp_path)
    _no_alert(browser)


def test_channels_sort_page_and_search(
    browser: Any, serve: Callable[..., Served], queue: Queue, tmp_path: Path
) -> None:
    now = queue.now()
    # c000 .. c119; the higher the number, the earlier its message is due.
    queue.create_many(
        [NewMessage(b"m", channel=f"c{i:03d}", dequeue_at=now - i * 1000) for i in range(120)]
    )
    queue.create_many([NewMessage(b"more", channel="c005") for _ in range(4)])
    queue.channel("c007").set_policy(max_concurrency=0)
    served = serve()
    browser.get(served.url + "channels")
    names = _names(browser)
    assert names == [f"c{i:03d}" for i in range(50)]
    assert _cells(browser, "tr.channel-row td.size")[5] == "5"
    assert "paused" in _cells(browser, "tr.channel-row")[7]
    browser.find_element(By.ID, "next-page").click()
    _wait_names(browser, [f"c{i:03d}" for i in range(50, 100)])
    browser.find_element(By.ID, "next-page").click()
    _wait_names(browser, [f"c{i:03d}" for i in range(100, 120)])
    assert not browser.find_elements(By.ID, "next-page")
    browser.find_element(By.ID, "first-page").click()
    _wait_names(browser, [f"c{i:03d}" for i in range(50)])
    _click(browser, "#sort-name")  # now descending
    _wait_names(browser, [f"c{i:03d}" for i in range(119, 69, -1)])
    browser.find_element(By.ID, "next-page").click()
    _wait_names(browser, [f"c{i:03d}" for i in range(69, 19, -1)])
    _click(browser, "#sort-due")
    # Earliest due first; the paused channel cannot give a message, so it is not listed.
    due = [f"c{i:03d}" for i in range(119, -1, -1) if i != 7]
    _wait_names(browser, due[:50])
    browser.find_element(By.ID, "next-page").click()
    _wait_names(browser, due[50:100])
    box = browser.find_element(By.ID, "search")
    box.clear()
    box.send_keys("C11")
    browser.find_element(By.ID, "search-button").click()
    _wait_names(browser, [f"c{i:03d}" for i in range(119, 109, -1)])
    box = browser.find_element(By.ID, "search")
    box.clear()
    box.send_keys("nothing-like-it")
    browser.find_element(By.ID, "search-button").click()
    _wait_names(browser, [])
    assert "nothing-like-it" in _text(browser, "no-channels")
    browser.get(served.url + "channels")
    _screenshot(browser, "dashboard-channels.png", tmp_path)


def test_live_sizes_and_rates_refresh_on_the_channels_page(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    queue.create_many([NewMessage(b"x", channel="busy") for _ in range(10)])
    served = serve()
    browser.get(served.url + "channels")
    assert _cells(browser, "tr.channel-row td.size") == ["10"]
    queue.create_many([NewMessage(b"x", channel="busy") for _ in range(5)])
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _cells(b, "tr.channel-row td.size") == ["15"], "the size never refreshed"
    )
    # Growing: messages leave at a negative rate.
    assert float(_cells(browser, "tr.channel-row td.rate")[0]) < 0


def test_a_channel_page_lists_waiting_and_locked_messages(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    queue.create_many([NewMessage(b"payload %d" % i, channel="orders") for i in range(60)])
    queue.channel("orders").set_policy(max_concurrency=3, max_size=1000)
    held = queue.dequeue_many(3, lock_ms=LOCK_MS)
    assert len(held) == 3
    served = serve()
    browser.get(served.url + "channels")
    _click(browser, "td.name a", "orders")
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "channel-name"))
    assert _text(browser, "channel-name") == "orders"
    assert _text(browser, "size") == "60"
    assert _text(browser, "in-flight") == "3"
    assert "concurrency 3" in _text(browser, "policy")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.message-row")
    assert len(rows) == 50
    assert "payload 3" in rows[0].text
    browser.find_element(By.ID, "next-page").click()
    following = [str(m) for m in range(held[-1].id + 51, held[-1].id + 58)]
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _cells(b, "tr.message-row td:first-child") == following
    )
    browser.find_element(By.ID, "view-locked").click()
    WebDriverWait(browser, WAIT_S).until(lambda b: _cells(b, "#view-locked.current") == ["locked"])
    ids = _cells(browser, "tr.message-row td:first-child")
    assert sorted(map(int, ids)) == sorted(m.id for m in held)
    rows = _cells(browser, "tr.message-row")
    # Their locks expire within the ten minutes they were taken for.
    assert all(re.search(r"\(in \d+\.\d (s|min)\)", row) for row in rows), rows


def test_hostile_values_show_as_text_and_run_nothing(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    hostile = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    queue.create_many(
        [
            NewMessage(hostile.encode(), channel=hostile),
            NewMessage(b"\xff\x00binary", channel="bin\u202eary"),
        ]
    )
    served = serve()
    browser.get(served.url + "channels")
    assert hostile in _names(browser)
    assert "bin\\u202eary" in _names(browser)
    _no_alert(browser)
    _click(browser, "td.name a", hostile)
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "channel-name"))
    assert _text(browser, "channel-name") == hostile
    assert hostile in browser.find_element(By.CSS_SELECTOR, "tr.message-row").text
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, main script")
    _no_alert(browser)
