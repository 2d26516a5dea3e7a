"""Create and revoke API keys. The raw key exists only in the return value."""

from __future__ import annotations

import hashlib
import secrets

from django.db import transaction
from django.utils import timezone

from quotas.models import ApiKey, Organization

KEY_PREFIX = "aq_"
PREFIX_SHOWN = 10  # characters kept in clear, to recognise a key in lists


def api_key_hash(raw: str) -> str:
    """Keys are 256 random bits, so a fast hash is enough (nothing to brute-force)."""
    return hashlib.sha256(raw.encode()).hexdigest()


@transaction.atomic
def api_key_create(*, org: Organization, name: str = "") -> tuple[ApiKey, str]:
    raw = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(org=org, name=name, prefix=raw[:PREFIX_SHOWN], key_hash=api_key_hash(raw))
    return key, raw


def api_key_revoke(*, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    return key
