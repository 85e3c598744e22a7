"""The CLI, run as a real subprocess against the test server."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

import lonnymq
from lonnymq import NewMessage, Queue, cli
from lonnymq.migrate import latest_version


def _cli(
    *args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m lonnymq.cli *args`` with exactly ``env``, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env=env,
        timeout=timeout,
        check=False,
    )


def _run(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _cli(*args, env={**os.environ, "LONNYMQ_DSN": dsn})


def _assert_refused(
    result: subprocess.CompletedProcess[str], *expected: str, returncode: int = 1
) -> None:
    """The command failed with ``returncode``, each of ``expected`` in its stderr, and no
    traceback."""
    assert result.returncode == returncode, result.stderr
    for text in expected:
        assert text in result.stderr
    assert "Traceback" not in result.stderr


def test_install_and_stats_json(dsn: str, schema_name: str) -> None:
    installed = _run(dsn, "--schema", schema_name, "install", "--archive")
    assert installed.returncode == 0, installed.stderr
    assert f"schema {schema_name!r} is at version {latest_version()}" in installed.stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'SELECT "{schema_name}".message_create(%s, %s)', (b"x", "cli"))
    stats = _run(dsn, "--schema", schema_name, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    rows = [json.loads(line) for line in stats.stdout.splitlines()]
    assert [(r["channel"], r["size"], r["in_flight"]) for r in rows] == [("cli", 1, 0)]


def test_migrate_print_is_the_install_script(dsn: str, schema_name: str) -> None:
    printed = _run(dsn, "--schema", schema_name, "migrate", "--print")
    assert printed.returncode == 0
    assert printed.stdout.startswith("BEGIN;")
    assert f'CREATE SCHEMA IF NOT EXISTS "{schema_name}"' in printed.stdout
    assert printed.stdout.rstrip().endswith("COMMIT;")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(printed.stdout.encode())
    _assert_works_at_latest(dsn, schema_name)


def test_migrate_print_from_a_version_upgrades_a_schema_at_it(dsn: str, schema_name: str) -> None:
    start = latest_version()
    full = _run(dsn, "--schema", schema_name, "migrate", "--print").stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(full.encode())
        # A function layer from another version: the upgrade script re-creates it.
        conn.execute(f"UPDATE \"{schema_name}\".function_source SET sha256 = 'older'")
        upgrade = _run(dsn, "--schema", schema_name, "migrate", "--print", "--from", str(start))
        assert upgrade.returncode == 0, upgrade.stderr
        assert upgrade.stdout.count("-- migration ") == 0
        conn.execute(upgrade.stdout.encode())
    _assert_works_at_latest(dsn, schema_name)


def _assert_works_at_latest(dsn: str, schema: str) -> None:
    """``install`` finds nothing to do, and a message goes round."""
    installed = _run(dsn, "--schema", schema, "install")
    assert f"schema {schema!r} is at version {latest_version()}" in installed.stdout
    assert _run(dsn, "--schema", schema, "create", "--channel", "m", "x").returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        taken = conn.execute(f'SELECT content FROM "{schema}".message_dequeue(60000)').fetchall()
    assert taken == [(b"x",)]


def test_migrate_print_refuses_a_version_it_does_not_know(dsn: str) -> None:
    for bad in ("-1", str(latest_version() + 1), "two"):
        result = _run(dsn, "migrate", "--print", "--from", bad)
        assert result.returncode == 2, bad
        assert "--from: must be a schema version from 0 to" in result.stderr
        assert result.stdout == ""


def test_version_is_the_installed_package_metadata(tmp_path: Path) -> None:
    expected = importlib.metadata.version("lonnymq")
    assert lonnymq.__version__ == expected
    for command in ([sys.executable, "-m", "lonnymq"], [sys.executable, "-m", "lonnymq.cli"]):
        shown = subprocess.run(
            [*command, "--version"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
        assert (shown.returncode, shown.stdout, shown.stderr) == (0, f"lonnymq {expected}\n", "")


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line, by its program name: lonnymq, lonnymq policy set, ..."""
    pending = [cli._parser()]
    while pending:
        parser = pending.pop()
        yield parser.prog, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())


