"""Redis unreachable: 503 with a clear JSON error (fail closed, the default), or admit and say so (fail open).

The views call ``get_engine()`` as imported into ``quotas.api.views``; the tests point it at a port
where nothing listens.
"""

from __future__ import annotations

import logging
import time

import pytest

from quotas.engine import QuotaEngine
from tests.api.conftest import assert_error, unused_port
from tests.api.test_errors import OPERATION_IDS, OPERATIONS, send


def unreachable_engine(fail_mode: str) -> QuotaEngine:
    return QuotaEngine.from_url(f"redis://127.0.0.1:{unused_port()}/0", fail_mode=fail_mode)


@pytest.fixture
def redis_down(monkeypatch):
    def down(fail_mode: str) -> QuotaEngine:
        engine = unreachable_engine(fail_mode)
        monkeypatch.setattr("quotas.api.views.get_engine", lambda: engine)
        return engine
    return down


@pytest.mark.parametrize("method, path, body", [op for op in OPERATIONS if "daily-spend" not in op[1]],
                         ids=[i for i in OPERATION_IDS if "daily-spend" not in i])
def test_fail_closed_answers_503_with_a_json_error_quickly(api, redis_down, method, path, body):
    redis_down("closed")
    started = time.monotonic()

    response = send(api, method, path, body)

    assert time.monotonic() - started < 2
    body = assert_error(response, 503, "backend_unavailable")
    assert "Redis" in body["detail"]
    assert response["Retry-After"] == "1"


def test_fail_closed_still_validates_first(api, redis_down):
    redis_down("closed")
    assert_error(api.check(agent="agent-1", tokens=-5), 400, "invalid_request", field="tokens")


def test_fail_closed_still_authenticates_first(demo, redis_down):
    from tests.api.conftest import Api

    redis_down("closed")
    assert_error(Api("aq_unknown").check(agent="agent-1"), 401, "not_authenticated")


def test_daily_spend_does_not_need_redis(api, redis_down):
    redis_down("closed")
    assert api.get("/api/v1/reports/daily-spend", {"from": "2026-11-01", "to": "2026-11-02"}).status_code == 200


def test_fail_open_admits_a_check_says_it_is_degraded_and_logs_it(api, redis_down, caplog):
    engine = redis_down("open")

    with caplog.at_level(logging.WARNING, logger="quotas.engine"):
        response = api.check(agent="agent-1", tool="llm_call", tokens=100)

    assert response.status_code == 200
    body = response.json()
    assert body["allowed"] is True and body["degraded"] is True
    assert body["reservation"] is None
    assert engine.fail_open_admits == 1
    assert "fail-open" in caplog.text and "acme-corp/agent-1" in caplog.text


def test_fail_open_admits_every_check_of_a_batch_as_degraded(api, redis_down):
    engine = redis_down("open")

    response = api.post("/api/v1/check/batch", {"checks": [{"agent": "agent-1"}, {"agent": "copywriter", "tokens": 5}]})

    assert response.status_code == 200
    results = response.json()["results"]
    assert [(r["allowed"], r["degraded"]) for r in results] == [(True, True), (True, True)]
    assert engine.fail_open_admits == 2


def test_when_redis_is_back_checks_are_decided_normally_again(api, monkeypatch):
    engine = unreachable_engine("closed")
    monkeypatch.setattr("quotas.api.views.get_engine", lambda: engine)
    assert api.check(agent="agent-1").status_code == 503

    monkeypatch.undo()

    response = api.check(agent="agent-1")
    assert response.status_code == 200 and "degraded" not in response.json()


def test_fail_open_peek_says_the_limits_are_unknown_not_absent(api, redis_down):
    redis_down("open")
    response = api.get("/api/v1/agents/agent-1/quota")
    assert response.status_code == 200
    assert response.json() == {"agent": "agent-1", "limits": [], "degraded": True}
