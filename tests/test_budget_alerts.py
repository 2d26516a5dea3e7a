"""Budget alerts: real Postgres, real Valkey, spend through the real engine with a clock the test sets.

The drain (quotas.services.usage_drain) puts agents that spent in the org's spent set; here the
tests put them there themselves (``spent``), so these tests do not depend on the drain.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from django.db import connection, transaction

from quotas.engine import QuotaEngine
from quotas.models import Agent, BudgetAlert, Organization
from quotas.policy.document import parse_policy
from quotas.services import budget_alerts
from quotas.services.budget_alerts import (
    BudgetAlertDeliveryError,
    budget_alert_deliver,
    budget_alerts_record,
    evaluate_budget_alerts,
    period_start,
)
from quotas.services.engine import get_engine
from quotas.services.policy_load import policy_load
from quotas.services.policy_sync import policy_sync_org_by_slug
from tests.support import clean_redis

pytestmark = pytest.mark.django_db(transaction=True)

START = dt.datetime(2030, 1, 15, 10, 30, tzinfo=dt.timezone.utc)
DAY_START = dt.datetime(2030, 1, 15, tzinfo=dt.timezone.utc)
TOKENS_PER_USD = 100_000  # gpt-4o output: $0.01 per 1K tokens


class Clock:
    def __init__(self, at: dt.datetime = START):
        self.ms = int(at.timestamp() * 1000)

    def __call__(self) -> int:
        return self.ms

    def advance(self, **delta) -> None:
        self.ms += int(dt.timedelta(**delta).total_seconds() * 1000)

    @property
    def now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.ms / 1000, dt.timezone.utc)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def engine(clock):
    """The service's engine (settings' Redis and key prefix), with the test's clock."""
    clean_redis()
    shared = get_engine()
    return QuotaEngine(shared.client, key_prefix=shared.keys.prefix, clock=clock, sweep_per_check=0,
                       on_policy_missing=policy_sync_org_by_slug)


def load(org_limits, *, agents=("a1",), agent_limits=(), team_limits=(), alert_webhook_url=""):
    data = {
        "model_prices": {"gpt-4o": {"input": 0.0025, "output": 0.01}},
        "orgs": [{
            "id": "acme",
            "limits": list(org_limits),
            "teams": [{"id": "eng", "limits": list(team_limits), "users": [{
                "id": "alice",
                "agents": [{"id": slug, "limits": list(agent_limits)} for slug in agents],
            }]}],
        }],
    }
    with transaction.atomic():  # policy sync runs on commit
        policy_load(doc=parse_policy(data))
        Organization.objects.filter(slug="acme").update(alert_webhook_url=alert_webhook_url)


def spend(engine, usd: str, agent="a1"):
    """Charge and settle ``usd`` of gpt-4o output through the engine, and mark the agent as spent."""
    tokens = int(Decimal(usd) * TOKENS_PER_USD)
    decision = engine.check(org="acme", agent=agent, model="gpt-4o", tokens=tokens)
    assert decision.allowed, decision
    engine.settle(org="acme", reservation=decision.reservation, input_tokens=0, output_tokens=tokens)
    spent(engine, agent)


def spent(engine, *agents):
    engine.client.sadd(engine.keys.spent_agents("acme"), *agents)  # what the drain does


def evaluate(engine, clock):
    return sorted((alert.level, alert.node, alert.threshold)
                  for alert in evaluate_budget_alerts(now=clock.now, engine=engine))


COST_DAY = {"metric": "cost", "limit": 1, "period": "day"}