def test_help_is_plain_words_for_every_command() -> None:
    parsers = dict(_parsers())
    assert len(parsers) > 20
    for prog, parser in parsers.items():
        text = parser.format_help()
        assert "``" not in text, prog
        assert not re.search(r":(class|meth|func|mod):", text), prog
        assert parser.description, f"{prog} --help says nothing about what it does"
    top = parsers["lonnymq"].format_help()
    # Every command is listed once, everyday ones apart from tooling.
    everyday, tooling = top.index("Everyday commands:"), top.index("Tooling:")
    for name in cli.EVERYDAY:
        assert len(re.findall(rf"^  {name} ", top, re.MULTILINE)) == 1, name
        assert everyday < top.index(f"\n  {name} ") < tooling, name
    for name in cli.TOOLING:
        assert tooling < top.index(f"\n  {name} ") < top.index("Exit codes:"), name
    assert {prog.split()[1] for prog in parsers if prog.count(" ") == 1} == {
        *cli.EVERYDAY,
        *cli.TOOLING,
    }
    for code in ("0", "1", "2", "3", "130", "141"):
        assert re.search(rf"^  {code} +\S", top, re.MULTILINE), code


def test_every_environment_twin_the_help_names_follows_the_rule() -> None:
    """An option's help names its twin as the epilog says: LONNYMQ_ and the option's name, with
    the command's name in between for the --out and --hold of the tooling commands."""
    twins = 0
    for prog, parser in _parsers():
        command = prog.split()[1] if " " in prog else ""
        for action in parser._actions:
            named = re.search(r"\(env (LONNYMQ_\w+)", action.help or "")
            if named is None:
                continue
            option = max(action.option_strings, key=len)
            name = option[2:].upper().replace("-", "_")
            if command in cli.TOOLING and option in ("--out", "--hold"):
                name = f"{command.upper()}_{name}"
            assert named[1] == f"LONNYMQ_{name}", (prog, option)
            twins += 1
    assert twins >= 25


def test_an_environment_twin_sets_its_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONNYMQ_CONCURRENCY", "7")
    monkeypatch.setenv("LONNYMQ_MAX_SIZE", "3")
    worker = cli._parser().parse_args(["worker", "m:f"])
    assert worker.concurrency == 7
    policy = cli._parser().parse_args(["policy", "set", "p"])
    assert policy.max_size == 3
    assert cli._parser().parse_args(["policy", "set", "p", "--max-size", "9"]).max_size == 9


def test_dsn_and_schema_may_follow_the_subcommand(dsn: str, schema_name: str) -> None:
    assert _run(dsn, "--schema", schema_name, "install").returncode == 0
    for env_dsn, args in (
        ("host=nowhere.invalid", ("stats", "--schema", schema_name, "--dsn", dsn, "--json")),
        (dsn, ("--schema", "elsewhere", "stats", "--json", "--schema", schema_name)),
        (dsn, ("--schema", "elsewhere", "policy", "--schema", schema_name, "show", "--json")),
    ):
        result = _run(env_dsn, *args)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stdout == ""  # an empty queue: no channels
    assert _run(dsn, "--schema", "elsewhere", "stats").returncode == 1  # not installed there


def test_a_malformed_environment_value_is_a_usage_error(dsn: str, schema_name: str) -> None:
    env = {**os.environ, "LONNYMQ_DSN": dsn, "LONNYMQ_LIMIT": "ten"}
    command = ("--schema", schema_name, "archive", "list")
    result = _cli(*command, env=env)
    _assert_refused(result, "argument --limit: invalid int value: 'ten'", returncode=2)
    # Other subcommands do not read it; on the command line, the option wins over it.
    assert _run(dsn, "--schema", schema_name, "install").returncode == 0
    given = _cli(*command, "--limit", "5", env=env)
    assert given.returncode == 0, given.stderr


