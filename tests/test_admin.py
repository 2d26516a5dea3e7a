"""Every admin page renders; the agent page shows its effective limits; keys are shown once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from django.contrib import admin
from django.urls import reverse

from quotas.models import Agent, ApiKey, BudgetAlert, Limit, Member, Organization, Override, Team
from quotas.policy.document import parse_policy
from quotas.services.api_keys import api_key_hash
from quotas.services.policy_load import policy_load

pytestmark = pytest.mark.django_db

DEMO = Path(__file__).resolve().parent.parent / "quotas" / "fixtures" / "demo_policy.yaml"
QUOTAS_MODELS = [model for model in admin.site._registry if model._meta.app_label == "quotas"]


@pytest.fixture
def demo():
    data = yaml.safe_load(DEMO.read_text())
    data["orgs"][0]["teams"][0]["users"][0]["agents"][0]["overrides"] = [
        {"metric": "tokens", "limit": 60000, "window": "1h", "expires_at": "2099-01-01T00:00:00Z", "reason": "launch week"},
    ]
    policy_load(doc=parse_policy(data))


def text_of(response) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.content.decode()))


def test_every_quotas_model_is_registered():
    names = {model.__name__ for model in QUOTAS_MODELS}
    assert names == {"Organization", "Team", "Member", "Agent", "Tier", "Limit", "Override", "ToolCost", "ModelPrice", "ApiKey",
                     "BudgetAlert"}


@pytest.mark.parametrize("model", QUOTAS_MODELS, ids=lambda model: model.__name__)
def test_changelist_add_and_change_views_render(admin_client, demo, model):
    if model is ApiKey:
        from quotas.services.api_keys import api_key_create

        api_key_create(org=Organization.objects.get(), name="x")
    if model is BudgetAlert:
        budget_alert()
    info = model._meta.app_label, model._meta.model_name
    changelist = admin_client.get(reverse("admin:%s_%s_changelist" % info))
    assert changelist.status_code == 200
    model_admin = admin.site._registry[model]
    if model_admin.search_fields:
        assert admin_client.get(reverse("admin:%s_%s_changelist" % info), {"q": "a"}).status_code == 200
    assert model_admin.search_fields, f"{model.__name__} changelist has no search"
    assert model_admin.list_filter, f"{model.__name__} changelist has no filters"
    read_only = model is BudgetAlert  # written by the evaluation and its deliveries only
    assert admin_client.get(reverse("admin:%s_%s_add" % info)).status_code == (403 if read_only else 200)
    for row in model.objects.all()[:3]:
        response = admin_client.get(reverse("admin:%s_%s_change" % info, args=[row.pk]))
        assert response.status_code == 200, row


@pytest.mark.parametrize(
    ("model", "filters"),
    [
        (Team, {"org__id__exact": "ORG"}),
        (Member, {"org__id__exact": "ORG"}),
        (Agent, {"org__id__exact": "ORG", "tier__id__exact": "TIER"}),
    ],
)
def test_filtered_changelists_narrow_the_hierarchy(admin_client, demo, model, filters):
    org = Organization.objects.get()
    tier = Agent.objects.get(slug="agent-1").tier
    values = {key: {"ORG": org.pk, "TIER": tier.pk}[value] for key, value in filters.items()}
    response = admin_client.get(reverse(f"admin:quotas_{model._meta.model_name}_changelist"), values)
    assert response.status_code == 200
    assert response.context["cl"].result_count == model.objects.count()


def test_org_page_links_down_the_hierarchy(admin_client, demo):
    response = admin_client.get(reverse("admin:quotas_organization_changelist"))
    org = Organization.objects.get()
    html = response.content.decode()
    assert f'href="/admin/quotas/team/?org__id__exact={org.pk}">2 teams</a>' in html
    assert f'href="/admin/quotas/agent/?org__id__exact={org.pk}">4 agents</a>' in html


def test_agent_page_shows_every_effective_limit(admin_client, demo):
    agent = Agent.objects.get(slug="agent-1")
    text = text_of(admin_client.get(reverse("admin:quotas_agent_change", args=[agent.pk])))
    rows = [
        "org acme-corp cost $500 day any any own",
        "org acme-corp requests 10000 1h any any own",
        "org acme-corp tokens 1000000 1h any any own",
        "team engineering tokens 500000 1h any any own",
        "user alice concurrency 3 at once any any own",
        "user alice tokens 100000 1h any any own",
        "agent agent-1 credits 50 10s any any 50 tier standard-agent",
        # the override replaced the tier's tokens limit
        "agent agent-1 tokens 60000 1h any any override until 2099-01-01 00:00 UTC (launch week)",
        "agent agent-1 requests 2 5m delete_record any own",
    ]
    for row in rows:
        assert row in text
    assert "tier standard-agent" in text and "25000" not in text


def test_limits_are_edited_inline_with_messages_that_say_how_to_fix(admin_client, demo):
    team = Team.objects.get(slug="engineering")
    url = reverse("admin:quotas_team_change", args=[team.pk])
    page = admin_client.get(url)
    form = {key: value for key, value in _form_values(page).items()}
    prefix = "limits"
    total = int(form[f"{prefix}-TOTAL_FORMS"])
    form.update({
        f"{prefix}-TOTAL_FORMS": str(total + 1),
        f"{prefix}-{total}-metric": "requests",
        f"{prefix}-{total}-amount": "100",
        f"{prefix}-{total}-window": "5 minutes",
    })
    response = admin_client.post(url, form)
    assert response.status_code == 200  # redisplayed with the error
    assert "&#x27;5 minutes&#x27; is not a window; use 30s, 5m, 1h or 1d" in response.content.decode()
    assert team.limits.count() == 1

    form[f"{prefix}-{total}-window"] = "5m"
    response = admin_client.post(url, form)
    assert response.status_code == 302, text_of(response)[:2000]
    assert team.limits.get(metric="requests").window == 300


def _form_values(response, form_id: str = "team_form") -> dict[str, str]:
    """The values a browser would submit from the admin change form (inputs, selects, textareas)."""
    html = response.content.decode()
    form = html[html.index(f'id="{form_id}"'):]
    values: dict[str, str] = {}
    for tag in re.findall(r"<input[^>]*>", form):
        name = re.search(r'name="([^"]+)"', tag)
        if not name or 'type="submit"' in tag:
            continue
        if 'type="checkbox"' in tag:
            if "checked" in tag:
                values[name.group(1)] = "on"
            continue
        value = re.search(r'value="([^"]*)"', tag)
        values[name.group(1)] = value.group(1) if value else ""
    for name, body in re.findall(r'<select[^>]*name="([^"]+)"[^>]*>(.*?)</select>', form, re.S):
        selected = re.search(r'<option value="([^"]*)"[^>]*selected', body)
        values[name] = selected.group(1) if selected else ""
    for name, body in re.findall(r'<textarea[^>]*name="([^"]+)"[^>]*>(.*?)</textarea>', form, re.S):
        values[name] = body.strip()
    return values


def test_api_key_is_shown_once_at_creation_and_only_its_hash_is_stored(admin_client, demo):
    org = Organization.objects.get()
    response = admin_client.post(reverse("admin:quotas_apikey_add"), {"org": org.pk, "name": "gateway"}, follow=True)
    html = response.content.decode()
    raw = re.search(r"<code[^>]*>(aq_[A-Za-z0-9_-]+)</code>", html).group(1)
    key = ApiKey.objects.get()
    assert key.key_hash == api_key_hash(raw) and key.name == "gateway" and key.org == org
    assert raw not in str(ApiKey.objects.values_list())  # not stored in clear
    change = admin_client.get(reverse("admin:quotas_apikey_change", args=[key.pk])).content.decode()
    assert raw not in change and key.prefix in change


def test_revoke_action(admin_client, demo):
    from quotas.services.api_keys import api_key_create

    key, _ = api_key_create(org=Organization.objects.get())
    response = admin_client.post(
        reverse("admin:quotas_apikey_changelist"), {"action": "revoke", "_selected_action": [key.pk]}, follow=True
    )
    assert response.status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_duplicate_agent_id_in_the_org_is_a_form_error_not_a_500(admin_client, demo):
    carol = Member.objects.get(slug="carol")
    response = admin_client.post(reverse("admin:quotas_agent_add"), {"slug": "agent-1", "member": carol.pk, "name": ""})
    assert response.status_code == 200
    assert "This organization already has an agent with this id" in response.content.decode()
    assert Agent.objects.filter(slug="agent-1").count() == 1


def test_override_changelist_lists_overrides(admin_client, demo):
    response = admin_client.get(reverse("admin:quotas_override_changelist"))
    assert "launch week" in response.content.decode()
    assert Override.objects.count() == 1 and Limit.objects.count() > 0


def budget_alert(**values) -> BudgetAlert:
    import datetime as dt
    from decimal import Decimal

    fields = dict(org="acme-corp", level="org", node="acme-corp", limit_ref="1a2b3c4d", limit_description="cost 500/day",
                  threshold=50, period_start=dt.datetime(2030, 1, 15, tzinfo=dt.timezone.utc), used=Decimal("251.5"),
                  amount=Decimal(500))
    fields.update(values)
    return BudgetAlert.objects.create(**fields)


def test_budget_alerts_list_shows_what_was_sent_read_only(admin_client, demo):
    import datetime as dt

    budget_alert(status="sent", attempts=2, sent_at=dt.datetime(2030, 1, 15, 9, tzinfo=dt.timezone.utc),
                 last_error="HTTP 500: boom")
    budget_alert(threshold=80, used=400, status="failed", attempts=9, last_error="ConnectTimeout: timed out")
    url = reverse("admin:quotas_budgetalert_changelist")
    text = text_of(admin_client.get(url))
    for shown in ("org acme-corp", "cost 500/day", "50%", "251.5 / 500", "sent", "HTTP 500: boom", "80%",
                  "400 / 500", "failed", "ConnectTimeout: timed out", "Jan. 15, 2030"):
        assert shown in text
    for filters, count in (({"status__exact": "failed"}, 1), ({"threshold": "50"}, 1), ({"org": "acme-corp"}, 2),
                           ({"org": "globex"}, 0)):
        assert admin_client.get(url, filters).context["cl"].result_count == count, filters
    alert = BudgetAlert.objects.get(threshold=50)
    change = admin_client.get(reverse("admin:quotas_budgetalert_change", args=[alert.pk]))
    assert change.status_code == 200 and 'name="threshold"' not in change.content.decode()  # view only
    response = admin_client.post(reverse("admin:quotas_budgetalert_change", args=[alert.pk]), {"status": "pending"})
    assert response.status_code == 403
    orgs = admin_client.get(reverse("admin:quotas_organization_changelist")).content.decode()
    assert 'href="/admin/quotas/budgetalert/?org=acme-corp">2 alerts</a>' in orgs


def test_org_page_edits_the_webhook_and_the_dashboard_viewers(admin_client, demo, django_user_model):
    org = Organization.objects.get()
    viewer = django_user_model.objects.create_user("viewer", password="x")
    url = reverse("admin:quotas_organization_change", args=[org.pk])
    page = admin_client.get(url)
    html = page.content.decode()
    assert 'name="alert_webhook_url"' in html and 'class="selectfilter"' in html  # filter_horizontal
    form = _form_values(page, form_id="organization_form")
    form["alert_webhook_url"] = "https://hooks.example.com/budget"
    form["viewers"] = [str(viewer.pk)]
    response = admin_client.post(url, form)
    assert response.status_code == 302, text_of(response)[:2000]
    org.refresh_from_db()
    assert org.alert_webhook_url == "https://hooks.example.com/budget"
    assert list(org.viewers.all()) == [viewer]


@pytest.mark.parametrize(("typed", "stored", "error"), [
    ("90, 50", [50, 90], None),
    ("none", [], None),  # no alerts
    ("", None, None),  # the default for the metric
    ("50, 50", None, "50 appears more than once; list each threshold once"),
    ("0", None, "0 is not a percent from 1 to 1000; use e.g. [50, 80, 100]"),
    ("fifty", None, "Item 1 in the array did not validate"),
])
def test_alert_thresholds_are_edited_inline(admin_client, demo, typed, stored, error):
    team = Team.objects.get(slug="engineering")
    limit = team.limits.get()
    limit.alert_at = [10]
    limit.save()
    url = reverse("admin:quotas_team_change", args=[team.pk])
    form = _form_values(admin_client.get(url))
    assert form["limits-0-alert_at"] == "10"
    form["limits-0-alert_at"] = typed
    response = admin_client.post(url, form)
    limit.refresh_from_db()
    if error:
        assert response.status_code == 200 and error in text_of(response)
        assert limit.alert_at == [10]
    else:
        assert response.status_code == 302, text_of(response)[:2000]
        assert limit.alert_at == stored
        again = _form_values(admin_client.get(url))["limits-0-alert_at"]
        assert again == {"90, 50": "50,90", "none": "none", "": ""}[typed]


def test_a_concurrency_limit_takes_no_alert_thresholds(admin_client, demo):
    alice = Member.objects.get(slug="alice")
    limit = alice.limits.get(metric="concurrency")
    response = admin_client.post(reverse("admin:quotas_limit_change", args=[limit.pk]), {
        "member": alice.pk, "metric": "concurrency", "amount": "3", "window": "", "period": "", "tool": "",
        "model": "", "burst": "", "alert_at": "80",
    })
    assert response.status_code == 200
    assert "a concurrency limit counts leases held at once, not a budget; leave alert_at empty" in text_of(response)
