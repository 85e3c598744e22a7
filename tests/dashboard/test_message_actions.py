"""The actions on one waiting message of a channel's page: delete it, make a scheduled one due
now. Each asks first, does what it says and is logged; a locked message is refused with a
message; and each is refused read-only, with a forged confirmation and for a role without
the admin grant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By

from lonnymq import Queue

from .conftest import Served, assert_bad_requests, get
from .test_actions import _form, _post, worker_role  # noqa: F401 (a fixture)
from .test_browser import LOCK_MS, _cells, _confirm, _no_alert, _text

HOUR_MS = 3_600_000


def _ids(browser: Any) -> list[int]:
    return [int(i) for i in _cells(browser, "tr.message-row td:first-child")]


def _act(browser: Any, served: Served, channel: str, message_id: int, link: str) -> str:
    """Follow the message's ``link`` on its channel's page, then confirm; the question."""
    browser.get(served.url + "channel?name=" + quote(channel, safe=""))
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.message-row")
    row = next(r for r in rows if r.find_element(By.TAG_NAME, "td").text == str(message_id))
    row.find_element(By.CSS_SELECTOR, f"a.{link}").click()
    return _confirm(browser)


@pytest.mark.browser
def test_delete_and_due_now_do_what_they_say_and_are_logged(
    browser: Any,
    serve: Callable[..., Served],
    archiving_queue: Queue,
    dashboard_log: Callable[[], list[str]],
) -> None:
    hostile = "<b>tenant</b>\u202e"
    now = archiving_queue.now()
    due = archiving_queue.create(b"due", channel=hostile).id
    later = archiving_queue.create(b"later", channel=hostile, dequeue_at=now + HOUR_MS).id
    assert due is not None
    assert later is not None
    served = serve()
    browser.get(served.url + "channel?name=" + quote(hostile, safe=""))
    assert _ids(browser) == [due, later]
    # Only the scheduled one can be made due now.
    assert len(browser.find_elements(By.CSS_SELECTOR, "a.expedite")) == 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "a.discard")) == 2

    question = _act(browser, served, hostile, later, "expedite")
    assert question.startswith(f"Make message {later} of channel <b>tenant</b>\\u202e due now")
    assert _text(browser, "done") == "Done: expedite."
    assert not browser.find_elements(By.CSS_SELECTOR, "a.expedite")
    taken = archiving_queue.dequeue_many(5, lock_ms=LOCK_MS)
    assert [m.id for m in taken] == [due, later]
    for message in taken:
        archiving_queue.defer(message, dequeue_at=now + HOUR_MS)

    question = _act(browser, served, hostile, due, "discard")
    assert question.startswith(f"Delete message {due} of channel <b>tenant</b>\\u202e")
    assert _text(browser, "done") == "Done: discard."
    assert _ids(browser) == [later]
    (archived,) = archiving_queue.archived()
    assert (archived.id, archived.outcome) == (due, "discarded")
    _no_alert(browser)
    assert dashboard_log() == [
        f"dashboard expedite on channel {hostile!r} (message {later}) from 127.0.0.1",
        f"dashboard discard on channel {hostile!r} (message {due}) from 127.0.0.1",
    ]


def test_a_message_taken_since_the_page_showed_it_is_refused_with_a_message(
    serve: Callable[..., Served], queue: Queue
) -> None:
    message_id = queue.create(b"m", channel="c").id
    served = serve()
    forms = {
        a: _form(served, f"action={a}&name=c&id={message_id}") for a in ("discard", "expedite")
    }
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    for form in forms.values():
        status, body = _post(served, form)
        assert status == 409
        assert f"MessageLockedError: message {message_id} is locked" in body
    queue.delete(held)
    status, body = _post(served, forms["discard"])
    assert status == 409
    assert "MessageNotFoundError" in body


def test_message_actions_are_refused_when_they_must_be(
    serve: Callable[..., Served], queue: Queue
) -> None:
    message_id = queue.create(b"m", channel="c", dequeue_at=queue.now() + HOUR_MS).id
    other = queue.create(b"o", channel="d").id
    served = serve()
    form = _form(served, f"action=discard&name=c&id={message_id}")
    assert form["id"] == str(message_id)
    # The confirmation of one message does not confirm another, nor another action.
    assert _post(served, {**form, "id": str(other)})[0] == 403
    assert _post(served, {**form, "action": "expedite"})[0] == 403
    read_only = serve(read_only=True)
    status, body = _post(read_only, form)
    assert status == 403
    assert "read-only" in body
    status, body = get(read_only, f"/channel/action?action=discard&name=c&id={message_id}")
    assert status == 403
    assert "read-only" in body
    status, body = get(read_only, "/channel?name=c")
    assert status == 200
    assert 'class="discard"' not in body
    assert 'class="expedite"' not in body
    # A message named under another channel than its own is not found there.
    mismatched = _form(served, f"action=discard&name=c&id={other}")
    status, body = _post(served, mismatched)
    assert status == 409
    assert "is not in channel" in body
    assert {m.id for m in queue.dequeue_many(5, lock_ms=LOCK_MS)} == {other}
    assert_bad_requests(
        served,
        "/channel/action?",
        (
            ("action=discard&name=c", "a message id is 1 or more, got None"),
            ("action=expedite&name=c&id=0", "a message id is 1 or more, got 0"),
            ("action=discard&name=c&id=x", "not a whole number"),
            ("action=discard&name=c&id=99999999999999999999", "a number out of range"),
        ),
    )


def test_a_role_without_the_admin_grant_may_not_act_on_a_message(
    serve: Callable[..., Served],
    queue: Queue,
    worker_role: str,  # noqa: F811
) -> None:
    message_id = queue.create(b"m", channel="c").id
    served = serve(as_dsn=worker_role)
    for action in ("discard", "expedite"):
        status, body = _post(served, _form(served, f"action={action}&name=c&id={message_id}"))
        assert status == 403
        assert "the database role may not do this" in body
    held = queue.dequeue(lock_ms=LOCK_MS)
    assert held is not None
    assert held.id == message_id