def test_archive_list_refuses_an_unknown_outcome(dsn: str, schema_name: str) -> None:
    """A typo (here or in LONNYMQ_OUTCOME) found nothing, silently: it is a usage error."""
    assert _run(dsn, "--schema", schema_name, "install", "--archive").returncode == 0
    typo = _run(dsn, "--schema", schema_name, "archive", "list", "--outcome", "faild")
    _assert_refused(typo, "must be one of completed, failed: 'faild'", returncode=2)
    env = {**os.environ, "LONNYMQ_DSN": dsn, "LONNYMQ_OUTCOME": "Failed"}
    by_env = _cli("--schema", schema_name, "archive", "list", env=env)
    _assert_refused(by_env, "argument --outcome", returncode=2)
    for outcome in ("completed", "failed"):
        assert (
            _run(dsn, "--schema", schema_name, "archive", "list", "--outcome", outcome).returncode
            == 0
        )


def test_bad_schema_name_is_a_clean_error(dsn: str) -> None:
    result = _run(dsn, "--schema", 'x"; DROP TABLE y; --', "stats")
    _assert_refused(result, "InvalidArgumentError")


def _demo_without(java: Path | None, dsn: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``lonnymq demo`` with no java on PATH, and ``java`` (when given) as JAVA_HOME's."""
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env.update(LONNYMQ_DSN=dsn, PATH=str(tmp_path / "empty"))
    if java is not None:
        env["JAVA_HOME"] = str(java)
    return _cli("demo", "--out", str(tmp_path / "out"), env=env, timeout=60)


def test_demo_without_java_says_what_to_install(dsn: str, tmp_path: Path) -> None:
    # The full demo runs in tests/spark/test_demo.py; here, its first check, before any work.
    result = _demo_without(None, dsn, tmp_path)
    _assert_refused(result, "needs Java 17+", "no java on PATH", "JAVA_HOME")
    assert not (tmp_path / "out").exists()


def test_demo_with_an_old_java_says_so(dsn: str, tmp_path: Path) -> None:
    java_home = tmp_path / "jdk11"
    (java_home / "bin").mkdir(parents=True)
    java = java_home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'openjdk version \"11.0.21\" 2023-10-17' >&2\n")
    java.chmod(0o755)
    result = _demo_without(java_home, dsn, tmp_path)
    _assert_refused(result, f"{java} is Java 11")


def test_demo_refuses_a_tiny_dataset(dsn: str) -> None:
    result = _run(dsn, "demo", "--rows", "10")
    _assert_refused(result, "--rows must be >= 100")


def test_dashboard_refuses_a_port_in_use(dsn: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = _run(dsn, "dashboard", "--port", str(port))
    _assert_refused(result, f"cannot listen on 127.0.0.1:{port}")


def test_demo_refuses_a_dashboard_port_out_of_range(dsn: str) -> None:
    result = _run(dsn, "demo", "--dashboard", "70000")
    _assert_refused(result, "--dashboard must be a port between 0 and 65535, got 70000")


def _run_in(
    dsn: str, schema: str, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return _cli(
        "--schema",
        schema,
        *args,
        env={**os.environ, "LONNYMQ_DSN": dsn, **(env or {})},
        stdin=stdin,
        timeout=120,
    )


def test_create_from_arguments_and_from_stdin(dsn: str, schema_name: str) -> None:
    assert _run_in(dsn, schema_name, "install").returncode == 0
    by_args = _run_in(dsn, schema_name, "create", "a", "b", "--channel", "x", "--json")
    assert by_args.returncode == 0, by_args.stderr
    results = [json.loads(line) for line in by_args.stdout.splitlines()]
    # A channel without a policy keeps no counter: no size comes back (stats() counts it).
    assert [(r["status"], r["channel_size"]) for r in results] == [
        ("created", None),
        ("created", None),
    ]
    # A channel with a policy reports its exact size.
    assert _run_in(dsn, schema_name, "policy", "set", "p", "--max-size", "2").returncode == 0
    limited = _run_in(dsn, schema_name, "create", "a", "b", "c", "--channel", "p", "--json")
    assert limited.returncode == 0, limited.stderr
    assert [
        (r["status"], r["channel_size"]) for r in map(json.loads, limited.stdout.splitlines())
    ] == [("created", 1), ("created", 2), ("dropped", 2)]
    # One message per non-empty stdin line; the channel comes from the environment twin.
    by_stdin = _run_in(
        dsn, schema_name, "create", stdin="one\n\ntwo\nthree\n", env={"LONNYMQ_CHANNEL": "y"}
    )
    assert by_stdin.returncode == 0, by_stdin.stderr
    assert by_stdin.stdout.strip() == "3 created"
    stats = _run_in(dsn, schema_name, "stats", "--json")
    sizes = {r["channel"]: r["size"] for r in map(json.loads, stats.stdout.splitlines())}
    assert sizes == {"p": 2, "x": 2, "y": 3}


def test_create_from_stdin_takes_windows_line_ends_off(dsn: str, schema_name: str) -> None:
    assert _run_in(dsn, schema_name, "install").returncode == 0
    created = _run_in(dsn, schema_name, "create", "--channel", "w", stdin="one\r\ntwo\r\n")
    assert created.returncode == 0, created.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f'SELECT content FROM "{schema_name}".message ORDER BY id').fetchall()
    assert [bytes(r[0]) for r in rows] == [b"one", b"two"]


def _contents(dsn: str, schema: str) -> list[bytes]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f'SELECT content FROM "{schema}".message ORDER BY id').fetchall()
    return [bytes(r[0]) for r in rows]


def _any_message(dsn: str, schema: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT EXISTS (SELECT FROM "{schema}".message)').fetchone()
    return bool(row and row[0])


def _waits_for_message_table(dsn: str, schema: str) -> bool:
    """Whether a session waits for a lock on ``schema``'s message table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = %s::regclass)",
            [f'"{schema}".message'],
        ).fetchone()
    return bool(row and row[0])


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_create_from_stdin_creates_lines_as_they_come(dsn: str, schema_name: str) -> None:
    """A producer that writes a line and keeps its output open gets that line created at once,
    not at the end of its input."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "lonnymq.cli", "--schema", schema_name, "create", "--channel", "s"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LONNYMQ_DSN": dsn},
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(b"first\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while _contents(dsn, schema_name) != [b"first"]:
            assert time.monotonic() < deadline, "the first line was not created before EOF"
            assert proc.poll() is None
            time.sleep(0.05)
        out, err = proc.communicate(b"second\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.decode().strip() == "2 created"
    assert _contents(dsn, schema_name) == [b"first", b"second"]


def test_create_from_stdin_says_how_many_were_created_before_a_bad_line(
    dsn: str, schema_name: str
) -> None:
    """A line that is not UTF-8 stops the command: the lines before it that were sent stay
    created (each batch is a transaction), and stderr says how many, and which line was bad."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    good = b"".join(b"m%d\n" % i for i in range(1500))
    result = subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "--schema", schema_name, "create", "--channel", "b"],
        input=good + b"bad \xff line\nafter\n",
        capture_output=True,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=120,
        check=False,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "line 1501 of standard input is not UTF-8" in stderr
    created = _contents(dsn, schema_name)
    assert 0 < len(created) <= 1500
    assert created == [b"m%d" % i for i in range(len(created))]
    assert f"stopped after the first {len(created):,} messages" in stderr
    # A bad first line creates nothing and says nothing about what was created.
    first = subprocess.run(
        [sys.executable, "-m", "lonnymq.cli", "--schema", schema_name, "create", "--channel", "z"],
        input=b"\xfe\nok\n",
        capture_output=True,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=120,
        check=False,
    )
    assert first.returncode == 1
    assert "line 1 of standard input is not UTF-8" in first.stderr.decode()
    assert "stopped after" not in first.stderr.decode()
    assert len(_contents(dsn, schema_name)) == len(created)


def _create_process(
    dsn: str, schema: str, *args: str, launcher: Sequence[str] = ("-m", "lonnymq.cli")
) -> subprocess.Popen[bytes]:
    """``lonnymq create ARGS`` reading a pipe the test writes to (``launcher``: how Python
    starts the CLI)."""
    return subprocess.Popen(
        [sys.executable, *launcher, "--schema", schema, "create", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LONNYMQ_DSN": dsn},
    )


def test_create_from_a_steady_slow_producer_does_not_wait_for_a_full_batch(
    dsn: str, schema_name: str
) -> None:
    """A line every 0.15 s: the wait for more lines counts from a batch's first line, not
    from the last (which waited for 1,000 lines or the end of input)."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc = _create_process(dsn, schema_name, "--channel", "slow")
    assert proc.stdin is not None
    try:
        for i in range(20):
            proc.stdin.write(b"line%d\n" % i)
            proc.stdin.flush()
            time.sleep(0.15)
        created_before_eof = len(_contents(dsn, schema_name))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert created_before_eof > 0
    assert _contents(dsn, schema_name) == [b"line%d" % i for i in range(20)]


def test_create_stops_cleanly_while_its_input_is_still_open(dsn: str, schema_name: str) -> None:
    """A bad line while the producer keeps the pipe open: exit 1 with the error. (The reader
    thread, blocked in sys.stdin's buffer, made the interpreter abort at exit: SIGABRT.)"""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc = _create_process(dsn, schema_name, "--channel", "b")
    assert proc.stdin is not None
    try:
        proc.stdin.write(b"ok\n\xff\n")
        proc.stdin.flush()  # and keep it open
        returncode = proc.wait(timeout=60)
        err = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        proc.kill()
    assert returncode == 1, err
    assert "line 2 of standard input is not UTF-8" in err
    assert "Fatal Python error" not in err


def test_create_delay_counts_from_when_each_line_is_sent(dsn: str, schema_name: str) -> None:
    """--delay-ms for a line that comes seconds after the start still delays it that long."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc = _create_process(dsn, schema_name, "--channel", "d", "--delay-ms", "2000")
    assert proc.stdin is not None
    try:
        proc.stdin.write(b"early\n")
        proc.stdin.flush()
        time.sleep(3)
        _, err = proc.communicate(b"late\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    with psycopg.connect(dsn, autocommit=True) as conn:
        delays = conn.execute(
            f'SELECT dequeue_at - created_at FROM "{schema_name}".message ORDER BY id'
        ).fetchall()
    assert len(delays) == 2
    assert all(1_500 <= d <= 2_500 for (d,) in delays), delays


@pytest.mark.slow
def test_create_interrupted_says_exactly_how_many_were_committed(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    """SIGTERM at random moments of a long create: the count on stderr is what the table
    holds. (It could miss a batch committed just before the signal: 11 of 25 runs did.)

    The signal goes once the create has committed its first messages, at a random moment
    after: earlier, a loaded machine may still be starting Python, before the command has a
    handler for it, and the signal's default action kills it (that is not a create's moment)."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    source = tmp_path / "lines.txt"
    source.write_bytes(b"".join(b"m%d\n" % i for i in range(300_000)))
    rng = random.Random(7)
    for _ in range(5):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DELETE FROM "{schema_name}".message')
        with source.open("rb") as lines:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lonnymq.cli", "--schema", schema_name, "create"],
                stdin=lines,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, "LONNYMQ_DSN": dsn},
            )
            try:

                def started(p: subprocess.Popen[bytes] = proc) -> bool:
                    return p.poll() is not None or _any_message(dsn, schema_name)

                _wait_for(started, "the create's first messages")
                time.sleep(rng.random() * 1.5)
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=60)
            finally:
                proc.kill()
        held = len(_contents(dsn, schema_name))
        if proc.returncode == 0:  # it finished first
            assert held == 300_000
            continue
        assert proc.returncode == 130, err
        said = re.search(rb"stopped after the first ([\d,]+) messages", err)
        if held == 0:
            assert said is None, err
            continue
        assert said is not None, (err, held)
        assert int(said[1].replace(b",", b"")) == held


