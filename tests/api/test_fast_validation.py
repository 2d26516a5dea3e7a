"""The check endpoints' fast validation never accepts what the serializer refuses, and agrees on what it accepts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.api.serializers import CheckInput, check_batch_input, fast_check

names = st.one_of(
    st.sampled_from(["agent-1", "a", "web_search", "gpt-4o", "openai/gpt-4o@2024", "x" * 64, "x" * 65, "A", "a b",
                     "a\n", " a", "", "-a", "a-", "a|b", "é", "0", "x" * 100, "x" * 101]),
    st.text(max_size=12),
)
values = st.one_of(names, st.none(), st.integers(-2, 10**9 + 2), st.booleans(), st.floats(allow_nan=False),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
bodies = st.one_of(
    st.fixed_dictionaries({"agent": values}, optional={"tool": values, "model": values, "tokens": values}),
    st.dictionaries(st.sampled_from(["agent", "tool", "model", "tokens", "x", "Agent"]), values, max_size=5),
    values,
)


def serializer_answer(data):
    """What the serializer accepts, with absent optional fields as the engine takes them (None)."""
    serializer = CheckInput(data=data)
    return {"tool": None, "model": None, **serializer.validated_data} if serializer.is_valid() else None


@settings(max_examples=3000, deadline=None)
@given(data=bodies)
def test_fast_validation_is_never_laxer_than_the_serializer(data):
    fast = fast_check(data)
    if fast is not None:
        assert serializer_answer(data) == fast


def test_the_common_bodies_take_the_fast_path():
    assert fast_check({"agent": "agent-1"}) == {"agent": "agent-1", "tool": None, "model": None, "tokens": 0}
    assert fast_check({"agent": "agent-1", "tool": "llm_call", "model": "gpt-4o", "tokens": 2000}) is not None
    assert check_batch_input({"checks": [{"agent": "agent-1"}, {"agent": "agent-2", "tokens": 5}]})[1]["tokens"] == 5
