"""The workers page: a running Worker shows up with what it runs; a stopped one is marked
stopped, one that stopped reporting is marked gone; hostile values are escaped."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import Message, NewMessage, Queue
from lonnymq.worker import Worker

from .conftest import Served, get
from .test_browser import WAIT_S, _cells, _no_alert

HOSTILE = "<script>alert('w')</script>"


@pytest.mark.browser
def test_a_running_worker_shows_up_with_what_it_runs_then_stops(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    created = queue.create_many([NewMessage(b"x", channel=f"tenant-{i}") for i in range(2)])
    release = threading.Event()

    def handler(message: Message) -> None:
        assert release.wait(WAIT_S)

    worker = Worker(queue, handler, concurrency=3, lock_ms=3_000, heartbeat_ms=100)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    served = serve()
    thread.start()
    try:
        browser.get(served.url)
        browser.find_element(By.ID, "nav-workers").click()
        WebDriverWait(browser, WAIT_S).until(
            lambda b: _cells(b, "tr.worker-row td.running") == ["2"],
            "the worker never showed its two messages",
        )
        assert _cells(browser, "tr.worker-row td.state") == ["alive"]
        running = _cells(browser, "tr.worker-row td.messages")[0]
        for result, channel in zip(created, ("tenant-0", "tenant-1"), strict=True):
            assert f"{result.id} in {channel}" in running
        link = browser.find_element(By.CSS_SELECTOR, "tr.worker-row td.messages a")
        assert "view=locked" in str(link.get_attribute("href"))
    finally:
        release.set()
        worker.stop()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    # The page refreshes itself: the worker is now marked stopped.
    WebDriverWait(browser, WAIT_S).until(
        lambda b: _cells(b, "tr.worker-row td.state") == ["stopped"],
        "the worker was never shown stopped",
    )
    assert _cells(browser, "tr.worker-row td.running") == ["0"]
    _no_alert(browser)


def test_a_worker_that_stopped_reporting_is_shown_gone(
    serve: Callable[..., Served], queue: Queue, report_worker: Callable[..., None]
) -> None:
    report_worker("quiet", running=1, message_ids=[5], channels=[HOSTILE], host=HOSTILE)
    queue.set_clock_offset(10_000)  # ten of its one-second rounds without a report
    report_worker("fresh")
    served = serve()
    status, body = get(served, "/workers")
    assert status == 200, body
    assert HOSTILE not in body
    escaped = "&lt;script&gt;alert(&#39;w&#39;)&lt;/script&gt;"
    quiet = body.split('id="worker-quiet"')[1].split("</tr>")[0]
    assert '<span class="badge">gone</span>' in quiet
    assert f'<td class="name">{escaped}</td>' in quiet
    assert f"5</a> in {escaped}" in quiet
    fresh = body.split('id="worker-fresh"')[1].split("</tr>")[0]
    assert '<td class="state">alive</td>' in fresh
    assert "1 alive, 1 stopped or gone in the last hour." in body


def test_no_worker_is_said_plainly(serve: Callable[..., Served], queue: Queue) -> None:
    status, body = get(serve(), "/workers")
    assert status == 200
    assert "No worker has reported in the last hour." in body
