"""RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers) on 200 and 429, and Retry-After on 429.

The headers are parsed as Structured Field Lists (RFC 8941) and checked item by item against the
JSON body's limits: one item per limit, q/w/qu from the policy, r/t from what remains.
"""

from __future__ import annotations

import math
from decimal import Decimal


from tests.api.structured_fields import by_name, parse_list

WINDOW_SECONDS = {"10s": 10, "5m": 300, "1h": 3600, "1m": 60, "day": 86400}
UNITS = {"requests": "requests", "credits": "credits", "tokens": "tokens", "cost": "usd-micro",
         "concurrency": "concurrent-requests"}


def policy_name(limit: dict) -> str:
    parts = [limit["level"], limit["node"], limit["metric"], limit["window"] or "at-once"]
    return ":".join(parts + [part for part in (limit["tool"], limit["model"]) if part])


def units(limit: dict, value) -> int:
    if limit["metric"] == "cost":
        return int((Decimal(str(value)) * 1_000_000).to_integral_value())
    return int(value)


def assert_ratelimit_headers_match(response, limits: list[dict]) -> None:
    policies = parse_list(response["RateLimit-Policy"])
    states = parse_list(response["RateLimit"])
    names = [policy_name(limit) for limit in limits]
    assert [name for name, _ in policies] == names, "one RateLimit-Policy item per limit, in the body's order"
    assert [name for name, _ in states] == names, "one RateLimit item per limit, in the body's order"
    policy_params, state_params = by_name(policies), by_name(states)
    for limit, name in zip(limits, names):
        policy, state = policy_params[name], state_params[name]
        expected_policy = {"q": units(limit, limit["limit"]), "qu": UNITS[limit["metric"]]}
        if limit["window"]:
            expected_policy["w"] = WINDOW_SECONDS[limit["window"]]
        assert policy == expected_policy, (name, policy)
        assert state == {"r": units(limit, limit["remaining"]), "t": math.ceil(limit["reset_ms"] / 1000)}, (name, state)
        assert state["r"] >= 0 and state["t"] >= 0


def exhaust_delete_record(api):
    for _ in range(2):
        assert api.check(agent="agent-1", tool="delete_record").status_code == 200
    return api.check(agent="agent-1", tool="delete_record")


def test_an_allowed_check_has_one_header_item_per_limit_and_no_retry_after(api):
    response = api.check(agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000)

    assert response.status_code == 200
    limits = response.json()["limits"]
    assert len(limits) == 7
    assert_ratelimit_headers_match(response, limits)
    assert "Retry-After" not in response


def test_the_header_values_are_the_ones_of_the_demo_policy(api):
    response = api.check(agent="agent-1", tool="llm_call", tokens=2000)

    policies = by_name(parse_list(response["RateLimit-Policy"]))
    states = by_name(parse_list(response["RateLimit"]))
    assert policies["agent:agent-1:tokens:1h"] == {"q": 25000, "w": 3600, "qu": "tokens"}
    assert states["agent:agent-1:tokens:1h"]["r"] == 23000
    assert policies["agent:agent-1:credits:10s"] == {"q": 50, "w": 10, "qu": "credits"}
    assert states["agent:agent-1:credits:10s"]["r"] == 47
    assert policies["org:acme-corp:cost:day"] == {"q": 500_000_000, "w": 86400, "qu": "usd-micro"}
    assert policies["org:acme-corp:requests:1h"] == {"q": 10000, "w": 3600, "qu": "requests"}
    assert states["org:acme-corp:requests:1h"]["r"] == 9999
    assert 0 < states["org:acme-corp:tokens:1h"]["t"] <= 3600 * 1.1


def test_a_refused_check_has_the_headers_and_retry_after_in_whole_seconds_rounded_up(api):
    response = exhaust_delete_record(api)

    assert response.status_code == 429
    body = response.json()
    assert_ratelimit_headers_match(response, body["limits"])
    assert response["Retry-After"] == str(math.ceil(body["retry_after_ms"] / 1000))
    states = by_name(parse_list(response["RateLimit"]))
    assert states["agent:agent-1:requests:5m:delete_record"]["r"] == 0


def test_a_sub_second_wait_is_a_retry_after_of_one_second(api):
    # code_execute weighs 5 credits: ten calls empty agent-2's bucket of 50, which refills 5 a second
    answers = [api.check(agent="agent-2", tool="code_execute") for _ in range(11)]
    refused = answers[-1]

    assert [a.status_code for a in answers[:10]] == [200] * 10
    assert refused.status_code == 429
    body = refused.json()
    assert body["blocked_by"]["metric"] == "credits"
    assert 0 < body["retry_after_ms"] <= 1000
    assert refused["Retry-After"] == "1" == str(math.ceil(body["retry_after_ms"] / 1000))
    assert_ratelimit_headers_match(refused, body["limits"])


def test_a_request_that_can_never_pass_has_the_headers_but_no_retry_after(api):
    response = api.check(agent="agent-2", tokens=30000)

    assert response.status_code == 429 and response.json()["retry_after_ms"] is None
    assert_ratelimit_headers_match(response, response.json()["limits"])
    assert "Retry-After" not in response


def test_a_refused_lease_has_a_concurrency_item_without_a_window_and_retry_after(api):
    for _ in range(3):
        assert api.post("/api/v1/leases", {"agent": "agent-1", "ttl_s": 30}).status_code == 201

    refused = api.post("/api/v1/leases", {"agent": "agent-2", "ttl_s": 30})

    assert refused.status_code == 429
    body = refused.json()
    assert_ratelimit_headers_match(refused, body["limits"])
    assert by_name(parse_list(refused["RateLimit-Policy"]))["user:alice:concurrency:at-once"] == {
        "q": 3, "qu": "concurrent-requests"}
    assert refused["Retry-After"] == str(math.ceil(body["retry_after_ms"] / 1000))


def test_the_quota_answer_has_the_headers_of_every_limit(api):
    api.check(agent="research-bot", tool="web_search", tokens=300)

    response = api.get("/api/v1/agents/research-bot/quota")

    assert response.status_code == 200
    assert_ratelimit_headers_match(response, response.json()["limits"])
    assert "Retry-After" not in response


def test_the_quota_answer_has_no_retry_after_even_when_a_limit_is_exhausted(api):
    exhaust_delete_record(api)

    response = api.get("/api/v1/agents/agent-1/quota", {"tool": "delete_record"})

    assert response.status_code == 200
    assert "Retry-After" not in response


def test_errors_other_than_429_have_no_ratelimit_headers(api):
    for response in (api.check(agent="no-such-agent"), api.check(tokens=-1)):
        assert response.status_code in (400, 404)
        assert not {"RateLimit", "RateLimit-Policy", "Retry-After"} & set(response.headers)
