"""A client for the agent-quotas check API (``/api/v1/``), sync and async. Needs httpx, nothing of Django.

It mirrors the in-process engine (``quotas.engine.QuotaEngine``): the same verbs and the same value
objects (``Decision``, ``LimitState``, ``Settlement``, ``QuotaExceeded``), without the ``org``
argument (the API key says which org). Code written against one moves to the other by changing how
it gets its quota object.

Sync (one ``httpx.Client`` inside: connections are reused; close it, or use ``with``)::

    from quotas.client import QuotaClient, QuotaExceeded

    with QuotaClient("http://127.0.0.1:8000", api_key) as quotas:
        d = quotas.check("agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
        if d.allowed:
            ...  # call the model
            quotas.settle(d.reservation, input_tokens=1200, output_tokens=640)
        else:
            print(d.blocked_by, d.retry_after)          # the limit that blocked; seconds (None: never)

        with quotas.allow("agent-1", tool="web_search") as d:       # QuotaExceeded if refused
            ...
        with quotas.acquire("agent-1", tool="llm_call", timeout=30) as d:   # sleeps Retry-After, retries
            ...
        with quotas.lease("agent-1", ttl_s=300) as lease:           # a concurrency slot, freed on exit
            lease.renew(ttl_s=300)

Async: the same methods, awaited. ``allow``, ``acquire`` and ``lease`` can be awaited or used
directly with ``async with``::

    from quotas.client import AsyncQuotaClient

    async with AsyncQuotaClient("http://127.0.0.1:8000", api_key) as quotas:
        d = await quotas.check("agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
        await quotas.settle(d.reservation, input_tokens=1200, output_tokens=640)

        async with quotas.acquire("agent-1", tool="llm_call", timeout=30) as d:
            ...
        async with quotas.lease("agent-1", ttl_s=300) as lease:
            await lease.renew(ttl_s=300)
        lease = await quotas.lease("agent-1")          # or hold it yourself
        await lease.release()

``check`` never raises for a refusal: it returns a Decision with ``allowed`` False (HTTP 429).
``allow`` raises ``QuotaExceeded`` at once; ``acquire`` (and ``lease`` with a ``timeout``) sleeps
for the refusal's ``retry_after_ms`` (a little more, with jitter) and tries again, and raises
``QuotaExceeded`` when the next attempt would come after its timeout, or at once when the refusal
says the request can never pass (``retry_after_ms`` null: it is larger than the limit).

Errors: ``QuotaClientError`` (``.status``, ``.code``, ``.detail``) and its kinds ``InvalidRequest``
(400; ``.detail`` names the field, also a ValueError as in the engine), ``AuthenticationError``
(401), ``NotFound`` (404; a LookupError as the engine's Unknown*), ``BackendUnavailable`` (503:
the service's Redis is unreachable; a ``quotas.engine.QuotaBackendUnavailable``) and its subclass
``NetworkError`` (no answer: connection refused, timeout...). Money (cost limits, costs) is
``Decimal``, parsed from the JSON text without going through float.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Awaitable, Callable, Generator
from urllib.parse import quote

import httpx

log = logging.getLogger("quotas.client")

__all__ = [
    "AsyncLease",
    "AsyncQuotaClient",
    "AuthenticationError",
    "BackendUnavailable",
    "Decision",
    "InvalidRequest",
    "Lease",
    "LimitState",
    "NetworkError",
    "NotFound",
    "QuotaClientError",
    "QuotaClient",
    "QuotaExceeded",
    "Settlement",
]


def _engine_values():
    """quotas.engine.decision (no Django, no Redis), even where its package cannot be imported.

    ``quotas/engine/__init__.py`` imports the engine, which needs redis-py; a client-only install
    may not have it. The value objects are then loaded from their file, under their own name, so
    they are the very same classes whenever both sides are importable.
    """
    try:
        from quotas.engine import decision

        return decision
    except ImportError:
        # The package's __init__ imports .decision first: it is usually loaded before the failure.
        loaded = sys.modules.get("quotas.engine.decision")
        if loaded is not None:
            return loaded
    name = "quotas.engine.decision"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "engine" / "decision.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_values = _engine_values()
LimitState = _values.LimitState
Settlement = _values.Settlement


class Decision(_values.Decision):
    """The engine's Decision (``allowed``, ``blocked_by``, ``retry_after_ms``, ``reservation``,
    ``limits``, ``would_block``, ``degraded``), plus ``retry_after`` in seconds, and usable as
    ``with client.acquire(...) as decision:`` (like the engine's ``Admitted``)."""

    __slots__ = ()

    @property
    def retry_after(self) -> float | None:
        """Seconds until the same request would pass; None when allowed or when it never can."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000

    def __enter__(self) -> Decision:
        return self

    def __exit__(self, *exc) -> None:
        return None


class QuotaExceeded(_values.QuotaExceeded):
    """A refusal raised by ``allow``, ``acquire`` and ``lease``: ``.decision``, ``.blocked_by``,
    ``.retry_after_ms``, and ``.retry_after`` in seconds (None: the request can never pass).
    A ``quotas.engine.QuotaExceeded``, so one ``except`` catches both."""

    @property
    def retry_after(self) -> float | None:
        ms = self.decision.retry_after_ms
        return None if ms is None else ms / 1000


class QuotaClientError(_values.QuotaError):
    """The service answered with an error (``status``: HTTP status, ``code``: its ``error`` field,
    ``detail``: its text), or could not be reached (``NetworkError``). A batch item's error has
    ``status`` None: the batch itself succeeded."""

    def __init__(self, detail: str, *, status: int | None = None, code: str | None = None, fields: list | None = None):
        self.detail = detail
        self.status = status
        self.code = code
        self.fields = list(fields or [])  # a 400's messages, one per field ("checks[2].tokens: ...")
        where = " ".join(str(part) for part in (status, code) if part is not None)
        super().__init__(f"{where}: {detail}" if where else detail)


class InvalidRequest(QuotaClientError, ValueError):
    """400: the request was refused as malformed; ``detail`` names the field."""


class AuthenticationError(QuotaClientError):
    """401: missing, unknown or revoked API key."""


class NotFound(QuotaClientError, LookupError):
    """404: no such agent in the key's org, reservation or lease."""


class BackendUnavailable(QuotaClientError, _values.QuotaBackendUnavailable):
    """No decision could be had: the service answered 503 (its Redis is unreachable). ``NetworkError``,
    a subclass, is the service itself not answering. Catch this one to fail open or closed."""


class NetworkError(BackendUnavailable):
    """The service could not be reached or did not answer in time (``code``: "timeout" or
    "network_error"); the httpx exception is the ``__cause__``."""


_ERRORS_BY_CODE = {"invalid_request": InvalidRequest, "invalid_body": InvalidRequest, "body_too_large": InvalidRequest,
                   "not_authenticated": AuthenticationError, "not_found": NotFound,
                   "backend_unavailable": BackendUnavailable}
_ERRORS_BY_STATUS = {400: InvalidRequest, 401: AuthenticationError, 404: NotFound, 503: BackendUnavailable}


# -- requests and answers, shared by both clients (no I/O here) ----------------------------------------
#
# Each operation is a generator: it yields a _Call (the driver sends it and sends back the
# httpx.Response) or a _Sleep (the driver sleeps), and returns its result. QuotaClient drives them
# with httpx.Client and time.sleep, AsyncQuotaClient with httpx.AsyncClient and asyncio.sleep: one
# implementation of the retry loops for both.


@dataclass(frozen=True)
class _Call:
    method: str
    path: str  # relative to .../api/
    json: dict | None = None
    params: dict | None = None


@dataclass(frozen=True)
class _Sleep:
    seconds: float


_Op = Generator[Any, Any, Any]


def _body(response: httpx.Response) -> Any:
    try:
        return json.loads(response.content, parse_float=Decimal)
    except ValueError:
        return None


def _error(response: httpx.Response, body: Any = None) -> QuotaClientError:
    body = _body(response) if body is None else body
    status = response.status_code
    if isinstance(body, dict) and "error" in body:
        code, detail = str(body["error"]), str(body.get("detail", ""))
        fields = body.get("fields")
    else:
        code, fields = None, None
        text = response.text.strip().replace("\n", " ")
        detail = f"unexpected answer to {response.request.method} {response.request.url}: {text[:200] or '(empty)'}"
    cls = _ERRORS_BY_CODE.get(code) or _ERRORS_BY_STATUS.get(status, QuotaClientError)
    return cls(detail, status=status, code=code, fields=fields if isinstance(fields, list) else None)


def _item_error(item: dict) -> QuotaClientError:
    code = str(item.get("error"))
    return _ERRORS_BY_CODE.get(code, QuotaClientError)(str(item.get("detail", "")), code=code)


def _amount(metric: str, value) -> int | Decimal:
    if metric == "cost":
        return value if isinstance(value, Decimal) else Decimal(value)
    return int(value)


def _limit(data: dict) -> LimitState:
    metric = data["metric"]
    return LimitState(
        level=data["level"], node=data["node"], metric=metric, limit=_amount(metric, data["limit"]),
        remaining=_amount(metric, data["remaining"]), window=data.get("window"), tool=data.get("tool"),
        model=data.get("model"), reset_ms=int(data["reset_ms"]), shadow=bool(data["shadow"]),
    )


def _decision(body: dict) -> Decision:
    """A check answer (200 or 429 body, or a batch item) -> Decision. ``passed`` is False on the
    limit that blocked and on the shadow limits that would have (so ``would_block`` works)."""
    limits = [_limit(item) for item in body.get("limits") or []]
    degraded = bool(body.get("degraded", False))
    if body["allowed"]:
        blocking = [_limit(item) for item in body.get("would_block") or []]
        missing = [limit for limit in blocking if limit not in limits]  # not expected: they are listed too
        limits = [limit._replace(passed=False) if limit in blocking else limit for limit in limits + missing]
        return Decision(True, reservation=body.get("reservation"), degraded=degraded, limits=limits)
    blocked = _limit(body["blocked_by"])
    if blocked in limits:
        index = limits.index(blocked)
    else:  # not expected: the service names one of the limits it lists
        limits.append(blocked)
        index = len(limits) - 1
    limits[index] = blocked._replace(passed=False)
    retry = body.get("retry_after_ms")
    return Decision(False, retry_after_ms=None if retry is None else int(retry), blocked=index + 1,
                    degraded=degraded, limits=limits)


def _check_answer(response: httpx.Response) -> Decision:
    body = _body(response)
    if response.status_code in (200, 429) and isinstance(body, dict) and "allowed" in body:
        return _decision(body)
    raise _error(response, body)


def _ok_body(response: httpx.Response, *expected: int) -> dict:
    body = _body(response)
    if response.status_code in expected and isinstance(body, dict):
        return body
    raise _error(response, body)


def _expires(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _check_body(agent: str, tool: str | None, model: str | None, tokens: int) -> dict:
    body: dict = {"agent": agent, "tokens": tokens}
    if tool is not None:
        body["tool"] = tool
    if model is not None:
        body["model"] = model
    return body


def _wait(decision: Decision, deadline: float, clock: Callable[[], float]) -> float:
    """How long to sleep before trying a refused request again; QuotaExceeded if not worth it."""
    if decision.retry_after_ms is None:
        raise QuotaExceeded(decision)  # larger than the limit: it can never pass
    # Never before retry_after (it would be refused again); a little after, spread so that the
    # callers refused together do not all come back in the same millisecond.
    wait = decision.retry_after_ms / 1000 * random.uniform(1.0, 1.1) + random.uniform(0, 0.005)
    if clock() + wait > deadline:
        raise QuotaExceeded(decision)
    return wait


def _check_op(body: dict) -> _Op:
    return _check_answer((yield _Call("POST", "v1/check", body)))


def _allow_op(body: dict) -> _Op:
    decision = yield from _check_op(body)
    if not decision.allowed:
        raise QuotaExceeded(decision)
    return decision


def _acquire_op(body: dict, timeout: float, clock: Callable[[], float]) -> _Op:
    deadline = clock() + timeout
    while True:
        decision = yield from _check_op(body)
        if decision.allowed:
            return decision
        yield _Sleep(_wait(decision, deadline, clock))


def _batch_op(checks: list[dict]) -> _Op:
    body = _ok_body((yield _Call("POST", "v1/check/batch", {"checks": list(checks)})), 200)
    return [_item_error(item) if "error" in item else _decision(item) for item in body["results"]]


def _settle_op(reservation: str, input_tokens: int, output_tokens: int) -> _Op:
    call = _Call("POST", "v1/usage", {"reservation": reservation, "input_tokens": input_tokens,
                                      "output_tokens": output_tokens})
    body = _ok_body((yield call), 200)
    cost, estimated = body.get("cost"), body["estimated_cost"]
    return Settlement(
        reservation=body["reservation"], status=body["status"],
        tokens=None if body.get("tokens") is None else int(body["tokens"]),
        cost=None if cost is None else Decimal(cost), estimated_tokens=int(body["estimated_tokens"]),
        estimated_cost=Decimal(estimated),
    )


def _peek_op(agent: str, tool: str | None, model: str | None, tokens: int) -> _Op:
    params = {name: value for name, value in (("tool", tool), ("model", model)) if value is not None}
    if tokens:
        params["tokens"] = str(tokens)
    body = _ok_body((yield _Call("GET", f"v1/agents/{quote(agent, safe='')}/quota", params=params or None)), 200)
    return [_limit(item) for item in body["limits"]]


def _lease_op(agent: str, ttl_s: int, timeout: float, clock: Callable[[], float]) -> _Op:
    deadline = clock() + timeout
    while True:
        response = yield _Call("POST", "v1/leases", {"agent": agent, "ttl_s": ttl_s})
        if response.status_code == 201:
            body = _ok_body(response, 201)
            return body["lease"], _expires(body["expires_at"])
        decision = _check_answer(response)  # a 429 is a refused check's answer; anything else raises
        yield _Sleep(_wait(decision, deadline, clock))


def _renew_op(lease: str, ttl_s: int) -> _Op:
    body = _ok_body((yield _Call("POST", f"v1/leases/{quote(lease, safe='')}/renew", {"ttl_s": ttl_s})), 200)
    return _expires(body["expires_at"])


def _release_op(lease: str) -> _Op:
    response = yield _Call("DELETE", f"v1/leases/{quote(lease, safe='')}")
    if response.status_code == 204:
        return True
    if response.status_code == 404 and _body(response) is not None:
        return False  # not held: released already, or expired
    raise _error(response)


def _api_url(base_url: str) -> str:
    """The service's root (``http://host:8000``) or its API root (``.../api``) -> ``.../api/``."""
    url = str(base_url).rstrip("/")
    return (url if url.endswith("/api") else url + "/api") + "/"


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}", "Accept": "application/json",
            "User-Agent": "agent-quotas-client/1"}


