"""The failures and archive page: failed messages with their error and traceback (escaped,
collapsible), filtered by outcome and channel, paged by id however sparse the filter; and the
replay action, which asks first, does what it says, is logged, and is refused read-only, for a
forged confirmation and for a role without the admin grant. A queue without the archive says
so."""

from __future__ import annotations

import http.client
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import NewMessage, Queue

from .conftest import Served, assert_bad_requests, get
from .test_actions import worker_role  # noqa: F401 (a fixture)
from .test_browser import LOCK_MS, WAIT_S, _cells, _confirm, _no_alert, _text

HOSTILE = "<script>alert('x')</script>"
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "handler.py", line 7, in handle\n'
    "    raise ValueError(payload)\n"
    "ValueError: {message}"
)


def _fail(queue: Queue, channel: str, count: int, error: str = "boom") -> list[int]:
    """``count`` messages of ``channel`` taken and failed with ``error``; their ids."""
    queue.create_many([NewMessage(b"job %d" % i, channel=channel) for i in range(count)])
    ids: list[int] = []
    while len(ids) < count:
        held = queue.dequeue_many(count - len(ids), lock_ms=LOCK_MS)
        assert held
        for message in held:
            assert message.channel == channel
            queue.fail(message, error=error)
            ids.append(message.id)
    return ids


def _complete(queue: Queue, channel: str, count: int) -> list[int]:
    queue.create_many([NewMessage(b"ok", channel=channel) for _ in range(count)])
    held = queue.dequeue_many(count, lock_ms=LOCK_MS)
    assert len(held) == count
    queue.delete_many(held)
    return [m.id for m in held]


