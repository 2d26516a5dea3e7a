"""The check API (v1): one view per operation. Views validate, call the engine, answer."""

from __future__ import annotations

import datetime as dt

import orjson
from django.http import HttpResponse, QueryDict
from django.http.request import RawPostDataException
from django.utils.datastructures import MultiValueDict
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from quotas.api import serializers as s
from quotas.api.errors import not_found
from quotas.api.headers import ratelimit_headers
from quotas.api.parsers import StrictJSONParser
from quotas.api.renderers import render_json
from quotas.engine import Decision, LimitState, QuotaError, QuotaExceeded, UnknownAgent, UnknownLease, UnknownReservation
from quotas.services import reports
from quotas.services.engine import get_engine
from quotas.vocabulary import SLUG_RE

ERRORS = {
    400: OpenApiResponse(s.ErrorOutput, description="Bad input: `detail` names the field."),
    401: OpenApiResponse(s.ErrorOutput, description="Missing, unknown or revoked API key."),
    503: OpenApiResponse(s.ErrorOutput, description="Redis unreachable (fail-closed mode)."),
}
LIMIT_EXAMPLE = {"level": "agent", "node": "agent-1", "metric": "tokens", "limit": 25000, "remaining": 23000,
                 "window": "1h", "tool": None, "model": None, "reset_ms": 3600000, "shadow": False}


def validated(serializer_class, data) -> dict:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def limit_json(limit: LimitState) -> dict:
    return limit.as_dict()


def decision_json(decision: Decision) -> dict:
    limits = [limit_json(limit) for limit in decision.limits]
    if decision.allowed:
        body = {"allowed": True, "reservation": decision.reservation, "limits": limits,
                "would_block": [limit_json(limit) for limit in decision.would_block]}
    else:
        body = {"allowed": False, "blocked_by": limit_json(decision.blocked_by),
                "retry_after_ms": decision.retry_after_ms, "limits": limits}
    if decision.degraded:
        body["degraded"] = True  # fail-open: admitted without Redis
    return body


def unknown_agent(agent: str):
    return not_found(f"no agent {agent!r} in this organization")


def ms_to_iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat().replace("+00:00", "Z")


class _JSONRequest(Request):
    """DRF's Request, parsing a body sent as exactly `application/json` without choosing among parsers.

    DRF matches the content type against each parser's media type (parsing both) on every request.
    For this one content type the choice is known: the view's only parser, StrictJSONParser. Any other
    content type (with parameters, another case, none) takes DRF's own way, 415 and all.
    """

    def _parse(self):
        parsers = self.parsers
        if (len(parsers) != 1 or type(parsers[0]) is not StrictJSONParser
                or self._request.META.get("CONTENT_TYPE") != StrictJSONParser.media_type):
            return super()._parse()
        try:
            stream = self.stream
        except RawPostDataException:
            return super()._parse()
        if stream is None:  # no body: as DRF, an empty dict (not a form type)
            return {}, MultiValueDict()
        try:
            return parsers[0].parse(stream, StrictJSONParser.media_type, self.parser_context), MultiValueDict()
        except Exception:
            # As DRF: empty data after a failed parse, so that nothing parses (and fails) twice.
            self._data = QueryDict("", encoding=self._request._encoding)
            self._files = MultiValueDict()
            self._full_data = self._data
            raise


# The check endpoints' base: DRF's request cycle (authentication, permissions, the exception handler,
# Response and the renderer) without per-request work that these views do not need. The answers,
# errors and schema are those of a plain APIView (tests/api/test_hot_path_view.py):
# - content negotiation: with one renderer (JSON) and no format override, a request without an Accept
#   header, or with `*/*` or `application/json`, gets that renderer without parsing the header; any
#   other Accept header is negotiated by DRF (406 when it cannot be satisfied);
# - a body sent as `application/json` goes straight to the JSON parser (_JSONRequest);
# - no throttle classes: no throttle pass; the `Allow` header is computed once per class.
# (No docstring: drf-spectacular would describe every operation of its subclasses with it.)
class HotPathView(APIView):
    def initialize_request(self, request, *args, **kwargs):
        return _JSONRequest(
            request,
            parsers=self.get_parsers(),
            authenticators=self.get_authenticators(),
            negotiator=self.get_content_negotiator(),
            parser_context=self.get_parser_context(request),
        )

    def perform_content_negotiation(self, request, force=False):
        if len(self.renderer_classes) == 1 and not getattr(self, "format_kwarg", None) and self.settings.URL_FORMAT_OVERRIDE is None:
            accept = request._request.META.get("HTTP_ACCEPT")
            renderer = self.renderer_classes[0]
            if accept is None or accept == "*/*" or accept == renderer.media_type:
                return renderer(), renderer.media_type  # what DRF's negotiation answers for these
        return super().perform_content_negotiation(request, force)

    def check_throttles(self, request):
        if self.throttle_classes:
            super().check_throttles(request)

    @property
    def default_response_headers(self):
        cls = type(self)
        allow = cls.__dict__.get("_allow_header")
        if allow is None:
            allow = ", ".join(self.allowed_methods)
            cls._allow_header = allow
        headers = {"Allow": allow}
        if len(self.renderer_classes) > 1:
            headers["Vary"] = "Accept"
        return headers


