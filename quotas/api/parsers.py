"""JSON bodies: at most 64 KiB, an object, and errors that say what is wrong."""

from __future__ import annotations

import json

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

MAX_BODY_BYTES = 64 * 1024


class BodyTooLarge(ParseError):
    default_code = "body_too_large"


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        request = (parser_context or {}).get("request")
        length = request.META.get("CONTENT_LENGTH") if request is not None else None
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise BodyTooLarge(f"body: over {MAX_BODY_BYTES // 1024} KiB")
        raw = stream.read(MAX_BODY_BYTES + 1) if stream is not None else b""
        if len(raw) > MAX_BODY_BYTES:
            raise BodyTooLarge(f"body: over {MAX_BODY_BYTES // 1024} KiB")
        try:
            data = _loads(raw.decode("utf-8") or "null")
        except (UnicodeDecodeError, ValueError) as exc:
            raise ParseError(f"body: not valid JSON ({exc})") from None
        except RecursionError:
            raise ParseError("body: nested too deeply") from None
        if not isinstance(data, dict):
            raise ParseError("body: expected a JSON object")
        return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_no_constant)


def _loads(text: str):
    """json.loads(text, parse_constant=_no_constant), less the decoder it makes on every call (half of
    the time of a check's body): the same check of a byte order mark first, then one decoder's decode."""
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _decoder.decode(text)
