"""Limits (on a tier or a node) and overrides (on a node, replacing a tier's limit)."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.db.models.functions import Round
from django.utils import timezone

from quotas.policy.rules import limit_spec_errors
from quotas.vocabulary import Metric, Period, format_window

from .fields import WindowField, model_name_validator, slug_validator
from .hierarchy import Agent, Member, Organization, Team, Tier

NODE_OWNERS = ("org", "team", "member", "agent")
LIMIT_OWNERS = ("tier", *NODE_OWNERS)
SPEC_KEY = ("metric", "window", "period", "tool", "model")
SPEC_FIELDS = ("metric", "amount", "window", "period", "tool", "model", "burst", "shadow")  # a LimitSpec's fields


def _exactly_one(fields: tuple[str, ...]) -> Q:
    """Q that holds when exactly one of ``fields`` is set."""
    one = Q()
    for field in fields:
        branch = Q(**{f"{field}__isnull": False})
        for other in fields:
            if other != field:
                branch &= Q(**{f"{other}__isnull": True})
        one |= branch
    return one


def _spec_constraints(prefix: str, owners: tuple[str, ...]) -> list[models.BaseConstraint]:
    """The rules of ``quotas.policy.rules`` that the database can hold, for one table."""
    metrics = [metric.value for metric in Metric]
    concurrency = Q(metric=Metric.CONCURRENCY)
    return [
        models.CheckConstraint(condition=Q(metric__in=metrics), name=f"{prefix}_metric_known"),
        models.CheckConstraint(condition=Q(amount__gt=0), name=f"{prefix}_amount_positive"),
        models.CheckConstraint(
            condition=Q(metric=Metric.COST) | Q(amount=Round("amount")), name=f"{prefix}_amount_whole_unless_cost"
        ),
        models.CheckConstraint(
            condition=Q(period__in=["", *[period.value for period in Period]]), name=f"{prefix}_period_known"
        ),
        models.CheckConstraint(condition=Q(window__isnull=True) | Q(window__gt=0), name=f"{prefix}_window_positive"),
        models.CheckConstraint(
            condition=(concurrency & Q(window__isnull=True, period="", burst__isnull=True, tool="", model=""))
            | (~concurrency & Q(window__isnull=False, period=""))
            | (~concurrency & Q(window__isnull=True) & ~Q(period="")),
            name=f"{prefix}_window_xor_period_none_for_concurrency",
        ),
        models.CheckConstraint(
            condition=Q(burst__isnull=True) | Q(burst__gt=0, window__isnull=False),
            name=f"{prefix}_burst_positive_with_window",
        ),
        models.CheckConstraint(condition=_exactly_one(owners), name=f"{prefix}_exactly_one_owner"),
        *[
            models.UniqueConstraint(
                fields=[owner, *SPEC_KEY],
                condition=Q(**{f"{owner}__isnull": False}),
                nulls_distinct=False,
                name=f"{prefix}_unique_per_{owner}",
                violation_error_message=(
                    "This node already has a limit on the same metric, window or period, tool and model; "
                    "edit that one instead."
                ),
            )
            for owner in owners
        ],
    ]


class LimitSpec(models.Model):
    """metric + amount + window or period, optionally narrowed to a tool or model."""

    metric = models.CharField(max_length=16, choices=[(metric.value, metric.value) for metric in Metric])
    amount = models.DecimalField(
        "limit", max_digits=20, decimal_places=6,
        help_text="Whole units for requests, credits, tokens and concurrency; USD for cost.",
    )
    window = WindowField(null=True, blank=True)
    period = models.CharField(
        max_length=8, blank=True, choices=[(period.value, period.value) for period in Period],
        help_text="Calendar budget, reset at 00:00 UTC. Leave empty for a rolling window.",
    )
    tool = models.CharField(max_length=64, blank=True, validators=[slug_validator], help_text="Only calls of this tool.")
    model = models.CharField(
        max_length=100, blank=True, validators=[model_name_validator], help_text="Only calls of this model."
    )
    burst = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Token bucket: up to this many at once, refilled at limit/window."
    )
    shadow = models.BooleanField(default=False, help_text="Report what would be blocked, never block.")
    alert_at = ArrayField(
        models.PositiveSmallIntegerField(), null=True, blank=True, verbose_name="alert at (%)",
        help_text="Budget alert thresholds in percent, e.g. 50,80,100. Empty: 50,80,100 for cost and token "
        "budgets, none for other metrics.",
    )

    class Meta:
        abstract = True

    def clean(self) -> None:
        super().clean()
        errors = limit_spec_errors(
            metric=self.metric,
            amount=self.amount,
            window_seconds=self.window,
            period=self.period,
            tool=self.tool,
            model=self.model,
            burst=self.burst,
            alert_at=self.alert_at,
        )
        if errors:
            raise ValidationError(errors)
        if self.alert_at:
            self.alert_at = sorted(self.alert_at)  # as the policy file stores and exports them

    @property
    def span(self) -> str:
        """'1h', 'day', or '' for concurrency: how the amount is counted."""
        return format_window(self.window) if self.window else self.period

    def describe(self) -> str:
        amount = self.amount.normalize() if isinstance(self.amount, Decimal) else self.amount
        narrowed = "".join(f" [{label}={value}]" for label, value in (("tool", self.tool), ("model", self.model)) if value)
        span = f"/{self.span}" if self.span else " at once"
        return f"{self.metric} {amount:f}{span}{narrowed}{' (shadow)' if self.shadow else ''}"

    def spec_key(self) -> tuple:
        return (self.metric, self.window, self.period, self.tool, self.model)

    def __str__(self) -> str:
        return self.describe()


class Limit(LimitSpec):
    """A limit of a tier, or a node's own limit (it replaces the tier's of the same key)."""

    tier = models.ForeignKey(Tier, null=True, blank=True, on_delete=models.CASCADE, related_name="limits")
    org = models.ForeignKey(Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="limits")
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="limits")
    member = models.ForeignKey(
        Member, null=True, blank=True, on_delete=models.CASCADE, related_name="limits", verbose_name="user"
    )
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.CASCADE, related_name="limits")

    class Meta:
        ordering = ["metric", "tool", "model", "window", "period"]
        constraints = _spec_constraints("limit", LIMIT_OWNERS)


class OverrideQuerySet(models.QuerySet):
    def active(self, now=None):
        now = now or timezone.now()
        return self.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))


class Override(LimitSpec):
    """A node's temporary (or standing) replacement of a limit of the same key."""

    org = models.ForeignKey(Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="overrides")
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="overrides")
    member = models.ForeignKey(
        Member, null=True, blank=True, on_delete=models.CASCADE, related_name="overrides", verbose_name="user"
    )
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.CASCADE, related_name="overrides")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: until removed.")
    reason = models.CharField(max_length=300, help_text="Why, for the next operator (e.g. 'launch week, ticket OPS-12').")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OverrideQuerySet.as_manager()

    class Meta:
        ordering = ["metric", "tool", "model", "window", "period"]
        constraints = [
            *_spec_constraints("override", NODE_OWNERS),
            models.CheckConstraint(condition=~Q(reason=""), name="override_reason_required"),
        ]

    def is_active(self, now=None) -> bool:
        return self.expires_at is None or self.expires_at > (now or timezone.now())
