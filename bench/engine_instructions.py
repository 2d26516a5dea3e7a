"""Instructions the server spends per check, counted by valgrind's callgrind (deterministic, unlike time).

Starts its own valkey-server under `valgrind --tool=callgrind` on a free loopback
port, and reports instructions per call of a trivial one-key EVALSHA, of this
engine's check with 1, 4 and 8 limits, and per check of a batch of 100. The same
binary and inputs give the same counts whatever else the machine is doing: the
number to watch when changing the Lua scripts. Needs Debian's valgrind (`apt-get install valgrind`); skips without it.
"""

from __future__ import annotations

import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import redis

from bench.common import table
from bench.engine_check import eight_limits, install
from project.embedded import valkey_bin
from quotas.engine import QuotaEngine
from quotas.policy.document import LimitDoc

CALLS = 200
BATCH = 100
BATCH_CASE = f"(e) engine batch of {BATCH} checks, 8 limits, 4 agents: per check"
BIG = Decimal(10**9)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Callgrind:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = _free_port()
        self.process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={workdir}/cg.out.%p", str(valkey_bin()),
             "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port, decode_responses=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("valkey-server under valgrind did not start in 60 s") from None
                time.sleep(0.2)

    def control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.process.pid)], capture_output=True, check=False)

    def per_call(self, fn, calls: int = CALLS) -> int:
        for _ in range(20):
            fn()
        self.control("-i", "on")
        self.control("-z")
        for _ in range(calls):
            fn()
        before = set(self.workdir.glob("cg.out.*"))
        self.control("-d")
        self.control("-i", "off")
        dump = max(set(self.workdir.glob("cg.out.*")) - before, key=lambda path: path.stat().st_mtime)
        total = int(re.search(r"^(?:summary|totals):\s*(\d+)", dump.read_text(), re.M).group(1))
        return round(total / calls)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def run() -> dict:
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        return {"skipped": "valgrind is not installed (apt-get install valgrind)"}
    with tempfile.TemporaryDirectory(prefix="aq-callgrind-") as workdir:
        grind = Callgrind(Path(workdir))
        try:
            client = grind.client
            trivial = client.register_script("return redis.call('GET', KEYS[1])")
            client.set("trivial", "1")
            results = {"(a) trivial EVALSHA, 1 key": grind.per_call(lambda: trivial(keys=["trivial"]))}
            one = [[], [], [], [LimitDoc("requests", BIG, 3600)]]
            per_level = [[LimitDoc("requests", BIG, 3600)]] * 4
            for name, limits in (("engine check, 1 limit", one), ("engine check, 4 limits (1 per level)", per_level),
                                 ("(d) engine check, 8 limits", eight_limits())):
                engine = QuotaEngine(client, key_prefix=f"cg{secrets.token_hex(3)}", sweep_per_check=0,
                                     clock=lambda: 1_795_000_000_000)
                install(client, engine, ("bench", "team-x", "user-x", "agent-x"), limits)
                results[name] = grind.per_call(lambda: engine.check(org="bench", agent="agent-x", tokens=100))
            # (e) one FCALL for 100 checks of 4 agents that share their org, team and user (check_batch.lua),
            # against (d) for the same checks one by one
            engine = QuotaEngine(client, key_prefix=f"cg{secrets.token_hex(3)}", sweep_per_check=0,
                                 clock=lambda: 1_795_000_000_000)
            agents = [f"agent-{i}" for i in range(4)]
            for agent in agents:
                install(client, engine, ("bench", "team-x", "user-x", agent), eight_limits())
            checks = [{"agent": agents[i % 4], "tokens": 100} for i in range(BATCH)]
            results[BATCH_CASE] = round(grind.per_call(lambda: engine.check_many(org="bench", checks=checks),
                                                       calls=CALLS // 20) / BATCH)
        finally:
            grind.stop()
    return {"instructions": results}


def report(results: dict) -> str:
    if "skipped" in results:
        return f"skipped: {results['skipped']}"
    rows = results["instructions"]
    floor = rows["(a) trivial EVALSHA, 1 key"]
    d = rows["(d) engine check, 8 limits"]
    return table(["case", "server instructions / call", "vs (a)"],
                 [[name, f"{count:,}", f"{count / floor:.1f}x"] for name, count in rows.items()]) + (
        f"\n(e) / (d): {rows[BATCH_CASE] / d:.2f} (a check in a batch against one on its own)")


if __name__ == "__main__":
    print(report(run()))