class CheckView(HotPathView):
    @extend_schema(
        summary="Check and charge every limit that applies to a call",
        request=s.CheckInput,
        responses={200: s.CheckAllowedOutput,
                   429: OpenApiResponse(s.CheckDeniedOutput, description="Refused: nothing was charged."),
                   404: OpenApiResponse(s.ErrorOutput, description="No such agent in this organization."), **ERRORS},
        examples=[
            OpenApiExample("an LLM call", request_only=True,
                           value={"agent": "agent-1", "tool": "llm_call", "model": "gpt-4o", "tokens": 2000}),
            OpenApiExample("allowed", response_only=True, status_codes=["200"],
                           value={"allowed": True, "reservation": "5f0c9a1b2c3d4e5f.engineering.alice.agent-1",
                                  "limits": [LIMIT_EXAMPLE], "would_block": []}),
            OpenApiExample("refused", response_only=True, status_codes=["429"],
                           value={"allowed": False, "blocked_by": LIMIT_EXAMPLE, "retry_after_ms": 1200,
                                  "limits": [LIMIT_EXAMPLE]}),
        ],
    )
    def post(self, request):
        data = s.check_input(request.data)
        try:
            decision = get_engine().check(org=request.user.org, **data)
        except UnknownAgent:
            raise unknown_agent(data["agent"]) from None
        return Response(decision_json(decision), status=200 if decision.allowed else 429,
                        headers=ratelimit_headers(decision))


class CheckBatchView(HotPathView):
    @extend_schema(
        summary="Up to 100 checks in one request (one Redis round trip), each decided on its own",
        request=s.CheckBatchInput,
        responses={200: s.CheckBatchOutput, **ERRORS},
        examples=[OpenApiExample("two checks", request_only=True, value={"checks": [
            {"agent": "agent-1", "tool": "web_search"}, {"agent": "agent-2", "model": "gpt-4o", "tokens": 500}]})],
    )
    def post(self, request):
        checks = s.check_batch_input(request.data)
        decided = get_engine().check_many(org=request.user.org, checks=checks)
        results = []
        for i, item in enumerate(checks):
            result, decided[i] = decided[i], None
            if isinstance(result, UnknownAgent):
                results.append({"error": "not_found", "detail": f"no agent {item['agent']!r} in this organization"})
            elif isinstance(result, QuotaError):
                results.append({"error": "quota_error", "detail": str(result)})
            else:
                # Written out at once, and the decision let go: 100 decisions, their limits and their
                # answers all alive until the end are thousands of objects for Python's cyclic garbage
                # collector to scan, again and again as they age (15 µs a check). The bytes are what the
                # renderer would write for the dict (tests/api/test_answer_building.py).
                results.append(orjson.Fragment(render_json(decision_json(result))))
        return Response({"results": results})


class UsageView(APIView):
    @extend_schema(
        summary="Settle a reservation with the actual tokens (idempotent)",
        request=s.UsageInput,
        responses={200: s.UsageOutput, 404: OpenApiResponse(s.ErrorOutput, description="Unknown reservation."),
                   **ERRORS},
        examples=[OpenApiExample("settle", request_only=True, value={
            "reservation": "5f0c9a1b2c3d4e5f.engineering.alice.agent-1", "input_tokens": 1200, "output_tokens": 640})],
    )
    def post(self, request):
        data = validated(s.UsageInput, request.data)
        try:
            settled = get_engine().settle(org=request.user.org, **data)
        except UnknownReservation:
            raise not_found(f"no reservation {data['reservation']!r} (never made, or settled or expired long ago)") from None
        return Response({
            "reservation": settled.reservation, "status": settled.status, "tokens": settled.tokens,
            "cost": settled.cost, "estimated_tokens": settled.estimated_tokens, "estimated_cost": settled.estimated_cost,
        })


