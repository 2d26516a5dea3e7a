"""Budget alerts: a threshold of a cost or token budget crossed, once per threshold per period."""

from __future__ import annotations

from django.db import models

from quotas.policy.rules import DEFAULT_ALERT_THRESHOLDS

DEFAULT_THRESHOLDS = DEFAULT_ALERT_THRESHOLDS  # percent of a cost or token budget, unless a limit says otherwise


class BudgetAlert(models.Model):
    """One threshold of one budget of one node crossed in one period, and its delivery."""

    class Status(models.TextChoices):
        PENDING = "pending", "pending"  # waiting for (another) delivery attempt
        SENT = "sent", "sent"  # the webhook answered 2xx
        FAILED = "failed", "failed"  # gave up after the last retry
        LOGGED = "logged", "logged only"  # the org has no webhook URL

    org = models.CharField(max_length=64)
    level = models.CharField(max_length=8)
    node = models.CharField(max_length=64)
    limit_ref = models.CharField(
        max_length=16, help_text="The engine's id of the limit (stable across edits of the amount)."
    )
    limit_description = models.CharField(max_length=300)
    threshold = models.PositiveSmallIntegerField(help_text="Percent of the budget.")
    period_start = models.DateTimeField(help_text="Start of the budget's period (or window) the alert is for.")
    used = models.DecimalField(max_digits=24, decimal_places=9)
    amount = models.DecimalField(max_digits=24, decimal_places=9, help_text="The budget.")
    created_at = models.DateTimeField(auto_now_add=True)

    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    webhook_url = models.URLField(max_length=500, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["org", "level", "node", "limit_ref", "period_start", "threshold"],
                name="budget_alert_once_per_threshold_per_period",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.org}/{self.level}:{self.node} {self.limit_description} reached {self.threshold}%"
