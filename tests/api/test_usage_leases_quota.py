"""Usage settlement, leases (create, renew, release), an agent's quota (peek) and the daily spend report."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from tests.api.conftest import assert_error
from tests.api.test_check import limit_of, peek


def parse_time(text: str) -> dt.datetime:
    assert text.endswith("Z"), text
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# -- usage ---------------------------------------------------------------------------------------


def test_settling_a_reservation_charges_the_actual_tokens_instead_of_the_estimate(api):
    reservation = api.check(agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000).json()["reservation"]

    response = api.post("/api/v1/usage", {"reservation": reservation, "input_tokens": 1200, "output_tokens": 640})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["reservation"] == reservation
    assert body["status"] == "settled"
    assert body["tokens"] == 1840 and body["estimated_tokens"] == 2000
    assert body["cost"] == pytest.approx(1.2 * 0.0025 + 0.64 * 0.01)
    assert body["estimated_cost"] > 0
    limits = peek(api, "agent-1")
    assert limit_of(limits, "agent", "tokens")["remaining"] == 25000 - 1840
    assert limit_of(limits, "org", "tokens")["remaining"] == 1000000 - 1840


def test_settling_twice_gives_the_same_answer_and_charges_once(api):
    reservation = api.check(agent="agent-2", tokens=500).json()["reservation"]
    usage = {"reservation": reservation, "input_tokens": 300, "output_tokens": 400}
    first = api.post("/api/v1/usage", usage).json()

    again = api.post("/api/v1/usage", usage)

    assert again.status_code == 200
    assert again.json() == {**first, "status": "repeat"}
    assert limit_of(peek(api, "agent-2"), "agent", "tokens")["remaining"] == 25000 - 700


@pytest.mark.parametrize("reservation", [
    "0123456789abcdef.engineering.alice.agent-1",  # well formed, never made
    "not-a-reservation",
    "a.b.c.d.e",
])
def test_an_unknown_reservation_is_a_404(api, reservation):
    response = api.post("/api/v1/usage", {"reservation": reservation, "input_tokens": 1, "output_tokens": 1})
    assert_error(response, 404, "not_found")


@pytest.mark.parametrize("body, field", [
    ({"input_tokens": 1, "output_tokens": 1}, "reservation"),
    ({"reservation": "r.a.b.c", "output_tokens": 1}, "input_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": 1}, "output_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": -1, "output_tokens": 1}, "input_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": 1, "output_tokens": 1.5}, "output_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": "1", "output_tokens": 1}, "input_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": 10**9 + 1, "output_tokens": 1}, "input_tokens"),
    ({"reservation": "r.a.b.c", "input_tokens": 1, "output_tokens": 1, "cost": 3}, "cost"),
    ({"reservation": 7, "input_tokens": 1, "output_tokens": True}, "output_tokens"),
], ids=["no-reservation", "no-input", "no-output", "negative", "float", "string", "over-a-billion", "unknown-field",
        "boolean"])
def test_bad_usage_is_a_400_naming_the_field(api, body, field):
    assert_error(api.post("/api/v1/usage", body), 400, "invalid_request", field=field)


# -- leases --------------------------------------------------------------------------------------


def test_a_lease_is_created_with_an_id_and_its_expiry(api):
    before = now()

    response = api.post("/api/v1/leases", {"agent": "agent-1", "ttl_s": 60})

    assert response.status_code == 201, response.content
    body = response.json()
    assert set(body) == {"lease", "expires_at"}
    assert body["lease"].endswith(".engineering.alice.agent-1")
    assert before + dt.timedelta(seconds=59) <= parse_time(body["expires_at"]) <= now() + dt.timedelta(seconds=61)
    concurrency = limit_of(peek(api, "agent-1"), "user", "concurrency")
    assert (concurrency["limit"], concurrency["remaining"]) == (3, 2)


def test_ttl_defaults_to_five_minutes(api):
    before = now()
    expires = parse_time(api.post("/api/v1/leases", {"agent": "agent-2"}).json()["expires_at"])
    assert before + dt.timedelta(seconds=299) <= expires <= now() + dt.timedelta(seconds=301)


def test_a_full_concurrency_limit_refuses_a_lease_with_429_until_one_is_released(api):
    # alice allows 3 concurrent runs across her agents
    leases = [api.post("/api/v1/leases", {"agent": agent, "ttl_s": 120}) for agent in ("agent-1", "agent-2", "agent-1")]
    assert [r.status_code for r in leases] == [201, 201, 201]

    refused = api.post("/api/v1/leases", {"agent": "agent-2", "ttl_s": 120})

    assert refused.status_code == 429
    body = refused.json()
    assert body["allowed"] is False
    blocked = body["blocked_by"]
    assert (blocked["level"], blocked["node"], blocked["metric"], blocked["limit"], blocked["remaining"],
            blocked["window"]) == ("user", "alice", "concurrency", 3, 0, None)
    assert 0 < body["retry_after_ms"] <= 120_000  # the earliest lease expires by then
    assert refused["Retry-After"] == str(math.ceil(body["retry_after_ms"] / 1000))

    assert api.delete(f"/api/v1/leases/{leases[0].json()['lease']}").status_code == 204
    assert api.post("/api/v1/leases", {"agent": "agent-2", "ttl_s": 120}).status_code == 201


def test_an_agent_without_a_concurrency_limit_gets_a_lease(api):
    assert api.post("/api/v1/leases", {"agent": "copywriter"}).status_code == 201


def test_releasing_a_lease_answers_204_then_404(api):
    lease = api.post("/api/v1/leases", {"agent": "agent-1"}).json()["lease"]

    first = api.delete(f"/api/v1/leases/{lease}")
    assert first.status_code == 204 and first.content == b""
    assert limit_of(peek(api, "agent-1"), "user", "concurrency")["remaining"] == 3

    assert_error(api.delete(f"/api/v1/leases/{lease}"), 404, "not_found")


def test_renewing_a_lease_moves_its_expiry(api):
    lease = api.post("/api/v1/leases", {"agent": "agent-1", "ttl_s": 10}).json()

    response = api.post(f"/api/v1/leases/{lease['lease']}/renew", {"ttl_s": 600})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["lease"] == lease["lease"]
    assert parse_time(body["expires_at"]) >= parse_time(lease["expires_at"]) + dt.timedelta(seconds=589)


def test_renewing_without_a_body_renews_for_five_minutes(api):
    lease = api.post("/api/v1/leases", {"agent": "agent-1", "ttl_s": 10}).json()["lease"]
    before = now()

    response = api.post(f"/api/v1/leases/{lease}/renew")

    assert response.status_code == 200, response.content
    assert parse_time(response.json()["expires_at"]) >= before + dt.timedelta(seconds=299)


def test_renewing_a_released_or_unknown_lease_is_a_404(api):
    lease = api.post("/api/v1/leases", {"agent": "agent-1"}).json()["lease"]
    api.delete(f"/api/v1/leases/{lease}")

    assert_error(api.post(f"/api/v1/leases/{lease}/renew", {}), 404, "not_found")
    assert_error(api.post("/api/v1/leases/0123456789abcdef.engineering.alice.agent-1/renew", {}), 404, "not_found")
    assert_error(api.post("/api/v1/leases/nonsense/renew", {}), 404, "not_found")
    assert_error(api.delete("/api/v1/leases/nonsense"), 404, "not_found")


def test_a_lease_for_an_unknown_agent_is_a_404(api):
    assert_error(api.post("/api/v1/leases", {"agent": "no-such-agent"}), 404, "not_found")


@pytest.mark.parametrize("path, body, field", [
    ("/api/v1/leases", {}, "agent"),
    ("/api/v1/leases", {"agent": "agent-1", "ttl_s": 0}, "ttl_s"),
    ("/api/v1/leases", {"agent": "agent-1", "ttl_s": 86401}, "ttl_s"),
    ("/api/v1/leases", {"agent": "agent-1", "ttl_s": "60"}, "ttl_s"),
    ("/api/v1/leases", {"agent": "agent-1", "ttl_s": 1.5}, "ttl_s"),
    ("/api/v1/leases", {"agent": "agent-1", "slots": 2}, "slots"),
    ("/api/v1/leases", {"agent": "Agent One"}, "agent"),
    ("/api/v1/leases/x.a.b.c/renew", {"ttl_s": -5}, "ttl_s"),
    ("/api/v1/leases/x.a.b.c/renew", {"ttl_s": 60, "agent": "agent-1"}, "agent"),
], ids=["no-agent", "ttl-zero", "ttl-over-a-day", "ttl-string", "ttl-float", "unknown-field", "bad-agent",
        "renew-negative", "renew-unknown-field"])
def test_bad_lease_input_is_a_400_naming_the_field(api, path, body, field):
    assert_error(api.post(path, body), 400, "invalid_request", field=field)


# -- an agent's quota (peek) ---------------------------------------------------------------------


def test_the_quota_lists_every_limit_that_applies_including_concurrency(api):
    response = api.get("/api/v1/agents/agent-1/quota")

    assert response.status_code == 200
    body = response.json()
    assert body["agent"] == "agent-1"
    assert [(l["level"], l["metric"], l["window"], l["limit"], l["remaining"]) for l in body["limits"]] == [
        ("org", "cost", "day", 500, 500),
        ("org", "requests", "1h", 10000, 10000),
        ("org", "tokens", "1h", 1000000, 1000000),
        ("team", "tokens", "1h", 500000, 500000),
        ("user", "concurrency", None, 3, 3),
        ("user", "tokens", "1h", 100000, 100000),
        ("agent", "credits", "10s", 50, 50),
        ("agent", "tokens", "1h", 25000, 25000),
    ]


def test_the_quota_consumes_nothing_and_shows_what_checks_used(api):
    first = peek(api, "research-bot")
    second = peek(api, "research-bot")
    assert [l["remaining"] for l in first] == [l["remaining"] for l in second]

    api.check(agent="research-bot", tool="web_search", tokens=700)

    after = peek(api, "research-bot")
    assert limit_of(after, "agent", "tokens")["remaining"] == 25000 - 700
    assert limit_of(after, "user", "tokens", node="bob")["remaining"] == 100000 - 700
    assert limit_of(after, "org", "requests")["remaining"] == 10000 - 1


def test_the_quota_for_a_tool_includes_that_tools_limits(api):
    plain = api.get("/api/v1/agents/agent-1/quota").json()["limits"]
    for_tool = api.get("/api/v1/agents/agent-1/quota", {"tool": "delete_record"}).json()["limits"]

    assert not [l for l in plain if l["tool"] == "delete_record"]
    assert limit_of(for_tool, "agent", "requests", tool="delete_record")["limit"] == 2


def test_the_quota_of_an_unknown_agent_is_a_404(api):
    assert_error(api.get("/api/v1/agents/no-such-agent/quota"), 404, "not_found")


@pytest.mark.parametrize("params, field", [
    ({"tokens": "-1"}, "tokens"),
    ({"tokens": "lots"}, "tokens"),
    ({"tokens": str(10**9 + 1)}, "tokens"),
    ({"tool": "Not A Tool"}, "tool"),
    ({"colour": "red"}, "colour"),
])
def test_bad_quota_parameters_are_a_400_naming_the_field(api, params, field):
    assert_error(api.get("/api/v1/agents/agent-1/quota", params), 400, "invalid_request", field=field)


# -- daily spend ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group_by", ["team", "user", "agent", "model", "tool"])
def test_daily_spend_answers_an_empty_list_of_rows_for_now(api, group_by):
    response = api.get("/api/v1/reports/daily-spend", {"from": "2026-11-01", "to": "2026-11-21", "group_by": group_by})

    assert response.status_code == 200, response.content
    assert response.json() == {"from": "2026-11-01", "to": "2026-11-21", "group_by": group_by, "rows": []}


def test_daily_spend_groups_by_team_by_default(api):
    response = api.get("/api/v1/reports/daily-spend", {"from": "2026-11-01", "to": "2026-11-01"})
    assert response.json()["group_by"] == "team"


@pytest.mark.parametrize("params, field", [
    ({"to": "2026-11-21"}, "from"),
    ({"from": "2026-11-01"}, "to"),
    ({"from": "yesterday", "to": "2026-11-21"}, "from"),
    ({"from": "2026-11-21", "to": "2026-11-01"}, "to"),
    ({"from": "2024-01-01", "to": "2026-01-01"}, "to"),
    ({"from": "2026-11-01", "to": "2026-11-21", "group_by": "org"}, "group_by"),
    ({"from": "2026-11-01", "to": "2026-11-21", "format": "xml"}, "format"),
    ({"from": "2026-11-01", "to": "2026-11-21", "page": "2"}, "page"),
], ids=["no-from", "no-to", "bad-date", "to-before-from", "over-366-days", "bad-group", "bad-format",
        "unknown-parameter"])
def test_bad_daily_spend_parameters_are_a_400_naming_the_field(api, params, field):
    assert_error(api.get("/api/v1/reports/daily-spend", params), 400, "invalid_request", field=field)
