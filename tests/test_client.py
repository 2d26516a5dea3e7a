"""quotas.client against the real service: pytest-django's live_server (the Django app on a free
port, the test database, the test run's Valkey), the demo policy, a real API key.

agent-1 (standard-agent tier): credits 50 per 10 s with burst 50 (refilled 5 per second);
llm_call costs 3 credits, image_generate 10; tokens 25,000/h. alice (agent-1's and agent-2's
user): 3 concurrent leases. gpt-4o: $0.0025 input, $0.01 output per 1K tokens.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from django.db import transaction

import quotas.engine
from tests.support import clean_redis
from quotas.client import (
    AsyncQuotaClient,
    AuthenticationError,
    BackendUnavailable,
    Decision,
    InvalidRequest,
    Lease,
    NetworkError,
    NotFound,
    QuotaClient,
    QuotaClientError,
    QuotaExceeded,
    Settlement,
)
from quotas.models import Organization
from quotas.policy.document import parse_policy, read_policy_file
from quotas.services.api_keys import api_key_create
from quotas.services.policy_load import policy_load

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "quotas" / "fixtures" / "demo_policy.yaml"
LLM_CALL = {"agent": "agent-1", "tool": "llm_call"}
WEB_SEARCH = {"agent": "agent-1", "tool": "web_search"}
EXHAUST = [LLM_CALL] * 20 + [WEB_SEARCH] * 3
# one request, one Redis round trip: 16 llm_calls take 48 of the 50 credits, the 17th is refused (and
# charges nothing), two web_searches take the last 2 credits: then an llm_call is 600 ms away.
EXHAUSTED = [True] * 16 + [False] * 4 + [True, True, False]


@pytest.fixture
def service(live_server, transactional_db):
    """The live service with the demo policy, clean counters and an API key of acme-corp."""
    clean_redis()
    with transaction.atomic():  # the policy sync to Redis runs after this commit
        policy_load(doc=parse_policy(read_policy_file(DEMO)))
    _, raw = api_key_create(org=Organization.objects.get(slug="acme-corp"))
    return SimpleNamespace(url=live_server.url, key=raw)


@pytest.fixture
def client(service):
    with QuotaClient(service.url, service.key) as client:
        yield client


class Recorder(httpx.HTTPTransport):
    """The real transport, keeping every response (to compare sleeps with the refusals before them)."""

    def __init__(self):
        super().__init__()
        self.responses: list[httpx.Response] = []

    def handle_request(self, request):
        response = super().handle_request(request)
        response.read()
        self.responses.append(response)
        return response


def exhaust(client) -> list:
    results = client.check_batch(EXHAUST)
    assert [r.allowed for r in results] == EXHAUSTED
    return results


def by_key(limits) -> dict:
    return {(l.level, l.metric, l.window): l for l in limits}


# -- no Django ------------------------------------------------------------------------------------------


def test_the_client_imports_without_django_or_redis():
    code = (
        "import sys; sys.modules['django'] = None; sys.modules['redis'] = None\n"
        "import quotas.client as c\n"
        "assert not any(name == 'django' or name.startswith('django.') for name in sys.modules if sys.modules[name])\n"
        "c.QuotaClient('http://127.0.0.1:1', 'k').close()\n"
        "print(c.Decision.__mro__[1].__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "quotas.engine.decision"


def test_the_client_shares_the_engines_value_objects():
    assert issubclass(Decision, quotas.engine.Decision)
    assert issubclass(QuotaExceeded, quotas.engine.QuotaExceeded)
    assert Settlement is quotas.engine.Settlement
    assert issubclass(BackendUnavailable, quotas.engine.QuotaBackendUnavailable)


# -- check -----------------------------------------------------------------------------------------------


def test_an_allowed_check(client):
    d = client.check("agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
    assert isinstance(d, quotas.engine.Decision)
    assert d.allowed and d.reservation.endswith(".engineering.alice.agent-1")
    assert d.blocked_by is None and d.retry_after_ms is None and d.retry_after is None and d.would_block == []
    limits = by_key(d.limits)
    assert limits[("agent", "credits", "10s")].limit == 50
    assert limits[("agent", "credits", "10s")].remaining == 47
    assert limits[("agent", "tokens", "1h")].remaining == 23000
    cost = limits[("org", "cost", "day")]  # the estimate: 2000 tokens at the higher (output) price
    assert isinstance(cost.limit, Decimal) and isinstance(cost.remaining, Decimal)
    assert (cost.limit, cost.remaining) == (Decimal("500"), Decimal("499.98"))


def test_the_17th_llm_call_is_refused_and_says_by_what_and_until_when(client):
    exhaust(client)
    d = client.check("agent-1", tool="llm_call")
    assert not d.allowed and not d and d.reservation is None
    blocked = d.blocked_by
    assert (blocked.level, blocked.node, blocked.metric, blocked.window) == ("agent", "agent-1", "credits", "10s")
    assert blocked.remaining < 3 and not blocked.passed
    assert 300 < d.retry_after_ms <= 600  # 3 credits refill in 600 ms
    assert d.retry_after == d.retry_after_ms / 1000
    assert blocked in d.limits


def test_a_batch_decides_each_check_on_its_own(client):
    results = client.check_batch([
        {"agent": "agent-1", "tool": "web_search"},
        {"agent": "nobody"},
        {"agent": "agent-2", "model": "gpt-4o", "tokens": 500},
    ])
    assert len(results) == 3
    assert isinstance(results[0], Decision) and results[0].allowed
    assert isinstance(results[1], NotFound) and results[1].code == "not_found" and "nobody" in results[1].detail
    assert results[1].status is None  # the batch itself succeeded
    assert isinstance(results[2], Decision) and results[2].allowed
    assert results[2].reservation.endswith(".agent-2")
    assert client.check_batch([]) == []


# -- settle ------------------------------------------------------------------------------------------------


def test_settle_is_decimal_exact_and_idempotent(client):
    d = client.check("agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
    settled = client.settle(d.reservation, input_tokens=1200, output_tokens=640)
    # 1200 * 0.0025 / 1000 + 640 * 0.01 / 1000 = 0.003 + 0.0064
    assert settled == Settlement(reservation=d.reservation, status="settled", tokens=1840, cost=Decimal("0.0094"),
                                 estimated_tokens=2000, estimated_cost=Decimal("0.02"))
    assert isinstance(settled.cost, Decimal) and str(settled.cost) == "0.0094"
    again = client.settle(d.reservation, input_tokens=1200, output_tokens=640)
    assert again.status == "repeat" and (again.tokens, again.cost) == (1840, Decimal("0.0094"))
    with pytest.raises(NotFound) as unknown:
        client.settle("0123456789abcdef.engineering.alice.agent-1", input_tokens=1, output_tokens=1)
    assert unknown.value.status == 404


# -- peek ------------------------------------------------------------------------------------------------


def test_peek_lists_every_limit_and_consumes_nothing(client):
    client.check("agent-1", tool="llm_call")
    first, second = client.peek("agent-1"), client.peek("agent-1")
    assert by_key(first)[("org", "requests", "1h")].remaining == 9999
    assert by_key(second)[("org", "requests", "1h")].remaining == 9999
    concurrency = by_key(first)[("user", "concurrency", None)]
    assert (concurrency.node, concurrency.limit, concurrency.remaining) == ("alice", 3, 3)
    assert by_key(first)[("org", "cost", "day")].limit == Decimal("500")
    with pytest.raises(NotFound):
        client.peek("nobody")


# -- leases --------------------------------------------------------------------------------------------------


def test_a_lease_holds_a_slot_until_the_block_ends(client):
    before = dt.datetime.now(dt.timezone.utc)
    with client.lease("agent-1", ttl_s=60) as first:
        assert isinstance(first, Lease) and first.id.endswith(".agent-1")
        assert 55 <= (first.expires_at - before).total_seconds() <= 61
        second, third = client.lease("agent-2"), client.lease("agent-1")
        with pytest.raises(QuotaExceeded) as refused:
            client.lease("agent-1")
        blocked = refused.value.blocked_by
        assert (blocked.level, blocked.node, blocked.metric, blocked.limit, blocked.remaining) == (
            "user", "alice", "concurrency", 3, 0)
        assert 50 < refused.value.retry_after <= 60  # when the earliest lease (first) expires
        renewed = first.renew(ttl_s=120)
        assert renewed == first.expires_at and 115 <= (renewed - before).total_seconds() <= 121
    assert first.released
    fourth = client.lease("agent-1")  # the block's exit freed a slot
    assert by_key(client.peek("agent-1"))[("user", "concurrency", None)].remaining == 0
    assert fourth.release() is True and fourth.release() is False
    assert Lease(client, third.id, third.expires_at).release() is True
    assert third.release() is False  # the server: not held any more
    with pytest.raises(NotFound):
        third.renew()
    second.release()
    assert by_key(client.peek("agent-1"))[("user", "concurrency", None)].remaining == 3


def test_lease_with_a_timeout_waits_for_the_earliest_lease_to_expire(service):
    slept: list[float] = []

    def sleep(seconds):
        slept.append(seconds)
        time.sleep(seconds)

    with QuotaClient(service.url, service.key, sleep=sleep) as client:
        held = [client.lease("agent-1", ttl_s=1) for _ in range(3)]
        started = time.monotonic()
        with client.lease("agent-1", ttl_s=60, timeout=5) as lease:
            assert lease.id not in [h.id for h in held]
        assert 1 <= len(slept) <= 2 and 0.5 < slept[0] <= 1.2
        assert time.monotonic() - started < 3


# -- allow and acquire ---------------------------------------------------------------------------------------


def test_allow_raises_quota_exceeded_when_refused(client):
    with client.allow("agent-2", tool="llm_call") as d:
        assert d.allowed and d.reservation.endswith(".agent-2")
    exhaust(client)
    with pytest.raises(QuotaExceeded) as refused:
        with client.allow("agent-1", tool="llm_call"):
            pytest.fail("the block ran although the check was refused")
    error = refused.value
    assert isinstance(error, quotas.engine.QuotaExceeded)
    assert error.blocked_by.metric == "credits" and not error.decision.allowed
    assert 0 < error.retry_after <= 0.6 and error.retry_after == error.retry_after_ms / 1000


def test_acquire_sleeps_for_retry_after_then_passes(service):
    slept: list[float] = []

    def sleep(seconds):
        slept.append(seconds)
        time.sleep(seconds)

    recorder = Recorder()
    with QuotaClient(service.url, service.key, sleep=sleep, transport=recorder) as client:
        exhaust(client)
        recorder.responses.clear()
        started = time.monotonic()
        with client.acquire("agent-1", tool="llm_call", timeout=5) as d:
            assert d.allowed and d.reservation
    assert time.monotonic() - started < 2
    statuses = [r.status_code for r in recorder.responses]
    assert statuses[-1] == 200 and set(statuses[:-1]) == {429} and len(slept) == len(statuses) - 1
    assert 1 <= len(slept) <= 2  # slept until the refusal said, not a polling loop
    for response, seconds in zip(recorder.responses, slept):
        wait = response.json()["retry_after_ms"] / 1000
        assert wait <= seconds <= wait * 1.1 + 0.005
        assert response.headers["Retry-After"] == str(max(1, -(-response.json()["retry_after_ms"] // 1000)))


def test_acquire_gives_up_at_its_timeout(service):
    now, slept = [0.0], []

    def sleep(seconds):  # a clock that moves only when acquire sleeps
        slept.append(seconds)
        now[0] += seconds

    with QuotaClient(service.url, service.key, sleep=sleep, clock=lambda: now[0]) as client:
        exhaust(client)  # an image_generate (10 credits) passes in ~2 s
        with pytest.raises(QuotaExceeded) as refused:
            client.acquire("agent-1", tool="image_generate", timeout=5.0)
        assert refused.value.blocked_by.metric == "credits" and refused.value.retry_after > 1
        assert len(slept) == 2 and sum(slept) <= 5.0  # 2 s, 2 s, and a third wait would end after 5 s
        assert all(seconds >= 1.5 for seconds in slept)

        slept.clear()
        with pytest.raises(QuotaExceeded):  # the first wait alone is longer than the timeout: no sleep
            client.acquire("agent-1", tool="image_generate", timeout=0.5)
        assert slept == []


def test_acquire_raises_at_once_when_the_request_can_never_pass(client):
    slept: list[float] = []
    client.sleep = slept.append
    with pytest.raises(QuotaExceeded) as refused:
        client.acquire("agent-1", tokens=30_000, timeout=30)  # agent-1 has 25,000 tokens an hour
    assert refused.value.retry_after is None and refused.value.retry_after_ms is None
    assert refused.value.blocked_by.metric == "tokens" and refused.value.blocked_by.limit == 25000
    assert slept == []


# -- errors ------------------------------------------------------------------------------------------------


def test_an_unknown_agent_is_not_found(client):
    with pytest.raises(NotFound) as missing:
        client.check("nobody", tool="llm_call")
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    assert "nobody" in missing.value.detail and isinstance(missing.value, LookupError)


def test_a_bad_key_is_an_authentication_error(service):
    with QuotaClient(service.url, "aq_not-a-key") as client:
        with pytest.raises(AuthenticationError) as refused:
            client.check("agent-1")
    assert (refused.value.status, refused.value.code) == (401, "not_authenticated")
    assert "API key" in refused.value.detail


def test_bad_input_is_an_invalid_request_naming_the_field(client):
    with pytest.raises(InvalidRequest) as bad:
        client.check("agent-1", tokens=-1)
    assert (bad.value.status, bad.value.code) == (400, "invalid_request")
    assert bad.value.detail.startswith("tokens:") and bad.value.fields[0].startswith("tokens:")
    with pytest.raises(InvalidRequest) as bad_batch:
        client.check_batch([LLM_CALL, {"agent": "agent-1", "tokens": "many"}])
    assert "checks[1].tokens" in bad_batch.value.detail


def test_an_unreachable_service_is_a_network_error():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with QuotaClient(f"http://127.0.0.1:{port}", "k", timeout=2) as client:
        with pytest.raises(NetworkError) as unreachable:
            client.check("agent-1")
    error = unreachable.value
    assert isinstance(error, BackendUnavailable) and error.code == "network_error" and error.status is None
    assert f"127.0.0.1:{port}/api/v1/check" in str(error) and isinstance(error.__cause__, httpx.ConnectError)


def test_a_503_and_a_non_json_answer_are_errors_with_their_status():
    def answer(request):
        if request.url.path == "/api/v1/check":
            return httpx.Response(503, json={"error": "backend_unavailable", "detail": "the quota store is down"})
        return httpx.Response(502, text="<html>Bad Gateway</html>")

    with QuotaClient("http://quotas.test", "k", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(BackendUnavailable) as down:
            client.check("agent-1")
        assert (down.value.status, down.value.code) == (503, "backend_unavailable")
        assert not isinstance(down.value, NetworkError)
        with pytest.raises(QuotaClientError) as gateway:
            client.peek("agent-1")
    assert gateway.value.status == 502 and gateway.value.code is None and "Bad Gateway" in gateway.value.detail


# -- async -----------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_check_and_settle(service):
    async with AsyncQuotaClient(service.url, service.key) as client:
        d = await client.check("agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
        assert d.allowed and by_key(d.limits)[("agent", "credits", "10s")].remaining == 47
        settled = await client.settle(d.reservation, input_tokens=1200, output_tokens=640)
        assert (settled.status, settled.cost) == ("settled", Decimal("0.0094"))
        assert (await client.settle(d.reservation, input_tokens=1200, output_tokens=640)).status == "repeat"
        assert by_key(await client.peek("agent-1"))[("org", "requests", "1h")].remaining == 9999
        with pytest.raises(NotFound):
            await client.check("nobody")


@pytest.mark.asyncio
async def test_async_leases(service):
    async with AsyncQuotaClient(service.url, service.key) as client:
        async with client.lease("agent-1", ttl_s=60) as first:
            second = await client.lease("agent-2")
            async with await client.lease("agent-1") as third:
                with pytest.raises(QuotaExceeded) as refused:
                    await client.lease("agent-1")
                assert refused.value.blocked_by.metric == "concurrency"
                await third.renew(ttl_s=30)
            assert third.released
            assert not first.released
        assert first.released
        assert await second.release() is True
        assert by_key(await client.peek("agent-1"))[("user", "concurrency", None)].remaining == 3


@pytest.mark.asyncio
async def test_async_allow_and_acquire(service):
    slept: list[float] = []

    async def sleep(seconds):
        slept.append(seconds)
        await asyncio.sleep(seconds)

    async with AsyncQuotaClient(service.url, service.key, sleep=sleep) as client:
        async with client.allow("agent-2", tool="web_search") as d:
            assert d.allowed
        assert [r.allowed for r in await client.check_batch(EXHAUST)] == EXHAUSTED
        with pytest.raises(QuotaExceeded) as refused:
            await client.allow("agent-1", tool="llm_call")
        assert refused.value.blocked_by.metric == "credits" and 0 < refused.value.retry_after <= 0.6
        assert slept == []
        async with client.acquire("agent-1", tool="llm_call", timeout=5) as d:
            assert d.allowed and d.reservation
        assert 1 <= len(slept) <= 2 and all(0 < s <= 0.7 for s in slept)


def test_shadow_limits_that_would_block_are_marked_on_the_decision():
    # The demo has no shadow limit: the answer's shape, as the check view builds it, from a mock.
    tokens = {"level": "agent", "node": "agent-1", "metric": "tokens", "limit": 25000, "remaining": 23000,
              "window": "1h", "tool": None, "model": None, "reset_ms": 3600000, "shadow": False}
    shadow = dict(tokens, level="org", node="acme-corp", metric="cost", limit=1.5, remaining=0.0, window="day",
                  shadow=True)
    answer = {"allowed": True, "reservation": "r.engineering.alice.agent-1", "limits": [shadow, tokens],
              "would_block": [shadow], "degraded": True}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    with QuotaClient("http://quotas.test", "k", transport=transport) as client:
        d = client.check("agent-1")
    assert d.allowed and d.degraded and [l.metric for l in d.would_block] == ["cost"]
    assert d.would_block[0].limit == Decimal("1.5") and not d.would_block[0].passed
    assert [l.passed for l in d.limits] == [False, True]
