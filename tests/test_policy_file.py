"""load_policy / export_policy: round trips, idempotency, and bad files that change nothing."""

from __future__ import annotations

import datetime as dt
import json
import os
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas.models import Agent, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost
from quotas.policy.document import PolicyFileError, dump_policy, parse_policy
from quotas.selectors import known_tiers, policy_export
from quotas.services.policy_load import policy_load

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parent.parent / "quotas" / "fixtures" / "demo_policy.yaml"
POLICY_MODELS = (Organization, Team, Member, Agent, Tier, Limit, Override, ToolCost, ModelPrice)


def load(data, prune=False):
    return policy_load(doc=parse_policy(data, known_tiers=known_tiers()), prune=prune)


def exported() -> dict:
    return policy_export().to_data()


def counts() -> dict:
    return {model.__name__: model.objects.count() for model in POLICY_MODELS}


def write(tmp_path, data, name="policy.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def demo_data() -> dict:
    return yaml.safe_load(DEMO.read_text())


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


def test_demo_file_round_trips_through_the_database(tmp_path):
    call_command("load_policy", str(DEMO), stdout=StringIO())
    out = StringIO()
    call_command("export_policy", stdout=out)

    assert yaml.safe_load(out.getvalue()) == parse_policy(demo_data()).to_data()
    # The export is itself a policy file, and loading it changes nothing.
    report = load(yaml.safe_load(out.getvalue()))
    assert (report.created, report.updated, report.deleted) == (0, 0, 0)
    assert report.not_in_file == []


def test_demo_file_content_reaches_the_tables():
    load(demo_data())
    acme = Organization.objects.get(slug="acme-corp")
    assert acme.limits.get(metric="cost").amount == Decimal("500.00")
    assert acme.limits.get(metric="cost").period == "day"
    agent = Agent.objects.get(org=acme, slug="agent-1")
    assert (agent.member.slug, agent.member.team.slug, agent.tier.slug) == ("alice", "engineering", "standard-agent")
    delete = agent.limits.get()
    assert (delete.metric, delete.tool, delete.amount, delete.window) == ("requests", "delete_record", 2, 300)
    assert Member.objects.get(slug="alice").limits.get(metric="concurrency").window is None
    credits = Tier.objects.get(slug="standard-agent").limits.get(metric="credits")
    assert (credits.window, credits.burst) == (10, 50)
    assert ToolCost.objects.get(tool="image_generate").weight == 10
    gpt = ModelPrice.objects.get(model="gpt-4o")
    assert (gpt.input_per_1k, gpt.output_per_1k) == (Decimal("0.0025"), Decimal("0.01"))


def test_loading_twice_changes_nothing_the_second_time():
    first = load(demo_data())
    before = counts()
    second = load(demo_data())
    assert first.created == sum(before.values())
    assert (second.created, second.updated, second.unchanged) == (0, 0, first.created)
    assert counts() == before


def test_json_is_accepted(tmp_path):
    path = write(tmp_path, json.dumps(demo_data()), "policy.json")
    call_command("load_policy", path, stdout=StringIO())
    out = StringIO()
    call_command("export_policy", "--format", "json", stdout=out)
    assert json.loads(out.getvalue()) == parse_policy(demo_data()).to_data()


slugs = st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True)
windows = st.sampled_from(["1s", "30s", "90s", "5m", "1h", "2h", "1d", "7d"])


@st.composite
def limit_data(draw, *, override=False):
    metric = draw(st.sampled_from(["requests", "credits", "tokens", "cost", "concurrency"]))
    if metric == "cost":
        amount = draw(st.decimals(min_value=Decimal("0.01"), max_value=Decimal("100000"), places=2))
        item = {"metric": metric, "limit": float(amount)}
    else:
        item = {"metric": metric, "limit": draw(st.integers(1, 10**9))}
    if metric != "concurrency":
        if draw(st.booleans()):
            item["window"] = draw(windows)
            if draw(st.booleans()):
                item["burst"] = draw(st.integers(1, 10**6))
        else:
            item["period"] = draw(st.sampled_from(["day", "month"]))
        if draw(st.booleans()):
            item["tool"] = draw(st.sampled_from(["web_search", "llm_call", "delete_record"]))
        if draw(st.booleans()):
            item["model"] = draw(st.sampled_from(["gpt-4o", "claude-sonnet-4"]))
        if draw(st.booleans()):  # budget alert thresholds, in any order; [] turns the default off
            item["alert_at"] = draw(st.lists(st.integers(1, 1000), unique=True, max_size=4))
    if draw(st.booleans()):
        item["shadow"] = True
    if override:
        item["reason"] = draw(st.sampled_from(["launch week", "incident OPS-12"]))
        item["expires_at"] = draw(st.one_of(st.none(), st.just("2030-01-01T00:00:00Z"), st.just("2020-06-01T12:30:00Z")))
    return item


