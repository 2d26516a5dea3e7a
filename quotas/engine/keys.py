"""Every Redis key the service uses is built here, and only here.

All keys of one org share the hash tag ``{org}``, so every key a script touches
lives in one Redis Cluster slot; scripts get them all in KEYS.

    aq:{acme-corp}:org                      hash: policy version, tool weights (t:TOOL), model prices (m:MODEL)
    aq:{acme-corp}:a:agent-1                string: the agent's compiled policy (JSON)
    aq:{acme-corp}:s:user:alice             string: counter state of alice's limits (packed records, see lua/lib.lua)
    aq:{acme-corp}:l:user:alice             zset: leases held on alice's concurrency limits (member -> expiry ms)
    aq:{acme-corp}:r                        hash: reservations (id -> what the check charged, then the settlement)
    aq:{acme-corp}:rq                       list: "pushed_ms:id"; entries fall due (pushed + TTL) in list order
    aq:{acme-corp}:usage                    stream: usage events for the spend pipeline
    aq:{acme-corp}:agents                   set: agent policy keys written by the last sync (to delete removed agents)
    aq:{acme-corp}:spent                    set: agents the drain saw spend since the budget alerts last looked
    aq:orgs                                 set: orgs whose policy is in Redis (no hash tag: only policy sync uses it)
"""

from __future__ import annotations

from dataclasses import dataclass

LEVEL_NAMES = ("org", "team", "user", "agent")


@dataclass(frozen=True)
class Keys:
    prefix: str = "aq"

    def _org(self, org: str) -> str:
        return f"{self.prefix}:{{{org}}}"

    def org_policy(self, org: str) -> str:
        return f"{self._org(org)}:org"

    def agent_policy(self, org: str, agent: str) -> str:
        return f"{self._org(org)}:a:{agent}"

    def counters(self, org: str, level: str, node: str) -> str:
        return f"{self._org(org)}:s:{level}:{node}"

    def leases(self, org: str, level: str, node: str) -> str:
        return f"{self._org(org)}:l:{level}:{node}"

    def reservations(self, org: str) -> str:
        return f"{self._org(org)}:r"

    def reservation_queue(self, org: str) -> str:
        return f"{self._org(org)}:rq"

    def usage_stream(self, org: str) -> str:
        return f"{self._org(org)}:usage"

    def spent_agents(self, org: str) -> str:
        return f"{self._org(org)}:spent"

    def org_agents(self, org: str) -> str:
        return f"{self._org(org)}:agents"

    def org_index(self) -> str:
        return f"{self.prefix}:orgs"

    def path_counters(self, org: str, path: tuple[str, str, str, str]) -> list[str]:
        return [self.counters(org, level, node) for level, node in zip(LEVEL_NAMES, path)]

    def path_leases(self, org: str, path: tuple[str, str, str, str]) -> list[str]:
        return [self.leases(org, level, node) for level, node in zip(LEVEL_NAMES, path)]

    def everything(self) -> str:
        """A SCAN pattern for every key under this prefix (tests and benchmarks clean up with it)."""
        return f"{self.prefix}:*"
