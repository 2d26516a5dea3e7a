"""/dashboard/ with Django's test client: who sees what, the numbers against the rollups, filters, CSV,
bad input. Real Postgres, real Valkey: spend is made through the engine and drained.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.test import Client

from quotas.models import HourlySpend
from quotas.services.reports import as_csv, daily_spend
from tests.dashboard.conftest import PASSWORD

pytestmark = pytest.mark.django_db
URL = "/dashboard/"
CSV = "/dashboard/spend.csv"


def today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


def client_for(user) -> Client:
    client = Client(raise_request_exception=False)  # a server error is a 500 to assert on, not an exception
    client.force_login(user)
    return client


def segments(html: str) -> list[dict]:
    """The spend chart's bar segments: their data attributes."""
    chart = html[html.index('class="chart spend-chart"'):]
    chart = chart[:chart.index("</svg>")]
    return [dict(re.findall(r'data-(\w+)="([^"]*)"', rect)) for rect in re.findall(r"<rect [^>]*>", chart)]


# -- login and who sees what --------------------------------------------------------------------


def test_login_required(users):
    anonymous = Client()
    for url in (URL, CSV):
        response = anonymous.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(f"/dashboard/login/?next={url}")
    assert anonymous.get("/dashboard/login/").status_code == 200


def test_the_login_form_logs_in_and_logout_logs_out(users):
    client = Client()
    response = client.post("/dashboard/login/", {"username": "viewer", "password": PASSWORD, "next": URL})
    assert response.status_code == 302 and response["Location"] == URL
    assert client.get(URL).status_code == 200
    assert client.post("/dashboard/logout/").status_code == 302
    assert client.get(URL).status_code == 302
    wrong = client.post("/dashboard/login/", {"username": "viewer", "password": "nope"})
    assert wrong.status_code == 200 and b"did not match" in wrong.content


def test_a_viewer_sees_their_org_and_not_another(users, spent_today):
    viewer = client_for(users["viewer"])
    response = viewer.get(URL)
    assert response.status_code == 200
    assert response.context["orgs"] == ["acme-corp"]  # the default: the one org they may see
    assert [value for value, _ in response.context["form"].fields["org"].choices] == ["acme-corp"]
    for url in (URL, CSV):
        assert viewer.get(url, {"org": "globex"}).status_code == 404
        assert viewer.get(url, {"org": "no-such-org"}).status_code == 404
        assert viewer.get(url, {"org": "*"}).status_code == 404  # "all" is every org they see: only with several
    assert b"globex" not in viewer.get(URL).content


def test_staff_see_every_org_and_all_of_them_together(users, spent_today):
    staff = client_for(users["staff"])
    response = staff.get(URL, {"org": "globex", "group_by": "agent"})
    assert response.status_code == 200
    assert response.context["spend"].groups == ["globex-bot"]
    choices = [value for value, _ in response.context["form"].fields["org"].choices]
    assert choices == ["acme-corp", "globex", "*"]
    both = staff.get(URL, {"org": "*"})
    assert both.status_code == 200
    total = HourlySpend.objects.aggregate(cost=Sum("cost"))["cost"]
    assert both.context["spend"].total_cost == total
    assert both.context["board"].budgets is None and b"Pick one organization" in both.content


def test_a_user_with_no_org_is_told_so(users):
    response = client_for(users["nobody"]).get(URL)
    assert response.status_code == 200
    assert b"not a viewer of any organization" in response.content
    assert client_for(users["nobody"]).get(CSV).status_code == 404


# -- the numbers ---------------------------------------------------------------------------------


def test_the_numbers_shown_equal_the_rollups(users, spent_today):
    response = client_for(users["viewer"]).get(URL)
    html = response.content.decode()
    spend = response.context["spend"]
    rollups = HourlySpend.objects.filter(org="acme-corp").aggregate(
        cost=Sum("cost"), requests=Sum("requests"), tokens=Sum("tokens"), denied=Sum("denied"))
    assert spend.total_cost == rollups["cost"] == spent_today.cost
    assert (spend.total_requests, spend.total_denied) == (rollups["requests"], rollups["denied"]) == (6, 2)
    assert spend.total_tokens == rollups["tokens"]
    kpi = re.search(r'id="kpi-cost" data-value="([^"]+)">([^<]+)<', html)
    assert Decimal(kpi[1]) == spent_today.cost and kpi[2] == "$0.054"  # exact, and shown to two significant digits

    # The chart: one segment per team that spent today, with its exact cost.
    bars = segments(html)
    assert {(bar["day"], bar["group"]): Decimal(bar["value"]) for bar in bars} == {
        (today().isoformat(), team): cost for team, cost in spent_today.by["team"].items()}
    assert all(bar["day"] == today().isoformat() for bar in bars)

    # Top users and agents: cost, requests, tokens from the rollups, the biggest first.
    top_agents = response.context["board"].top_agents
    assert [t.name for t in top_agents] == sorted(spent_today.by["agent"], key=lambda a: -spent_today.by["agent"][a])
    for total in top_agents:
        rows = HourlySpend.objects.filter(org="acme-corp", agent=total.name).aggregate(
            cost=Sum("cost"), requests=Sum("requests"), tokens=Sum("tokens"), denied=Sum("denied"))
        assert (total.cost, total.requests, total.tokens, total.denied) == (
            rows["cost"], rows["requests"], rows["tokens"], rows["denied"])
    assert {t.name: t.cost for t in response.context["board"].top_users} == spent_today.by["user"]
    assert {t.name: t.owner for t in response.context["board"].top_users} == {
        "alice": "engineering", "bob": "engineering", "carol": "marketing"}

    # Refused checks per day.
    assert response.context["spend"].denied_by_day[today()] == 2
    assert 'class="chart denied-chart"' in html