IGNORING_SIGINT = (
    "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "from lonnymq.cli import main; sys.exit(main(sys.argv[1:]))",
)


def _signal_during_a_batch(
    dsn: str, schema: str, sig: int, *args: str, ignore: bool = False
) -> tuple[subprocess.Popen[bytes], bytes, bytes]:
    """One line created, then two more whose create_many waits on a table lock while ``sig``
    comes; the lock is then let go and the input ended."""
    # A command started with ``sig`` ignored, when asked: as a shell starts a background job.
    assert not ignore or sig == signal.SIGINT
    launcher = IGNORING_SIGINT if ignore else ("-m", "lonnymq.cli")
    proc = _create_process(dsn, schema, *args, launcher=launcher)
    assert proc.stdin is not None
    try:
        with psycopg.connect(dsn) as locker:
            proc.stdin.write(b"first\n")
            proc.stdin.flush()
            _wait_for(lambda: _any_message(dsn, schema), "the first line created")
            locker.execute(f'LOCK TABLE "{schema}".message IN ACCESS EXCLUSIVE MODE')
            proc.stdin.write(b"x\ny\n")
            proc.stdin.flush()
            _wait_for(lambda: _waits_for_message_table(dsn, schema), "the batch sent, waiting")
            proc.send_signal(sig)
            time.sleep(0.3)
            locker.rollback()
        out, err = proc.communicate(b"z\n", timeout=60)
    finally:
        proc.kill()
    return proc, out, err


