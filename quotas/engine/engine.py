"""QuotaEngine: the Python face of the Lua scripts. Needs a Redis URL, nothing of Django.

    engine = QuotaEngine.from_url("redis://127.0.0.1:6379/0")
    d = engine.check(org="acme-corp", agent="agent-1", tool="llm_call", model="gpt-4o", tokens=2000)
    if d.allowed:
        ...  # call the model
        engine.settle(org="acme-corp", reservation=d.reservation, input_tokens=1200, output_tokens=640)

A check is one FCALL, and so is a batch of checks. The script's keys follow
from the agent's path (org, team, user, agent), which the engine learns from
the first answer and keeps, with the agent's policy (to describe the limits the
script reports by index).
A script that finds the path changed answers "stale" with the new policy and
the engine asks again: after a policy edit that moved the agent, once.
"""

from __future__ import annotations

import json
import logging
import re
import random
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable

import redis

from quotas.vocabulary import format_window

from .compile import nanos_to_usd
from .decision import (
    LEVELS,
    Decision,
    LimitState,
    PolicyNotLoaded,
    QuotaBackendUnavailable,
    QuotaError,
    QuotaExceeded,
    Settlement,
    UnknownAgent,
    UnknownLease,
    UnknownOrg,
    UnknownReservation,
)
from .ids import random_hex
from .keys import Keys
from .scripts import Scripts, unavailable

log = logging.getLogger("quotas.engine")

MAX_TOKENS = 10**9
UNKNOWN = "?"  # a path part not learnt yet: the script answers "stale" before using (or writing) such a key
Path = tuple[str, str, str, str]


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@+-]{0,99}")


def _check_name(kind: str, value: str | None) -> str:
    """Ids end up in keys and in `|`-separated records: no spaces, separators or control characters."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} is not a valid name: letters, digits, '.', '_', '-', '/', '@', '+'")
    return value


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be a whole number from 0 to {MAX_TOKENS}, not {value!r}")
    return value


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class _Known:
    """What the engine has learnt of one agent: its path, its policy version, its limits, its keys."""

    path: Path
    version: str
    limits: list[tuple]  # per policy entry: the static fields of a LimitState
    check_keys: list[bytes]  # check.lua's 9 KEYS
    peek_keys: list[bytes]  # ... and the 4 lease zsets, which only a peek reads
    lease_keys: list[bytes]

    def describe(self, rows) -> list[LimitState]:
        """LimitStates from a script's [index * 2 + passed, remaining, reset_ms]* rows."""
        states, limits, make = [], self.limits, tuple.__new__  # (positional: a third of LimitState(**fields))
        for i in range(0, len(rows), 3):
            index, passed = divmod(int(rows[i]), 2)
            level, node, metric, limit, window, tool, model, shadow, burst, lid = limits[index - 1]
            remaining = int(rows[i + 1])
            if metric == "cost":
                remaining = max(nanos_to_usd(remaining), Decimal(0))
            elif remaining < 0:
                remaining = 0
            states.append(make(LimitState, (level, node, metric, limit, remaining, window, tool, model,
                                            int(rows[i + 2]), shadow, burst, lid, passed == 1)))
        return states


