"""Makes ``format("lonnymq")`` work in any Spark session without registering anything.

PySpark registers the ``DefaultSource`` of every importable top-level module whose name
starts with ``pyspark_``; this module is that hook for :mod:`lonnymq.spark`.
"""

from lonnymq.spark import LonnyMQDataSource as DefaultSource

__all__ = ["DefaultSource"]
