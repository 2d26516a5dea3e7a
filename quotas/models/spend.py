"""Spend rollups: what the usage stream drains into, and what reports read.

Rows name nodes by their ids (text, not foreign keys): spend history outlives a deleted agent,
and a moved agent's past spend stays with the team it was spent in.
"""

from __future__ import annotations

from django.db import connection, models

# The dimensions of a rollup row, in the order of its unique key (after org and the time bucket).
DIMENSIONS = ("team", "user", "agent", "tool", "model")
# What a row adds up.
MEASURES = ("requests", "credits", "tokens", "input_tokens", "output_tokens", "cost", "unsettled", "denied")


class SpendRow(models.Model):
    org = models.CharField(max_length=64)
    team = models.CharField(max_length=64)
    user = models.CharField(max_length=64)
    agent = models.CharField(max_length=64)
    tool = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=100, blank=True)

    requests = models.BigIntegerField(default=0, help_text="Admitted checks.")
    credits = models.BigIntegerField(default=0, help_text="Tool weights of the admitted checks.")
    tokens = models.BigIntegerField(
        default=0, help_text="Tokens as the budgets count them: the estimate until settled, then the actual."
    )
    input_tokens = models.BigIntegerField(default=0, help_text="Settled input tokens.")
    output_tokens = models.BigIntegerField(default=0, help_text="Settled output tokens.")
    cost = models.DecimalField(
        max_digits=24, decimal_places=9, default=0,
        help_text="USD: the estimate until settled, then the actual (exact to the nano-dollar).",
    )
    unsettled = models.BigIntegerField(default=0, help_text="Reservations that expired without a usage report.")
    denied = models.BigIntegerField(default=0, help_text="Refused checks.")

    class Meta:
        abstract = True


class HourlySpend(SpendRow):
    """Written by the drain (quotas.services.usage_drain), one row per node, tool and model per hour."""

    hour = models.DateTimeField(help_text="Start of the UTC hour.")

    class Meta:
        constraints = [
            # hour first: the daily rollup reads a day of every org; a report reads an org's few open days.
            models.UniqueConstraint(fields=["hour", "org", *DIMENSIONS], name="hourly_spend_unique"),
        ]
        verbose_name_plural = "hourly spend"


def column(name: str) -> str:
    """A rollup field's column, quoted for raw SQL (the same in HourlySpend and DailySpend)."""
    return connection.ops.quote_name(HourlySpend._meta.get_field(name).column)


def columns(names) -> list[str]:
    return [column(name) for name in names]


class DailySpend(SpendRow):
    """Written by the daily rollup (quotas.services.rollups) from the hourly rows of a finished day."""

    day = models.DateField(help_text="UTC day.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["org", "day", *DIMENSIONS], name="daily_spend_unique"),
        ]
        verbose_name_plural = "daily spend"


class RolledDay(models.Model):
    """A UTC day whose DailySpend rows equal the sum of its HourlySpend rows.

    Reports read such a day from DailySpend and any other day from HourlySpend. The drain deletes
    the mark when it adds to a marked day (a late event), so the day is read from the hours until
    it is rolled up again.
    """

    day = models.DateField(primary_key=True)
    rolled_at = models.DateTimeField(auto_now=True)


class StreamCursor(models.Model):
    """The newest usage-stream entry applied to the rollups, per stream: the drain's idempotency.

    Written in the same transaction as the rollups; an entry at or before it is acknowledged
    without being counted again.
    """

    stream = models.CharField(max_length=200, primary_key=True)
    last_ms = models.BigIntegerField(default=0)
    last_seq = models.BigIntegerField(default=0)
    events = models.BigIntegerField(default=0, help_text="Entries applied so far.")
    updated_at = models.DateTimeField(auto_now=True)

    @property
    def last_id(self) -> str:
        return f"{self.last_ms}-{self.last_seq}"