def _network_error(call: _Call, url: str, exc: httpx.TransportError) -> NetworkError:
    code = "timeout" if isinstance(exc, httpx.TimeoutException) else "network_error"
    what = "did not answer in time" if code == "timeout" else "could not be reached"
    return NetworkError(f"{call.method} {url}{call.path}: the quota service {what} ({type(exc).__name__}: {exc})",
                        code=code)


# -- leases ---------------------------------------------------------------------------------------------


class _LeaseState:
    def __init__(self, client, lease_id: str, expires_at: dt.datetime):
        self.client = client
        self.id = lease_id
        self.expires_at = expires_at  # aware datetime, UTC
        self.released = False

    @property
    def expires_at_ms(self) -> int:
        """As the engine's Lease has it: milliseconds since the epoch."""
        return round(self.expires_at.timestamp() * 1000)

    def __repr__(self) -> str:
        state = "released" if self.released else f"expires_at={self.expires_at.isoformat()}"
        return f"{type(self).__name__}({self.id!r}, {state})"


class Lease(_LeaseState):
    """A held concurrency slot. Released on leaving the ``with`` block; frees itself after its TTL
    unless renewed."""

    def renew(self, ttl_s: int = 300) -> dt.datetime:
        """Hold it ``ttl_s`` more seconds from now; returns the new ``expires_at``. NotFound if it lapsed."""
        self.expires_at = self.client._run(_renew_op(self.id, ttl_s))
        return self.expires_at

    def release(self) -> bool:
        """Free the slot; False if it was not held (released already, or expired)."""
        if self.released:
            return False
        held = self.client._run(_release_op(self.id))
        self.released = True
        return held

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.release()
            return
        try:  # do not hide the block's own exception: the slot frees itself at its TTL anyway
            self.release()
        except QuotaClientError as error:
            log.warning("could not release lease %s (it expires by itself): %s", self.id, error)


