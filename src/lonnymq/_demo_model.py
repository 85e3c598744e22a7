"""The demo's dataset and its report (see :mod:`lonnymq.demo`): the tenants, which orders
get a notification and which of those fail, and what the report holds per queue and tenant.

The demo's two halves share these: :mod:`lonnymq.demo` (the Python side, which runs the
pipeline) and :mod:`lonnymq.spark.demo` (the Spark steps). It imports nothing from lonnymq,
so that the Spark steps depend on it and not on the pipeline that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "MAX_ATTEMPTS",
    "NOTIFY_MIN_CENTS",
    "PERMANENT_EVERY",
    "TENANTS",
    "TRANSIENT_EVERY",
    "QueueReport",
    "Tenant",
    "TenantReport",
    "policies",
    "policy_text",
    "send_failure",
]

NOTIFY_MIN_CENTS = 200_000
"""Orders of this amount or more get a confirmation e-mail (about 7% of them)."""
TRANSIENT_EVERY = 20
"""The first attempt at the notification of every 20th order fails (a mail server timeout)."""
PERMANENT_EVERY = 400
"""Notifications to every 400th customer always fail (no valid address): failed for good."""
MAX_ATTEMPTS = 3


def send_failure(order_id: int, customer_id: int, attempt: int) -> Exception | None:
    """What sending an order's notification meets at this attempt: no valid address (every
    ``PERMANENT_EVERY``-th customer, every attempt), a mail server timeout (the first attempt
    of every ``TRANSIENT_EVERY``-th order), or ``None`` when it is sent."""
    if customer_id % PERMANENT_EVERY == 0:
        return ValueError(f"customer {customer_id} has no valid e-mail address")
    if order_id % TRANSIENT_EVERY == 0 and attempt == 1:
        return TimeoutError("the mail server timed out")
    return None


@dataclass(frozen=True)
class Tenant:
    """A tenant of the dataset: its share of the orders and its notification channel's policy
    (``max_concurrency`` and ``max_size`` are filled in per run)."""

    name: str
    share: float
    policy: str  # "", "max_concurrency", "release_interval_ms" or "max_size"


TENANTS = (
    Tenant("tenant-big", 0.62, "max_concurrency"),
    Tenant("tenant-mid", 0.20, ""),
    Tenant("tenant-small", 0.08, ""),
    Tenant("tenant-rate", 0.05, "release_interval_ms"),
    Tenant("tenant-capped", 0.05, "max_size"),
)
RELEASE_INTERVAL_MS = 20


def policies(workers: int, offered: dict[str, int]) -> dict[str, dict[str, int]]:
    """The notification channels' policies: the big tenant never takes the last two workers,
    one tenant is rate limited, and one may hold only half of its notifications (the rest
    are dropped at ingestion: back-pressure)."""
    result: dict[str, dict[str, int]] = {}
    for tenant in TENANTS:
        if tenant.policy == "max_concurrency":
            result[tenant.name] = {"max_concurrency": max(1, workers - 2)}
        elif tenant.policy == "release_interval_ms":
            result[tenant.name] = {"release_interval_ms": RELEASE_INTERVAL_MS}
        elif tenant.policy == "max_size":
            result[tenant.name] = {"max_size": max(1, offered.get(tenant.name, 0) // 2)}
        else:
            result[tenant.name] = {}
    return result


def policy_text(policy: dict[str, int]) -> str:
    """``policy`` as ``name=value, …`` (``-`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in policy.items()) or "-"


# -- the report (filled in by lonnymq.spark.demo from the archives) ------------------------


@dataclass
class TenantReport:
    """One tenant's messages in one queue, as the archive tells."""

    tenant: str
    policy: str
    messages: int
    failed: int
    retries: int
    throughput: float
    """Messages per second from the start of the drain until the tenant was done."""
    p50_ms: float
    p95_ms: float
    p99_ms: float
    """Latency: finished_at - created_at."""
    done_s: float
    """When its last message was finished, in seconds after the drain started."""
    fifo_done_s: float
    """The same for one FIFO queue serving the orders in the order they came, at the same
    overall rate: an estimate."""
    min_gap_ms: int | None
    """The smallest gap between two dequeues (of final attempts) of the channel."""


@dataclass
class QueueReport:
    """One queue's archive, per tenant, with completions over time for the chart."""

    title: str
    schema: str
    messages: int
    span_s: float
    throughput: float
    tenants: list[TenantReport]
    timeline: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per tenant: (seconds after the drain started, messages finished by then)."""