def test_each_threshold_of_a_cost_budget_fires_once(engine, clock):
    load([COST_DAY])
    spend(engine, "0.55")
    assert evaluate(engine, clock) == [("org", "acme", 50)]
    spent(engine, "a1")
    assert evaluate(engine, clock) == []  # the same use again: nothing new
    spend(engine, "0.30")
    assert evaluate(engine, clock) == [("org", "acme", 80)]
    spend(engine, "0.15")
    assert evaluate(engine, clock) == [("org", "acme", 100)]
    spent(engine, "a1")
    assert evaluate(engine, clock) == []

    alerts = list(BudgetAlert.objects.order_by("threshold"))
    assert [(a.threshold, a.used, a.amount) for a in alerts] == [
        (50, Decimal("0.55"), 1), (80, Decimal("0.85"), 1), (100, Decimal("1.00"), 1),
    ]
    assert {(a.org, a.level, a.node, a.limit_description, a.period_start) for a in alerts} == {
        ("acme", "org", "acme", "cost 1/day", DAY_START),
    }
    assert not engine.client.exists(engine.keys.spent_agents("acme"))  # taken out of the set


def test_jumping_past_several_thresholds_fires_each_of_them(engine, clock):
    load([COST_DAY])
    spend(engine, "0.9")
    assert evaluate(engine, clock) == [("org", "acme", 50), ("org", "acme", 80)]


def test_a_new_period_fires_again(engine, clock):
    load([COST_DAY])
    spend(engine, "0.6")
    assert evaluate(engine, clock) == [("org", "acme", 50)]
    clock.advance(days=1)  # 00:00 UTC passed: the daily budget is new
    spend(engine, "0.1")
    assert evaluate(engine, clock) == []  # 10% of the new day
    spend(engine, "0.5")
    assert evaluate(engine, clock) == [("org", "acme", 50)]
    assert sorted(BudgetAlert.objects.values_list("period_start", flat=True)) == [
        DAY_START, DAY_START + dt.timedelta(days=1),
    ]


def test_a_rolling_budget_re_arms_once_per_window_length(engine, clock):
    load([], agent_limits=[{"metric": "tokens", "limit": 1000, "window": "1h"}])

    def use(tokens):
        decision = engine.check(org="acme", agent="a1", tokens=tokens)
        assert decision.allowed
        spent(engine, "a1")

    use(600)
    assert evaluate(engine, clock) == [("agent", "a1", 50)]
    clock.advance(minutes=10)
    use(10)
    assert evaluate(engine, clock) == []  # same hour-long period (10:00-11:00 UTC)
    clock.advance(hours=1)  # the 600 left the window
    use(700)
    assert evaluate(engine, clock) == [("agent", "a1", 50)]
    assert sorted(BudgetAlert.objects.values_list("period_start", flat=True)) == [
        dt.datetime(2030, 1, 15, 10, tzinfo=dt.timezone.utc), dt.datetime(2030, 1, 15, 11, tzinfo=dt.timezone.utc),
    ]


def test_period_start():
    now = dt.datetime(2030, 3, 17, 13, 45, 12, 500, tzinfo=dt.timezone.utc)
    assert period_start(window=None, period="day", now=now) == dt.datetime(2030, 3, 17, tzinfo=dt.timezone.utc)
    assert period_start(window=None, period="month", now=now) == dt.datetime(2030, 3, 1, tzinfo=dt.timezone.utc)
    assert period_start(window=3600, period="", now=now) == dt.datetime(2030, 3, 17, 13, tzinfo=dt.timezone.utc)
    assert period_start(window=300, period="", now=now) == dt.datetime(2030, 3, 17, 13, 45, tzinfo=dt.timezone.utc)


def test_thresholds_per_limit_default_explicit_and_off(engine, clock):
    load(
        [COST_DAY, {"metric": "tokens", "limit": 100_000, "period": "day", "alert_at": []}],  # tokens: off
        team_limits=[{"metric": "requests", "limit": 4, "period": "day", "alert_at": [75, 25]}],  # explicit
        agent_limits=[{"metric": "requests", "limit": 4, "period": "month"}],  # requests by default: none
    )
    spend(engine, "0.3")
    spend(engine, "0.3")  # 2 requests, $0.60, 60,000 tokens (60% of a budget whose alerts are off)
    assert evaluate(engine, clock) == [("org", "acme", 50), ("team", "eng", 25)]
    spend(engine, "0.01")  # 3 requests: 75% of the team's and of the agent's
    assert evaluate(engine, clock) == [("team", "eng", 75)]


