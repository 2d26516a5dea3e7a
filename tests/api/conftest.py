"""Check API fixtures: the demo policy (Acme Corp) plus a second org (Globex) on real Postgres and Valkey,
an API key for each, and a small JSON client over Django's test client.

Every test starts from an empty Redis (this run's key prefix only) and an empty API key cache.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import transaction
from django.test import Client

from quotas.api.auth import forget_cached_keys
from quotas.models import Organization
from quotas.policy.document import parse_policy, read_policy_file
from quotas.services.api_keys import api_key_create
from quotas.services.engine import get_engine
from quotas.services.policy_load import policy_load
from tests.support import clean_redis

DEMO = Path(__file__).resolve().parents[2] / "quotas" / "fixtures" / "demo_policy.yaml"
DEMO_AGENTS = ("agent-1", "agent-2", "research-bot", "copywriter")

# A second tenant. It has an agent-1 of its own (same id as Acme's) and an agent Acme does not have.
GLOBEX = {
    "id": "globex",
    "name": "Globex",
    "limits": [{"metric": "requests", "limit": 1000, "window": "1h"}],
    "teams": [{
        "id": "research",
        "users": [{
            "id": "dana",
            "limits": [{"metric": "concurrency", "limit": 1}],
            "agents": [
                {"id": "agent-1", "limits": [{"metric": "requests", "limit": 5, "window": "1m"}]},
                {"id": "globex-bot", "limits": [{"metric": "tokens", "limit": 5000, "window": "1h"}]},
            ],
        }],
    }],
}


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def fresh_redis_and_key_cache():
    clean_redis()
    yield
    forget_cached_keys()


def policy_document() -> dict:
    data = read_policy_file(DEMO)
    data["orgs"].append(GLOBEX)
    return data


@pytest.fixture
def demo(db, django_capture_on_commit_callbacks):
    """The demo policy and Globex in Postgres, synced to Redis by the after-commit hook as in production."""
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            policy_load(doc=parse_policy(policy_document()))
    engine = get_engine()
    assert engine.client.hget(engine.keys.org_policy("acme-corp"), "v") is not None, "the policy did not reach Redis"
    assert engine.client.hget(engine.keys.org_policy("globex"), "v") is not None, "the policy did not reach Redis"
    return engine


@dataclass
class Key:
    raw: str
    model: object  # quotas.models.ApiKey


def _key(slug: str) -> Key:
    model, raw = api_key_create(org=Organization.objects.get(slug=slug), name=f"tests/api {slug}")
    return Key(raw, model)


@pytest.fixture
def acme_key(demo) -> Key:
    return _key("acme-corp")


@pytest.fixture
def globex_key(demo) -> Key:
    return _key("globex")


class Api:
    """JSON requests through Django's test client with a bearer key (or none, or any Authorization value).

    A server error comes back as a 500 response (and Django's log), not as an exception: the tests
    assert on statuses, and "no input answers 500" is one of the contracts.
    """

    def __init__(self, key: str | None = None, *, authorization: str | None = None):
        self.client = Client(raise_request_exception=False)
        self.authorization = authorization if authorization is not None else (f"Bearer {key}" if key else None)

    def headers(self, extra=None) -> dict:
        headers = {"Authorization": self.authorization} if self.authorization is not None else {}
        return {**headers, **(extra or {})}

    def get(self, path: str, params=None, **kw):
        return self.client.get(path, params or {}, headers=self.headers(kw.pop("headers", None)), **kw)

    def post(self, path: str, body=None, *, raw: bytes | str | None = None, content_type="application/json", **kw):
        data = raw if raw is not None else (json.dumps(body) if body is not None else "")
        return self.client.post(path, data, content_type=content_type, headers=self.headers(kw.pop("headers", None)),
                                **kw)

    def delete(self, path: str, **kw):
        return self.client.delete(path, headers=self.headers(kw.pop("headers", None)), **kw)

    def generic(self, method: str, path: str, **kw):
        return self.client.generic(method, path, headers=self.headers(kw.pop("headers", None)), **kw)

    def check(self, **body):
        return self.post("/api/v1/check", body)


@pytest.fixture
def api(acme_key) -> Api:
    return Api(acme_key.raw)


@pytest.fixture
def globex_api(globex_key) -> Api:
    return Api(globex_key.raw)


@pytest.fixture
def anonymous() -> Api:
    return Api()


def assert_error(response, status: int, code: str, *, field: str | None = None) -> dict:
    """An error answer: the status, JSON {"error": CODE, "detail": TEXT}, and the field named in the detail."""
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert body["error"] == code, body
    assert isinstance(body["detail"], str) and body["detail"], body
    if field is not None:
        assert re.search(rf"(^|; ){re.escape(field)}: ", body["detail"]), f"{field!r} not named in {body['detail']!r}"
    return body