def test_budgets_show_what_redis_counted(users, spent_today):
    board = client_for(users["viewer"]).get(URL).context["board"]
    budgets = {(b.level, b.node, b.metric, b.window): b for b in board.budgets.rows}
    # Acme's $500 a day: used exactly what was spent today (the settled costs).
    org_cost = budgets[("org", "acme-corp", "cost", "day")]
    assert org_cost.limit == Decimal(500) and org_cost.used == spent_today.cost
    tokens = HourlySpend.objects.filter(org="acme-corp").aggregate(t=Sum("tokens"))["t"]
    assert budgets[("org", "acme-corp", "tokens", "1h")].used == tokens
    assert budgets[("team", "marketing", "tokens", "1h")].used == HourlySpend.objects.filter(
        org="acme-corp", team="marketing").aggregate(t=Sum("tokens"))["t"]
    assert ("user", "alice", "tokens", "1h") in budgets and ("user", "bob", "tokens", "1h") in budgets
    agent_rows = [b for b in board.budgets.rows if b.level == "agent"]
    assert {b.node for b in agent_rows} == set(spent_today.by["agent"])
    assert agent_rows == sorted(agent_rows, key=lambda b: -b.percent)  # the fullest first
    assert not [b for b in board.budgets.rows if b.metric not in ("cost", "tokens")]


def test_grouping_by_model_and_an_empty_range(users, spent_today):
    viewer = client_for(users["viewer"])
    response = viewer.get(URL, {"group_by": "model"})
    assert {bar["group"]: Decimal(bar["value"]) for bar in segments(response.content.decode())} == spent_today.by["model"]
    assert set(response.context["spend"].groups) == {"gpt-4o", "gpt-4o-mini", "claude-sonnet-4"}

    empty = viewer.get(URL, {"from": "2020-01-01", "to": "2020-01-31"})
    assert empty.status_code == 200
    assert b"No spend in this range." in empty.content and b"No refused checks in this range." in empty.content
    assert len(empty.context["spend"].days) == 31


def test_the_default_range_is_the_last_14_days(users, spent_today):
    form = client_for(users["viewer"]).get(URL).context["form"]
    assert form.cleaned_data["end"] == today()
    assert form.cleaned_data["start"] == today() - dt.timedelta(days=13)
    assert form.cleaned_data["group_by"] == "team"


def test_csv_is_the_report_of_the_same_filters(users, spent_today):
    response = client_for(users["viewer"]).get(CSV, {"org": "acme-corp", "from": today().isoformat(),
                                                      "to": today().isoformat(), "group_by": "agent"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"] == (
        f'attachment; filename="spend-acme-corp-{today()}-{today()}-agent.csv"')
    body = response.content.decode()
    assert body == as_csv(daily_spend(org="acme-corp", start=today(), end=today(), group_by="agent"), "agent")
    rows = {row["agent"]: row for row in csv.DictReader(io.StringIO(body))}
    assert {agent: Decimal(row["cost"]) for agent, row in rows.items()} == spent_today.by["agent"]
    # The page links the CSV of what it shows.
    page = client_for(users["viewer"]).get(URL, {"group_by": "model"}).content.decode()
    assert f'href="/dashboard/spend.csv?org=acme-corp&amp;from={today() - dt.timedelta(days=13)}&amp;to={today()}&amp;group_by=model"' in page


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("params, message", [
    ({"from": "2026-13-01"}, "Enter a valid date."),
    ({"from": "yesterday"}, "Enter a valid date."),
    ({"from": "2026-03-10", "to": "2026-03-01"}, "The end date is before the start date."),
    ({"from": "2024-01-01", "to": "2025-12-31"}, "A range is at most 366 days; this one has 731."),
    ({"from": "9999-12-31", "to": "9999-12-31"}, "Pick a day from 2000-01-01 to 9999-12-30."),
    ({"group_by": "planet"}, "Select a valid choice."),
    ({"group_by": "team'; DROP TABLE quotas_hourlyspend; --"}, "Select a valid choice."),
])
def test_bad_filters_are_a_message_never_a_500(users, params, message):
    viewer = client_for(users["viewer"])
    response = viewer.get(URL, params)
    assert response.status_code == 400
    assert message.encode() in response.content
    assert b"These filters cannot be shown" in response.content
    as_csv_ = viewer.get(CSV, params)
    assert as_csv_.status_code == 400 and message.encode() in as_csv_.content


def test_a_366_day_range_is_fine(users, spent_today):
    response = client_for(users["viewer"]).get(URL, {"from": "2025-01-01", "to": "2025-12-31"})
    assert response.status_code == 200 and len(response.context["spend"].days) == 365
    leap = client_for(users["viewer"]).get(URL, {"from": "2024-01-01", "to": "2024-12-31"})
    assert leap.status_code == 200 and len(leap.context["spend"].days) == 366


def test_post_is_refused(users):
    assert client_for(users["viewer"]).post(URL).status_code == 405


# -- the admin links here ------------------------------------------------------------------------


def test_the_admin_links_the_dashboard(users):
    users["staff"].is_superuser = True
    users["staff"].save()
    response = client_for(users["staff"]).get("/admin/")
    assert response.status_code == 200 and b'href="/dashboard/"' in response.content