def test_a_budget_narrowed_to_a_model_is_seen(engine, clock):
    load([], team_limits=[{"metric": "cost", "limit": 2, "period": "month", "model": "gpt-4o", "alert_at": [10]}])
    spend(engine, "0.25")
    alerts = evaluate_budget_alerts(now=clock.now, engine=engine)
    assert [(a.level, a.threshold, a.limit_description, a.period_start) for a in alerts] == [
        ("team", 10, "cost 2/month [model=gpt-4o]", dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)),
    ]


def count_peeks(engine, monkeypatch) -> list[str]:
    peeks = []
    real_peek = engine.peek
    monkeypatch.setattr(engine, "peek", lambda **kw: peeks.append(kw["agent"]) or real_peek(**kw))
    return peeks


def test_a_budget_shared_by_many_agents_is_looked_at_once(engine, clock, monkeypatch):
    load([COST_DAY], agents=("a1", "a2", "a3"))
    for agent in ("a1", "a2", "a3"):
        spend(engine, "0.2", agent=agent)
    peeks = count_peeks(engine, monkeypatch)
    assert evaluate(engine, clock) == [("org", "acme", 50)]
    assert len(peeks) == 1  # the org's budget, through whichever agent came first


def test_agents_with_budgets_of_their_own_are_each_looked_at(engine, clock, monkeypatch):
    load([COST_DAY], agents=("a1", "a2", "a3"), agent_limits=[{"metric": "cost", "limit": "0.25", "period": "day"}])
    for agent in ("a1", "a2", "a3"):
        spend(engine, "0.2", agent=agent)
    peeks = count_peeks(engine, monkeypatch)
    assert evaluate(engine, clock) == [("agent", "a1", 50), ("agent", "a1", 80), ("agent", "a2", 50),
                                       ("agent", "a2", 80), ("agent", "a3", 50), ("agent", "a3", 80),
                                       ("org", "acme", 50)]
    assert sorted(peeks) == ["a1", "a2", "a3"]


def test_unknown_agents_are_skipped(engine, clock):
    load([COST_DAY], agents=("a1", "a2", "a3"))
    spend(engine, "0.6", agent="a2")
    Agent.objects.filter(slug="a1").delete()  # gone from Postgres (and, after the sync, from Redis)
    engine.client.delete(engine.keys.agent_policy("acme", "a3"))  # in Postgres, not in Redis
    spent(engine, "a1", "a3", "ghost")
    assert evaluate(engine, clock) == [("org", "acme", 50)]
    spent(engine, "a3")
    assert evaluate(engine, clock) == []  # UnknownAgent from the peek: skipped


def test_two_inserts_of_the_same_crossing_at_once_record_it_once():
    """The second transaction waits on the unique index for the first, then inserts nothing."""
    def alert():
        return BudgetAlert(org="acme", level="org", node="acme", limit_ref="0000abcd", limit_description="cost 1/day",
                           threshold=50, period_start=DAY_START, used=Decimal("0.6"), amount=Decimal(1))

    barrier = threading.Barrier(2)
    results = {}

    def first():
        try:
            with transaction.atomic():
                results["first"] = budget_alerts_record([alert()])
                barrier.wait()
                time.sleep(0.5)  # the second is blocked on the index meanwhile
        finally:
            connection.close()

    def second():
        try:
            barrier.wait()
            with transaction.atomic():
                results["second"] = budget_alerts_record([alert()])
        finally:
            connection.close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert (len(results["first"]), len(results["second"])) == (1, 0)
    assert BudgetAlert.objects.count() == 1


