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


def test_a_connection_the_server_closed_is_replaced_not_an_error(engine, install, redis_client):
    from tests.engine.conftest import lim

    install(agent=[lim("requests", 5, "1m")])
    assert engine.check(org="acme", agent="agent-1").allowed  # opens this thread's connection
    connection = engine._scripts._connection()
    connection.send_command("CLIENT", "ID")
    redis_client.execute_command("CLIENT", "KILL", "ID", connection.read_response())  # a restart, an idle timeout
    assert engine.check(org="acme", agent="agent-1").allowed  # sent again on a new connection, once
    assert engine.peek(org="acme", agent="agent-1").limits[0].remaining == 3  # and charged once


def test_each_thread_and_each_process_has_its_own_connection(engine, install):
    import os
    import threading

    from tests.engine.conftest import lim

    install(agent=[lim("requests", 100, "1m")])
    engine.check(org="acme", agent="agent-1")
    mine = engine._scripts._connection()
    theirs = []
    thread = threading.Thread(target=lambda: (engine.check(org="acme", agent="agent-1"),
                                              theirs.append(engine._scripts._connection())))
    thread.start()
    thread.join()
    assert theirs and theirs[0] is not mine
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked worker (gunicorn, Celery prefork) must not share the parent's socket
        ok = engine._scripts._connection() is not mine and engine.check(org="acme", agent="agent-1").allowed
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 1) == b"1"
    assert engine.check(org="acme", agent="agent-1").allowed  # the parent's connection still works


def test_a_batch_on_a_connection_the_server_closed_is_sent_again_once(engine, install, redis_client):
    from tests.engine.conftest import lim

    install(agent=[lim("requests", 10, "1m")])
    assert engine.check(org="acme", agent="agent-1").allowed
    connection = engine._scripts._connection()
    connection.send_command("CLIENT", "ID")
    redis_client.execute_command("CLIENT", "KILL", "ID", connection.read_response())
    results = engine.check_many(org="acme", checks=[{"agent": "agent-1"}] * 3)
    assert [result.allowed for result in results] == [True, True, True]
    assert engine.peek(org="acme", agent="agent-1").limits[0].remaining == 6  # each charged once
