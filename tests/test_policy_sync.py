"""Policy in Postgres reaches the hot path: after commit, on a missing policy, and by the full resync."""

from __future__ import annotations

import datetime as dt
import time
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.conf import settings
from django.core.management import call_command
from django.db import transaction
from django.urls import reverse

from quotas.engine import QuotaEngine, UnknownAgent, UnknownOrg
from quotas.models import Agent, Limit, Organization, Override, Team
from quotas.policy.document import parse_policy
from quotas.services.engine import get_engine
from quotas.services.policy_load import policy_load
from tests.support import clean_redis

DEMO = Path(__file__).resolve().parent.parent / "quotas" / "fixtures" / "demo_policy.yaml"


@pytest.fixture
def engine():
    clean_redis()
    return get_engine()


@pytest.fixture
def demo(engine):
    with transaction.atomic():
        policy_load(doc=parse_policy(yaml.safe_load(DEMO.read_text())))


def amounts(decision) -> list[tuple]:
    return [(l.level, l.metric, l.window, l.limit) for l in decision.limits]


@pytest.mark.django_db(transaction=True)
def test_an_admin_edit_reaches_the_engine_within_a_second(admin_client, demo, engine):
    assert ("team", "tokens", "1h", 500000) in amounts(engine.peek(org="acme-corp", agent="agent-1"))
    limit = Limit.objects.get(team__slug="engineering", metric="tokens")
    response = admin_client.post(reverse("admin:quotas_limit_change", args=[limit.pk]), {
        "team": limit.team_id, "metric": "tokens", "amount": "123456", "window": "1h", "period": "",
        "tool": "", "model": "", "burst": "",
    })
    assert response.status_code == 302, response.content.decode()[:3000]
    committed = time.monotonic()
    while ("team", "tokens", "1h", 123456) not in amounts(engine.peek(org="acme-corp", agent="agent-1")):
        assert time.monotonic() - committed < 1.0, "the edit did not reach Redis within 1 s"
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_a_policy_file_load_reaches_the_engine(demo, engine):
    assert engine.client.hget(engine.keys.org_policy("acme-corp"), "v") is not None
    # copywriter: the org's three limits, marketing's tokens, and its tier's two
    assert [(l.level, l.metric) for l in engine.peek(org="acme-corp", agent="copywriter").limits] == [
        ("org", "cost"), ("org", "requests"), ("org", "tokens"), ("team", "tokens"),
        ("agent", "credits"), ("agent", "tokens"),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_flushed_redis_is_noticed_and_resynced_by_the_first_check(demo, engine):
    before = amounts(engine.peek(org="acme-corp", agent="agent-1"))
    keys = list(engine.client.scan_iter(engine.keys.everything(), count=1000))
    engine.client.delete(*keys)  # what FLUSHALL does to our keys, without touching anyone else's
    decision = engine.check(org="acme-corp", agent="agent-1", tool="llm_call", model="gpt-4o", tokens=10)
    assert decision.allowed and amounts(decision) == [a for a in before if a[1] != "concurrency"]


@pytest.mark.django_db(transaction=True)
def test_deleted_agents_and_orgs_are_unknown_after_sync(demo, engine):
    assert engine.check(org="acme-corp", agent="agent-2").allowed
    with transaction.atomic():
        Agent.objects.get(slug="agent-2").delete()
    with pytest.raises(UnknownAgent):
        engine.check(org="acme-corp", agent="agent-2")
    with pytest.raises(UnknownOrg, match="unknown org 'globex'"):
        engine.check(org="globex", agent="agent-1")


@pytest.mark.django_db(transaction=True)
def test_override_expiry_takes_effect_without_a_sync(demo, engine):
    now = dt.datetime.now(dt.timezone.utc)
    expires = now + dt.timedelta(minutes=10)
    with transaction.atomic():
        Override.objects.create(agent=Agent.objects.get(slug="agent-1"), metric="tokens", amount=60000,
                                window=3600, expires_at=expires, reason="launch week")
    clock = {"ms": int(now.timestamp() * 1000)}
    fixed = QuotaEngine(engine.client, key_prefix=engine.keys.prefix, clock=lambda: clock["ms"])
    assert ("agent", "tokens", "1h", 60000) in amounts(fixed.peek(org="acme-corp", agent="agent-1"))
    clock["ms"] = int(expires.timestamp() * 1000)  # the moment it passes, with no sync in between
    tokens = [a for a in amounts(fixed.peek(org="acme-corp", agent="agent-1")) if a[:2] == ("agent", "tokens")]
    assert tokens == [("agent", "tokens", "1h", 25000)]  # the tier's limit is back


@pytest.mark.django_db(transaction=True)
def test_sync_policy_command_and_task_repair_drift(demo, engine):
    engine.client.delete(engine.keys.agent_policy("acme-corp", "agent-1"))
    out = StringIO()
    call_command("sync_policy", stdout=out)
    assert "acme-corp: 4 agents" in out.getvalue()
    assert engine.check(org="acme-corp", agent="agent-1").allowed

    from quotas.tasks import sync_policy_all

    engine.client.delete(engine.keys.org_policy("acme-corp"))
    assert sync_policy_all.apply().get() == 4
    assert engine.client.hget(engine.keys.org_policy("acme-corp"), "t:llm_call") == "3"


def test_the_beat_schedule_runs_the_resync():
    tasks = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert {"quotas.tasks.sync_policy_all", "quotas.tasks.sweep_reservations"} <= tasks


@pytest.mark.django_db(transaction=True)
def test_a_process_with_a_fast_clock_cannot_hide_later_edits(demo, engine, monkeypatch):
    """Versions come from Redis's clock, not the syncing process's (which may be ahead)."""
    import time as time_module

    from quotas.services.policy_sync import policy_sync_org

    real = time_module.time_ns
    monkeypatch.setattr(time_module, "time_ns", lambda: real() + 10**9 * 3600)  # this host is an hour ahead
    policy_sync_org(org=Organization.objects.get(slug="acme-corp"))
    monkeypatch.undo()
    with transaction.atomic():
        Limit.objects.filter(team__slug="engineering", metric="tokens").update(amount=4242)
        Team.objects.get(slug="engineering").save()  # an edit that sends its signal
    assert ("team", "tokens", "1h", 4242) in amounts(engine.peek(org="acme-corp", agent="agent-1"))


@pytest.mark.django_db(transaction=True)
def test_a_team_moved_to_another_org_takes_its_users_and_agents_along(demo, engine):
    globex = Organization.objects.create(slug="globex")
    with transaction.atomic():
        team = Team.objects.get(slug="engineering")
        team.org = globex
        team.save()
    assert set(Agent.objects.filter(member__team=team).values_list("org__slug", flat=True)) == {"globex"}
    assert engine.check(org="globex", agent="agent-1").allowed
    with pytest.raises(UnknownAgent):
        engine.check(org="acme-corp", agent="agent-1")


@pytest.mark.django_db(transaction=True)
def test_a_move_that_would_clash_with_the_target_orgs_ids_is_refused(demo):
    from django.core.exceptions import ValidationError

    from quotas.models import Member

    globex = Organization.objects.create(slug="globex")
    Member.objects.create(team=Team.objects.create(org=globex, slug="research"), slug="alice")
    team = Team.objects.get(slug="engineering")
    team.org = globex
    with pytest.raises(ValidationError, match="clash with users alice"):
        team.full_clean()


@pytest.mark.django_db(transaction=True)
def test_a_limit_moved_to_another_org_leaves_the_old_org_at_once(demo, engine):
    globex = Organization.objects.create(slug="globex")
    research = Team.objects.create(org=globex, slug="research")
    limit = Limit.objects.get(team__slug="engineering", metric="tokens")
    with transaction.atomic():
        limit.team = research
        limit.save()
    assert ("team", "tokens", "1h", 500000) not in amounts(engine.peek(org="acme-corp", agent="agent-1"))
