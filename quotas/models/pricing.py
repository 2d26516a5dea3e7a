"""Tool weights (credits) and model prices (USD per 1K tokens)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from .fields import model_name_validator, slug_validator


class ToolCost(models.Model):
    tool = models.CharField(max_length=64, unique=True, validators=[slug_validator])
    weight = models.PositiveIntegerField(help_text="Credits one call of this tool costs (unknown tools cost 1).")

    class Meta:
        ordering = ["tool"]
        verbose_name = "tool cost"
        constraints = [models.CheckConstraint(condition=Q(weight__gt=0), name="toolcost_weight_positive")]

    def __str__(self) -> str:
        return f"{self.tool}: {self.weight}"


class ModelPrice(models.Model):
    model = models.CharField(max_length=100, unique=True, validators=[model_name_validator])
    input_per_1k = models.DecimalField("input USD / 1K tokens", max_digits=14, decimal_places=8)
    output_per_1k = models.DecimalField("output USD / 1K tokens", max_digits=14, decimal_places=8)

    class Meta:
        ordering = ["model"]
        verbose_name = "model price"
        constraints = [
            models.CheckConstraint(
                condition=Q(input_per_1k__gte=0, output_per_1k__gte=0), name="modelprice_prices_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return self.model
