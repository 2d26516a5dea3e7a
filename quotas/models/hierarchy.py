"""org > team > user > agent, and the tiers nodes are assigned to."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models, transaction

from quotas.vocabulary import Level

from .fields import slug_validator


def _unique_in_org(name: str, label: str) -> models.UniqueConstraint:
    return models.UniqueConstraint(
        fields=["org", "slug"],
        name=f"{name}_slug_unique_in_org",
        violation_error_message=(
            f"This organization already has {label} with this id; ids are unique within an org."
        ),
    )


class Tier(models.Model):
    """A named plan: a set of limits that nodes of one level are assigned to."""

    slug = models.CharField("id", max_length=64, unique=True, validators=[slug_validator])
    level = models.CharField(
        max_length=8,
        choices=[(level.value, level.value) for level in Level],
        blank=True,
        help_text="The level of the nodes this tier is for; empty means any level.",
    )
    description = models.TextField(blank=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(level__in=["", *[level.value for level in Level]]), name="tier_level_known"
            ),
        ]

    def __str__(self) -> str:
        return self.slug


class Node(models.Model):
    """Common to the four levels: an id (slug) unique within the org, a name, a tier."""

    level: Level

    slug = models.CharField("id", max_length=64, validators=[slug_validator])
    name = models.CharField(max_length=200, blank=True)
    tier = models.ForeignKey(
        Tier, null=True, blank=True, on_delete=models.PROTECT, related_name="%(class)ss",
        help_text="Limits of this plan apply unless the node's own limits or overrides replace them.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        super().clean()
        if self.tier_id and self.tier.level and self.tier.level != self.level:
            raise ValidationError(
                {"tier": f"Tier '{self.tier.slug}' is for {self.tier.level} nodes; pick a tier for {self.level} nodes."}
            )


class Organization(Node):
    level = Level.ORG
    slug = models.CharField("id", max_length=64, unique=True, validators=[slug_validator])
    alert_webhook_url = models.URLField(
        "budget alert webhook", max_length=500, blank=True,
        help_text="Budget alerts are POSTed here as JSON (and always logged). Empty: logged only.",
    )
    viewers = models.ManyToManyField(
        "auth.User", blank=True, related_name="viewable_orgs",
        help_text="Users who see this org's dashboard (staff see every org).",
    )

    class Meta(Node.Meta):
        verbose_name = "organization"


class Team(Node):
    level = Level.TEAM
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="teams")

    class Meta(Node.Meta):
        constraints = [_unique_in_org("team", "a team")]

    def __str__(self) -> str:
        return f"{self.slug} ({self.org.slug})" if self.org_id else self.slug

    def clean(self) -> None:
        super().clean()
        if self.pk and self.org_id:
            _check_move(Member.objects.filter(team=self), Agent.objects.filter(member__team=self), self.org_id)

    def save(self, *args, **kwargs):
        # A team moved to another org takes its users and agents along (their org is derived).
        with transaction.atomic():
            super().save(*args, **kwargs)
            Member.objects.filter(team=self).exclude(org_id=self.org_id).update(org_id=self.org_id)
            Agent.objects.filter(member__team=self).exclude(org_id=self.org_id).update(org_id=self.org_id)


class Member(Node):
    """A person (or service account) in a team; "user" in the product's vocabulary.

    Named Member so that it does not clash with django.contrib.auth's User.
    """

    level = Level.USER
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="members", editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="members")

    class Meta(Node.Meta):
        verbose_name = "user"
        constraints = [_unique_in_org("member", "a user")]

    def __str__(self) -> str:
        return f"{self.slug} ({self.org.slug})" if self.org_id else self.slug

    def clean(self) -> None:
        super().clean()
        if self.pk and self.team_id:
            _check_move(Member.objects.none(), Agent.objects.filter(member=self), self.team.org_id)

    def save(self, *args, **kwargs):
        # The org is the team's: kept here so that "unique within the org" is a constraint.
        self.org_id = self.team.org_id
        with transaction.atomic():
            super().save(*args, **kwargs)
            Agent.objects.filter(member=self).exclude(org_id=self.org_id).update(org_id=self.org_id)

    def validate_constraints(self, exclude=None):
        # org is derived, so forms exclude it; "unique within the org" must still be checked.
        if self.team_id:
            self.org_id = self.team.org_id
            exclude = set(exclude or ()) - {"org"}
        super().validate_constraints(exclude=exclude)


class Agent(Node):
    level = Level.AGENT
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="agents", editable=False)
    member = models.ForeignKey(Member, on_delete=models.CASCADE, related_name="agents", verbose_name="user")

    class Meta(Node.Meta):
        constraints = [_unique_in_org("agent", "an agent")]

    def __str__(self) -> str:
        return f"{self.slug} ({self.org.slug})" if self.org_id else self.slug

    def save(self, *args, **kwargs):
        self.org_id = self.member.org_id
        super().save(*args, **kwargs)

    def validate_constraints(self, exclude=None):
        # org is derived, so forms exclude it; "unique within the org" must still be checked.
        if self.member_id:
            self.org_id = self.member.org_id
            exclude = set(exclude or ()) - {"org"}
        super().validate_constraints(exclude=exclude)


def _check_move(members, agents, org_id: int) -> None:
    """Moving users and agents into org ``org_id`` must not clash with ids it already has."""
    clashes = []
    for label, rows, model in (("users", members, Member), ("agents", agents, Agent)):
        moving = rows.exclude(org_id=org_id).values_list("slug", flat=True)
        taken = sorted(model.objects.filter(org_id=org_id, slug__in=list(moving)).values_list("slug", flat=True))
        if taken:
            clashes.append(f"{label} {', '.join(taken)}")
    if clashes:
        raise ValidationError(
            f"Moving here would clash with {' and '.join(clashes)} of that organization "
            "(ids are unique within an org): rename them first."
        )
