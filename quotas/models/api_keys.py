"""API keys: one org each, stored only as a hash, revocable."""

from __future__ import annotations

from django.db import models

from .hierarchy import Organization


class ApiKey(models.Model):
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True, help_text="What uses it, e.g. 'gateway-prod'.")
    prefix = models.CharField(max_length=16, editable=False, help_text="The key's first characters, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.org.slug}{', revoked' if self.revoked_at else ''})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None
