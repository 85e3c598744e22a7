"""The dashboard's actions on a channel (pause, resume, set and clear its policy): each asks
for confirmation, does what it says, is logged, and is refused in read-only mode, without a
valid confirmation (cross-site request forgery), and for a role without the admin grant."""

from __future__ import annotations

import http.client
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from lonnymq import NewMessage, Policy, Queue

from .conftest import Served, assert_bad_requests
from .test_browser import WAIT_S, _confirm, _text

PASSWORD = "lonnymq-dashboard-pw"


def _policy(queue: Queue, channel: str) -> Policy | None:
    stats = queue.channel(channel).stats()
    return None if stats is None else stats.policy


def _press(browser: Any, served: Served, channel: str, button: str) -> str:
    """Press ``button`` on the channel's page, then confirm; returns the question asked."""
    browser.get(served.url + "channel?name=" + quote(channel, safe=""))
    browser.find_element(By.ID, button).click()
    return _confirm(browser)


@pytest.mark.browser
def test_each_action_asks_then_does_what_it_says_and_is_logged(
    browser: Any,
    serve: Callable[..., Served],
    queue: Queue,
    dashboard_log: Callable[[], list[str]],
) -> None:
    queue.create_many([NewMessage(b"x", channel="orders") for _ in range(3)])
    queue.channel("orders").set_policy(max_concurrency=4, release_interval_ms=50)
    served = serve()

    question = _press(browser, served, "orders", "pause")
    assert question.startswith("Pause channel orders")
    assert _text(browser, "done") == "Done: pause."
    assert "paused" in _text(browser, "policy")
    assert _policy(queue, "orders") == Policy(0, 50, None)
    assert queue.dequeue(lock_ms=1000) is None

    question = _press(browser, served, "orders", "resume")
    assert question.startswith("Resume channel orders")
    # The concurrency limit it had before the pause is back.
    assert _policy(queue, "orders") == Policy(4, 50, None)

    browser.get(served.url + "channel?name=orders")
    for field, value in (("max_concurrency", "2"), ("release_interval_ms", ""), ("max_size", "9")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "set-policy").click()
    assert "max_concurrency 2, max_size 9" in _text(browser, "question")
    # Cancel first: nothing changes.
    browser.find_element(By.ID, "cancel").click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "channel-name"))
    assert _policy(queue, "orders") == Policy(4, 50, None)
    browser.back()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "confirm"))[0].click()
    WebDriverWait(browser, WAIT_S).until(lambda b: b.find_elements(By.ID, "done"))
    assert _policy(queue, "orders") == Policy(2, None, 9)

    _press(browser, served, "orders", "clear")
    assert _policy(queue, "orders") == Policy(None, None, None)
    done = dashboard_log()
    assert [line.split(" on ")[0] for line in done] == [
        "dashboard pause",
        "dashboard resume",
        "dashboard set",
        "dashboard clear",
    ]
    assert "max_concurrency 2, max_size 9" in done[2]


def _post(served: Served, fields: dict[str, str], headers: dict[str, str] | None = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/channel/action",
            body=urlencode(fields),
            headers={"Content-Type": "application/x-www-form-urlencoded", **(headers or {})},
        )
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _form(served: Served, query: str) -> dict[str, str]:
    """The hidden fields of the confirmation page for ``query``."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", "/channel/action?" + query)
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', body))


def test_an_action_without_its_confirmation_is_refused(
    serve: Callable[..., Served], queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lonnymq.dashboard")
    queue.create(b"x", channel="c")
    served = serve()
    status, body = _post(served, {"action": "pause", "name": "c"})
    assert status == 403
    assert "not valid" in body
    form = _form(served, "action=pause&name=c")
    assert form["action"] == "pause"
    assert form["name"] == "c"
    # The confirmation of one action does not confirm another.
    assert _post(served, {**form, "action": "clear"})[0] == 403
    assert _post(served, {**form, "name": "other"})[0] == 403
    assert _post(served, {**form, "csrf": "0" * 64})[0] == 403
    # A form posted from another site, even with a good token.
    assert _post(served, form, {"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert _policy(queue, "c") == Policy(None, None, None)
    assert _post(served, form)[0] == 303
    assert _policy(queue, "c") == Policy(0, None, None)
    refusals = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(refusals) == 5


def test_bad_action_requests_are_refused_with_a_message(
    serve: Callable[..., Served], queue: Queue
) -> None:
    assert_bad_requests(
        serve(),
        "/channel/action?",
        (
            ("action=explode&name=c", "unknown action"),
            ("action=pause&name=", "channel name must be 1 to 255"),
            ("action=set&name=c&max_size=-1", "max_size must be 0 or more"),
            ("action=set&name=c&max_size=many", "not a whole number"),
        ),
    )


@pytest.mark.browser
def test_a_read_only_dashboard_refuses_every_action(
    browser: Any, serve: Callable[..., Served], queue: Queue
) -> None:
    queue.create(b"x", channel="c")
    served = serve(read_only=True)
    browser.get(served.url + "channel?name=c")
    assert "read-only" in _text(browser, "actions")
    assert not browser.find_elements(By.ID, "pause")
    browser.get(served.url + "channel/action?action=pause&name=c")
    assert "read-only" in _text(browser, "error")
    writable = serve()
    form = _form(writable, "action=pause&name=c")
    status, body = _post(served, form)
    assert status == 403
    assert "read-only" in body
    assert _policy(queue, "c") == Policy(None, None, None)


@pytest.fixture
def worker_role(dsn: str, admin: psycopg.Connection[Any], queue: Queue) -> Iterator[str]:
    """A LOGIN role granted the worker kind (no admin grant), and the dashboard's reads."""
    role = f"lmq_dash_{uuid.uuid4().hex[:12]}"
    admin.execute(
        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(PASSWORD)
        )
    )
    try:
        queue.grant(role, "worker")
        for function in (
            "dashboard_overview",
            "dashboard_channels",
            "dashboard_channel_messages",
            "dashboard_workers",  # the channel page's service
        ):
            admin.execute(
                sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                    sql.Identifier(queue.schema, function), sql.Identifier(role)
                )
            )
        yield make_conninfo(dsn, user=role, password=PASSWORD)
    finally:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.browser
def test_a_role_without_the_admin_grant_is_refused(
    browser: Any, serve: Callable[..., Served], queue: Queue, worker_role: str
) -> None:
    queue.create(b"x", channel="c")
    served = serve(as_dsn=worker_role)
    _press(browser, served, "c", "pause")
    assert "the database role may not do this" in _text(browser, "error")
    assert _policy(queue, "c") == Policy(None, None, None)
