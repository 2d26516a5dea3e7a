"""Bearer API keys: one org each, looked up by hash, cached in the process for at most a second.

The hot path does not query the database on every request; a revoked key stops
working within ``CACHE_SECONDS``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from rest_framework import authentication, exceptions

from quotas.models import ApiKey
from quotas.services.api_keys import api_key_hash

CACHE_SECONDS = 1.0
CACHE_MAX = 10_000


@dataclass(frozen=True)
class ApiClient:
    """Who is calling: the org of the key (request.user in the API views)."""

    org: str
    org_id: int
    key_id: int
    is_authenticated: bool = True


_cache: dict[str, tuple[float, ApiClient | None]] = {}
_lock = threading.Lock()


def client_for_key(raw: str) -> ApiClient | None:
    digest = api_key_hash(raw)
    now = time.monotonic()
    hit = _cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    key = ApiKey.objects.select_related("org").filter(key_hash=digest, revoked_at__isnull=True).first()
    client = ApiClient(org=key.org.slug, org_id=key.org_id, key_id=key.id) if key else None
    with _lock:
        if len(_cache) >= CACHE_MAX:
            _cache.clear()
        _cache[digest] = (now + CACHE_SECONDS, client)
    return client


def forget_cached_keys() -> None:
    _cache.clear()


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None  # -> 401 not_authenticated
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip():  # auth schemes are case-insensitive (RFC 9110)
            raise exceptions.AuthenticationFailed("use the header `Authorization: Bearer <key>`")
        client = client_for_key(raw.strip())
        if client is None:
            raise exceptions.AuthenticationFailed("unknown or revoked API key")
        return client, client

    def authenticate_header(self, request) -> str:
        return self.keyword


try:  # the OpenAPI schema's description of this scheme
    from drf_spectacular.extensions import OpenApiAuthenticationExtension

    class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
        target_class = "quotas.api.auth.ApiKeyAuthentication"
        name = "ApiKey"

        def get_security_definition(self, auto_schema):
            return {"type": "http", "scheme": "bearer", "description": "An org's API key (`manage.py create_api_key ORG`)."}
except ImportError:  # pragma: no cover
    pass