class AsyncLease(_LeaseState):
    """``Lease`` for ``AsyncQuotaClient``: ``await lease.renew()``, ``await lease.release()``, ``async with``."""

    async def renew(self, ttl_s: int = 300) -> dt.datetime:
        self.expires_at = await self.client._run(_renew_op(self.id, ttl_s))
        return self.expires_at

    async def release(self) -> bool:
        if self.released:
            return False
        held = await self.client._run(_release_op(self.id))
        self.released = True
        return held

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.release()
            return
        try:
            await self.release()
        except QuotaClientError as error:
            log.warning("could not release lease %s (it expires by itself): %s", self.id, error)


# -- the clients ----------------------------------------------------------------------------------------


class QuotaClient:
    """The check API over HTTP, synchronously.

    base_url: the service (``http://127.0.0.1:8000``; ``.../api`` accepted too).
    api_key: an org's key (``manage.py create_api_key ORG``).
    timeout: seconds for each HTTP request (``acquire``'s own ``timeout`` is how long it may wait).
    transport: an ``httpx.BaseTransport`` (tests: ``httpx.MockTransport``).
    sleep, clock: what ``acquire`` and ``lease`` wait with and measure their timeout by.
    """

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 5.0,
                 transport: httpx.BaseTransport | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.base_url = _api_url(base_url)
        self.sleep = sleep
        self.clock = clock
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(api_key), timeout=timeout,
                                  transport=transport)

    # -- the API

    def check(self, agent: str, *, tool: str | None = None, model: str | None = None, tokens: int = 0) -> Decision:
        """Charge every limit that applies, or none. A refusal is a Decision with ``allowed`` False."""
        return self._run(_check_op(_check_body(agent, tool, model, tokens)))

    def check_batch(self, checks: list[dict]) -> list[Decision | QuotaClientError]:
        """Up to 100 checks (dicts of ``check``'s arguments) in one request, each decided on its own:
        a Decision, or the error of that item (``NotFound`` for an unknown agent)."""
        if not checks:
            return []
        return self._run(_batch_op(checks))

    def settle(self, reservation: str, *, input_tokens: int, output_tokens: int) -> Settlement:
        """Charge a reservation's actual tokens (idempotent: again gives status "repeat")."""
        return self._run(_settle_op(reservation, input_tokens, output_tokens))

    def peek(self, agent: str, *, tool: str | None = None, model: str | None = None,
             tokens: int = 0) -> list[LimitState]:
        """Every limit that applies to the agent (concurrency included) and what remains; consumes nothing."""
        return self._run(_peek_op(agent, tool, model, tokens))

    def allow(self, agent: str, *, tool: str | None = None, model: str | None = None, tokens: int = 0) -> Decision:
        """Check, and raise QuotaExceeded if refused. ``with client.allow(...) as decision:``."""
        return self._run(_allow_op(_check_body(agent, tool, model, tokens)))

    def acquire(self, agent: str, *, tool: str | None = None, model: str | None = None, tokens: int = 0,
                timeout: float = 30.0) -> Decision:
        """Check; when refused sleep for its retry_after (with jitter) and check again, up to ``timeout``
        seconds. QuotaExceeded when it cannot pass in time, at once when it can never pass."""
        return self._run(_acquire_op(_check_body(agent, tool, model, tokens), timeout, self.clock))

    def lease(self, agent: str, *, ttl_s: int = 300, timeout: float = 0.0) -> Lease:
        """Take a slot in every concurrency limit on the agent's path, or none. Waits up to ``timeout``
        seconds for one (until the earliest lease expires), then raises QuotaExceeded."""
        lease_id, expires_at = self._run(_lease_op(agent, ttl_s, timeout, self.clock))
        return Lease(self, lease_id, expires_at)

    # -- plumbing

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> QuotaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"QuotaClient({self.base_url!r})"

    def _send(self, call: _Call) -> httpx.Response:
        try:
            return self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise _network_error(call, self.base_url, exc) from exc

    def _run(self, op: _Op):
        try:
            step = next(op)
            while True:
                if isinstance(step, _Sleep):
                    self.sleep(step.seconds)
                    step = op.send(None)
                else:
                    step = op.send(self._send(step))
        except StopIteration as done:
            return done.value


