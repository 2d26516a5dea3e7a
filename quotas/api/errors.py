"""Every error as JSON ``{"error": CODE, "detail": TEXT}``; a 400 names the field."""

from __future__ import annotations

import logging

from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from quotas.engine import QuotaBackendUnavailable, QuotaError

log = logging.getLogger("quotas.api")


class ApiError(exceptions.APIException):
    def __init__(self, status_code: int, code: str, detail: str):
        super().__init__(detail=detail, code=code)
        self.status_code = status_code


def not_found(detail: str) -> ApiError:
    return ApiError(status.HTTP_404_NOT_FOUND, "not_found", detail)


CODES = {
    exceptions.ParseError: "invalid_body",
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "not_authenticated",
    exceptions.PermissionDenied: "forbidden",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "rate_limited",
}


def _flatten(detail, prefix: str = "") -> list[str]:
    """DRF's nested validation errors -> ["checks[2].tokens: ...", ...]."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            place = key if key != "non_field_errors" else ""
            if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
                place = f"{prefix}[{key}]"
            elif prefix:
                place = f"{prefix}.{key}" if place else prefix
            out.extend(_flatten(value, place))
        return out
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return [f"{prefix}: {item}" if prefix else str(item) for item in detail]
        out = []
        for index, item in enumerate(detail):
            if item:
                out.extend(_flatten(item, f"{prefix}[{index}]"))
        return out
    return [f"{prefix}: {detail}" if prefix else str(detail)]


def exception_handler(exc, context):
    if isinstance(exc, QuotaBackendUnavailable):
        log.error("quota backend unavailable: %s", exc)
        return Response({"error": "backend_unavailable", "detail": "the quota store (Redis) is unreachable; retry"},
                        status=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})
    if isinstance(exc, QuotaError):
        return Response({"error": "quota_error", "detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("no such resource")
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a real 500: Django logs it
    if isinstance(exc, exceptions.ValidationError):
        messages = _flatten(exc.detail)
        response.data = {"error": "invalid_request", "detail": "; ".join(messages), "fields": messages}
        return response
    if isinstance(exc, ApiError):
        code = exc.get_codes()
    else:
        code = next((name for cls, name in CODES.items() if isinstance(exc, cls)), "error")
        if isinstance(exc, exceptions.ParseError) and getattr(exc, "default_code", "") == "body_too_large":
            code = "body_too_large"
    response.data = {"error": code, "detail": str(exc.detail)}
    return response
