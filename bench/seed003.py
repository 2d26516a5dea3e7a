"""The hierarchical check of ../shared/seeds/003, written from its description: a baseline.

Round trip 1 reads every tier's fixed-window counters in a pipeline; round trip 2,
if all were under their limits, increments them all in a MULTI. Between the two,
another caller can read the same counters: concurrent callers over-admit. Its fixed
windows also let twice the limit through across a window boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Tier:
    name: str
    identifier: str
    max_requests: int
    max_tokens: int
    window_seconds: int


def hierarchical_check(client, prefix: str, tiers: list[Tier], tokens: int) -> dict:
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for tier in tiers:
        window = int(now // tier.window_seconds)
        pipe.get(f"{prefix}:hier:{tier.name}:{tier.identifier}:req:{window}")
        pipe.get(f"{prefix}:hier:{tier.name}:{tier.identifier}:tok:{window}")
    results = pipe.execute()

    blocked_by = None
    for i, tier in enumerate(tiers):
        current_req = int(results[i * 2] or 0)
        current_tok = int(results[i * 2 + 1] or 0)
        if current_req + 1 > tier.max_requests or current_tok + tokens > tier.max_tokens:
            blocked_by = tier.name
            break

    if not blocked_by:
        pipe = client.pipeline(transaction=True)
        for tier in tiers:
            window = int(now // tier.window_seconds)
            req_key = f"{prefix}:hier:{tier.name}:{tier.identifier}:req:{window}"
            tok_key = f"{prefix}:hier:{tier.name}:{tier.identifier}:tok:{window}"
            pipe.incr(req_key)
            pipe.expire(req_key, tier.window_seconds)
            pipe.incrby(tok_key, tokens)
            pipe.expire(tok_key, tier.window_seconds)
        pipe.execute()
    return {"allowed": blocked_by is None, "blocked_by": blocked_by}