class _Pending:
    """An AsyncQuotaClient call that can be awaited (``d = await client.acquire(...)``) or entered
    (``async with client.acquire(...) as d:``; a lease is released on leaving the block)."""

    def __init__(self, start: Callable[[], Awaitable]):
        self._start = start
        self._value = None

    def __await__(self):
        return self._start().__await__()

    async def __aenter__(self):
        self._value = await self._start()
        enter = getattr(self._value, "__aenter__", None)
        return await enter() if enter is not None else self._value

    async def __aexit__(self, *exc):
        leave = getattr(self._value, "__aexit__", None)
        if leave is not None:
            return await leave(*exc)
        return None


class AsyncQuotaClient:
    """``QuotaClient`` for asyncio (httpx.AsyncClient): every method is awaited; ``allow``, ``acquire``
    and ``lease`` also work as ``async with``. ``sleep`` defaults to ``asyncio.sleep``."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None, clock: Callable[[], float] = time.monotonic):
        import asyncio

        self.base_url = _api_url(base_url)
        self.sleep = sleep or asyncio.sleep
        self.clock = clock
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport)

    async def check(self, agent: str, *, tool: str | None = None, model: str | None = None,
                    tokens: int = 0) -> Decision:
        return await self._run(_check_op(_check_body(agent, tool, model, tokens)))

    async def check_batch(self, checks: list[dict]) -> list[Decision | QuotaClientError]:
        if not checks:
            return []
        return await self._run(_batch_op(checks))

    async def settle(self, reservation: str, *, input_tokens: int, output_tokens: int) -> Settlement:
        return await self._run(_settle_op(reservation, input_tokens, output_tokens))

    async def peek(self, agent: str, *, tool: str | None = None, model: str | None = None,
                   tokens: int = 0) -> list[LimitState]:
        return await self._run(_peek_op(agent, tool, model, tokens))

    def allow(self, agent: str, *, tool: str | None = None, model: str | None = None, tokens: int = 0) -> _Pending:
        """``async with client.allow(...) as decision:`` (or ``await``); QuotaExceeded if refused."""
        body = _check_body(agent, tool, model, tokens)
        return _Pending(lambda: self._run(_allow_op(body)))

    def acquire(self, agent: str, *, tool: str | None = None, model: str | None = None, tokens: int = 0,
                timeout: float = 30.0) -> _Pending:
        """``async with client.acquire(...) as decision:`` (or ``await``): waits Retry-After, retries."""
        body = _check_body(agent, tool, model, tokens)
        return _Pending(lambda: self._run(_acquire_op(body, timeout, self.clock)))

    def lease(self, agent: str, *, ttl_s: int = 300, timeout: float = 0.0) -> _Pending:
        """``async with client.lease(...) as lease:`` (released on exit), or ``lease = await client.lease(...)``."""

        async def take() -> AsyncLease:
            lease_id, expires_at = await self._run(_lease_op(agent, ttl_s, timeout, self.clock))
            return AsyncLease(self, lease_id, expires_at)

        return _Pending(take)

    async def close(self) -> None:
        await self._http.aclose()

    aclose = close

    async def __aenter__(self) -> AsyncQuotaClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncQuotaClient({self.base_url!r})"

    async def _send(self, call: _Call) -> httpx.Response:
        try:
            return await self._http.request(call.method, call.path, json=call.json, params=call.params)
        except httpx.TransportError as exc:
            raise _network_error(call, self.base_url, exc) from exc

    async def _run(self, op: _Op):
        try:
            step = next(op)
            while True:
                if isinstance(step, _Sleep):
                    await self.sleep(step.seconds)
                    step = op.send(None)
                else:
                    step = op.send(await self._send(step))
        except StopIteration as done:
            return done.value
