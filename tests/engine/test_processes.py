"""N processes against one limit of L admit exactly L (real server time, real connections)."""

from __future__ import annotations

import multiprocessing
import os

from quotas.engine import QuotaEngine

from .conftest import lim

PROCESSES = 8
ATTEMPTS = 60  # per process: 480 in all against a limit of 200


def _hammer(args) -> list[tuple[int, int]]:
    prefix, agent, barrier = args
    engine = QuotaEngine.from_url(os.environ["REDIS_URL"], key_prefix=prefix)
    barrier.wait()
    return [int(engine.check(org="acme", agent=agent, tokens=1).allowed) for _ in range(ATTEMPTS)]


def test_eight_processes_admit_exactly_the_limit(engine, install, prefix):
    engine.clock = None  # the server's TIME, as in production
    install(user=[lim("requests", 200, "1h")], org=[lim("tokens", 10_000, "1h")])
    install(user=[lim("requests", 200, "1h")], org=[lim("tokens", 10_000, "1h")],
            path=("acme", "eng", "alice", "agent-2"))
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        jobs = [(prefix, "agent-1" if i % 2 else "agent-2", barrier) for i in range(PROCESSES)]
        with context.Pool(PROCESSES) as pool:
            results = pool.map(_hammer, jobs)
    admitted = sum(sum(r) for r in results)
    assert admitted == 200
    peek = engine.peek(org="acme", agent="agent-1")
    assert [(l.level, l.metric, l.remaining) for l in peek.limits] == [("org", "tokens", 10_000 - 200), ("user", "requests", 0)]