def unique_limits(items):
    seen, result = set(), []
    for item in items:
        key = (item["metric"], item.get("window"), item.get("period"), item.get("tool"), item.get("model"))
        if key not in seen:
            seen.add(key)
            result.append(item)
    return result


@st.composite
def policy_data(draw):
    counter = iter(range(10**6))
    tiers = {f"tier-{name}": unique_limits(draw(st.lists(limit_data(), max_size=3))) for name in draw(st.sets(slugs, max_size=2))}

    def node(children_key=None, child=None, depth=0):
        item = {"id": f"{draw(slugs)}-{next(counter)}"}
        if draw(st.booleans()):
            item["name"] = draw(st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=20))
        if tiers and draw(st.booleans()):
            item["tier"] = draw(st.sampled_from(sorted(tiers)))
        limits = unique_limits(draw(st.lists(limit_data(), max_size=3)))
        if limits:
            item["limits"] = limits
        overrides = unique_limits(draw(st.lists(limit_data(override=True), max_size=2)))
        if overrides:
            item["overrides"] = overrides
        if children_key:
            item[children_key] = [child() for _ in range(draw(st.integers(0, 2)))]
        return item

    def agent():
        return node()

    def user():
        return node("agents", agent)

    def team():
        return node("users", user)

    orgs = [node("teams", team) for _ in range(draw(st.integers(0, 2)))]
    return {
        "tool_costs": draw(st.dictionaries(slugs, st.integers(1, 100), max_size=3)),
        "model_prices": draw(st.dictionaries(
            slugs,
            st.fixed_dictionaries({"input": st.sampled_from([0, 0.0025, 0.01, 1.5]), "output": st.sampled_from([0, 0.01, 0.00015])}),
            max_size=2,
        )),
        "tiers": tiers,
        "orgs": orgs,
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=policy_data())
def test_generated_policies_round_trip(data):
    with transaction.atomic():
        load(data)
        once = exported()
        assert once == parse_policy(data).to_data()
        # The export reads back as itself, through YAML text.
        assert exported() == parse_policy(yaml.safe_load(dump_policy(once))).to_data()
        again = load(once)
        assert (again.created, again.updated, again.deleted) == (0, 0, 0)
        transaction.set_rollback(True)


# ---------------------------------------------------------------------------
# Updates, partial files and --prune
# ---------------------------------------------------------------------------


def test_update_changes_amounts_in_place_and_keeps_what_the_file_omits():
    load(demo_data())
    data = demo_data()
    agent_1 = data["orgs"][0]["teams"][0]["users"][0]["agents"][0]
    agent_1["limits"] = [{"metric": "requests", "tool": "delete_record", "limit": 5, "window": "5m"}]
    data["orgs"][0]["limits"] = data["orgs"][0]["limits"][:1]  # drop requests and cost from the file
    report = load(data)

    assert report.updated == 1
    assert Agent.objects.get(slug="agent-1").limits.get().amount == 5
    assert Organization.objects.get(slug="acme-corp").limits.count() == 3  # kept, not deleted
    assert sorted(report.not_in_file) == [
        "limit: acme-corp cost 500/day",
        "limit: acme-corp requests 10000/1h",
    ]


def test_prune_deletes_what_the_file_does_not_have():
    load(demo_data())
    data = demo_data()
    data["orgs"][0]["teams"] = data["orgs"][0]["teams"][:1]  # marketing goes
    report = load(data, prune=True)
    assert not Team.objects.filter(slug="marketing").exists()
    assert not Agent.objects.filter(slug="copywriter").exists()
    assert report.deleted >= 4  # team, its limit, carol, copywriter
    assert exported() == parse_policy(data).to_data()


def test_a_node_moved_in_the_file_moves_in_the_database():
    load(demo_data())
    data = demo_data()
    users = data["orgs"][0]["teams"][0]["users"]
    bob = users.pop(1)
    data["orgs"][0]["teams"][1]["users"].append(bob)
    load(data)
    bob_row = Member.objects.get(slug="bob")
    assert bob_row.team.slug == "marketing"
    assert Member.objects.filter(slug="bob").count() == 1
    assert Agent.objects.get(slug="research-bot").member == bob_row


