"""Every error is JSON {"error": CODE, "detail": TEXT}; a 400 names the field; no input answers 500."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api, assert_error
from tests.api.test_check import limit_of, peek

MAX_BODY = 64 * 1024

# Every operation with a body that would be valid, for the checks that apply to all of them.
OPERATIONS = [
    ("POST", "/api/v1/check", {"agent": "agent-1"}),
    ("POST", "/api/v1/check/batch", {"checks": [{"agent": "agent-1"}]}),
    ("POST", "/api/v1/usage", {"reservation": "x.engineering.alice.agent-1", "input_tokens": 1, "output_tokens": 1}),
    ("POST", "/api/v1/leases", {"agent": "agent-1"}),
    ("POST", "/api/v1/leases/x.engineering.alice.agent-1/renew", {}),
    ("DELETE", "/api/v1/leases/x.engineering.alice.agent-1", None),
    ("GET", "/api/v1/agents/agent-1/quota", None),
    ("GET", "/api/v1/reports/daily-spend?from=2026-11-01&to=2026-11-02", None),
]
OPERATION_IDS = [f"{method} {path.split('?')[0]}" for method, path, _ in OPERATIONS]


def send(api: Api, method: str, path: str, body):
    if method == "POST":
        return api.post(path, body)
    if method == "DELETE":
        return api.delete(path)
    return api.client.get(path, headers=api.headers())


# -- 400 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({}, "agent"),
    ({"tool": "web_search"}, "agent"),
    ({"agent": ""}, "agent"),
    ({"agent": None}, "agent"),
    ({"agent": "Agent One"}, "agent"),
    ({"agent": "a" * 65}, "agent"),
    ({"agent": ["agent-1"]}, "agent"),
    ({"agent": "agent-1", "tokens": -1}, "tokens"),
    ({"agent": "agent-1", "tokens": 1.5}, "tokens"),
    ({"agent": "agent-1", "tokens": 2.0}, "tokens"),
    ({"agent": "agent-1", "tokens": "2000"}, "tokens"),
    ({"agent": "agent-1", "tokens": True}, "tokens"),
    ({"agent": "agent-1", "tokens": None}, "tokens"),
    ({"agent": "agent-1", "tokens": 10**9 + 1}, "tokens"),
    ({"agent": "agent-1", "tokens": 10**30}, "tokens"),
    ({"agent": "agent-1", "tool": "Web Search"}, "tool"),
    ({"agent": "agent-1", "model": "gpt 4o"}, "model"),
    ({"agent": "agent-1", "colour": "red"}, "colour"),
    ({"agent": "agent-1", "Agent": "agent-2"}, "Agent"),
], ids=["empty", "missing-agent", "blank-agent", "null-agent", "agent-not-a-slug", "agent-too-long", "agent-a-list",
        "negative-tokens", "fractional-tokens", "float-tokens", "string-tokens", "boolean-tokens", "null-tokens",
        "tokens-over-a-billion", "huge-tokens", "bad-tool", "bad-model", "unknown-field", "unknown-field-case"])
def test_bad_check_input_is_a_400_naming_the_field_and_charges_nothing(api, body, field):
    body = assert_error(api.post("/api/v1/check", body), 400, "invalid_request", field=field)
    assert all(isinstance(message, str) for message in body["fields"])
    assert limit_of(peek(api, "agent-1"), "org", "requests")["remaining"] == 10000


@pytest.mark.parametrize("body, field", [
    ({"agent": "agent-1", "model": 0}, "model"),
    ({"agent": "agent-1", "tool": 7}, "tool"),
], ids=["number-model", "number-tool"])
def test_a_number_where_a_string_is_expected_is_a_400(api, body, field):
    assert_error(api.post("/api/v1/check", body), 400, "invalid_request", field=field)


def test_every_bad_field_is_named_at_once(api):
    body = assert_error(api.post("/api/v1/check", {"tokens": -1, "colour": "red"}), 400, "invalid_request")
    assert "colour: " in body["detail"]  # unknown fields are reported first, on their own
    body = assert_error(api.post("/api/v1/check", {"tool": "BAD", "tokens": -1}), 400, "invalid_request")
    for field in ("agent", "tool", "tokens"):
        assert f"{field}: " in body["detail"], body


@pytest.mark.parametrize("raw", [
    "{not json",
    '{"agent": "agent-1",}',
    '{"agent": "agent-1", "tokens": NaN}',
    '{"agent": "agent-1", "tokens": Infinity}',
    '{"agent": "agent-1"} trailing',
    b'{"agent": "\xff\xfe"}',
    '{"agent": "agent-1", "tokens": ' + "9" * 5000 + "}",
], ids=["broken", "trailing-comma", "nan", "infinity", "trailing-text", "not-utf8", "5000-digit-number"])
def test_a_body_that_is_not_json_is_a_400_naming_the_body(api, raw):
    assert_error(api.post("/api/v1/check", raw=raw), 400, "invalid_body", field="body")


@pytest.mark.parametrize("raw", ["[]", '["agent-1"]', '"agent-1"', "42", "null"])
def test_a_json_body_that_is_not_an_object_is_a_400(api, raw):
    assert_error(api.post("/api/v1/check", raw=raw), 400, "invalid_body", field="body")


def test_an_empty_body_is_a_400_for_the_missing_agent(api):
    assert_error(api.post("/api/v1/check", raw=""), 400, "invalid_request", field="agent")


def test_a_body_of_exactly_64_kib_is_accepted(api):
    raw = '{"agent": "agent-1"}'
    raw += " " * (MAX_BODY - len(raw))
    assert len(raw.encode()) == MAX_BODY

    assert api.post("/api/v1/check", raw=raw).status_code == 200


@pytest.mark.parametrize("size", [MAX_BODY + 1, 3 * 1024 * 1024], ids=["64KiB+1", "3MiB"])
def test_a_body_over_64_kib_is_a_400(api, size):
    raw = '{"agent": "agent-1"}'
    raw += " " * (size - len(raw))

    body = assert_error(api.post("/api/v1/check", raw=raw), 400, "body_too_large", field="body")
    assert "64 KiB" in body["detail"]


def test_a_batch_body_over_64_kib_is_a_400(api):
    checks = [{"agent": "agent-1", "tool": "web_search", "model": "m" * 100}] * 100
    raw = '{"checks": %s}' % str(checks).replace("'", '"')
    raw += " " * (MAX_BODY + 1 - len(raw))

    assert_error(api.post("/api/v1/check/batch", raw=raw), 400, "body_too_large")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_declared_json_is_a_415(api, content_type):
    response = api.post("/api/v1/check", raw='{"agent": "agent-1"}', content_type=content_type)
    assert_error(response, 415, "unsupported_media_type")


# -- 401 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, body", OPERATIONS, ids=OPERATION_IDS)
def test_every_operation_answers_401_without_a_key(demo, method, path, body):
    response = send(Api(), method, path, body)

    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("authorization", [
    "Bearer aq_this-key-does-not-exist",
    "Bearer",
    "Bearer ",
    "Basic YWRtaW46YWRtaW4=",
    "Token aq_this-key-does-not-exist",
    "aq_this-key-does-not-exist",
], ids=["unknown-key", "no-key", "blank-key", "basic", "token-scheme", "no-scheme"])
def test_a_bad_authorization_header_is_a_401(demo, authorization):
    response = Api(authorization=authorization).check(agent="agent-1")

    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_key_with_a_stray_space_is_a_401(acme_key):
    response = Api(authorization=f"Bearer {acme_key.raw[:-1]} {acme_key.raw[-1]}").check(agent="agent-1")
    assert_error(response, 401, "not_authenticated")


def test_the_bearer_scheme_is_case_insensitive(acme_key):
    assert Api(authorization=f"bearer {acme_key.raw}").check(agent="agent-1").status_code == 200


# -- 404 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/api/v1/check", {"agent": "no-such-agent"}),
    ("POST", "/api/v1/leases", {"agent": "no-such-agent"}),
    ("GET", "/api/v1/agents/no-such-agent/quota", None),
    ("POST", "/api/v1/usage", {"reservation": "0123456789abcdef.team.user.no-such-agent", "input_tokens": 1,
                               "output_tokens": 1}),
    ("DELETE", "/api/v1/leases/0123456789abcdef.team.user.no-such-agent", None),
    ("POST", "/api/v1/leases/0123456789abcdef.team.user.no-such-agent/renew", {}),
], ids=["check", "lease", "quota", "usage", "release", "renew"])
def test_what_does_not_exist_is_a_json_404(api, method, path, body):
    assert_error(send(api, method, path, body), 404, "not_found")


def test_an_unknown_api_path_is_a_json_404(api):
    assert_error(api.get("/api/v1/no-such-endpoint"), 404, "not_found")


# -- 405 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/check"),
    ("PUT", "/api/v1/check"),
    ("GET", "/api/v1/check/batch"),
    ("GET", "/api/v1/usage"),
    ("GET", "/api/v1/leases"),
    ("GET", "/api/v1/leases/x.a.b.c"),
    ("PATCH", "/api/v1/leases/x.a.b.c"),
    ("GET", "/api/v1/leases/x.a.b.c/renew"),
    ("POST", "/api/v1/agents/agent-1/quota"),
    ("DELETE", "/api/v1/agents/agent-1/quota"),
    ("POST", "/api/v1/reports/daily-spend"),
])
def test_a_method_an_endpoint_does_not_have_is_a_405_listing_the_allowed_ones(api, method, path):
    response = api.generic(method, path, data=b"{}", content_type="application/json")

    assert_error(response, 405, "method_not_allowed")
    assert method not in response["Allow"].replace(" ", "").split(",")


# -- never a 500 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [
    "/api/v1/agents/%00/quota",
    "/api/v1/agents/" + "a" * 3000 + "/quota",
    "/api/v1/agents/%F0%9F%A4%96/quota",
    "/api/v1/agents/%ED%A0%80/quota",
    "/api/v1/agents/%3F/quota",
    "/api/v1/agents/%7Bglobex%7D/quota",
    "/api/v1/agents/agent-1%20/quota",
])
def test_odd_agent_ids_in_the_path_are_a_404(api, path):
    assert_error(api.get(path), 404, "not_found")


@pytest.mark.parametrize("lease", ["....", "a.b.c.d", "%00.%00.%00.%00", "x.{globex}.dana.agent-1", "x" * 3000,
                                   "%F0%9F%A4%96.a.b.c"])
def test_odd_lease_ids_are_a_404(api, lease):
    assert_error(api.delete(f"/api/v1/leases/{lease}"), 404, "not_found")
    assert_error(api.post(f"/api/v1/leases/{lease}/renew", {}), 404, "not_found")


@pytest.mark.parametrize("reservation", ["....", ".a.b.c", "x.{globex}.dana.agent-1", "x" * 300, "🤖.a.b.c"])
def test_odd_reservation_ids_are_a_404(api, reservation):
    response = api.post("/api/v1/usage", {"reservation": reservation, "input_tokens": 1, "output_tokens": 1})
    assert_error(response, 404, "not_found")


def test_an_unknown_field_named_with_a_lone_surrogate_is_a_400(api):
    response = api.post("/api/v1/check", raw='{"agent": "agent-1", "\\ud800": 1}')
    assert_error(response, 400, "invalid_request")


def test_deeply_nested_json_is_a_400(api):
    raw = '{"agent": ' + "[" * 30000 + "]" * 30000 + "}"
    assert len(raw) < MAX_BODY

    assert_error(api.post("/api/v1/check", raw=raw), 400, "invalid_body", field="body")


@pytest.mark.parametrize("raw", [
    '{"agent": "\\ud800"}',
    '{"agent": "agent-1\\u0000"}',
    '{"agent": "agent-1", "model": "\\udfff"}',
    '{"agent": "agent-1", "tool": {"name": "x"}}',
    '{"agent": {"$gt": ""}}',
    '{"agent": "agent-1", "tokens": -0}',
    '{"agent": "agent-1", "tokens": 1e3}',
    '{"agent": "agent-1", "agent": "agent-2", "tokens": [1]}',
    '{"checks": null}',
], ids=["surrogate-agent", "nul-agent", "surrogate-model", "object-tool", "object-agent", "minus-zero",
        "exponent", "duplicate-keys", "checks-null"])
def test_odd_json_values_are_answered_without_a_server_error(api, raw):
    response = api.post("/api/v1/check", raw=raw)
    assert response.status_code in (200, 400), (response.status_code, response.content[:300])
    assert "error" in response.json() or response.json()["allowed"] is True