class LeaseCreateView(APIView):
    @extend_schema(
        summary="Take a concurrency slot (in every concurrency limit on the agent's path, or none)",
        request=s.LeaseInput,
        responses={201: s.LeaseOutput,
                   429: OpenApiResponse(s.CheckDeniedOutput, description="A concurrency limit is full."),
                   404: OpenApiResponse(s.ErrorOutput, description="No such agent."), **ERRORS},
        examples=[OpenApiExample("a run", request_only=True, value={"agent": "agent-1", "ttl_s": 300})],
    )
    def post(self, request):
        data = validated(s.LeaseInput, request.data)
        try:
            lease = get_engine().lease(org=request.user.org, agent=data["agent"], ttl_s=data["ttl_s"])
        except UnknownAgent:
            raise unknown_agent(data["agent"]) from None
        except QuotaExceeded as refused:
            return Response(decision_json(refused.decision), status=429, headers=ratelimit_headers(refused.decision))
        return Response({"lease": lease.id, "expires_at": ms_to_iso(lease.expires_at_ms)}, status=201)


class LeaseDetailView(APIView):
    @extend_schema(summary="Release a lease", request=None,
                   responses={204: None, 404: OpenApiResponse(s.ErrorOutput, description="Not held."), **ERRORS})
    def delete(self, request, lease: str):
        try:
            released = get_engine().lease_release(org=request.user.org, lease=lease)
        except UnknownLease:
            released = False
        if not released:
            raise not_found(f"lease {lease!r} is not held (released, expired, or never granted)")
        return Response(status=status.HTTP_204_NO_CONTENT)


class LeaseRenewView(APIView):
    @extend_schema(summary="Renew a lease for ttl_s more seconds", request=s.LeaseRenewInput,
                   responses={200: s.LeaseOutput, 404: OpenApiResponse(s.ErrorOutput, description="Not held."),
                              **ERRORS})
    def post(self, request, lease: str):
        data = validated(s.LeaseRenewInput, request.data or {})
        try:
            expires = get_engine().lease_renew(org=request.user.org, lease=lease, ttl_s=data["ttl_s"])
        except UnknownLease:
            raise not_found(f"lease {lease!r} is not held (released, expired, or never granted)") from None
        return Response({"lease": lease, "expires_at": ms_to_iso(expires)})


class AgentQuotaView(APIView):
    @extend_schema(summary="Every limit that applies to an agent, with what remains (consumes nothing)",
                   parameters=[s.PeekQuery], responses={200: s.QuotaOutput, 404: s.ErrorOutput, **ERRORS})
    def get(self, request, agent: str):
        query = validated(s.PeekQuery, request.query_params.dict())
        if not SLUG_RE.fullmatch(agent):
            raise unknown_agent(s.printable(agent))  # not even a possible id
        try:
            decision = get_engine().peek(org=request.user.org, agent=agent, **query)
        except UnknownAgent:
            raise unknown_agent(agent) from None
        body = {"agent": agent, "limits": [limit_json(limit) for limit in decision.limits]}
        if decision.degraded:
            body["degraded"] = True  # fail-open without Redis: the limits are unknown, not absent
        return Response(body, headers=ratelimit_headers(decision, retry_after=False))


class DailySpendView(APIView):
    @extend_schema(summary="Spend per day, grouped by team, user, agent, model or tool (JSON, or CSV with format=csv)",
                   parameters=[s.DailySpendQuery],
                   responses={(200, "application/json"): s.DailySpendOutput,
                              (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="With format=csv: "
                                                                 "a header line, then one line per row."),
                              **ERRORS})
    def get(self, request):
        query = validated(s.DailySpendQuery, request.query_params.dict())
        start, end, group_by = query["from"], query["to"], query["group_by"]
        rows = reports.daily_spend(org=request.user.org, start=start, end=end, group_by=group_by)
        if query["format"] == "csv":
            response = HttpResponse(reports.as_csv(rows, group_by), content_type="text/csv; charset=utf-8")
            name = f"daily-spend-{request.user.org}-{start}-{end}-by-{group_by}.csv"
            response["Content-Disposition"] = f'attachment; filename="{name}"'
            return response
        return Response({"from": start, "to": end, "group_by": group_by,
                         "rows": [row.as_dict(group_by) for row in rows]})


def api_not_found(request, *args, **kwargs):
    """A path under /api/ that is no endpoint: the API's JSON error, not Django's HTML page."""
    from django.http import JsonResponse

    return JsonResponse({"error": "not_found", "detail": f"no endpoint at {s.printable(request.path)}"}, status=404)


class PingView(APIView):
    """A trivial JSON view: the benchmark's baseline for the cost of the web stack itself."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(exclude=True)
    def get(self, request):
        return Response({"ok": True})
