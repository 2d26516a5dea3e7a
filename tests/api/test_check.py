"""POST /api/v1/check and POST /api/v1/check/batch: the contract of DESIGN.md "Check API (v1)"."""

from __future__ import annotations

import pytest

from tests.api.conftest import DEMO_AGENTS, assert_error

LIMIT_FIELDS = {"level", "node", "metric", "limit", "remaining", "window", "tool", "model", "reset_ms", "shadow"}


def limit_of(limits: list[dict], level: str, metric: str, **match) -> dict:
    found = [l for l in limits if l["level"] == level and l["metric"] == metric
             and all(l[key] == value for key, value in match.items())]
    assert len(found) == 1, (level, metric, match, limits)
    return found[0]


def peek(api, agent: str) -> list[dict]:
    response = api.get(f"/api/v1/agents/{agent}/quota")
    assert response.status_code == 200, response.content
    return response.json()["limits"]


# -- single check --------------------------------------------------------------------------------


def test_an_allowed_check_answers_200_with_a_reservation_and_every_limit_that_applies(api):
    response = api.check(agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000)

    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"allowed", "reservation", "limits", "would_block"}
    assert body["allowed"] is True
    assert body["reservation"].endswith(".engineering.alice.agent-1")
    assert body["would_block"] == []
    assert all(set(limit) == LIMIT_FIELDS for limit in body["limits"])
    assert [(l["level"], l["node"], l["metric"], l["window"]) for l in body["limits"]] == [
        ("org", "acme-corp", "cost", "day"),
        ("org", "acme-corp", "requests", "1h"),
        ("org", "acme-corp", "tokens", "1h"),
        ("team", "engineering", "tokens", "1h"),
        ("user", "alice", "tokens", "1h"),
        ("agent", "agent-1", "credits", "10s"),
        ("agent", "agent-1", "tokens", "1h"),
    ]
    limits = body["limits"]
    assert limit_of(limits, "agent", "tokens")["remaining"] == 25000 - 2000
    assert limit_of(limits, "agent", "credits")["remaining"] == 50 - 3  # llm_call weighs 3
    assert limit_of(limits, "org", "requests")["remaining"] == 10000 - 1
    assert 0 < limit_of(limits, "org", "cost")["remaining"] < 500  # gpt-4o's estimated cost is charged


def test_tool_model_and_tokens_are_optional(api):
    response = api.check(agent="copywriter")

    assert response.status_code == 200, response.content
    limits = response.json()["limits"]
    assert limit_of(limits, "agent", "tokens")["remaining"] == 25000
    assert limit_of(limits, "agent", "credits")["remaining"] == 49
    assert limit_of(limits, "team", "tokens", node="marketing")["remaining"] == 200000


def test_null_tool_and_model_are_the_same_as_leaving_them_out(api):
    response = api.check(agent="agent-2", tool=None, model=None, tokens=10)

    assert response.status_code == 200, response.content
    assert limit_of(response.json()["limits"], "agent", "tokens")["remaining"] == 25000 - 10


def test_a_refused_check_answers_429_names_the_blocking_limit_and_charges_nothing(api):
    assert api.check(agent="agent-1", tool="delete_record").status_code == 200
    assert api.check(agent="agent-1", tool="delete_record").status_code == 200
    before = peek(api, "agent-1")

    response = api.check(agent="agent-1", tool="delete_record")

    assert response.status_code == 429
    body = response.json()
    assert set(body) == {"allowed", "blocked_by", "retry_after_ms", "limits"}
    assert body["allowed"] is False
    blocked = body["blocked_by"]
    assert {key: blocked[key] for key in ("level", "node", "metric", "limit", "remaining", "window", "tool")} == {
        "level": "agent", "node": "agent-1", "metric": "requests", "limit": 2, "remaining": 0, "window": "5m",
        "tool": "delete_record"}
    assert blocked in body["limits"]
    # The window is counted in 10 sub-window buckets: a request leaves it up to a tenth of it late.
    assert 0 < body["retry_after_ms"] <= 5 * 60 * 1000 * 1.1
    after = peek(api, "agent-1")
    assert limit_of(after, "org", "requests")["remaining"] == limit_of(before, "org", "requests")["remaining"]


def test_a_check_larger_than_a_limit_is_refused_with_no_retry_time(api):
    response = api.check(agent="agent-2", tokens=30000)  # the tier allows 25,000 tokens an hour

    assert response.status_code == 429
    body = response.json()
    assert body["retry_after_ms"] is None
    assert (body["blocked_by"]["level"], body["blocked_by"]["metric"]) == ("agent", "tokens")
    assert "Retry-After" not in response


