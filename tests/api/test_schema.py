"""OpenAPI 3 at /api/schema/, Swagger UI at /api/docs/ with local assets, and schemathesis against the schema.

The schemathesis run goes through Django's WSGI application in this process (no server), with a
real API key of the demo org, a bounded number of examples per operation, and the checks that a
response is never a server error and matches what the schema documents (status codes, content
types, headers, bodies).
"""

from __future__ import annotations

import re

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

OPERATIONS = {
    ("post", "/api/v1/check"),
    ("post", "/api/v1/check/batch"),
    ("post", "/api/v1/usage"),
    ("post", "/api/v1/leases"),
    ("delete", "/api/v1/leases/{lease}"),
    ("post", "/api/v1/leases/{lease}/renew"),
    ("get", "/api/v1/agents/{agent}/quota"),
    ("get", "/api/v1/reports/daily-spend"),
}


@pytest.fixture
def openapi(api) -> dict:
    response = api.client.get("/api/schema/", headers={"Accept": "application/json"})
    assert response.status_code == 200
    return response.json()


def test_the_schema_is_openapi_3_without_authentication(demo):
    response = Client().get("/api/schema/")

    assert response.status_code == 200
    assert response.content.startswith(b"openapi: 3.")


def test_the_schema_describes_every_endpoint_and_nothing_else(openapi):
    operations = {(method, path) for path, item in openapi["paths"].items() for method in item
                  if method != "parameters"}

    assert operations == OPERATIONS
    assert openapi["openapi"].startswith("3.")


def test_every_endpoint_needs_a_bearer_key_and_documents_its_errors(openapi):
    scheme = openapi["components"]["securitySchemes"]["ApiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, item in openapi["paths"].items():
        for method, operation in item.items():
            assert operation["security"] == [{"ApiKey": []}], (method, path)
            assert {"400", "401", "503"} <= set(operation["responses"]), (method, path)


def test_the_check_responses_are_documented_with_their_shapes(openapi):
    check = openapi["paths"]["/api/v1/check"]["post"]
    assert {"200", "429", "404"} <= set(check["responses"])
    assert openapi["paths"]["/api/v1/leases"]["post"]["responses"].keys() >= {"201", "429"}


def test_the_schema_says_request_bodies_reject_unknown_fields(openapi):
    for name, component in openapi["components"]["schemas"].items():
        if name.endswith("Request"):
            assert component.get("additionalProperties") is False, name


def test_swagger_ui_is_served_with_local_assets_only(demo, settings):
    settings.WHITENOISE_USE_FINDERS = True  # serve the sidecar's files as `make run` does (DEBUG) or collectstatic
    client = Client()  # a new client loads the middleware with this setting

    page = client.get("/api/docs/")

    assert page.status_code == 200
    html = page.content.decode()
    assert "SwaggerUIBundle" in html and '"/api/schema/"' in html
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert any(asset.endswith("swagger-ui-bundle.js") for asset in assets)
    assert any(asset.endswith("swagger-ui.css") for asset in assets)
    assert not re.search(r"https?://", " ".join(assets)), assets
    assert not re.search(r"cdn|unpkg|jsdelivr|cdnjs", html, re.IGNORECASE)
    for asset in assets:
        assert asset.startswith("/static/"), asset
        response = client.get(asset)
        assert response.status_code == 200, asset
        assert b"".join(response.streaming_content if response.streaming else [response.content])


# -- schemathesis ----------------------------------------------------------------------------------

_django = WSGIHandler()


def wsgi_app(environ, start_response):
    """Django's WSGI application, minus the connection recycling around each request.

    As in Django's test client: closing "old" connections at the end of a request would close the
    test's own connection, and with it its transaction.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        response = _django(environ, start_response)
        try:
            return [b"".join(response)]
        finally:
            response.close()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


# Loaded when this module is collected (no database needed for the schema).
# schemathesis.pytest.from_fixture() would load it in a fixture instead, but its lazy mode fails
# under pytest 9 (it sets Function._nodeid, which pytest 9 no longer has).
schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app)
QUOTA = "^/api/v1/agents/"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
EXAMPLES = hypothesis_settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.filter_too_much, HealthCheck.data_too_large])


@schema.exclude(path_regex=QUOTA).parametrize()
@EXAMPLES
@pytest.mark.django_db
def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(case, acme_key):
    case.call_and_validate(headers={"Authorization": f"Bearer {acme_key.raw}"}, checks=CHECKS)


@schema.include(path_regex=QUOTA).parametrize()
@EXAMPLES
@pytest.mark.django_db
def test_schemathesis_finds_no_server_error_in_the_agent_quota(case, acme_key):
    case.call_and_validate(headers={"Authorization": f"Bearer {acme_key.raw}"}, checks=CHECKS)