def test_tier_null_clears_and_absent_tier_keeps():
    load(demo_data())
    data = demo_data()
    agents = data["orgs"][0]["teams"][0]["users"][0]["agents"]
    agents[0]["tier"] = None
    del agents[1]["tier"]
    load(data)
    assert Agent.objects.get(slug="agent-1").tier is None
    assert Agent.objects.get(slug="agent-2").tier.slug == "standard-agent"


def test_overrides_load_with_expiry_and_reason():
    data = demo_data()
    data["orgs"][0]["teams"][0]["users"][0]["agents"][0]["overrides"] = [
        {"metric": "tokens", "limit": 50000, "window": "1h", "expires_at": "2030-01-01T00:00:00Z", "reason": "launch"},
    ]
    load(data)
    override = Override.objects.get()
    assert override.expires_at == dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    assert (override.agent.slug, override.amount, override.reason) == ("agent-1", 50000, "launch")
    assert exported() == parse_policy(data).to_data()


def test_alert_at_loads_exports_and_updates_in_place():
    data = demo_data()
    org = data["orgs"][0]
    org["limits"][2]["alert_at"] = [90, 25]  # cost 500/day: any order, stored sorted
    org["limits"][0]["alert_at"] = []  # tokens 1M/h: no alerts at all
    load(data)
    limits = {limit.metric: limit for limit in Organization.objects.get(slug="acme-corp").limits.all()}
    assert (limits["cost"].alert_at, limits["tokens"].alert_at, limits["requests"].alert_at) == ([25, 90], [], None)
    exported_org = exported()["orgs"][0]
    assert {item["metric"]: item.get("alert_at") for item in exported_org["limits"]} == {
        "cost": [25, 90], "tokens": [], "requests": None,
    }
    assert "{metric: cost, limit: 500, period: day, alert_at: [25, 90]}" in dump_policy(exported())  # one line a limit

    org["limits"][2]["alert_at"] = [80]
    del org["limits"][0]["alert_at"]  # back to the default
    report = load(data)
    assert report.updated == 2
    limits = {limit.metric: limit for limit in Organization.objects.get(slug="acme-corp").limits.all()}
    assert (limits["cost"].alert_at, limits["tokens"].alert_at) == ([80], None)
    assert exported() == parse_policy(data).to_data()


# ---------------------------------------------------------------------------
# Bad files: the error names the place and the fix; nothing is written
# ---------------------------------------------------------------------------


def mutate(path, value):
    """The demo document with the item at ``path`` (a tuple of keys/indexes) set to ``value``."""
    data = demo_data()
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return data


