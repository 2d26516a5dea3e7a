"""A strict parser for the HTTP Structured Field Lists (RFC 8941) the RateLimit headers use.

Enough of RFC 8941 section 4.2 for Lists of Items (no Inner Lists): bare items and parameter values
may be Integers, Decimals, Strings, Tokens or Booleans. Anything else is a ValueError, so a header
that a conforming client could not parse fails the test.
"""

from __future__ import annotations

import re
from decimal import Decimal

_KEY = re.compile(r"[a-z*][a-z0-9_\-.*]*")
_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")

Item = tuple[object, dict[str, object]]


def parse_list(text: str) -> list[Item]:
    parser = _Parser(text)
    members = parser.list()
    return members


def by_name(items: list[Item]) -> dict[str, dict[str, object]]:
    """{policy name: parameters}; names must be unique Strings."""
    names = [name for name, _ in items]
    assert all(isinstance(name, str) for name in names), names
    assert len(set(names)) == len(names), f"duplicate policy names in {names}"
    return {name: params for name, params in items}


class _Parser:
    def __init__(self, text: str):
        if not text.isascii():
            raise ValueError(f"not ASCII: {text!r}")
        self.s, self.i = text, 0

    def _peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def _skip(self, chars: str) -> None:
        while self._peek() and self._peek() in chars:
            self.i += 1

    def _fail(self, what: str):
        raise ValueError(f"{what} at {self.i} in {self.s!r}")

    def list(self) -> list[Item]:
        self._skip(" ")
        members = []
        while self.i < len(self.s):
            members.append(self.item())
            self._skip(" \t")
            if self.i == len(self.s):
                return members
            if self._peek() != ",":
                self._fail("expected ','")
            self.i += 1
            self._skip(" \t")
            if self.i == len(self.s):
                self._fail("trailing ','")
        return members

    def item(self) -> Item:
        return self.bare(), self.params()

    def params(self) -> dict[str, object]:
        params: dict[str, object] = {}
        while self._peek() == ";":
            self.i += 1
            self._skip(" ")
            match = _KEY.match(self.s, self.i)
            if not match:
                self._fail("expected a parameter key")
            self.i = match.end()
            value: object = True
            if self._peek() == "=":
                self.i += 1
                value = self.bare()
            params[match.group()] = value
        return params

    def bare(self) -> object:
        char = self._peek()
        if char == '"':
            return self.string()
        if char == "-" or char.isdigit():
            match = _NUMBER.match(self.s, self.i)
            if not match:
                self._fail("bad number")
            self.i = match.end()
            text = match.group()
            if match.group(1):
                return Decimal(text)
            if len(text.lstrip("-")) > 15:
                self._fail("integer over 15 digits")
            return int(text)
        if char == "?":
            value = self.s[self.i + 1:self.i + 2]
            if value not in ("0", "1"):
                self._fail("bad boolean")
            self.i += 2
            return value == "1"
        match = _TOKEN.match(self.s, self.i)
        if not match:
            self._fail("expected an item")
        self.i = match.end()
        return Token(match.group())

    def string(self) -> str:
        self.i += 1
        out = []
        while True:
            char = self._peek()
            if not char:
                self._fail("unterminated string")
            self.i += 1
            if char == '"':
                return "".join(out)
            if char == "\\":
                escaped = self._peek()
                if escaped not in ('"', "\\"):
                    self._fail("bad escape")
                self.i += 1
                out.append(escaped)
            elif not (0x20 <= ord(char) <= 0x7E):
                self._fail("character not allowed in a string")
            else:
                out.append(char)


class Token(str):
    """A Token bare item (distinct from a String)."""