def test_two_evaluators_at_once_fire_each_threshold_once(engine, clock, monkeypatch):
    agents = [f"a{i}" for i in range(8)]
    load([COST_DAY], agents=agents)
    for agent in agents:
        spend(engine, "0.11", agent=agent)  # 88%
    monkeypatch.setattr(budget_alerts, "POP_BATCH", 1)  # so that both get agents of the same org
    barrier = threading.Barrier(2)
    results, errors = [], []

    def evaluator():
        try:
            barrier.wait()
            results.append(evaluate_budget_alerts(now=clock.now, engine=engine))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=evaluator) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    created = sorted(alert.threshold for result in results for alert in result)
    assert created == [50, 80]  # between them, each once
    assert sorted(BudgetAlert.objects.values_list("threshold", flat=True)) == [50, 80]


def test_a_failed_run_puts_the_agents_back(engine, clock, monkeypatch):
    load([COST_DAY])
    spend(engine, "0.6")

    def broken(alerts):
        raise RuntimeError("database went away")

    monkeypatch.setattr(budget_alerts, "budget_alerts_record", broken)
    with pytest.raises(RuntimeError):
        evaluate_budget_alerts(now=clock.now, engine=engine)
    assert engine.client.smembers(engine.keys.spent_agents("acme")) == {"a1"}
    monkeypatch.undo()
    assert evaluate(engine, clock) == [("org", "acme", 50)]


def test_one_orgs_failure_does_not_hold_up_the_others(engine, clock, monkeypatch):
    load([COST_DAY])
    spend(engine, "0.6")
    Organization.objects.create(slug="aaa-first")  # evaluated before acme
    evaluate_org = budget_alerts.budget_alerts_evaluate_org

    def failing_first(*, org, **kwargs):
        if org.slug == "aaa-first":
            raise redis.ConnectionError("Redis went away for this org")
        return evaluate_org(org=org, **kwargs)

    monkeypatch.setattr(budget_alerts, "budget_alerts_evaluate_org", failing_first)
    assert evaluate(engine, clock) == [("org", "acme", 50)]


# ---------------------------------------------------------------------------
# Delivery
# ---------------------------------------------------------------------------


class Webhook:
    """A real HTTP server on loopback that answers with the statuses it is given, in turn, and keeps what it got."""

    def __init__(self, *statuses: int, delay: float = 0.0):
        self.statuses = list(statuses)
        self.delay = delay
        self.received: list[dict] = []
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                webhook.received.append({"path": self.path, "json": json.loads(body),
                                         "content_type": self.headers["Content-Type"]})
                time.sleep(webhook.delay)
                status = webhook.statuses.pop(0) if len(webhook.statuses) > 1 else webhook.statuses[0]
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:  # the client timed out and left
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/budget?token=s3cret"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def one_alert(engine, clock, *, url="") -> BudgetAlert:
    load([COST_DAY], alert_webhook_url=url)
    spend(engine, "0.55")
    (alert,) = evaluate_budget_alerts(now=clock.now, engine=engine)
    return alert


def test_a_failed_delivery_is_retried_then_sent(engine, clock, caplog):
    caplog.set_level(logging.INFO, logger="quotas.alerts")
    with Webhook(500, 200) as hook:
        alert = one_alert(engine, clock, url=hook.url)
        BudgetAlert.objects.filter(pk=alert.pk).update(status="pending", attempts=0)  # whatever on_commit did
        hook.received.clear()

        with pytest.raises(BudgetAlertDeliveryError, match="HTTP 500"):
            budget_alert_deliver(alert_id=alert.pk)
        alert.refresh_from_db()
        assert (alert.status, alert.attempts, alert.sent_at) == ("pending", 1, None)
        assert alert.last_error.startswith("HTTP 500")

        budget_alert_deliver(alert_id=alert.pk)  # the retry
        alert.refresh_from_db()
        assert (alert.status, alert.attempts, alert.webhook_url) == ("sent", 2, hook.url)
        assert alert.sent_at is not None

        budget_alert_deliver(alert_id=alert.pk)  # a repeated task sends nothing twice
        assert len(hook.received) == 2

    request = hook.received[-1]
    assert (request["path"], request["content_type"]) == ("/hooks/budget?token=s3cret", "application/json")
    payload = request["json"]
    assert payload == {
        "id": alert.pk, "org": "acme", "level": "org", "node": "acme", "limit": "cost 1/day", "metric": "cost",
        "threshold": 50, "used": 0.55, "amount": 1, "period_start": "2030-01-15T00:00:00Z",
        "created_at": payload["created_at"],
    }
    assert dt.datetime.fromisoformat(payload["created_at"]) == alert.created_at
    lines = [r.getMessage() for r in caplog.records if r.name == "quotas.alerts" and f"alert {alert.pk}:" in r.getMessage()]
    assert any("failed (attempt 1, will retry): HTTP 500" in line for line in lines)
    assert any("sent to http://127.0.0.1:" in line and "attempt 2" in line for line in lines)
    assert not any("s3cret" in line for line in lines)  # the URL's secret stays out of the logs
    assert all("\n" not in line for line in lines)


