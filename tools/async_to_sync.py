"""Derive the sync API (``queue.py``) from the async one (``queue_async.py``).

The async file is the source; this script rewrites its names and keywords and writes the
result. ``--check`` exits non-zero when ``queue.py`` is not what the script would write (CI
runs it).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "lonnymq" / "queue_async.py"
TARGET = ROOT / "src" / "lonnymq" / "queue.py"

HEADER = (
    "# Generated from queue_async.py by tools/async_to_sync.py: do not edit.\n"
    "# Change queue_async.py and run `python tools/async_to_sync.py`.\n"
)

# Whole words replaced, in order.
WORDS = [
    ("AsyncConnectionPool", "ConnectionPool"),
    ("AsyncConnection", "Connection"),
    ("AsyncCursor", "Cursor"),
    ("AsyncQueue", "Queue"),
    ("AsyncChannel", "Channel"),
    ("AsyncMessage", "Message"),
    ("AsyncIterator", "Iterator"),
    ("asynccontextmanager", "contextmanager"),
    ("__aenter__", "__enter__"),
    ("__aexit__", "__exit__"),
    ("asyncio.Lock", "threading.Lock"),
    ("import asyncio", "import threading"),
]
# Phrases replaced literally.
PHRASES = [
    ("async def ", "def "),
    ("async with ", "with "),
    ("async for ", "for "),
    ("await ", ""),
    ("The asyncio API", "The sync API"),
    ("asyncio API", "sync API"),
]


def convert(source: str) -> str:
    # A blocking call the async API runs in a thread is a plain call in the sync one:
    # ``await asyncio.to_thread(f, a)`` becomes ``f(a)``, ``await asyncio.to_thread(f)`` ``f()``.
    text = re.sub(r"await asyncio\.to_thread\(([\w.]+)\)", r"\1()", source)
    text = re.sub(r"await asyncio\.to_thread\(([\w.]+), ", r"\1(", text)
    # A helper with a sync twin: ``await _core.f_async(a)`` becomes ``_core.f(a)``.
    text = re.sub(r"await _core\.(\w+)_async\(", r"_core.\1(", text)
    for old, new in WORDS:
        text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    for old, new in PHRASES:
        text = text.replace(old, new)
    # The docstring's first paragraph explains the derivation from the other side.
    text = text.replace(
        "This file is the source of ``queue.py`` (the sync API): ``tools/async_to_sync.py`` "
        "derives\nit, and CI checks that the two agree. Keep the code here in the shapes "
        "that script knows.",
        "Derived from ``queue_async.py``; see the header.",
    )
    return HEADER + text


def _ruff(args: list[str], text: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(TARGET), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"ruff {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def formatted(text: str) -> str:
    """Sort imports and format with ruff, so the derived file is as tidy as its source."""
    return _ruff(["format"], _ruff(["check", "--select", "I", "--fix", "--quiet"], text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if queue.py is out of date")
    args = parser.parse_args()
    expected = formatted(convert(SOURCE.read_text("utf-8")))
    if args.check:
        if TARGET.read_text("utf-8") != expected:
            print(f"{TARGET} is out of date: run python tools/async_to_sync.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(expected, "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
