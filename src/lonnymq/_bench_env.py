"""What ``lonnymq bench`` and its Spark section (:mod:`lonnymq.spark.bench`) both need:
whether Spark can run here, a run's own schema names, and dropping the schemas a run made. It
imports nothing from lonnymq, so that the Spark section depends on it and not on the bench that
runs it."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
from pathlib import Path

import psycopg
from psycopg import sql

__all__ = ["drop_schemas", "run_schema", "spark_unavailable"]


def spark_unavailable() -> str | None:
    """Why the Spark figures cannot be measured here (``None``: they can)."""
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (pip install 'lonnymq[spark]')"
    java_home = os.environ.get("JAVA_HOME")
    if not (java_home and Path(java_home, "bin", "java").exists()) and not shutil.which("java"):
        return "no Java runtime (set JAVA_HOME or put java on PATH)"
    return None


def run_schema(prefix: str) -> str:
    """A schema name of this run's own: ``prefix``, this process's pid and a random token.
    Two runs on one server (two test sessions, a bench beside the suite) never share one, so
    neither drops what the other is measuring."""
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"


def drop_schemas(dsn: str, *schemas: str) -> None:
    """Drop ``schemas`` (none: nothing), if they exist."""
    if not schemas:
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