def test_a_timeout_is_a_failure_and_the_last_one_marks_it_failed(engine, clock):
    with Webhook(200, delay=1.0) as hook:
        alert = one_alert(engine, clock, url=hook.url)
        BudgetAlert.objects.filter(pk=alert.pk).update(status="pending", attempts=0, sent_at=None)
        with pytest.raises(BudgetAlertDeliveryError, match="Timeout"):
            budget_alert_deliver(alert_id=alert.pk, timeout=0.2)
        with pytest.raises(BudgetAlertDeliveryError):
            budget_alert_deliver(alert_id=alert.pk, timeout=0.2, final=True)
    alert.refresh_from_db()
    assert (alert.status, alert.attempts, alert.sent_at) == ("failed", 2, None)
    assert "Timeout" in alert.last_error


def test_without_a_webhook_the_alert_is_logged(engine, clock, caplog):
    caplog.set_level(logging.INFO, logger="quotas.alerts")
    alert = one_alert(engine, clock)
    BudgetAlert.objects.filter(pk=alert.pk).update(status="pending")
    budget_alert_deliver(alert_id=alert.pk)
    alert.refresh_from_db()
    assert (alert.status, alert.attempts, alert.sent_at) == ("logged", 0, None)
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "quotas.alerts" and f"alert {alert.pk}:" in r.getMessage() and "logged" in r.getMessage()]
    assert line == (f"budget alert {alert.pk}: acme org acme cost 1/day reached 50% (0.55 of 1, "
                    "period from 2030-01-15T00:00:00Z) (no webhook URL: logged only)")


# -- through Celery (eagerly, in this process: the task's retry policy without a worker) ------------


@pytest.fixture
def eager_celery():
    from project.celery import app

    app.conf.task_always_eager = True
    yield app
    app.conf.task_always_eager = False


def test_the_task_retries_with_celery_until_the_webhook_answers(engine, clock, eager_celery):
    from quotas.tasks import deliver_budget_alert

    assert deliver_budget_alert.max_retries == 8 and deliver_budget_alert.retry_backoff
    with Webhook(503, 502, 200) as hook:
        # evaluate -> commit -> on_commit -> the task, delivered at once (eager), retried twice
        alert = one_alert(engine, clock, url=hook.url)
        alert.refresh_from_db()
    assert (alert.status, alert.attempts) == ("sent", 3)
    assert len(hook.received) == 3 and hook.received[0]["json"] == hook.received[2]["json"]


def test_the_task_gives_up_after_its_last_retry(engine, clock, eager_celery):
    with Webhook(500) as hook:
        alert = one_alert(engine, clock, url=hook.url)
        alert.refresh_from_db()
    assert (alert.status, alert.attempts) == ("failed", 9)  # the first attempt and 8 retries
    assert len(hook.received) == 9


def test_the_evaluation_task_delivers_what_it_found(engine, clock, eager_celery, monkeypatch):
    from quotas import tasks

    load([COST_DAY])
    spend(engine, "0.55")
    monkeypatch.setattr(budget_alerts, "get_engine", lambda: engine)
    assert tasks.evaluate_budget_alerts.delay().get() == 1
    assert list(BudgetAlert.objects.values_list("threshold", "status")) == [(50, "logged")]
