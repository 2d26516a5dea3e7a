"""Redis unreachable: fail closed (a clear error, the default) or open (admit, log, count)."""

from __future__ import annotations

import socket
import time

import pytest

from quotas.engine import QuotaBackendUnavailable, QuotaEngine


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_fail_closed_raises_a_clear_error_quickly():
    engine = QuotaEngine.from_url(f"redis://127.0.0.1:{unused_port()}/0")
    started = time.monotonic()
    with pytest.raises(QuotaBackendUnavailable, match="Redis did not answer"):
        engine.check(org="acme", agent="agent-1")
    assert time.monotonic() - started < 2


def test_fail_open_admits_logs_and_counts(caplog):
    engine = QuotaEngine.from_url(f"redis://127.0.0.1:{unused_port()}/0", fail_mode="open")
    decision = engine.check(org="acme", agent="agent-1", tool="llm_call")
    assert decision.allowed and decision.degraded and decision.reservation is None
    assert engine.fail_open_admits == 1
    assert "Redis unreachable: admitting acme/agent-1 llm_call without a check (fail-open)" in caplog.text


def test_a_read_timeout_is_bounded(redis_client):
    # A server that accepts connections but never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        engine = QuotaEngine.from_url(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", read_timeout_ms=300)
        started = time.monotonic()
        with pytest.raises(QuotaBackendUnavailable):
            engine.check(org="acme", agent="agent-1")
        assert time.monotonic() - started < 3


def test_a_full_redis_is_backend_unavailable_not_a_crash(engine, install, redis_client):
    from tests.engine.conftest import lim

    install(agent=[lim("requests", 5, "1m")])
    assert engine.check(org="acme", agent="agent-1").allowed
    limit = redis_client.config_get("maxmemory")["maxmemory"]
    redis_client.config_set("maxmemory", "1")  # every write is now refused with OOM
    try:
        with pytest.raises(QuotaBackendUnavailable, match="OutOfMemoryError"):
            engine.check(org="acme", agent="agent-1")
        results = None
        with pytest.raises(QuotaBackendUnavailable):
            results = engine.check_many(org="acme", checks=[{"agent": "agent-1"}])
        assert results is None
        engine.fail_mode = "open"
        assert engine.check(org="acme", agent="agent-1").degraded
        assert [r.degraded for r in engine.check_many(org="acme", checks=[{"agent": "agent-1"}])] == [True]
    finally:
        redis_client.config_set("maxmemory", limit)
