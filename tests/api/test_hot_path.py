"""What a check costs the server once it is warm: no database query, and no reload of the agent's policy."""

from __future__ import annotations

import pytest

from quotas.services.engine import get_engine


@pytest.fixture
def policy_loads(api, monkeypatch) -> list[str]:
    """The agents whose compiled policy the engine (re)parses from a script's answer."""
    engine = get_engine()
    loads: list[str] = []
    learn = engine._learn

    def spy(org, agent, version, blob):
        loads.append(agent)
        return learn(org, agent, version, blob)

    monkeypatch.setattr(engine, "_learn", spy)
    return loads


def test_a_warm_check_does_not_reload_the_agents_policy(api, policy_loads):
    assert api.check(agent="agent-1").status_code == 200
    first = len(policy_loads)

    for _ in range(3):
        assert api.check(agent="agent-1").status_code == 200
    assert api.post("/api/v1/check/batch", {"checks": [{"agent": "agent-1"}] * 5}).status_code == 200

    assert first >= 1
    assert len(policy_loads) == first