ALICE = ("orgs", 0, "teams", 0, "users", 0)
BAD_FILES = [
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5, "window": "5 minutes"}),
        "orgs[0].teams[0].users[0].limits[1].window: '5 minutes' is not a window; use 30s, 5m, 1h or 1d",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "token", "limit": 5, "window": "5m"}),
        "orgs[0].teams[0].users[0].limits[1].metric: 'token' is not a metric; use one of requests, credits, tokens, cost, concurrency",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "concurrency", "limit": 3, "window": "1h"}),
        "orgs[0].teams[0].users[0].limits[1].window: a concurrency limit counts leases held at once; leave window and period empty",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 10.5, "window": "1h"}),
        "orgs[0].teams[0].users[0].limits[1].limit: tokens are counted in whole units; use a whole number such as 10",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": -1, "window": "1h"}),
        "orgs[0].teams[0].users[0].limits[1].limit: -1 must be greater than 0",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5}),
        "orgs[0].teams[0].users[0].limits[1].window: a tokens limit needs a rolling window (30s, 5m, 1h, 1d) or a calendar period (day, month)",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5, "period": "week"}),
        "orgs[0].teams[0].users[0].limits[1].period: 'week' is not a period; use day or month",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "cost", "limit": 5, "period": "day", "burst": 10}),
        "orgs[0].teams[0].users[0].limits[1].burst: burst makes a token bucket over a rolling window; set a window or leave burst empty",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 7, "window": "1h"}),
        "orgs[0].teams[0].users[0].limits[1]: same metric, window or period, tool and model as orgs[0].teams[0].users[0].limits[0]; keep one of them",
    ),
    (
        mutate((*ALICE, "agents", 0, "tier"), "gold"),
        "orgs[0].teams[0].users[0].agents[0].tier: 'gold' is not a tier; define it under tiers: (known: standard-agent)",
    ),
    (
        mutate(("orgs", 0, "teams", 1, "users", 0, "id"), "alice"),
        "orgs[0].teams[1].users[0].id: 'alice' is already a user in acme-corp (orgs[0].teams[0].users[0]); user ids are unique within an org",
    ),
    (
        mutate((*ALICE, "id"), "Alice Smith"),
        "orgs[0].teams[0].users[0].id: 'Alice Smith' is not a valid name; use lowercase letters, digits, '-' and '_', e.g. 'agent-1'",
    ),
    (
        mutate((*ALICE, "id"), "alice\n"),
        "orgs[0].teams[0].users[0].id: 'alice\\n' is not a valid name; use lowercase letters, digits, '-' and '_', e.g. 'agent-1'",
    ),
    (
        mutate((*ALICE, "agentz"), []),
        "orgs[0].teams[0].users[0].agentz: unknown key; expected one of id, name, tier, limits, overrides, agents",
    ),
    (
        mutate(("tool_costs", "llm_call"), 0),
        "tool_costs.llm_call: 0 is not a weight; use a whole number of credits from 1 to 2147483647",
    ),
    (
        mutate(("model_prices", "gpt-4o"), {"input": "cheap", "output": 0.01}),
        "model_prices.gpt-4o.input: 'cheap' is not a number",
    ),
    (
        mutate((*ALICE, "overrides"), [{"metric": "tokens", "limit": 5, "window": "1h"}]),
        "orgs[0].teams[0].users[0].overrides[0].reason: is missing",
    ),
    (
        mutate((*ALICE, "overrides"), [{"metric": "tokens", "limit": 5, "window": "1h", "reason": "x", "expires_at": "soon"}]),
        "orgs[0].teams[0].users[0].overrides[0].expires_at: 'soon' is not a date-time; use ISO 8601, e.g. 2026-12-01T00:00:00Z",
    ),
    (
        mutate(("orgs",), {"id": "acme-corp"}),
        "orgs: expected a list; got a mapping",
    ),
    (
        mutate(("orgs", 0, "limits", 0), {"metric": "cost", "limit": 500, "period": "month", "alert_at": [50, 90, 50]}),
        "orgs[0].limits[0].alert_at: 50 appears more than once; list each threshold once",
    ),
    (
        mutate(("orgs", 0, "limits", 0), {"metric": "cost", "limit": 500, "period": "month", "alert_at": [0, 90]}),
        "orgs[0].limits[0].alert_at: 0 is not a percent from 1 to 1000; use e.g. [50, 80, 100]",
    ),
    (
        mutate(("orgs", 0, "limits", 0), {"metric": "cost", "limit": 500, "period": "month", "alert_at": [1001]}),
        "orgs[0].limits[0].alert_at: 1001 is not a percent from 1 to 1000; use e.g. [50, 80, 100]",
    ),
    (
        mutate(("orgs", 0, "limits", 0), {"metric": "cost", "limit": 500, "period": "month", "alert_at": [50, 87.5]}),
        "orgs[0].limits[0].alert_at: 87.5 (float) is not a percent; use whole numbers such as [50, 80, 100]",
    ),
    (
        mutate(("orgs", 0, "limits", 0), {"metric": "cost", "limit": 500, "period": "month", "alert_at": 80}),
        "orgs[0].limits[0].alert_at: expected a list of percents such as [50, 80, 100]; got 80 (int)",
    ),
    (
        mutate((*ALICE, "limits", 1), {"metric": "concurrency", "limit": 3, "alert_at": [80]}),
        "orgs[0].teams[0].users[0].limits[1].alert_at: a concurrency limit counts leases held at once, not a budget; leave alert_at empty",
    ),
    (
        mutate((*ALICE, "overrides"), [{"metric": "tokens", "limit": 5, "window": "1h", "reason": "x", "alert_at": [True]}]),
        "orgs[0].teams[0].users[0].overrides[0].alert_at: true (a boolean) is not a percent; use whole numbers such as [50, 80, 100]",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD_FILES, ids=[message.split(":")[0] for _, message in BAD_FILES])
def test_bad_file_names_the_place_and_changes_nothing(tmp_path, data, message):
    before = counts()
    with pytest.raises(CommandError) as raised:
        call_command("load_policy", write(tmp_path, data), stdout=StringIO())
    assert message in str(raised.value).splitlines()
    assert "nothing was changed" in str(raised.value)
    assert counts() == before == {model.__name__: 0 for model in POLICY_MODELS}


def test_bad_file_on_a_loaded_database_changes_nothing(tmp_path):
    load(demo_data())
    before = exported()
    data = demo_data()
    data["tool_costs"]["llm_call"] = 7  # a valid change...
    data["orgs"][0]["teams"][0]["limits"][0]["window"] = "an hour"  # ...beside a bad one
    with pytest.raises(CommandError):
        call_command("load_policy", write(tmp_path, data), stdout=StringIO())
    assert exported() == before