def test_json_prints_every_committed_message_when_a_signal_waits_for_the_batch(
    dsn: str, schema_name: str
) -> None:
    """The batch in flight when SIGTERM came is committed, counted on stderr, and its results
    printed (they were not: ``--json`` printed fewer ids than were committed)."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc, out, err = _signal_during_a_batch(dsn, schema_name, signal.SIGTERM, "--json")
    assert proc.returncode == 130, err
    said = re.search(rb"stopped after the first (\d+) messages", err)
    assert said is not None, err
    assert int(said[1]) == len(_contents(dsn, schema_name)) == 3
    printed = [json.loads(line) for line in out.splitlines()]
    assert len(printed) == 3, (out, err)


def test_an_ignored_sigint_is_still_ignored_during_a_batch(dsn: str, schema_name: str) -> None:
    """A command started with SIGINT ignored (a background job of a script, ``trap '' INT``)
    keeps ignoring it while a batch is sent, as it does while it waits for input (a handler
    that held signals back during the batch was installed over SIG_IGN)."""
    assert _run_in(dsn, schema_name, "install").returncode == 0
    proc, _, err = _signal_during_a_batch(dsn, schema_name, signal.SIGINT, ignore=True)
    assert proc.returncode == 0, err
    assert len(_contents(dsn, schema_name)) == 4


def test_a_long_line_is_read_in_linear_time(monkeypatch: Any) -> None:
    """A 32 MiB line (the payload limit is 64 MiB) is read in well under a second. Joining and
    splitting all that was pending at every 64 KiB read took 12-19 s."""
    size = 32 << 20
    r, w = os.pipe()

    def writer() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(b"x" * size + b"\n")

    threading.Thread(target=writer, daemon=True).start()
    saved = os.dup(0)
    os.dup2(r, 0)
    os.close(r)
    lines: queue.Queue[Any] = queue.Queue()
    try:
        with open(0, closefd=False) as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)  # pytest replaced it
            started = time.monotonic()
            cli._read_stdin(lines)
            took = time.monotonic() - started
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    number, line = lines.get_nowait()
    assert (number, len(line)) == (1, size)
    assert took < 3.0, f"a 32 MiB line took {took:.1f} s"


def test_migrate_print_refuses_a_bad_schema_name(dsn: str) -> None:
    for bad in ("", "1bad", "pg_evil", 'a"b'):
        result = _run(dsn, "--schema", bad, "migrate", "--print")
        assert result.returncode != 0, bad
        assert "schema" in result.stderr
        assert result.stdout == ""


def test_create_refuses_contradictory_options(dsn: str, schema_name: str) -> None:
    assert _run_in(dsn, schema_name, "install").returncode == 0
    both = _run_in(dsn, schema_name, "create", "a", "--dequeue-at", "1", "--delay-ms", "5")
    _assert_refused(both, "not both")
    dedup = _run_in(dsn, schema_name, "create", "a", "b", "--dedup-key", "k")
    _assert_refused(dedup, "exactly one message")


def test_policy_set_show_clear(dsn: str, schema_name: str) -> None:
    assert _run_in(dsn, schema_name, "install").returncode == 0
    set_ = _run_in(
        dsn,
        schema_name,
        "policy",
        "set",
        "p",
        "--max-concurrency",
        "2",
        "--release-interval-ms",
        "50",
    )
    assert set_.returncode == 0, set_.stderr
    # Each change says what is in force now, as read back from the queue.
    assert set_.stdout == (
        "channel 'p': policy set; in force now: max_concurrency=2, release_interval_ms=50\n"
    )
    shown = _run_in(dsn, schema_name, "policy", "show", "--json")
    assert [json.loads(line) for line in shown.stdout.splitlines()] == [
        {"channel": "p", "max_concurrency": 2, "release_interval_ms": 50, "max_size": None}
    ]
    bad = _run_in(dsn, schema_name, "policy", "set", "p", "--max-size", "-1")
    assert bad.returncode == 1
    assert "InvalidPolicyError" in bad.stderr
    assert bad.stdout == ""
    # A policy set is whole: the limits not given are gone.
    narrowed = _run_in(dsn, schema_name, "policy", "set", "p", "--max-size", "7")
    assert narrowed.stdout == "channel 'p': policy set; in force now: max_size=7\n"
    cleared = _run_in(dsn, schema_name, "policy", "clear", "p")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout == "channel 'p': policy cleared; in force now: no limits\n"
    assert _run_in(dsn, schema_name, "policy", "show").stdout == ""
    # A channel that holds messages keeps its row when its policy goes: still read back.
    assert _run_in(dsn, schema_name, "create", "--channel", "held", "m").returncode == 0
    assert _run_in(dsn, schema_name, "policy", "set", "held", "--max-concurrency", "0").stdout == (
        "channel 'held': policy set; in force now: max_concurrency=0\n"
    )
    assert _run_in(dsn, schema_name, "policy", "clear", "held").stdout == (
        "channel 'held': policy cleared; in force now: no limits\n"
    )


def test_maintain_vacuums_what_needs_it(
    dsn: str, make_queue: Any, churn: Callable[[Any, int, int], None]
) -> None:
    # The command's outcomes in both forms. (Whether a VACUUM leaves nothing due behind is
    # tests/sql/test_maintenance.py's business: it needs a database of its own.) A session
    # holds a snapshot older than the churns, so that no VACUUM removes their dead rows
    # whatever else runs on the server, and the compactions are known: channel (3,600 and
    # then 1,100 dead row versions, from 1,000) but never message (6,000, then 8,000 in all,
    # under 10,000).
    queue = make_queue()
    idle = _run_in(dsn, queue.schema, "maintain")
    assert idle.stdout.strip() == "nothing to do (or not the tables' owner)"
    assert json.loads(_run_in(dsn, queue.schema, "maintain", "--json").stdout) == {
        "vacuumed": [],
        "compacted": [],
    }
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        churn(queue, 3_000, 600)
        done = _run_in(dsn, queue.schema, "maintain")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "vacuumed: channel, message\ncompacted: channel\n"
        churn(queue, 1_000, 100)
        again = _run_in(dsn, queue.schema, "maintain", "--json")
        assert json.loads(again.stdout) == {
            "vacuumed": ["channel", "message"],
            "compacted": ["channel"],
        }
        holder.execute("ROLLBACK")


def test_worker_command_runs_a_handler_until_idle(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    (tmp_path / "cli_handlers.py").write_text(
        "seen = []\n"
        "def handle(message):\n"
        "    if message.content == b'bad':\n"
        "        raise ValueError('bad message')\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "LONNYMQ_MAX_ATTEMPTS": "1"}
    assert _run_in(dsn, schema_name, "install", "--archive").returncode == 0
    assert _run_in(dsn, schema_name, "create", "ok1", "ok2", "bad").returncode == 0
    worked = _run_in(dsn, schema_name, "worker", "cli_handlers:handle", "--until-idle", env=env)
    assert worked.returncode == 0, worked.stderr
    stats = json.loads(worked.stdout.splitlines()[-1])
    assert (stats["completed"], stats["failed"]) == (2, 1)
    missing = _run_in(dsn, schema_name, "worker", "cli_handlers:nope", env=env)
    _assert_refused(missing, "cannot load handler")
    # The installed script finds a handler module in the current directory, as `python -m`.
    assert _run_in(dsn, schema_name, "create", "ok3").returncode == 0
    script = Path(sys.executable).parent / "lonnymq"
    here = subprocess.run(
        [str(script), "--schema", schema_name, "worker", "cli_handlers:handle", "--until-idle"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "LONNYMQ_DSN": dsn},
        timeout=240,
        check=False,
    )
    assert here.returncode == 0, here.stderr
    assert json.loads(here.stdout.splitlines()[-1])["completed"] == 1


def test_output_into_a_closed_pipe_ends_quietly(dsn: str, schema_name: str) -> None:
    # `lonnymq stats | head -1` ended in a BrokenPipeError traceback.
    assert _run(dsn, "--schema", schema_name, "install").returncode == 0
    with Queue(dsn, schema=schema_name) as queue:
        queue.create_many(NewMessage(b"x", channel=f"channel-{i:05}") for i in range(5_000))
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    process = subprocess.Popen(
        [sys.executable, "-m", "lonnymq.cli", "--schema", schema_name, "stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    assert process.stdout.readline()  # the header, then the reader goes away
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert b"Traceback" not in stderr, stderr.decode()
    assert process.returncode == 141


@pytest.mark.own_server
def test_sigterm_stops_a_command_and_the_embedded_server_it_started(tmp_path: Path) -> None:
    # `timeout 5 lonnymq top` left the embedded server running: the default action of SIGTERM
    # killed the command before it could stop the server.
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "LONNYMQ_DSN"}
    env["LONNYMQ_DATA_DIR"] = str(data)
    env["PYTHONUNBUFFERED"] = "1"  # each view as it is printed
    # Installed, and one message so that each view prints a line.
    for command in (["install"], ["create", "x", "--channel", "a"]):
        done = _cli(*command, env=env)
        assert done.returncode == 0, done.stderr
    process = subprocess.Popen(
        [sys.executable, "-m", "lonnymq.cli", "top", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline()  # a first view: the server is up
        pid_file = data / "postmaster.pid"
        server = int(pid_file.read_text().split()[0])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 130
        deadline = time.monotonic() + 30
        while _alive(server):
            assert time.monotonic() < deadline, "the embedded server was left running"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_with_an_unreachable_server_is_a_clean_error() -> None:
    # bench talks to the server directly: a bad DSN ended in psycopg's traceback.
    env = {k: v for k, v in os.environ.items() if k != "LONNYMQ_DSN"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lonnymq.cli",
            "bench",
            "--quick",
            "--dsn",
            "postgresql://postgres@127.0.0.1:1/postgres",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("lonnymq: DatabaseUnavailableError: connection failed")
