"""``install()`` records the settings and ``settings()`` reads them back."""

from __future__ import annotations

from collections.abc import Callable

from lonnymq import Queue, Settings


def test_install_records_settings_and_keeps_them(make_queue: Callable[..., Queue]) -> None:
    assert make_queue().settings() == Settings(event_channel=None, archive=False)
    make_queue(event_channel="lmq_settings", archive=True)
    assert make_queue().settings() == Settings(event_channel="lmq_settings", archive=True)
    # A later install without arguments changes nothing; archive=False turns it off.
    make_queue(archive=False)
    assert make_queue().settings() == Settings(event_channel="lmq_settings", archive=False)
