"""The dashboard's ASGI application: pages rendered on the server (Jinja2, every value
escaped), refreshed in place by htmx, which is served from the package (nothing is fetched
from the internet)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs, quote

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import schedule as _schedule
from ..errors import InvalidArgumentError, LonnyMQError, MessageError, PermissionDeniedError
from ..queue_async import AsyncQueue

PAGE_SIZE = 50
# A channel without a policy keeps no counter: its waiting messages are counted, up to this.
COUNT_CAP = 10_000
PREVIEW_BYTES = 200
# Failures are counted over this window of the archive (the failure rate is its count / it).
FAILED_WINDOW_MS = 10_000
# The overview samples the queue at most this often, whoever asks, and keeps this many samples;
# a reading that takes long (counting 10^6 waiting messages) is taken less often, so that the
# dashboard spends at most about 1/SAMPLE_COST_SHARE of its time reading.
SAMPLE_EVERY_S = 1.0
SAMPLE_COST_SHARE = 10
SAMPLES_KEPT = 300
# Of the channels the workers' reports name, the dashboard keeps the rates of at most this many
# (those taken from most) in each reading.
SERVICE_KEPT = 1_000
# Finish rates are taken over about this span of samples: PostgreSQL publishes a backend's
# row counts at most about once a second, so a rate over one second would jump.
RATE_SPAN_MS = 5_000
TOKEN_COOKIE = "lonnymq_dashboard_token"
# What an action's confirmation form stays good for.
CONFIRM_TTL_S = 600
# The actions on a channel, and what each asks before it runs.
ACTIONS = {
    "pause": "Pause channel {name}: no message of it is taken until it is resumed (its "
    "max_concurrency becomes 0, and is remembered; its other limits stay).",
    "resume": "Resume channel {name}: its messages are taken again, under the concurrency limit "
    "it had when it was paused here (none if it was paused otherwise; its other limits stay).",
    "set": "Set the policy of channel {name} to: {policy}. Limits left empty are removed.",
    "clear": "Remove the policy of channel {name}: no limit from now on.",
    "discard": "Delete message {id} of channel {name}, which waits: it is removed for good "
    "(the archive, when it is on, keeps it with outcome discarded).",
    "expedite": "Make message {id} of channel {name} due now: it leaves after the messages "
    "already due in its channel.",
}
# The actions on one waiting message of a channel (the others are on the channel).
MESSAGE_ACTIONS = ("discard", "expedite")
POLICY_FIELDS = ("max_concurrency", "release_interval_ms", "max_size")
# What an action's signature covers: every field a confirmation form carries.
SIGNED = ("action", "name", "id", "ids", "expires", *POLICY_FIELDS)
REPLAY = (
    "Replay {count} archived message(s) ({ids}): each is created again in its channel, due "
    "now, with its attempts from zero. A message replayed before is not replayed again."
)
# At most this many archived messages are replayed by one confirmation.
REPLAY_MAX = 1000
# The archive page walks at most this many archived rows per page (a filter few of them
# match then offers to walk on), and shows at most this much of an error.
ARCHIVE_SCAN_CAP = 10_000
ERROR_CHARS = 16_384
# The workers page lists at most this many workers (the table keeps an hour of them); one that
# missed this many of its reports (plus the slack, for a slow round) is shown as gone.
WORKERS_SHOWN = 1000
GONE_ROUNDS = 3
GONE_SLACK_MS = 2_000
# A schedule's spec holds the content it creates: one longer than this is not fetched.
SPEC_BYTES = 1 << 20
REPLAY_STATUSES = ("replayed", "already", "dropped", "not_found")
log = logging.getLogger("lonnymq.dashboard")
SORTS = ("name", "-name", "due")
HEADERS = {
    # Scripts and styles from the dashboard only: an injected tag would not run.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Sample:
    """One reading of ``dashboard_overview``."""

    at_ms: int
    waiting: int
    due: int
    scheduled: int
    locked: int
    lag_ms: int | None
    finished_total: int
    failed_recent: int
    archive: bool


T = TypeVar("T")


class Readings(Generic[T]):
    """Readings taken by ``read`` at most every ``SAMPLE_EVERY_S``, whoever asks (so many open
    pages cost the database one reading; a slow reading is taken less often), the last
    ``SAMPLES_KEPT`` kept in a ring in memory."""

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self._read = read
        self._kept: deque[T] = deque(maxlen=SAMPLES_KEPT)
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def latest(self) -> T:
        async with self._lock:
            if not self._kept or time.monotonic() >= self._next:
                started = time.monotonic()
                self._kept.append(await self._read())
                took = time.monotonic() - started
                self._next = started + max(SAMPLE_EVERY_S, took * SAMPLE_COST_SHARE)
            return self._kept[-1]

    def kept(self) -> list[T]:
        return list(self._kept)


class Sampler(Readings[Sample]):
    """The overview's readings: the rates are the counters' growth between readings, so
    nothing is written per message to get them."""

    def __init__(self, queue: AsyncQueue) -> None:
        async def read() -> Sample:
            rows = await queue._fetch("dashboard_overview", {"window_ms": FAILED_WINDOW_MS}, None)
            return Sample(*rows[0])

        super().__init__(read)

    def rates(self) -> list[tuple[int, float, float]]:
        """(time, finished per second, failed per second) at each reading that has one
        about ``RATE_SPAN_MS`` before it."""
        samples = self.kept()
        out: list[tuple[int, float, float]] = []
        start = 0
        for sample in samples[1:]:
            while samples[start + 1].at_ms <= sample.at_ms - RATE_SPAN_MS:
                start += 1
            first = samples[start]
            if first is sample or sample.at_ms <= first.at_ms:
                continue
            seconds = (sample.at_ms - first.at_ms) / 1000
            # A statistics reset makes the counter go back: no rate across it.
            finished = max(0, sample.finished_total - first.finished_total) / seconds
            out.append((sample.at_ms, finished, sample.failed_recent * 1000 / FAILED_WINDOW_MS))
        return out


@dataclass(frozen=True)
class Service:
    """What the live workers took per second, channel by channel, as their last reports say
    (each covers the time since the worker's report before)."""

    at_ms: int
    # The channels the reports name (the SERVICE_KEPT taken from most), and their rates.
    rates: dict[str, float]
    # From every channel, named or not.
    total: float
    # True when the reports name every channel taken from: any other took none.
    complete: bool
    workers: int

    def rate(self, channel: str) -> float | None:
        """Messages of ``channel`` taken per second; None when no report names it but some
        took from channels they do not name."""
        rate = self.rates.get(channel)
        if rate is None and self.complete:
            return 0.0
        return rate

    def share(self, channel: str) -> float | None:
        """``channel``'s part of everything taken (0 to 1); None when nothing was taken or
        its rate is not known."""
        rate = self.rate(channel)
        return None if rate is None or self.total <= 0 else rate / self.total


def service(workers: Sequence[dict[str, Any]]) -> Service:
    """The service the alive ``workers`` (rows of ``_worker_row``) report."""
    rates: dict[str, float] = {}
    total = 0.0
    complete = True
    counted = 0
    now_ms = 0
    for worker in workers:
        now_ms = worker["now_ms"]
        if worker["state"] != "alive" or worker["served_ms"] <= 0:
            continue
        counted += 1
        per_s = 1000 / worker["served_ms"]
        for channel, count in zip(worker["served_channels"], worker["served_counts"], strict=True):
            rates[channel] = rates.get(channel, 0.0) + count * per_s
        total += (sum(worker["served_counts"]) + worker["served_other"]) * per_s
        complete = complete and worker["served_other"] == 0
    if len(rates) > SERVICE_KEPT:
        rates = dict(sorted(rates.items(), key=lambda item: -item[1])[:SERVICE_KEPT])
        complete = False
    return Service(now_ms, rates, total, complete, counted)


class ServiceSampler(Readings[Service]):
    """The channels' service as the workers report it, read with the workers' table. A
    reading taken before any worker reported again shares the rates of the one before (the
    rates change once a heartbeat round, the readings once a second)."""

    def __init__(self, queue: AsyncQueue) -> None:
        last: list[tuple[tuple[Any, ...], Service]] = []

        async def read() -> Service:
            rows = await queue._fetch("dashboard_workers", {"limit": WORKERS_SHOWN}, None)
            if not rows:
                return Service(await queue.now(), {}, 0.0, True, 0)
            listed = [_worker_row(row) for row in rows]
            reports = tuple((w["id"], w["seen_at"], w["state"]) for w in listed)
            if last and last[0][0] == reports:
                return dataclasses.replace(last[0][1], at_ms=listed[0]["now_ms"])
            last[:] = [(reports, service(listed))]
            return last[0][1]

        super().__init__(read)

    def shares(self, channel: str) -> list[tuple[int, float | None]]:
        """(time, ``channel``'s share) at each kept reading."""
        return [(s.at_ms, s.share(channel)) for s in self.kept()]


def shown(value: str, lines: bool = False) -> str:
    """``value`` with what would not show as itself (control and format characters, such as
    a right-to-left override) written as escapes, line breaks kept when ``lines``; HTML
    escaping is still the template's."""
    kept = "\n" if lines else ""
    return "".join(c if c.isprintable() or c in kept else f"\\u{ord(c):04x}" for c in value)


def last_line(text: str | None) -> str:
    """An error's last non-empty line: the exception and its message, under the traceback."""
    if not text:
        return "-"
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return "-"


def preview(data: bytes | None, length: int | None) -> str:
    """A safe one-line view of a payload: its text when it is UTF-8, else its bytes in hex."""
    if data is None:
        return "-"
    more = "…" if length is not None and length > len(data) else ""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return f"({length} bytes) {bytes(data)[:64].hex(' ')}{'…' if len(data) > 64 else more}"
    return shown(text) + more


def when(ms: int | None, now_ms: int | None = None) -> str:
    """A time in ms since the epoch, in UTC, and how far it is from now."""
    if ms is None:
        return "-"
    stamp = datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
    if now_ms is None:
        return stamp
    return f"{stamp} ({duration(ms - now_ms, signed=True)})"


def duration(ms: int | None, *, signed: bool = False) -> str:
    """A span of ms for people: 850 ms, 12.5 s, 3 min, 2.1 h, 4 d."""
    if ms is None:
        return "-"
    sign = ("in " if ms > 0 else "") if signed else ""
    suffix = " ago" if signed and ms < 0 else ""
    ms = abs(ms)
    if ms < 1000:
        text = f"{ms} ms"
    elif ms < 60_000:
        text = f"{ms / 1000:.1f} s"
    elif ms < 3_600_000:
        text = f"{ms / 60_000:.1f} min"
    elif ms < 86_400_000:
        text = f"{ms / 3_600_000:.1f} h"
    else:
        text = f"{ms / 86_400_000:.1f} d"
    return f"{sign}{text}{suffix}"


def polyline(
    points: Sequence[tuple[int, float]], first: int, span: int, *, top: float, size: tuple[int, int]
) -> str:
    """SVG polyline points for ``(time, value)`` pairs: time from ``first`` over ``span`` ms
    across the ``size``'s width, value from 0 to ``top`` up its height."""
    return " ".join(
        f"{(at - first) * size[0] / span:.1f},{size[1] - value * size[1] / top:.1f}"
        for at, value in points
    )


def chart_points(
    rates: Sequence[tuple[int, float, float]], width: int, height: int
) -> dict[str, Any]:
    """SVG polyline points for the finish and failure rates over the kept span."""
    size = (width, height)
    if not rates:
        return {"finished": "", "failed": "", "top": 0.0}
    first, span = rates[0][0], max(rates[-1][0] - rates[0][0], 1)
    top = max(*(r[1] for r in rates), *(r[2] for r in rates), 1.0)
    return {
        "finished": polyline([(r[0], r[1]) for r in rates], first, span, top=top, size=size),
        "failed": polyline([(r[0], r[2]) for r in rates], first, span, top=top, size=size),
        "top": top,
    }


class TokenGate:
    """Lets a request through when it carries the token: as ``Authorization: Bearer``, as the
    cookie set when a page was opened with ``?token=``, or as that query parameter (which
    then redirects to the same page without it, so the token leaves the address bar)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._token = token.encode()

    @property
    def routes(self) -> list[BaseRoute]:
        """The dashboard's routes: a ``Mount`` of this gate in another application finds them
        here when a page builds its links (``url_for``)."""
        return list(getattr(self._app, "routes", []))

    def _good(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(candidate.encode(), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request = Request(scope)
        bearer = request.headers.get("authorization", "")
        if self._good(bearer.removeprefix("Bearer ")) if bearer.startswith("Bearer ") else False:
            await self._app(scope, receive, send)
            return
        if self._good(request.cookies.get(TOKEN_COOKIE)):
            await self._app(scope, receive, send)
            return
        if self._good(request.query_params.get("token")):
            response: Response = RedirectResponse(
                str(request.url.remove_query_params("token")), status_code=303
            )
            response.set_cookie(
                TOKEN_COOKIE,
                request.query_params["token"],
                httponly=True,
                samesite="strict",
                path=scope.get("root_path") or "/",
            )
            await response(scope, receive, send)
            return
        response = PlainTextResponse(
            "This dashboard needs its token: open it with ?token=... once, or send "
            "Authorization: Bearer ...",
            status_code=401,
        )
        await response(scope, receive, send)


def app(queue: AsyncQueue, *, read_only: bool = False, token: str | None = None) -> ASGIApp:
    """The dashboard of ``queue`` as an ASGI application, to serve alone (``lonnymq
    dashboard``) or to mount in your own (``Mount("/queue", app=dashboard.app(queue))``).
    ``token``: every request must carry it (see the docs). ``read_only``: the dashboard only
    shows. The queue must be open for as long as the application serves."""
    if not isinstance(queue, AsyncQueue):
        raise InvalidArgumentError(f"queue must be an AsyncQueue, got {type(queue).__name__}")
    if token is not None and (not isinstance(token, str) or not token):
        raise InvalidArgumentError("token must be a non-empty string, or None for no token")
    env = Environment(
        loader=PackageLoader("lonnymq.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters.update(
        shown=shown, duration=duration, preview=preview, when=when, last_line=last_line
    )
    sampler = Sampler(queue)
    services = ServiceSampler(queue)
    # The channel sizes each page last showed, for the net rate the next refresh shows.
    seen: dict[str, tuple[int, int]] = {}

    def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        html = env.get_template(template).render(
            request=request,
            url=lambda route, **query: _url(request, route, query),
            schema=queue.schema,
            read_only=read_only,
            **context,
        )
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    async def overview(request: Request) -> Response:
        sample = await sampler.latest()
        return render(request, "overview.html", **_overview_context(sampler, sample))

    async def overview_live(request: Request) -> Response:
        sample = await sampler.latest()
        return render(request, "_overview_live.html", **_overview_context(sampler, sample))

    async def channels(request: Request) -> Response:
        query = request.query_params
        sort = query.get("sort", "name")
        if sort not in SORTS:
            return render(request, "error.html", 400, message=f"unknown sort {sort!r}")
        search = query.get("q") or None
        after_name = query.get("after") or None
        after_due = _int(query.get("after_due"))
        rows = await queue._fetch(
            "dashboard_channels",
            {
                "sort": sort,
                "after_name": after_name,
                "after_due": after_due,
                "search": search,
                "limit": PAGE_SIZE + 1,
                "count_cap": COUNT_CAP,
                "only": None,
            },
            None,
        )
        page = [_channel_row(row) for row in rows[:PAGE_SIZE]]
        now_ms = (await sampler.latest()).at_ms
        _net_rates(page, seen, now_ms)
        served = await services.latest()
        for row in page:
            row["served_rate"] = served.rate(row["channel"])
        following = None
        if len(rows) > PAGE_SIZE:
            last = page[-1]
            following = {"sort": sort, "q": search or "", "after": last["channel"]}
            if sort == "due":
                following["after_due"] = str(last["next_dequeue_at"])
        return render(
            request,
            "channels.html",
            channels=page,
            sort=sort,
            search=search or "",
            paged=after_name is not None,
            following=following,
            now_ms=now_ms,
        )

    async def channel(request: Request) -> Response:
        name = request.query_params.get("name", "")
        view = request.query_params.get("view", "waiting")
        if view not in ("waiting", "locked"):
            return render(request, "error.html", 400, message=f"unknown view {view!r}")
        try:
            rows = await queue._fetch("dashboard_channels", _only(name), None)
            messages = await queue._fetch(
                "dashboard_channel_messages",
                {
                    "channel": name,
                    "locked": view == "locked",
                    "after_at": _int(request.query_params.get("after_at")),
                    "after_id": _int(request.query_params.get("after_id")),
                    "limit": PAGE_SIZE + 1,
                    "preview_bytes": PREVIEW_BYTES,
                },
                None,
            )
        except InvalidArgumentError as err:
            return render(request, "error.html", 400, message=str(err))
        info = _channel_row(rows[0]) if rows else None
        listed = [_message_row(row) for row in messages[:PAGE_SIZE]]
        following = None
        if len(messages) > PAGE_SIZE:
            last = listed[-1]
            at = last["unlock_at"] if view == "locked" else last["dequeue_at"]
            following = {"name": name, "view": view, "after_at": at, "after_id": last["id"]}
        return render(
            request,
            "channel.html",
            name=name,
            info=info,
            view=view,
            messages=listed,
            following=following,
            # The clock once the messages were read: only a message due after it offers "due now".
            now_ms=await queue.now(),
            done=request.query_params.get("done"),
            **_service_context(services, await services.latest(), name),
        )

    async def channel_live(request: Request) -> Response:
        name = request.query_params.get("name", "")
        latest = await services.latest()
        return render(
            request, "_channel_live.html", name=name, **_service_context(services, latest, name)
        )

    secret = secrets.token_bytes(32)

    def signature(fields: dict[str, str]) -> str:
        text = "\0".join(f"{k}={fields.get(k, '')}" for k in SIGNED)
        return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()

    def refused(request: Request, why: str, status: int, fields: dict[str, str]) -> Response:
        log.warning(
            "dashboard refused %s on %s from %s: %s",
            fields.get("action"),
            _target(fields),
            request.client.host if request.client else "?",
            why,
        )
        return render(request, "error.html", status, message=f"Refused: {why}")

    async def posted(request: Request) -> tuple[dict[str, str], Response | None]:
        """The fields of a confirmed action's form, or the response that refuses it: in
        read-only mode, from another site, or without a valid confirmation."""
        parsed = parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)
        fields = {k: v[0] for k, v in parsed.items() if len(v) == 1}
        if read_only:
            return fields, refused(request, "this dashboard is read-only", 403, fields)
        # A browser names where a request comes from; another site's form is refused.
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return fields, refused(request, f"a request from another site ({site})", 403, fields)
        good = hmac.compare_digest(fields.get("csrf", ""), signature(fields))
        if not good or (_int(fields.get("expires")) or 0) < time.time():
            why = "the confirmation is not valid (expired or forged)"
            return fields, refused(request, why, 403, fields)
        return fields, None

    def confirmation(request: Request, form: dict[str, str], question: str, back: str) -> Response:
        form["expires"] = str(int(time.time()) + CONFIRM_TTL_S)
        form["csrf"] = signature(form)
        return render(request, "confirm.html", question=question, form=form, back=back)

    async def confirm(request: Request) -> Response:
        fields = {
            k: v
            for k, v in request.query_params.items()
            if k in ("action", "name", "id", *POLICY_FIELDS)
        }
        if read_only:
            return refused(request, "this dashboard is read-only", 403, fields)
        try:
            action, name, values = _action(fields)
        except InvalidArgumentError as err:
            return render(request, "error.html", 400, message=str(err))
        form = {"action": action, "name": name}
        form.update({k: "" if v is None else str(v) for k, v in values.items()})
        question = ACTIONS[action].format(
            name=shown(name), policy=_policy_text(values), id=values.get("id")
        )
        return confirmation(request, form, question, _url(request, "channel", {"name": name}))

    async def act(request: Request) -> Response:
        fields, refusal = await posted(request)
        if refusal is not None:
            return refusal
        try:
            action, name, values = _action(fields)
            channel = queue.channel(name)
            if action == "discard":
                await queue._fetch("message_discard", {"id": values["id"], "channel": name}, None)
            elif action == "expedite":
                await queue._fetch("message_expedite", {"id": values["id"], "channel": name}, None)
            elif action == "clear":
                await channel.clear_policy()
            elif action == "set":
                await channel.set_policy(
                    max_concurrency=values["max_concurrency"],
                    release_interval_ms=values["release_interval_ms"],
                    max_size=values["max_size"],
                )
            else:
                statement = "channel_pause" if action == "pause" else "channel_resume"
                await queue._fetch(statement, {"channel": name}, None)
        except PermissionDeniedError as err:
            return refused(request, f"the database role may not do this ({err})", 403, fields)
        except InvalidArgumentError as err:
            return render(request, "error.html", 400, message=str(err))
        except MessageError as err:
            # The message left or was taken since the page showed it.
            return render(request, "error.html", 409, message=f"{type(err).__name__}: {err}")
        detail = "-"
        if action == "set":
            detail = _policy_text(values)
        elif action in MESSAGE_ACTIONS:
            detail = f"message {values['id']}"
        log.info(
            "dashboard %s on channel %r (%s) from %s",
            action,
            name,
            detail,
            request.client.host if request.client else "?",
        )
        return RedirectResponse(_url(request, "channel", {"name": name, "done": action}), 303)

    async def archive(request: Request) -> Response:
        query = request.query_params
        outcome = query.get("outcome") or None
        name = query.get("channel") or None
        rows = await queue._fetch(
            "dashboard_archive",
            {
                "outcome": outcome,
                "channel": name,
                "before_id": _int(query.get("before")),
                "limit": PAGE_SIZE,
                "scan_cap": ARCHIVE_SCAN_CAP,
                "preview_bytes": PREVIEW_BYTES,
                "error_chars": ERROR_CHARS,
            },
            None,
        )
        listed = [_archived_row(row) for row in rows if row[0] is not None]
        following = None
        if rows and rows[-1][0] is None:
            following = {"outcome": outcome, "channel": name, "before": rows[-1][-1]}
        done = {k: _int(query.get(k)) for k in REPLAY_STATUSES if query.get(k)}
        return render(
            request,
            "archive.html",
            archived=listed,
            outcome=outcome or "",
            channel=name or "",
            following=following,
            paged="before" in query,
            archive_on=(await queue.settings()).archive,
            done=done,
            now_ms=(await sampler.latest()).at_ms,
        )

    async def replay_confirm(request: Request) -> Response:
        fields = {"action": "replay", "ids": ",".join(request.query_params.getlist("id"))}
        if read_only:
            return refused(request, "this dashboard is read-only", 403, fields)
        ids = _ids(fields["ids"])
        form = {"action": "replay", "ids": ",".join(map(str, ids))}
        shown_ids = ", ".join(map(str, ids[:10])) + (", …" if len(ids) > 10 else "")
        question = REPLAY.format(count=len(ids), ids=shown_ids)
        return confirmation(request, form, question, _url(request, "archive", {}))

    async def replay(request: Request) -> Response:
        fields, refusal = await posted(request)
        if refusal is not None:
            return refusal
        if fields.get("action") != "replay":
            return render(request, "error.html", 400, message="not a replay's confirmation")
        ids = _ids(fields.get("ids", ""))
        try:
            results = await queue.replay(ids)
        except PermissionDeniedError as err:
            return refused(request, f"the database role may not do this ({err})", 403, fields)
        counts = {k: sum(1 for r in results if r.status == k) for k in REPLAY_STATUSES}
        log.info(
            "dashboard replay of archived messages %s (%s) from %s",
            fields["ids"],
            ", ".join(f"{k} {v}" for k, v in counts.items() if v),
            request.client.host if request.client else "?",
        )
        shown_counts = {k: v for k, v in counts.items() if v}
        return RedirectResponse(_url(request, "archive", shown_counts), 303)

    async def schedules(request: Request) -> Response:
        after = request.query_params.get("after") or None
        rows = await queue._fetch(
            "dashboard_schedules",
            {"after_name": after, "limit": PAGE_SIZE + 1, "spec_bytes": SPEC_BYTES},
            None,
        )
        listed = [_schedule_row(row) for row in rows[:PAGE_SIZE]]
        following = {"after": listed[-1]["name"]} if len(rows) > PAGE_SIZE else None
        return render(
            request,
            "schedules.html",
            schedules=listed,
            following=following,
            paged=after is not None,
            now_ms=await queue.now(),
        )

    async def workers(request: Request) -> Response:
        rows = await queue._fetch("dashboard_workers", {"limit": WORKERS_SHOWN}, None)
        listed = [_worker_row(row) for row in rows]
        return render(
            request,
            "workers.html",
            workers=listed,
            alive=sum(1 for w in listed if w["state"] == "alive"),
            now_ms=listed[0]["now_ms"] if listed else await queue.now(),
        )

    routes = [
        Route("/", overview, name="overview"),
        Route("/workers", workers, name="workers"),
        Route("/schedules", schedules, name="schedules"),
        Route("/archive", archive, name="archive"),
        Route("/archive/replay", replay_confirm, name="replay_confirm"),
        Route("/archive/replay", replay, methods=["POST"], name="replay"),
        Route("/channel/action", confirm, name="confirm"),
        Route("/channel/action", act, methods=["POST"], name="act"),
        Route("/live/overview", overview_live, name="overview_live"),
        Route("/live/channel", channel_live, name="channel_live"),
        Route("/channels", channels, name="channels"),
        Route("/channel", channel, name="channel"),
        Mount(
            "/static",
            app=StaticFiles(packages=[("lonnymq.dashboard", "static")]),
            name="static",
        ),
    ]

    async def failed(request: Request, err: Exception) -> Response:
        status = 500
        if isinstance(err, InvalidArgumentError):
            status = 400
        elif isinstance(err, PermissionDeniedError):
            status = 403
        return render(request, "error.html", status, message=f"{type(err).__name__}: {err}")

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        LonnyMQError: failed
    }
    built: ASGIApp = Starlette(routes=routes, exception_handlers=handlers)
    if token is not None:
        built = TokenGate(built, token)
    return built


def _url(request: Request, route: str, query: dict[str, Any]) -> str:
    """The path of ``route`` (under the mount point), with ``query`` (values percent-encoded,
    empty ones left out)."""
    url = URL(request.url_for(route).path)
    kept = {k: str(v) for k, v in query.items() if v is not None and v != ""}
    if kept:
        url = url.replace(
            query="&".join(f"{quote(k)}={quote(v, safe='')}" for k, v in kept.items())
        )
    return str(url)


def _only(name: str) -> dict[str, Any]:
    """``dashboard_channels``' parameters for one channel."""
    return {
        "sort": "name",
        "after_name": None,
        "after_due": None,
        "search": None,
        "limit": 1,
        "count_cap": COUNT_CAP,
        "only": name,
    }


def _action(fields: dict[str, str]) -> tuple[str, str, dict[str, int | None]]:
    """The action, channel and values (a policy, or a message's id) a form names, checked."""
    action = fields.get("action", "")
    if action not in ACTIONS:
        raise InvalidArgumentError(f"unknown action {action[:40]!r}")
    name = fields.get("name", "")
    if not 1 <= len(name) <= 255:
        raise InvalidArgumentError(f"channel name must be 1 to 255 characters, got {len(name)}")
    policy: dict[str, int | None] = {}
    if action == "set":
        for field in POLICY_FIELDS:
            value = _int(fields.get(field))
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{field} must be 0 or more, got {value}")
            policy[field] = value
    if action in MESSAGE_ACTIONS:
        message_id = _int(fields.get("id"))
        if message_id is None or message_id < 1:
            raise InvalidArgumentError(f"a message id is 1 or more, got {message_id}")
        policy["id"] = message_id
    return action, name, policy


def _target(fields: dict[str, str]) -> str:
    """What an action's form names, for the log."""
    if fields.get("ids"):
        return f"archived messages {fields['ids'][:200]}"
    return f"channel {fields.get('name')!r}"


def _ids(text: str) -> list[int]:
    """The archived message ids a replay names (comma-separated), checked, once each."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise InvalidArgumentError("choose at least one archived message to replay")
    if len(parts) > REPLAY_MAX:
        raise InvalidArgumentError(f"at most {REPLAY_MAX} messages a replay, got {len(parts)}")
    ids: set[int] = set()
    for part in parts:
        value = _int(part)
        if value is None or value < 1:
            raise InvalidArgumentError(f"a message id is 1 or more, got {value}")
        ids.add(value)
    return sorted(ids)


def _policy_text(policy: dict[str, int | None]) -> str:
    return ", ".join(f"{k} {v}" for k, v in policy.items() if v is not None) or "no limit"


def _int(text: str | None) -> int | None:
    """A whole number a request names (a database BIGINT), or None when it names none."""
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"not a whole number: {text[:40]!r}") from None
    if not -(2**63) <= value < 2**63:
        raise InvalidArgumentError(f"a number out of range: {text[:40]!r}")
    return value


def _overview_context(sampler: Sampler, sample: Sample) -> dict[str, Any]:
    rates = sampler.rates()
    return {
        "sample": sample,
        "finished_rate": rates[-1][1] if rates else None,
        "failed_rate": rates[-1][2] if rates else None,
        "chart": chart_points(rates, 600, 120),
        "chart_span_s": round((rates[-1][0] - rates[0][0]) / 1000) if rates else 0,
    }


def _service_context(services: ServiceSampler, latest: Service, name: str) -> dict[str, Any]:
    """A channel's service: its rate and share now, and its share over the kept readings."""
    shares = services.shares(name)
    known = [(at, share) for at, share in shares if share is not None]
    first = shares[0][0] if shares else latest.at_ms
    span = max(latest.at_ms - first, 1)
    return {
        "service": latest,
        "served_rate": latest.rate(name),
        "share": latest.share(name),
        "share_chart": polyline(known, first, span, top=1.0, size=(600, 120)),
        "share_span_s": round(span / 1000),
    }


# The columns of dashboard_channels and dashboard_channel_messages, as the pages name them.
CHANNEL_COLUMNS = (
    "channel", "size", "size_exact", "in_flight", "next_dequeue_at", "has_policy",
    "max_concurrency", "release_interval_ms", "max_size",
)  # fmt: skip


def _schedule_row(row: Sequence[Any]) -> dict[str, Any]:
    """A schedule as the page shows it: its spec read as ``schedules()`` reads it (a spec
    too long to fetch, or unreadable, shows as such)."""
    name, data, length, next_at, state, locked = row
    shown_row: dict[str, Any] = {
        "name": name,
        "next_at": next_at,
        "last_fired_at": _schedule.decode_state(None if state is None else bytes(state)),
        "firing": locked,
        "spec": None,
        "problem": None,
    }
    if data is None:
        shown_row["problem"] = f"its spec is {length:,} bytes, too long to show"
        return shown_row
    try:
        shown_row["spec"] = _schedule.ScheduleSpec.decode(bytes(data))
    except InvalidArgumentError as err:
        shown_row["problem"] = str(err)
    return shown_row


WORKER_COLUMNS = (
    "id", "host", "pid", "started_at", "seen_at", "every_ms", "concurrency", "running",
    "message_ids", "channels", "stopped_at", "served_ms", "served_channels", "served_counts",
    "served_other", "now_ms",
)  # fmt: skip


def _worker_row(row: Sequence[Any]) -> dict[str, Any]:
    """A worker as the page shows it: ``alive``, ``stopped``, or ``gone`` once it has missed
    ``GONE_ROUNDS`` reports (it died, or lost the database)."""
    worker = dict(zip(WORKER_COLUMNS, row, strict=True))
    if worker["stopped_at"] is not None:
        worker["state"] = "stopped"
    elif worker["now_ms"] - worker["seen_at"] > GONE_ROUNDS * worker["every_ms"] + GONE_SLACK_MS:
        worker["state"] = "gone"
    else:
        worker["state"] = "alive"
    worker["messages"] = list(zip(worker["message_ids"], worker["channels"], strict=True))
    taken = sum(worker["served_counts"]) + worker["served_other"]
    worker["taken_rate"] = (
        taken * 1000 / worker["served_ms"]
        if worker["state"] == "alive" and worker["served_ms"] > 0
        else None
    )
    return worker


ARCHIVE_COLUMNS = (
    "id", "channel", "outcome", "num_attempts", "created_at", "finished_at", "error",
    "error_length", "content", "content_length", "replayed_as", "next_before",
)  # fmt: skip
MESSAGE_COLUMNS = (
    "id", "num_attempts", "dequeue_at", "unlock_at", "created_at", "content", "content_length",
    "state", "state_length", "dedup_key",
)  # fmt: skip


def _channel_row(row: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(CHANNEL_COLUMNS, row, strict=True))


def _archived_row(row: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(ARCHIVE_COLUMNS, row, strict=True))


def _message_row(row: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(MESSAGE_COLUMNS, row, strict=True))


SEEN_KEPT = 10_000


def _net_rates(page: list[dict[str, Any]], seen: dict[str, tuple[int, int]], now_ms: int) -> None:
    """Each row's net rate: messages leaving per second (negative: the channel grows) since the
    dashboard last showed that channel (none the first time)."""
    for row in page:
        before = seen.get(row["channel"])
        row["net_rate"] = None
        if before is not None and now_ms > before[0]:
            row["net_rate"] = (before[1] - row["size"]) * 1000 / (now_ms - before[0])
        if before is None or now_ms > before[0]:
            seen[row["channel"]] = (now_ms, row["size"])
    while len(seen) > SEEN_KEPT:
        seen.pop(next(iter(seen)))