def _post(served: Served, path: str, fields: dict[str, str], site: str | None = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if site is not None:
        headers["Sec-Fetch-Site"] = site
    try:
        conn.request("POST", path, body=urlencode(fields), headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _form(served: Served, query: str) -> dict[str, str]:
    status, body = get(served, "/archive/replay?" + query)
    assert status == 200, body
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', body))


def _listed(body: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr class="archived-row" id="archived-(\d+)">', body)]


def _next(body: str) -> str | None:
    found = re.search(r'<a id="next-page" href="([^"]*)">', body)
    return None if found is None else found.group(1).replace("&amp;", "&")


def test_failures_are_listed_newest_first_with_their_error_escaped(
    serve: Callable[..., Served], archiving_queue: Queue
) -> None:
    error = TRACEBACK.format(message=HOSTILE + " \u202e" + "é" * 300)
    failed = _fail(archiving_queue, HOSTILE, 2, error=error)
    completed = _complete(archiving_queue, "fine", 3)
    served = serve()
    status, body = get(served, "/archive")
    assert status == 200, body
    # Only what did not complete, newest first.
    assert _listed(body) == sorted(failed, reverse=True)
    assert HOSTILE not in body
    escaped = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
    assert f">{escaped}</a></td>" in body
    # The summary is the exception's line, cut short; the traceback keeps its lines.
    summary = re.search(r'<summary class="error-summary">([^<]*)</summary>', body)
    assert summary is not None
    assert summary.group(1).startswith(f"ValueError: {escaped} \\u202e")
    assert summary.group(1).endswith("…")
    assert len(summary.group(1)) < 260
    assert "\n    raise ValueError(payload)\nValueError: " in body
    assert "\u202e" not in body
    assert "é" * 300 in body
    _, completed_page = get(served, "/archive?outcome=completed")
    assert _listed(completed_page) == sorted(completed, reverse=True)
    _, none = get(served, "/archive?outcome=failed&channel=fine")
    assert _listed(none) == []
    assert "No archived message with outcome “failed” in channel “fine”" in none
    status, body = get(served, "/archive?outcome=" + "x" * 65)
    assert status == 400
    assert "outcome must be 1 to 64 characters" in body
    assert get(served, "/archive?channel=" + "c" * 256)[0] == 400
    assert get(served, "/archive?before=soon")[0] == 400
    assert get(served, "/archive?before=99999999999999999999")[0] == 400


def test_a_long_error_is_cut_and_says_how_long_it_was(
    serve: Callable[..., Served], archiving_queue: Queue
) -> None:
    _fail(archiving_queue, "c", 1, error="S" + "E" * 20_000 + "\nRuntimeError: at the end")
    _, body = get(serve(), "/archive")
    head, tail = "S" + "E" * 8_191, "E" * (8_192 - 25) + "\nRuntimeError: at the end"
    assert f'<pre class="traceback">{head}\n…\n{tail}</pre>' in body
    assert "20,026 characters in all: the middle is left out." in body
    assert '<summary class="error-summary">RuntimeError: at the end</summary>' in body


def test_pages_walk_on_where_a_sparse_filter_leaves_off(
    serve: Callable[..., Served], archiving_queue: Queue, dsn: str
) -> None:
    """A page walks at most 10,000 archived rows; a filter matching few of them still pages
    through every match, by id, each page a bounded walk."""
    rare = _fail(archiving_queue, "rare", 3)
    _fail(archiving_queue, "common", 120)
    served = serve()
    seen: list[int] = []
    path: str | None = "/archive"
    while path is not None:
        status, body = get(served, path)
        assert status == 200, body
        seen.extend(_listed(body))
        path = _next(body)
    assert len(seen) == 123
    assert seen == sorted(seen, reverse=True)
    # The function walks no further than its cap: with a cap of 50, the rare channel's
    # messages (the oldest) are found only by walking on from where each call left off.
    with psycopg.connect(dsn, autocommit=True) as conn:
        statement = sql.SQL(
            "SELECT id, next_before FROM {}.dashboard_archive(p_channel => 'rare', "
            "p_before_id => %s, p_limit => 2, p_scan_cap => 50)"
        ).format(sql.Identifier(archiving_queue.schema))
        found: list[int] = []
        before = None
        calls = 0
        while True:
            rows = conn.execute(statement, [before]).fetchall()
            calls += 1
            found.extend(r[0] for r in rows if r[0] is not None)
            if not rows or rows[-1][0] is not None:
                break
            before = rows[-1][1]
        assert found == sorted(rare, reverse=True)
        # 50 rows walked, then 50, then 23 (a full page: two of the rare ones), then the last.
        assert calls == 4
        bad = sql.SQL("SELECT * FROM {}.dashboard_archive(p_scan_cap => 0)").format(
            sql.Identifier(archiving_queue.schema)
        )
        with pytest.raises(psycopg.Error, match="scan_cap must be between"):
            conn.execute(bad)


def test_without_the_archive_the_page_says_so(serve: Callable[..., Served], queue: Queue) -> None:
    queue.create(b"x", channel="c")
    taken = queue.dequeue(lock_ms=LOCK_MS)
    assert taken is not None
    queue.fail(taken, error="lost")
    served = serve()
    status, body = get(served, "/archive")
    assert status == 200
    assert 'id="archive-off"' in body
    assert "The archive is off" in body
    assert _listed(body) == []


@pytest.mark.browser
def test_replay_asks_then_creates_the_messages_again_and_is_logged(
    browser: Any,
    serve: Callable[..., Served],
    archiving_queue: Queue,
    dashboard_log: Callable[[], list[str]],
) -> None:
    first, second, third = _fail(archiving_queue, "orders", 3)
    served = serve()
    browser.get(served.url)
    browser.find_element(By.ID, "nav-archive").click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "archived"))
    ids = _cells(browser, "tr.archived-row td.num:nth-child(2)")
    assert ids == [str(third), str(second), str(first)]
    # The traceback is folded until asked for.
    details = browser.find_element(By.CSS_SELECTOR, f"#archived-{third} details")
    assert not details.get_attribute("open")
    details.find_element(By.TAG_NAME, "summary").click()
    assert details.get_attribute("open")

    browser.find_element(By.CSS_SELECTOR, f"#archived-{third} a.replay-one").click()
    assert _text(browser, "question").startswith(f"Replay 1 archived message(s) ({third})")
    browser.find_element(By.ID, "cancel").click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "archived"))
    assert archiving_queue.channel("orders").stats() is None  # nothing replayed yet
    browser.find_element(By.CSS_SELECTOR, f"#archived-{third} a.replay-one").click()
    _confirm(browser)
    assert _text(browser, "done") == "Done: 1 replayed."
    assert "replayed as" in _text(browser, f"archived-{third}")
    waiting = archiving_queue.dequeue(lock_ms=LOCK_MS)
    assert waiting is not None
    assert waiting.content == b"job 2"
    archiving_queue.delete(waiting)

    for picked in (first, second):
        browser.find_element(By.CSS_SELECTOR, f"#archived-{picked} input.pick").click()
    browser.find_element(By.ID, "replay-selected").click()
    question = _confirm(browser)
    assert question.startswith(f"Replay 2 archived message(s) ({first}, {second})")
    assert _text(browser, "done") == "Done: 2 replayed."
    again = archiving_queue.dequeue_many(5, lock_ms=LOCK_MS)
    assert sorted(m.content for m in again) == [b"job 0", b"job 1"]
    assert not browser.find_elements(By.CSS_SELECTOR, "input.pick")
    _no_alert(browser)
    assert dashboard_log() == [
        f"dashboard replay of archived messages {third} (replayed 1) from 127.0.0.1",
        f"dashboard replay of archived messages {first},{second} (replayed 2) from 127.0.0.1",
    ]


