"""Served per second and share of service: what the live workers' reports say they took from
each channel, on the channels page, a channel's page (with its share over time) and the
workers page; a real Worker's two equal channels are shown served about equally."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import Message, NewMessage, Queue
from lonnymq.worker import Worker

from .conftest import Served, get
from .test_browser import WAIT_S, _cells, _read, _screenshot
from .test_workers import HOSTILE

ESCAPED = "&lt;script&gt;alert(&#39;w&#39;)&lt;/script&gt;"
# The dashboard reads the workers' table at most once a second.
READ_EVERY_S = 1.1


def _cell(body: str, channel_html: str, cls: str) -> str:
    """The text of the ``cls`` cell in the channels page's row of ``channel_html``."""
    row = body.split(f">{channel_html}</a></td>")[1].split("</tr>", maxsplit=1)[0]
    found = re.search(rf'<td class="num {cls}">(.*?)</td>', row, re.S)
    assert found is not None, row
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _card(body: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}">(.*?)</div>', body, re.S)
    assert found is not None, body
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _cards(served: Served, path: str, expected: tuple[str, str, str]) -> str:
    """The page at ``path``, once its served rate, share and total are checked."""
    status, body = get(served, path)
    assert status == 200, body
    cards = (_card(body, "served-rate"), _card(body, "share"), _card(body, "served-total"))
    assert cards == expected
    return body


def test_rates_and_shares_come_from_the_live_workers_reports(
    serve: Callable[..., Served], queue: Queue, report_worker: Callable[..., None]
) -> None:
    for name in ("a", HOSTILE, "b"):
        queue.create(b"x", channel=name)
    # A worker that stopped reporting counts no more.
    report_worker("old", served_ms=1000, served_channels=["b"], served_counts=[900])
    queue.set_clock_offset(10_000)
    # 300 of a and 100 of the hostile channel in 2 s; 50 more of a in 1 s.
    report_worker("w1", served_ms=2000, served_channels=["a", HOSTILE], served_counts=[300, 100])
    report_worker("w2", served_ms=1000, served_channels=["a"], served_counts=[50])
    served = serve()
    status, body = get(served, "/channels")
    assert status == 200, body
    assert HOSTILE not in body
    assert _cell(body, "a", "served") == "200.0"
    assert _cell(body, ESCAPED, "served") == "50.0"
    # Every report named all it took from: a channel none names took nothing.
    assert _cell(body, "b", "served") == "0.0"
    _cards(served, "/channel?name=a", ("200.0", "80.0 %", "250.0"))
    status, body = get(served, "/workers")
    taken = re.findall(r'<td class="num taken">(.*?)</td>', body)
    assert taken == ["-", "200.0", "50.0"]  # the gone worker, then w1 and w2
    # A report that took from channels it does not name: those it does not name are unknown.
    report_worker("w3", served_ms=1000, served_channels=["a"], served_counts=[10], served_other=40)
    time.sleep(READ_EVERY_S)
    status, body = get(served, "/channels")
    assert _cell(body, "b", "served") == "-"
    assert _cell(body, "a", "served") == "210.0"
    _cards(served, "/live/channel?name=b", ("under the named", "-", "300.0"))
    # Two readings kept: the share chart of a has a point for each.
    body = _cards(served, "/live/channel?name=a", ("210.0", "70.0 %", "300.0"))
    points = re.search(r'id="share-line" points="([^"]*)"', body)
    assert points is not None, body
    assert len(points.group(1).split()) == 2


def test_a_channel_no_worker_serves_shows_no_share(
    serve: Callable[..., Served], queue: Queue
) -> None:
    queue.create(b"x", channel="idle")
    body = _cards(serve(), "/channel?name=idle", ("0.0", "-", "0.0"))
    assert 'id="share-line"' not in body


def _percent(browser: Any) -> float | None:
    text = _read(browser, "share")
    if not text or not text[0].endswith(" %"):
        return None
    return float(text[0].removesuffix(" %"))


def _points(browser: Any) -> list[str]:
    points = browser.execute_script(
        "const e = document.getElementById('share-line'); return e && e.getAttribute('points');"
    )
    return str(points).split() if points else []


@pytest.mark.browser
def test_a_workers_two_equal_channels_are_served_about_equally(
    browser: Any, serve: Callable[..., Served], queue: Queue, tmp_path: Path
) -> None:
    queue.create_many(
        [NewMessage(b"x", channel=name) for _ in range(1_500) for name in ("left", "right")]
    )
    stop = threading.Event()

    def handler(message: Message) -> None:
        stop.wait(0.005)

    worker = Worker(queue, handler, concurrency=2, lock_ms=3_000, heartbeat_ms=200)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    served = serve()
    thread.start()
    try:
        browser.get(served.url + "channel?name=left")
        shares: list[float] = []

        def fair(b: Any) -> bool:
            share = _percent(b)
            if share is not None:
                shares.append(share)
            return share is not None and 30 <= share <= 70

        WebDriverWait(browser, WAIT_S).until(fair, f"left's share never near half: {shares}")
        WebDriverWait(browser, WAIT_S).until(
            lambda b: len(_points(b)) >= 4, "the share chart never grew"
        )
        _screenshot(browser, "dashboard-channel.png", tmp_path)
        browser.get(served.url + "channels")
        WebDriverWait(browser, WAIT_S).until(
            lambda b: (
                all(
                    re.fullmatch(r"[0-9,]+\.[0-9]", c) and float(c.replace(",", "")) > 0
                    for c in _cells(b, "tr.channel-row td.served")
                )
                and len(_cells(b, "tr.channel-row td.served")) == 2
            ),
            "the channels page never showed both channels served",
        )
    finally:
        stop.set()
        worker.stop()
        thread.join(WAIT_S)
    assert not thread.is_alive()