def test_tokens_of_exactly_a_billion_pass_validation(api):
    response = api.check(agent="agent-1", tokens=10**9)

    assert response.status_code == 429  # valid input, but over every tokens limit
    assert response.json()["retry_after_ms"] is None


def test_an_unknown_agent_is_a_404(api):
    body = assert_error(api.check(agent="no-such-agent"), 404, "not_found")
    assert "no-such-agent" in body["detail"]


# -- batch ---------------------------------------------------------------------------------------


def test_a_batch_decides_each_check_on_its_own_and_answers_in_order(api):
    checks = [
        {"agent": "agent-1", "tool": "delete_record"},
        {"agent": "agent-1", "tool": "delete_record"},
        {"agent": "agent-1", "tool": "delete_record"},  # the third in 5 minutes: refused
        {"agent": "no-such-agent"},
        {"agent": "globex-bot"},  # another org's agent: unknown here
        {"agent": "agent-2", "tokens": 30000},  # can never pass
        {"agent": "copywriter", "tool": "web_search", "tokens": 100},
    ]

    response = api.post("/api/v1/check/batch", {"checks": checks})

    assert response.status_code == 200, response.content
    results = response.json()["results"]
    assert len(results) == len(checks)
    assert [r.get("allowed") for r in results] == [True, True, False, None, None, False, True]
    assert results[2]["blocked_by"]["tool"] == "delete_record" and results[2]["retry_after_ms"] > 0
    assert results[3] == {"error": "not_found", "detail": "no agent 'no-such-agent' in this organization"}
    assert results[4] == {"error": "not_found", "detail": "no agent 'globex-bot' in this organization"}
    assert results[5]["retry_after_ms"] is None
    assert results[0]["reservation"] != results[1]["reservation"]
    assert limit_of(results[6]["limits"], "agent", "tokens")["remaining"] == 25000 - 100


def test_a_batch_charges_exactly_what_single_checks_would(api):
    response = api.post("/api/v1/check/batch", {"checks": [{"agent": "agent-1", "tool": "web_search"}] * 3})

    assert response.status_code == 200
    assert [r["allowed"] for r in response.json()["results"]] == [True] * 3
    limits = peek(api, "agent-1")
    assert limit_of(limits, "org", "requests")["remaining"] == 10000 - 3


def test_a_batch_of_100_checks_is_accepted(api):
    checks = [{"agent": DEMO_AGENTS[i % 4], "tool": "web_search"} for i in range(100)]

    response = api.post("/api/v1/check/batch", {"checks": checks})

    assert response.status_code == 200
    results = response.json()["results"]
    assert len(results) == 100 and all(r["allowed"] for r in results)
    assert limit_of(peek(api, "agent-1"), "org", "requests")["remaining"] == 10000 - 100


@pytest.mark.parametrize("body, field", [
    ({"checks": [{"agent": "agent-1"}] * 101}, "checks"),
    ({"checks": []}, "checks"),
    ({"checks": {"agent": "agent-1"}}, "checks"),
    ({}, "checks"),
    ({"checks": [{"agent": "agent-1"}], "dry_run": True}, "dry_run"),
    ({"checks": [{"agent": "agent-1"}, {"agent": "agent-1", "tokens": -1}]}, "checks[1].tokens"),
    ({"checks": [{"agent": "agent-1"}, {"agent": "agent-1"}, {"tool": "web_search"}]}, "checks[2].agent"),
    ({"checks": [{"agent": "agent-1", "colour": "red"}]}, "checks[0].colour"),
    ({"checks": [{"agent": "agent-1", "tokens": "12"}]}, "checks[0].tokens"),
    ({"checks": [{"agent": "agent-1", "tokens": 10**9 + 1}]}, "checks[0].tokens"),
    ({"checks": ["agent-1"]}, "checks[0]"),
], ids=["101-checks", "empty", "not-a-list", "missing", "unknown-field", "negative-tokens", "missing-agent",
        "unknown-field-in-a-check", "string-tokens", "too-many-tokens", "check-not-an-object"])
def test_a_bad_batch_is_a_400_naming_the_field_and_charges_nothing(api, body, field):
    assert_error(api.post("/api/v1/check/batch", body), 400, "invalid_request", field=field)
    assert limit_of(peek(api, "agent-1"), "org", "requests")["remaining"] == 10000