def test_replay_without_its_confirmation_or_read_only_is_refused(
    serve: Callable[..., Served], archiving_queue: Queue
) -> None:
    first, second = _fail(archiving_queue, "c", 2)
    served = serve()
    form = _form(served, f"id={first}")
    assert form["ids"] == str(first)
    assert _post(served, "/archive/replay", {"action": "replay", "ids": str(first)})[0] == 403
    # The confirmation of one replay does not confirm another, nor a channel's action.
    assert _post(served, "/archive/replay", {**form, "ids": f"{first},{second}"})[0] == 403
    assert _post(served, "/archive/replay", {**form, "csrf": "0" * 64})[0] == 403
    assert _post(served, "/archive/replay", form, site="cross-site")[0] == 403
    assert _post(served, "/channel/action", form)[0] == 400
    channel_form = dict(
        re.findall(
            r'<input type="hidden" name="(\w+)" value="([^"]*)">',
            get(served, "/channel/action?action=pause&name=c")[1],
        )
    )
    assert _post(served, "/archive/replay", channel_form)[0] == 400
    read_only = serve(read_only=True)
    status, body = get(read_only, f"/archive/replay?id={first}")
    assert status == 403
    assert "read-only" in body
    status, body = _post(read_only, "/archive/replay", form)
    assert status == 403
    assert "read-only" in body
    _, page = get(read_only, "/archive")
    assert "Replay is off" in page
    assert "replay-one" not in page
    assert 'class="pick"' not in page
    assert archiving_queue.channel("c").stats() is None  # nothing was replayed
    assert _post(served, "/archive/replay", form)[0] == 303
    assert archiving_queue.channel("c").stats() is not None


def test_bad_replay_requests_are_refused_with_a_message(
    serve: Callable[..., Served], queue: Queue
) -> None:
    assert_bad_requests(
        serve(),
        "/archive/replay?",
        (
            ("", "choose at least one archived message"),
            ("id=x", "not a whole number"),
            ("id=0", "a message id is 1 or more"),
            ("id=" + ",".join(map(str, range(1, 1002))), "at most 1000 messages a replay"),
        ),
    )


def test_a_role_without_the_admin_grant_may_not_replay(
    serve: Callable[..., Served],
    queue: Queue,
    admin: psycopg.Connection[Any],
    worker_role: str,  # noqa: F811
) -> None:
    # Turned on by the owner's call (installing again would take the reads granted above).
    admin.execute(
        sql.SQL("SELECT {}(p_archive => true)").format(sql.Identifier(queue.schema, "config_set"))
    )
    (failed,) = _fail(queue, "c", 1)
    admin.execute(
        sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
            sql.Identifier(queue.schema, "dashboard_archive"),
            sql.Identifier(str(conninfo_to_dict(worker_role)["user"])),
        )
    )
    served = serve(as_dsn=worker_role)
    _, page = get(served, "/archive")
    assert _listed(page) == [failed]
    status, body = _post(served, "/archive/replay", _form(served, f"id={failed}"))
    assert status == 403
    assert "the database role may not do this" in body
    assert queue.channel("c").stats() is None
    assert quote("c") in page