def test_every_mistake_is_reported_at_once():
    data = mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5, "window": "5 minutes"})
    data["tool_costs"]["llm_call"] = -3
    with pytest.raises(PolicyFileError) as raised:
        parse_policy(data)
    places = [place for place, _ in raised.value.errors]
    assert places == ["tool_costs.llm_call", "orgs[0].teams[0].users[0].limits[1].window"]


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, "orgs:\n  - id: acme\n    limits: [\n")
    with pytest.raises(CommandError) as raised:
        call_command("load_policy", path, stdout=StringIO())
    assert f"{path}:4:1: not valid YAML" in str(raised.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CommandError, match="cannot read .*nope.yaml: No such file or directory"):
        call_command("load_policy", str(tmp_path / "nope.yaml"), stdout=StringIO())


def test_load_policy_exits_non_zero_on_a_bad_file(tmp_path):
    import subprocess
    import sys

    from django.db import connection

    db = connection.settings_dict  # the test database: migrated, and empty outside this test's transaction
    url = f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    path = write(tmp_path, mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5, "window": "5 minutes"}))
    result = subprocess.run(
        [sys.executable, "manage.py", "load_policy", path],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DATABASE_URL": url},
    )
    assert result.returncode != 0
    assert "orgs[0].teams[0].users[0].limits[1].window: '5 minutes' is not a window" in result.stderr


# ---------------------------------------------------------------------------
# Found in review: files the columns refuse, tiers in short form, what --prune takes along
# ---------------------------------------------------------------------------

COLUMN_LIMITS = [
    (mutate((*ALICE, "overrides"), [{"metric": "tokens", "limit": 5, "window": "1h", "reason": "x" * 301}]),
     "orgs[0].teams[0].users[0].overrides[0].reason: at most 300 characters"),
    (mutate(("tool_costs", "x"), 3_000_000_000),
     "tool_costs.x: 3000000000 is not a weight; use a whole number of credits from 1 to 2147483647"),
    (mutate((*ALICE, "limits", 1), {"metric": "tokens", "limit": 5, "window": "1h", "burst": 10**20}),
     "orgs[0].teams[0].users[0].limits[1].burst: 100000000000000000000 is too large; at most 1000000000000000"),
    (mutate(("model_prices", "gpt-4o"), {"input": 1000000, "output": 0.01}),
     "model_prices.gpt-4o.input: 1000000 has too many digits; at most 6 before and 8 after the point"),
    (mutate((*ALICE, "overrides"), [{"metric": "tokens", "limit": 5, "window": "1h", "reason": "x",
                                     "expires_at": "9999-12-31T23:00:00-05:00"}]),
     "orgs[0].teams[0].users[0].overrides[0].expires_at: 9999-12-31T23:00:00-05:00 is out of range; use a date before year 9999"),
]


@pytest.mark.parametrize(("data", "message"), COLUMN_LIMITS, ids=[m.split(":")[0] for _, m in COLUMN_LIMITS])
def test_values_the_columns_cannot_hold_are_named_not_crashed_on(tmp_path, data, message):
    with pytest.raises(CommandError) as raised:
        call_command("load_policy", write(tmp_path, data), stdout=StringIO())
    assert message in str(raised.value).splitlines()
    assert counts() == {model.__name__: 0 for model in POLICY_MODELS}


def test_prices_with_eight_decimals_round_trip():
    data = demo_data()
    data["model_prices"]["cheap"] = {"input": 0.0000375, "output": 0.00000001}
    load(data)
    assert ModelPrice.objects.get(model="cheap").input_per_1k == Decimal("0.0000375")
    assert exported() == parse_policy(yaml.safe_load(dump_policy(exported()))).to_data()
    again = load(yaml.safe_load(dump_policy(exported())))
    assert (again.created, again.updated) == (0, 0)


def test_a_tier_in_short_form_keeps_its_level_and_description():
    load({"tiers": {"std": {"level": "agent", "description": "Standard plan", "limits": [
        {"metric": "requests", "limit": 5, "window": "1m"}]}}})
    load({"tiers": {"std": [{"metric": "requests", "limit": 6, "window": "1m"}]}})
    tier = Tier.objects.get(slug="std")
    assert (tier.level, tier.description, tier.limits.get().amount) == ("agent", "Standard plan", 6)


def test_prune_says_what_it_took_along(tmp_path):
    from quotas.services.api_keys import api_key_create

    load(demo_data())
    api_key_create(org=Organization.objects.get(slug="acme-corp"))
    out = StringIO()
    call_command("load_policy", write(tmp_path, {"tool_costs": {"web_search": 1}}), "--prune", stdout=out)
    assert "with them deleted: 1 API keys" in out.getvalue()
