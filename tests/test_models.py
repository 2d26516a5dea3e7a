"""What must always hold is a database constraint; the admin's validation says how to fix it."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from quotas.models import Agent, ApiKey, Limit, Member, ModelPrice, Organization, Override, Team, Tier, ToolCost

pytestmark = pytest.mark.django_db


@pytest.fixture
def tree():
    org = Organization.objects.create(slug="acme-corp")
    team = Team.objects.create(org=org, slug="engineering")
    member = Member.objects.create(team=team, slug="alice")
    agent = Agent.objects.create(member=member, slug="agent-1")
    return org, team, member, agent


def refused(**fields):
    """True when the database refuses to insert a Limit with ``fields`` (skipping model validation)."""
    try:
        with transaction.atomic():
            Limit.objects.create(**fields)
    except IntegrityError:
        return True
    return False


def test_derived_org_follows_the_parent(tree):
    org, team, member, agent = tree
    assert member.org == org and agent.org == org


@pytest.mark.parametrize(
    "fields",
    [
        {"metric": "tokens", "amount": 0, "window": 3600},
        {"metric": "tokens", "amount": -5, "window": 3600},
        {"metric": "tokens", "amount": Decimal("1.5"), "window": 3600},
        {"metric": "tokens", "amount": 5},  # neither window nor period
        {"metric": "tokens", "amount": 5, "window": 60, "period": "day"},  # both
        {"metric": "tokens", "amount": 5, "period": "week"},
        {"metric": "tokens", "amount": 5, "window": 0},
        {"metric": "concurrency", "amount": 3, "window": 60},
        {"metric": "concurrency", "amount": 3, "period": "day"},
        {"metric": "concurrency", "amount": 3, "tool": "llm_call"},
        {"metric": "credits", "amount": 5, "period": "day", "burst": 10},  # burst needs a window
        {"metric": "credits", "amount": 5, "window": 10, "burst": 0},
        {"metric": "widgets", "amount": 5, "window": 10},
    ],
    ids=lambda fields: ",".join(f"{key}={value}" for key, value in fields.items()),
)
def test_database_refuses_ill_formed_limits(tree, fields):
    org = tree[0]
    assert refused(org=org, **fields)


def test_database_accepts_the_well_formed_ones(tree):
    org = tree[0]
    assert not refused(org=org, metric="cost", amount=Decimal("500.25"), period="day")
    assert not refused(org=org, metric="concurrency", amount=3)
    assert not refused(org=org, metric="credits", amount=50, window=10, burst=50)


def test_a_limit_has_exactly_one_owner(tree):
    org, team, _, _ = tree
    tier = Tier.objects.create(slug="gold")
    assert refused(metric="tokens", amount=5, window=60)
    assert refused(org=org, team=team, metric="tokens", amount=5, window=60)
    assert refused(tier=tier, org=org, metric="tokens", amount=5, window=60)
    assert not refused(tier=tier, metric="tokens", amount=5, window=60)


def test_one_limit_per_key_and_owner_even_with_empty_window(tree):
    org, team, _, _ = tree
    assert not refused(org=org, metric="concurrency", amount=3)
    assert refused(org=org, metric="concurrency", amount=4)  # window NULL is not "distinct"
    assert not refused(team=team, metric="concurrency", amount=3)  # another owner
    assert not refused(org=org, metric="tokens", amount=5, window=60)
    assert refused(org=org, metric="tokens", amount=6, window=60)
    assert not refused(org=org, metric="tokens", amount=6, window=60, tool="llm_call")


def test_ids_are_unique_within_an_org_not_across_orgs(tree):
    org, team, member, _ = tree
    other_team = Team.objects.create(org=org, slug="marketing")
    for create in (
        lambda: Team.objects.create(org=org, slug="engineering"),
        lambda: Member.objects.create(team=other_team, slug="alice"),
        lambda: Agent.objects.create(member=Member.objects.create(team=other_team, slug="carol"), slug="agent-1"),
        lambda: Organization.objects.create(slug="acme-corp"),
    ):
        with pytest.raises(IntegrityError), transaction.atomic():
            create()
    other = Organization.objects.create(slug="globex")
    other_member = Member.objects.create(team=Team.objects.create(org=other, slug="engineering"), slug="alice")
    Agent.objects.create(member=other_member, slug="agent-1")
    assert Agent.objects.filter(slug="agent-1").count() == 2


def test_prices_weights_and_override_reasons(tree):
    org = tree[0]
    ApiKey.objects.create(org=org, prefix="aq_1", key_hash="same")
    for create in (
        lambda: ToolCost.objects.create(tool="llm_call", weight=0),
        lambda: ModelPrice.objects.create(model="gpt-4o", input_per_1k=Decimal("-0.01"), output_per_1k=0),
        lambda: Override.objects.create(org=org, metric="tokens", amount=5, window=60, reason=""),
        lambda: Tier.objects.create(slug="x", level="galaxy"),
        lambda: ApiKey.objects.create(org=org, prefix="aq_2", key_hash="same"),
    ):
        with pytest.raises(IntegrityError), transaction.atomic():
            create()
    money = ModelPrice.objects.create(model="gpt-4o", input_per_1k=Decimal("0.0025"), output_per_1k=Decimal("0.01"))
    money.refresh_from_db()
    assert money.input_per_1k == Decimal("0.0025")  # decimal, not float


# ---------------------------------------------------------------------------
# Validation messages (what the admin shows)
# ---------------------------------------------------------------------------


def messages_of(instance) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as raised:
        instance.full_clean()
    return raised.value.message_dict


def test_validation_says_what_is_wrong_and_how_to_fix_it(tree):
    org = tree[0]
    assert messages_of(Limit(org=org, metric="concurrency", amount=3, window=60)) == {
        "window": ["a concurrency limit counts leases held at once; leave window and period empty"],
    }
    assert messages_of(Limit(org=org, metric="tokens", amount=Decimal("2.5"), window=60)) == {
        "amount": ["tokens are counted in whole units; use a whole number such as 2"],
    }
    assert messages_of(Limit(org=org, metric="requests", amount=5)) == {
        "window": ["a requests limit needs a rolling window (30s, 5m, 1h, 1d) or a calendar period (day, month)"],
    }
    assert messages_of(Limit(org=org, metric="credits", amount=5, period="day", burst=5)) == {
        "burst": ["burst makes a token bucket over a rolling window; set a window or leave burst empty"],
    }


def test_validation_catches_a_duplicate_id_in_the_org(tree):
    org, team, member, agent = tree
    other_team = Team.objects.create(org=org, slug="marketing")
    other_member = Member.objects.create(team=other_team, slug="carol")
    errors = messages_of(Agent(member=other_member, slug="agent-1"))
    assert errors == {"__all__": ["This organization already has an agent with this id; ids are unique within an org."]}
    errors = messages_of(Member(team=other_team, slug="alice"))
    assert errors == {"__all__": ["This organization already has a user with this id; ids are unique within an org."]}


def test_validation_catches_a_tier_for_another_level(tree):
    agent = tree[3]
    agent.tier = Tier.objects.create(slug="team-plan", level="team")
    assert messages_of(agent) == {"tier": ["Tier 'team-plan' is for team nodes; pick a tier for agent nodes."]}


def test_slugs_are_validated(tree):
    org = tree[0]
    assert "slug" in messages_of(Team(org=org, slug="Bad Name"))
    assert "slug" in messages_of(Team(org=org, slug="trailing-newline\n"))  # `$` would let it through
