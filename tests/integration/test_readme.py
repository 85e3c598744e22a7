"""The README's code is the examples' (which tests/docs runs), and its links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_each_python_block_is_an_example_file() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text("utf-8"), flags=re.DOTALL)
    examples = {p.read_text("utf-8"): p.name for p in (ROOT / "examples").glob("*.py")}
    assert [examples.get(b) for b in blocks] == ["quickstart.py", "worker.py"]


def test_local_links_lead_to_files() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text("utf-8"))
    local = [link for link in links if "://" not in link]
    assert local
    # docs/performance.md is written with the benchmarks.
    missing = [n for n in local if not (ROOT / n).exists() and n != "docs/performance.md"]
    assert not missing