class QuotaEngine:
    def __init__(
        self,
        client: redis.Redis,
        *,
        key_prefix: str = "aq",
        reservation_ttl_s: int = 600,
        fail_mode: str = "closed",
        on_policy_missing: Callable[[str], bool] | None = None,
        clock: Callable[[], int] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        sweep_per_check: int = 2,
        path_cache_size: int = 100_000,
    ):
        """
        client: a redis-py client (``decode_responses`` either way).
        on_policy_missing(org) -> bool: called when the org's policy is not in Redis; returns whether
            it loaded it (the Django service resyncs from Postgres). Without it the check raises.
        clock() -> ms: fixes the time the scripts use (tests); None uses the Redis server's TIME.
        """
        if fail_mode not in ("closed", "open"):
            raise ValueError("fail_mode must be 'closed' or 'open'")
        self.client = client
        self.keys = Keys(key_prefix)
        self.reservation_ttl_ms = reservation_ttl_s * 1000
        self.fail_mode = fail_mode
        self.on_policy_missing = on_policy_missing
        self.clock = clock
        self.sleep = sleep
        self.sweep_per_check = sweep_per_check
        self.fail_open_admits = 0
        self._scripts = Scripts(client)
        self._known: dict[tuple[str, str], _Known] = {}
        self._cache_size = path_cache_size

    @classmethod
    def from_url(cls, url: str, *, connect_timeout_ms: int = 200, read_timeout_ms: int = 500, **options) -> QuotaEngine:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_ms / 1000,
            socket_timeout=read_timeout_ms / 1000,
            decode_responses=True,
        )
        return cls(client, **options)

    # -- the public API --------------------------------------------------------------

    def check(self, *, org: str, agent: str, tool: str | None = None, model: str | None = None, tokens: int = 0) -> Decision:
        """Charge every limit that applies, or none; say which blocked and when it would pass."""
        return self._evaluate("check", org, agent, tool, model, tokens)

    def peek(self, *, org: str, agent: str, tool: str | None = None, model: str | None = None, tokens: int = 0) -> Decision:
        """Every limit that applies to the agent (concurrency included) and what remains; consumes nothing."""
        return self._evaluate("peek", org, agent, tool, model, tokens)

    def settle(self, *, org: str, reservation: str, input_tokens: int, output_tokens: int) -> Settlement:
        """Charge the actual tokens and cost of a reservation; refund or add the difference. Idempotent."""
        _check_count("input_tokens", input_tokens)
        _check_count("output_tokens", output_tokens)
        path = self._path_of_id(org, reservation, UnknownReservation)
        keys = [
            self.keys.org_policy(org), self.keys.agent_policy(org, path[3]), *self.keys.path_counters(org, path),
            self.keys.reservations(org), self.keys.reservation_queue(org), self.keys.usage_stream(org),
        ]
        args = [self._now(), reservation, input_tokens, output_tokens, self.reservation_ttl_ms, org]
        result = json.loads(self._scripts.run("settle", keys, args))
        status = result["s"]
        if status == "unknown":
            raise UnknownReservation(reservation)
        return Settlement(
            reservation=reservation,
            status=status,
            tokens=int(result["tokens"]) if "tokens" in result else None,
            cost=nanos_to_usd(result["cost"]) if "cost" in result else None,
            estimated_tokens=int(result["est_tokens"]),
            estimated_cost=nanos_to_usd(result["est_cost"]),
        )

    def check_many(self, *, org: str, checks: list[dict]) -> list[Decision | QuotaError]:
        """Several checks of one org, each decided on its own, in order, in one call (check_batch.lua).

        ``checks`` are dicts of ``check``'s arguments (agent, tool, model, tokens). Each result is a
        Decision, or the QuotaError (UnknownAgent, ...) that ``check`` would have raised for it, as
        the same checks made one by one would answer. Agents met for the first time, or moved by a
        policy edit, cost one more round trip: the checks from the first of them on are sent again.
        """
        results: list = [None] * len(checks)
        pending = list(range(len(checks)))
        for item in checks:
            _check_count("tokens", item.get("tokens", 0))
            for kind in ("agent", "tool", "model"):
                _check_name(kind, item.get(kind))
        resynced = False
        for _ in range(4):
            if not pending:
                break
            # check_batch.lua's KEYS and ARGV (see its header): each agent's keys once, numbered from 1
            keys, agent_args, check_args, agents, sent = self._batch_keys(org), [], [], {}, []
            for i in pending:
                item = checks[i]
                entry = agents.get(item["agent"])
                if entry is None:
                    known = self._known.get((org, item["agent"])) or self._placeholder(org, item["agent"])
                    entry = agents[item["agent"]] = (len(agents) + 1, known)
                    keys += known.check_keys[1:6]
                    agent_args += (" ".join(known.path), known.version)
                number, known = entry
                check_args += (number, item.get("tool") or "", item.get("model") or "", item.get("tokens", 0),
                               self._new_id(known.path))
                sent.append((i, known))
            args = [self._now(), self.reservation_ttl_ms, self.sweep_per_check * len(sent), len(agents),
                    *agent_args, *check_args]
            try:
                reply = self._scripts.run("check_batch", keys, args)
            except QuotaBackendUnavailable:
                if self.fail_mode == "closed":
                    raise
                self.fail_open_admits += len(pending)
                log.warning("Redis unreachable: admitting %d checks of %s without a check (fail-open)",
                            len(pending), org)
                for i in pending:
                    results[i] = Decision(True, degraded=True)
                return results
            if _text(reply[0]) == "missing":
                if resynced or self.on_policy_missing is None:
                    error = PolicyNotLoaded(org) if self.on_policy_missing is None else UnknownOrg(org)
                    for i in pending:
                        results[i] = error
                    return results
                resynced = True
                if not self._resync(org):
                    for i in pending:
                        results[i] = UnknownOrg(org)
                    return results
                continue
            retry_later, learnt, at = [], {}, 0
            for i, known in sent:
                agent = checks[i]["agent"]
                status, version, blob = _text(reply[at]), reply[at + 1], reply[at + 2]
                end = at + 7 + 3 * int(reply[at + 6])
                if status == "stale" or status == "skip":  # sent again, in order, from the first stale check
                    if status == "stale" and agent not in learnt:
                        learnt[agent] = self._learn(org, agent, version, blob)
                    retry_later.append(i)
                elif status == "unknown":
                    self._known.pop((org, agent), None)
                    results[i] = UnknownAgent(org, agent)
                else:
                    if blob:  # the policy changed since we learnt it
                        known = learnt.get(agent) or self._learn(org, agent, version, blob)
                        learnt[agent] = known
                    reply[at] = status
                    results[i] = self._decision("check", reply[at:at + 6], reply[at + 7:end], known)
                at = end
            pending = retry_later
        for i in pending:  # pragma: no cover - a policy changing under every attempt
            results[i] = QuotaError(f"the policy of {org}/{checks[i]['agent']} kept changing under the check")
        return results

    def acquire(self, *, org: str, agent: str, tool: str | None = None, model: str | None = None, tokens: int = 0,
                timeout: float = 30.0) -> "Admitted":
        """Check, and if refused sleep for the decision's retry_after (with jitter) and check again.

        Raises QuotaExceeded (with the last decision) when it cannot pass within ``timeout`` seconds,
        at once if the request can never pass. Use as ``with engine.acquire(...) as decision:``.
        """
        deadline = time.monotonic() + timeout
        while True:
            decision = self.check(org=org, agent=agent, tool=tool, model=model, tokens=tokens)
            if decision.allowed:
                return Admitted(decision)
            if decision.retry_after_ms is None:
                raise QuotaExceeded(decision)
            wait = decision.retry_after_ms / 1000 * random.uniform(1.0, 1.1) + random.uniform(0, 0.005)
            if time.monotonic() + wait > deadline:
                raise QuotaExceeded(decision)
            self.sleep(wait)

    def lease(self, *, org: str, agent: str, ttl_s: float = 300, timeout: float = 0.0) -> "Lease":
        """Take a slot in every concurrency limit on the agent's path, or none.

        Waits up to ``timeout`` seconds for a slot (sleeping until the earliest lease expires), then
        raises QuotaExceeded. Use as ``with engine.lease(...) as lease: ... lease.renew()``.
        """
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms <= 0:
            raise ValueError("ttl_s must be greater than 0")
        deadline = time.monotonic() + timeout
        while True:
            lease_id = None

            def args(known: _Known) -> list:
                nonlocal lease_id
                lease_id = self._new_id(known.path)
                return ["acquire", self._now(), " ".join(known.path), lease_id, ttl_ms, known.version]

            reply, known = self._run("lease", org, agent, args, keys="lease_keys")
            if reply[0] == "ok":
                return Lease(self, org, lease_id, int(reply[5]), known.describe(reply[6:]))
            decision = Decision(False, retry_after_ms=int(reply[3]), blocked=int(reply[4]), rows=reply[6:],
                                describe=known.describe)
            wait = decision.retry_after_ms / 1000 * random.uniform(1.0, 1.1)
            if time.monotonic() + wait > deadline:
                raise QuotaExceeded(decision)
            self.sleep(wait)

    def lease_renew(self, *, org: str, lease: str, ttl_s: float = 300) -> int:
        """Extend a held lease to ``ttl_s`` from now; returns its new expiry (ms). UnknownLease if it lapsed."""
        path = self._path_of_id(org, lease, UnknownLease)
        reply = self._scripts.run("lease", self._lease_keys(org, path),
                                  ["renew", self._now(), " ".join(path), lease, int(ttl_s * 1000), ""])
        if _text(reply[0]) != "ok":
            raise UnknownLease(lease)
        return int(reply[1])

    def lease_release(self, *, org: str, lease: str) -> bool:
        """Free the lease's slots; False if it was not held (already released or expired)."""
        path = self._path_of_id(org, lease, UnknownLease)
        reply = self._scripts.run("lease", self._lease_keys(org, path), ["release", self._now(), " ".join(path), lease, 0, ""])
        return _text(reply[0]) == "ok"

    def sweep(self, *, org: str, batch: int = 500) -> int:
        """Expire reservations whose settlement is overdue (they count at their estimate)."""
        keys = [self.keys.reservations(org), self.keys.reservation_queue(org), self.keys.usage_stream(org)]
        return int(self._scripts.run("sweep", keys, [self._now(), org, batch, self.reservation_ttl_ms]))

    def forget_paths(self) -> None:
        """Drop what was learnt of agents (the scripts also correct it as needed)."""
        self._known.clear()

    # -- internals ----------------------------------------------------------------

    def _evaluate(self, mode: str, org: str, agent: str, tool: str | None, model: str | None, tokens: int) -> Decision:
        _check_count("tokens", tokens)
        for kind, value in (("org", org), ("agent", agent), ("tool", tool), ("model", model)):
            _check_name(kind, value)
        if not org or not agent:
            raise ValueError("org and agent are required")
        try:
            reply, known = self._run("check", org, agent, lambda known: self._check_args(mode, known, tool, model, tokens),
                                     keys=f"{mode}_keys")
        except QuotaBackendUnavailable:
            if self.fail_mode == "closed":
                raise
            self.fail_open_admits += 1
            log.warning("Redis unreachable: admitting %s/%s %s without a check (fail-open)", org, agent, tool or "")
            return Decision(True, degraded=True)
        return self._decision(mode, reply, reply[6:], known)

    def _check_args(self, mode: str, known: _Known, tool: str | None, model: str | None, tokens: int) -> list:
        """check.lua's ARGV (see its header)."""
        return [mode, self._now(), " ".join(known.path), tool or "", model or "", tokens, self._new_id(known.path),
                self.reservation_ttl_ms, self.sweep_per_check if mode == "check" else 0, known.version]

    @staticmethod
    def _decision(mode: str, head: list, rows: list, known: _Known) -> Decision:
        """A Decision from a reply's first six values (status ... reservation) and its rows."""
        retry = int(head[3])
        allowed = head[0] == "ok"
        return Decision(
            allowed,
            retry_after_ms=None if allowed or retry < 0 else retry,
            reservation=(_text(head[5]) or None) if mode == "check" else None,
            blocked=int(head[4]),
            rows=rows,
            describe=known.describe,
        )

    def _run(self, script: str, org: str, agent: str, args: Callable[[_Known], list], *, keys: str) -> tuple[list, _Known]:
        """Run a script that needs the agent's path; learn or correct the path and policy as the script says."""
        resynced = False
        for _ in range(4):
            known = self._known.get((org, agent)) or self._placeholder(org, agent)
            reply = self._scripts.run(script, getattr(known, keys), args(known))
            status = reply[0] = _text(reply[0])
            if status == "stale":
                self._learn(org, agent, reply[1], reply[2])
                continue
            if status == "missing":
                if not resynced and self.on_policy_missing is not None:
                    resynced = True
                    if self._resync(org):
                        continue
                    raise UnknownOrg(org)
                raise PolicyNotLoaded(org)
            if status == "unknown":
                self._known.pop((org, agent), None)
                raise UnknownAgent(org, agent)
            if reply[2]:  # the policy changed since we learnt it
                known = self._learn(org, agent, reply[1], reply[2])
            return reply, known
        raise RuntimeError(f"the policy of {org}/{agent} kept changing under the check")  # pragma: no cover

    def _resync(self, org: str) -> bool:
        try:
            return self.on_policy_missing(org)
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            raise QuotaBackendUnavailable(f"Redis failed while reloading the policy: {exc}") from exc

    def _batch_keys(self, org: str) -> list[bytes]:
        """check_batch.lua's first 4 KEYS (each agent's 5 follow)."""
        return [key.encode() for key in (self.keys.org_policy(org), self.keys.reservations(org),
                                         self.keys.reservation_queue(org), self.keys.usage_stream(org))]

    def _placeholder(self, org: str, agent: str) -> _Known:
        # The script answers "stale" (with the real path) before using a key built from "?" (check.lua reads
        # the counter keys with the policy, in one MGET, and ignores them).
        return self._known_for((org, UNKNOWN, UNKNOWN, agent), "", [])

    def _known_for(self, path: Path, version: str, limits: list[tuple]) -> _Known:
        org = path[0]
        check_keys = [
            self.keys.org_policy(org), self.keys.agent_policy(org, path[3]), *self.keys.path_counters(org, path),
            self.keys.reservations(org), self.keys.reservation_queue(org), self.keys.usage_stream(org),
        ]
        encode = lambda keys: [key.encode() for key in keys]  # noqa: E731
        return _Known(path, version, limits, encode(check_keys), encode(check_keys + self.keys.path_leases(org, path)),
                      encode(self._lease_keys(org, path)))

    def _learn(self, org: str, agent: str, version, blob) -> _Known:
        policy = json.loads(blob)
        path = tuple(policy["p"])
        limits = []
        for entry in policy["l"]:
            money = entry["m"] == "cost"
            convert = nanos_to_usd if money else int
            limits.append((
                LEVELS[entry["lv"] - 1], path[entry["lv"] - 1], entry["m"], convert(entry["a"]),
                format_window(entry["w"] // 1000) if "w" in entry else (entry.get("p") or None),
                entry.get("t"), entry.get("md"), bool(entry.get("sh")),
                convert(entry["b"]) if "b" in entry else None, entry["id"],
            ))
        if len(self._known) >= self._cache_size:
            self._known.clear()  # simple and thread-safe; agents are relearnt at one extra round trip each
        known = self._known[(org, agent)] = self._known_for(path, str(int(version)), limits)
        return known

    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def _new_id(self, path: Path) -> str:
        """A reservation or lease id that names the path it was made on (settle and release need its keys)."""
        return f"{random_hex(8)}.{path[1]}.{path[2]}.{path[3]}"

    def _path_of_id(self, org: str, ident: str, error) -> Path:
        parts = ident.split(".") if isinstance(ident, str) else []
        if len(parts) != 4 or not all(parts):
            raise error(ident)
        return (org, parts[1], parts[2], parts[3])

    def _lease_keys(self, org: str, path: Path) -> list[str]:
        return [self.keys.org_policy(org), self.keys.agent_policy(org, path[3]), *self.keys.path_leases(org, path)]


class Admitted:
    """What ``acquire`` returns: the admitting decision, usable in a ``with`` block."""

    def __init__(self, decision: Decision):
        self.decision = decision

    def __enter__(self) -> Decision:
        return self.decision

    def __exit__(self, *exc) -> None:
        return None


class Lease:
    """A held concurrency slot. Released on leaving the ``with`` block; expires by itself if not renewed."""

    def __init__(self, engine: QuotaEngine, org: str, lease_id: str, expires_at_ms: int, limits: list[LimitState]):
        self.engine, self.org, self.id = engine, org, lease_id
        self.expires_at_ms = expires_at_ms
        self.limits = limits
        self.released = False

    def renew(self, ttl_s: float = 300) -> int:
        self.expires_at_ms = self.engine.lease_renew(org=self.org, lease=self.id, ttl_s=ttl_s)
        return self.expires_at_ms

    def release(self) -> bool:
        if self.released:
            return False
        self.released = True
        return self.engine.lease_release(org=self.org, lease=self.id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
