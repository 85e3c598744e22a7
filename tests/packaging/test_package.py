"""The package as a user gets it: the source tree built into a wheel and an sdist, the wheel
installed (with the demo extra) into a clean virtual environment, and its ``lonnymq`` command
run from a directory outside the checkout, so that nothing can come from the source tree.

pip's cache makes the install quick after the first run (Spark is most of it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

import lonnymq
from lonnymq.migrate import latest_version

ROOT = Path(__file__).resolve().parents[2]
DEMO_ROWS = 200  # its time is Spark's start and steps, whatever the size


def _source_files() -> list[str]:
    """The files of the source tree, as git sees them: tracked, or new and not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return [
        name
        for name in listed.stdout.decode().split("\0")
        if name and (ROOT / name).is_file()  # a file deleted but not yet staged is listed
    ]


def _run(
    command: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without what would point the installed package back at this checkout
    or this test run (its virtual environment, its Python path, its Spark and lonnymq
    settings)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("LONNYMQ_", "PYSPARK_", "PYTHON", "VIRTUAL_ENV"))
    }
    return {**env, **extra}


@pytest.mark.slow
@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_the_wheel_installs_and_its_command_works_from_anywhere(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()

    # Build from a copy of the source tree: the checkout stays as it is (the build writes
    # egg-info next to the sources), and two test runs can build side by side.
    files = _source_files()
    tree = tmp_path / "tree"
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    dist = tmp_path / "dist"
    # The wheel is built from the sdist: a file the sdist missed would be missing from both.
    _run([sys.executable, "-m", "build", "--outdir", dist, tree], cwd=tmp_path, env=_clean_env())
    (wheel,) = dist.glob("lonnymq-*.whl")
    (sdist,) = dist.glob("lonnymq-*.tar.gz")
    timings["build"] = time.monotonic() - started

    # Every .sql file of the package's source, its py.typed and the dashboard's templates and
    # static files are in both.
    dashboard = ("src/lonnymq/dashboard/templates/", "src/lonnymq/dashboard/static/")
    package_data = sorted(
        name.removeprefix("src/")
        for name in files
        if name.startswith("src/lonnymq/")
        and (name.endswith((".sql", "py.typed")) or name.startswith(dashboard))
    )
    assert "lonnymq/py.typed" in package_data
    assert "lonnymq/dashboard/static/htmx.min.js" in package_data
    assert "lonnymq/dashboard/templates/overview.html" in package_data
    assert sum(name.endswith(".sql") for name in package_data) >= 3
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    assert [name for name in package_data if name not in in_wheel] == []
    assert "pyspark_lonnymq.py" in in_wheel
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        in_sdist = {name.removeprefix(f"{top}/src/") for name in archive.getnames()}
    assert [name for name in package_data if name not in in_sdist] == []

    # A clean virtual environment, the wheel and the demo's extra installed into it.
    mark = time.monotonic()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path, env=_clean_env())
    bin_dir = venv / "bin"
    _run(
        [
            bin_dir / "python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            f"{wheel}[demo]",
        ],
        cwd=tmp_path,
        env=_clean_env(),
        timeout=900,
    )
    timings["install"] = time.monotonic() - mark

    # Everything below runs in a directory of its own, far from the checkout.
    work = tmp_path / "work"
    work.mkdir()
    env = _clean_env(LONNYMQ_DSN=dsn, LONNYMQ_SCHEMA=schema_name)
    lonnymq_command = bin_dir / "lonnymq"
    where = _run(
        [bin_dir / "python", "-c", "import lonnymq; print(lonnymq.__file__)"], cwd=work, env=env
    )
    assert Path(where.stdout.strip()).is_relative_to(venv)

    version = _run([lonnymq_command, "--version"], cwd=work, env=env)
    assert version.stdout == f"lonnymq {lonnymq.__version__}\n"
    assert wheel.name.startswith(f"lonnymq-{lonnymq.__version__}-")

    # The schema comes from the SQL inside the wheel; a worker drains what was created.
    mark = time.monotonic()
    installed = _run([lonnymq_command, "install", "--archive"], cwd=work, env=env)
    assert installed.stdout == f"schema {schema_name!r} is at version {latest_version()}\n"
    _run([lonnymq_command, "create", "--channel", "c", "a", "b", "c"], cwd=work, env=env)
    (work / "handlers.py").write_text(
        "def handle(message):\n"
        "    with open('handled.txt', 'a') as out:\n"
        "        out.write(message.content.decode() + '\\n')\n"
    )
    worked = _run(
        [lonnymq_command, "worker", "handlers:handle", "--until-idle", "--concurrency", "2"],
        cwd=work,
        env=env,
        timeout=120,
    )
    assert json.loads(worked.stdout.splitlines()[-1])["completed"] == 3
    assert sorted((work / "handled.txt").read_text().split()) == ["a", "b", "c"]
    timings["worker"] = time.monotonic() - mark

    # The demo, small: Spark in, a Worker and a Spark stream out, a report.
    mark = time.monotonic()
    out = work / "demo"
    options = ["--rows", str(DEMO_ROWS), "--workers", "2", "--batch", "100", "--out", str(out)]
    demo = _run(
        [lonnymq_command, "demo", *options],
        cwd=work,
        env=env,
        timeout=600,
    )
    assert "All checks held." in demo.stdout, demo.stdout
    assert json.loads((out / "report.json").read_text())["rows"] == DEMO_ROWS
    timings["demo"] = time.monotonic() - mark
    print(", ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.items()))
