"""HotPathView (the check endpoints' base) answers exactly as a plain DRF APIView would.

It skips per-request work (content negotiation for the Accept headers that need none, the choice of
a parser for `application/json`, the throttle pass); these tests send the same requests to a view on
each base, with every Accept header, content type, body, method and key that matters, and compare
the whole answers: status, headers and body.
"""

from __future__ import annotations

import json

import pytest
from django.test import RequestFactory
from rest_framework.exceptions import ParseError
from rest_framework.response import Response
from rest_framework.views import APIView

from quotas.api.views import CheckBatchView, CheckView, HotPathView


def _post(self, request):
    """Echoes what DRF made of the request: the parsed body, the caller, the accepted media type."""
    return Response({"data": request.data, "org": request.user.org, "accepted": request.accepted_media_type},
                    status=201, headers={"X-Seen": "yes"})


def echo_view(base):
    class Echo(base):  # one name for both: OPTIONS answers it
        post = _post
    return Echo


HotEcho, PlainEcho = echo_view(HotPathView), echo_view(APIView)


ACCEPTS = [None, "*/*", "application/json", "APPLICATION/JSON", "application/json; indent=4", "application/*",
           "*/*;q=0.1", "text/html", "text/html, application/json;q=0.9", "application/xml", "text/*", "",
           "application/json, text/html", " application/json", "application/json;q=0"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "application/JSON", "application/json ",
                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/vnd.api+json", "*/*", None]
BODIES = [b'{"agent": "agent-1", "tokens": 5}', b"", b"{}", b"[]", b"null", b"{", b'{"a": NaN}', b'\xef\xbb\xbf{}',
          b'{"a": "\xff"}', b"[" * 3000 + b"]" * 3000, b" " * (64 * 1024 + 1), b'{"a": 1} x', b"agent=agent-1"]


def answer(view_class, factory, method="post", body=b"", content_type=None, headers=None):
    """(status, headers, body) of the view's answer; content_type None: no Content-Type at all."""
    request = factory.generic(method.upper(), "/x", body, content_type=content_type or "", headers=headers)
    if content_type is None:
        request.META.pop("CONTENT_TYPE", None)
    response = view_class.as_view()(request)
    if hasattr(response, "render"):
        response.render()
    return response.status_code, sorted(response.items()), response.content


@pytest.fixture
def factory() -> RequestFactory:
    return RequestFactory()


@pytest.fixture
def auth(acme_key) -> dict:
    return {"Authorization": f"Bearer {acme_key.raw}"}


def test_every_accept_header_and_content_type_answers_as_on_a_plain_apiview(factory, auth):
    body = b'{"agent": "agent-1", "tokens": 5}'
    for accept in ACCEPTS:
        headers = {**auth, **({"Accept": accept} if accept is not None else {})}
        for content_type in CONTENT_TYPES:
            hot = answer(HotEcho, factory, body=body, content_type=content_type, headers=headers)
            plain = answer(PlainEcho, factory, body=body, content_type=content_type, headers=headers)
            assert hot == plain, (accept, content_type)


def test_every_body_answers_as_on_a_plain_apiview(factory, auth):
    for body in BODIES:
        for content_type in ("application/json", "application/json; charset=utf-8", None):
            hot = answer(HotEcho, factory, body=body, content_type=content_type, headers=auth)
            plain = answer(PlainEcho, factory, body=body, content_type=content_type, headers=auth)
            assert hot == plain, (body[:40], content_type)


def test_other_methods_answer_as_on_a_plain_apiview(factory, auth):
    for method in ("get", "put", "patch", "delete", "options", "head"):
        hot = answer(HotEcho, factory, method=method, headers=auth)
        assert hot == answer(PlainEcho, factory, method=method, headers=auth), method
        assert hot[0] in (200, 405)


def test_a_missing_or_bad_key_answers_as_on_a_plain_apiview(db, factory):
    body = b'{"agent": "agent-1"}'
    for authorization in (None, "Bearer nope", "Basic x", "Bearer", "Bearer  "):
        headers = {"Authorization": authorization} if authorization is not None else {}
        hot = answer(HotEcho, factory, body=body, content_type="application/json", headers=headers)
        assert hot == answer(PlainEcho, factory, body=body, content_type="application/json", headers=headers)
        assert hot[0] == 401, authorization


def test_after_a_failed_parse_the_data_is_what_drf_leaves(factory):
    left = []
    for view_class in (HotEcho, PlainEcho):
        request = view_class().initialize_request(factory.post("/x", data=b"{", content_type="application/json"))
        with pytest.raises(ParseError, match="not valid JSON"):
            request.data
        left.append((type(request.data), request.data, type(request.FILES), request.FILES))
    assert left[0] == left[1]


def test_the_check_views_are_hot_path_views_with_the_allow_header_of_their_methods(api):
    assert issubclass(CheckView, HotPathView) and issubclass(CheckBatchView, HotPathView)
    for path in ("/api/v1/check", "/api/v1/check/batch"):
        response = api.post(path, {"agent": "agent-1"} if path.endswith("check") else {"checks": [{"agent": "agent-1"}]})
        assert response.status_code == 200
        assert response["Allow"] == "POST, OPTIONS"
        assert "Vary" not in response
        assert json.loads(response.content)
