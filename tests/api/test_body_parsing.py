"""The JSON parser's decoder, made once, answers every text as json.loads(text, parse_constant=...) does."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.api.parsers import _loads, _no_constant

documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=10,
).map(lambda value: json.dumps(value, allow_nan=True))
texts = st.one_of(
    documents,
    st.tuples(documents, st.integers(0, 40), st.text(max_size=3)).map(lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:]),
    st.text(max_size=30),
    st.sampled_from(["", "\ufeff{}", "\ufeff", "NaN", "[Infinity]", "-Infinity", "1e400", '"\\ud800"', "[" * 3000,
                     "[" * 3000 + "]" * 3000, '{"a": 1} x', " {} ", "\x0c{}", '{"a":1,"a":2}']),
)


def outcome(parse, text):
    try:
        return "ok", repr(parse(text))
    except (ValueError, RecursionError) as error:
        return type(error).__name__, str(error)


@settings(max_examples=1500, deadline=None)
@given(text=texts)
def test_the_decoder_answers_as_json_loads(text):
    assert outcome(_loads, text) == outcome(lambda t: json.loads(t, parse_constant=_no_constant), text)
