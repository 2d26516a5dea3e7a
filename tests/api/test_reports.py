"""GET /api/v1/reports/daily-spend: JSON and CSV over the rollups, one org's rows only."""

from __future__ import annotations

import csv
import datetime as dt
import io

import pytest

from quotas.services.usage_drain import drain_all
from tests.api.conftest import assert_error

URL = "/api/v1/reports/daily-spend"


def today() -> str:
    return dt.datetime.now(dt.UTC).date().isoformat()


@pytest.fixture
def spent(demo, api):
    """Acme: 3 admitted checks (2 settled), Globex: 1, all drained (today, UTC)."""
    first = api.check(agent="agent-1", tool="llm_call", model="gpt-4o", tokens=1000).json()
    api.post("/api/v1/usage", {"reservation": first["reservation"], "input_tokens": 1000, "output_tokens": 500})
    second = api.check(agent="research-bot", tool="web_search", model="gpt-4o-mini", tokens=200).json()
    api.post("/api/v1/usage", {"reservation": second["reservation"], "input_tokens": 100, "output_tokens": 100})
    api.check(agent="agent-2", tool="web_search")
    demo.check(org="globex", agent="globex-bot", tokens=10)
    drain_all()


@pytest.mark.django_db(transaction=True)
def test_json_by_user_and_by_model(api, spent):
    body = api.get(URL, {"from": today(), "to": today(), "group_by": "user"}).json()
    assert body["group_by"] == "user" and body["from"] == today()
    rows = {row["user"]: row for row in body["rows"]}
    assert set(rows) == {"alice", "bob"}
    alice = rows["alice"]
    assert (alice["requests"], alice["credits"], alice["input_tokens"], alice["output_tokens"]) == (2, 4, 1000, 500)
    # gpt-4o at $0.0025 in / $0.01 out per 1K: 1000 in + 500 out = $0.0075, exact, as a string
    assert alice["cost"] == "0.0075"
    assert rows["bob"]["cost"] == "0.000075"  # gpt-4o-mini: 100 in at $0.00015 + 100 out at $0.0006 per 1K
    by_team = api.get(URL, {"from": today(), "to": today()}).json()["rows"]  # group_by defaults to team
    assert by_team == [{  # the README's example
        "day": today(), "team": "engineering", "requests": 3, "credits": 5, "tokens": 1700, "input_tokens": 1100,
        "output_tokens": 600, "cost": "0.007575", "unsettled": 0, "denied": 0,
    }]

    by_model = {row["model"]: row["requests"] for row in api.get(URL, {"from": today(), "to": today(),
                                                                       "group_by": "model"}).json()["rows"]}
    assert by_model == {"": 1, "gpt-4o": 1, "gpt-4o-mini": 1}


@pytest.mark.django_db(transaction=True)
def test_csv(api, spent):
    response = api.get(URL, {"from": today(), "to": today(), "group_by": "agent", "format": "csv"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [row["agent"] for row in rows] == ["agent-1", "agent-2", "research-bot"]
    assert rows[0]["cost"] == "0.0075" and rows[0]["day"] == today()


@pytest.mark.django_db(transaction=True)
def test_an_org_sees_only_its_own_spend(globex_api, spent):
    rows = globex_api.get(URL, {"from": today(), "to": today(), "group_by": "agent"}).json()["rows"]
    assert [(row["agent"], row["requests"]) for row in rows] == [("globex-bot", 1)]


@pytest.mark.django_db(transaction=True)
def test_no_rows_outside_the_range(api, spent):
    assert api.get(URL, {"from": "2020-01-01", "to": "2020-01-31"}).json()["rows"] == []


@pytest.mark.parametrize("params, field", [
    ({"to": "2026-01-01"}, "from"),
    ({"from": "2026-01-02", "to": "2026-01-01"}, "to"),
    ({"from": "2026-01-01", "to": "2026-13-01"}, "to"),
    ({"from": "2026-01-01", "to": "2026-01-02", "group_by": "planet"}, "group_by"),
    ({"from": "2026-01-01", "to": "2026-01-02", "format": "xml"}, "format"),
    ({"from": "2024-01-01", "to": "2026-01-02"}, "to"),
    ({"from": "9999-12-31", "to": "9999-12-31"}, "to"),  # its end (the next midnight) is no date
])
@pytest.mark.django_db
def test_bad_queries_are_400s_naming_the_field(api, params, field):
    assert_error(api.get(URL, params), 400, "invalid_request", field=field)
