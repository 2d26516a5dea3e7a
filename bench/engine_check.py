"""Issue 3's benchmark: the engine's check against its baselines, in one run on one Valkey.

(a) a trivial one-key EVALSHA round trip: the floor
(b) seed 003's two-round-trip four-tier check (bench/seed003.py)
(c) the `limits` library (moving window) hitting four keys in turn
(d) this engine's check of an agent with 8 limits (requests and tokens at each of 4 levels)

plus (d)'s throughput with 1 and 4 client processes, Redis memory per agent, and
over-admission with 8 processes against a limit of 200.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import secrets
import time
from decimal import Decimal

import redis

from bench.common import latencies_us, redis_url, summary, table
from bench.seed003 import Tier, hierarchical_check
from quotas.engine import Keys, QuotaEngine
from quotas.engine.compile import NodeLimits, compile_agent, compile_org
from quotas.policy.document import LimitDoc

LEVELS = ("org", "team", "user", "agent")
ROUNDS, PER_ROUND = 5, 1000
BIG = 10**9


def eight_limits(requests: int = BIG, tokens: int = BIG) -> list[list[LimitDoc]]:
    return [[LimitDoc("requests", Decimal(requests), 3600), LimitDoc("tokens", Decimal(tokens), 3600)] for _ in LEVELS]


def install(client, engine: QuotaEngine, path, limits) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    nodes = [NodeLimits(level, slug, own_limits=own) for level, slug, own in zip(LEVELS, path, limits)]
    client.set(engine.keys.agent_policy(path[0], path[3]), compile_agent(version=1, path=path, nodes=nodes, now=now))
    client.hset(engine.keys.org_policy(path[0]), mapping=compile_org(version=1, tool_weights={"llm_call": 3}, model_prices={}))


def cleanup(client, prefix: str) -> None:
    for batch in _chunks(list(client.scan_iter(Keys(prefix).everything(), count=5000)), 1000):
        client.delete(*batch)


def _chunks(items, size):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _throughput_worker(args) -> int:
    url, prefix, agent, seconds, barrier = args
    engine = QuotaEngine.from_url(url, key_prefix=prefix, sweep_per_check=0)
    engine.check(org="bench", agent=agent, tokens=100)
    barrier.wait()
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        engine.check(org="bench", agent=agent, tokens=100)
        done += 1
    return done


def _overadmit_worker(args) -> int:
    url, prefix, kind, attempts, barrier = args
    client = redis.Redis.from_url(url, decode_responses=True)
    tiers = [Tier(level, f"{level}-x", 200 if level == "agent" else BIG, BIG, 3600) for level in LEVELS]
    engine = QuotaEngine(client, key_prefix=prefix, sweep_per_check=0)
    barrier.wait()
    admitted = 0
    for _ in range(attempts):
        if kind == "seed003":
            admitted += hierarchical_check(client, prefix, tiers, tokens=10)["allowed"]
        else:
            admitted += engine.check(org="bench", agent="agent-x", tokens=10).allowed
    return admitted


UNIX = "(d) engine check, 8 limits, unix socket"


def run() -> dict:
    url = redis_url()
    client = redis.Redis.from_url(url, decode_responses=True)
    prefix = f"bench{secrets.token_hex(3)}"
    engine = QuotaEngine(client, key_prefix=prefix, sweep_per_check=0)
    path = ("bench", "team-x", "user-x", "agent-x")
    results: dict = {}
    try:
        install(client, engine, path, eight_limits())
        trivial = client.register_script("return redis.call('GET', KEYS[1])")
        trivial_key = f"{prefix}:trivial"
        client.set(trivial_key, "1")
        trivial(keys=[trivial_key])  # loaded, so its sha is known
        pool = client.connection_pool
        raw = pool.connection_class(**pool.connection_kwargs)

        def raw_call(*command):
            raw.send_command(*command)
            return raw.read_response()

        tiers = [Tier(level, f"{level}-x", BIG, BIG, 3600) for level in LEVELS]

        import limits
        from limits.storage import RedisStorage

        storage = RedisStorage(url, key_prefix=f"{prefix}:limits")
        limiter = limits.strategies.MovingWindowRateLimiter(storage)
        items = [limits.parse(f"{BIG}/hour") for _ in LEVELS]

        cases = {
            "(a) trivial EVALSHA, 1 key": lambda: trivial(keys=[trivial_key]),
            "(b) seed-003 check, 2 round trips": lambda: hierarchical_check(client, prefix, tiers, tokens=100),
            "(c) limits moving window, 4 hits": lambda: [limiter.hit(item, level, "x") for item, level in zip(items, LEVELS)],
            "(d) engine check, 8 limits": lambda: engine.check(org="bench", agent="agent-x", tokens=100),
            # (a) on the engine's own client path (quotas/engine/scripts.py: a connection per thread, no
            # execute_command): the floor for that path, so the client's share shows on its own.
            "(a') trivial EVALSHA on a raw connection": lambda: raw_call("EVALSHA", trivial.sha, 1, trivial_key),
        }
        socket_url = os.environ.get("QUOTAS_REDIS_URL", "")
        if socket_url.startswith("unix://"):  # the hot path as `make run` connects it: the same server, its socket
            by_socket = QuotaEngine(redis.Redis.from_url(socket_url, decode_responses=True), key_prefix=prefix,
                                    sweep_per_check=0)
            cases[UNIX] = lambda: by_socket.check(org="bench", agent="agent-x", tokens=100)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        server: dict[str, list[float]] = {name: [] for name in cases}
        script_command = {"(a) trivial EVALSHA, 1 key": "cmdstat_evalsha", "(d) engine check, 8 limits": "cmdstat_fcall"}
        for _ in range(ROUNDS):  # interleaved rounds: a noisy neighbour hurts every case alike
            for name, fn in cases.items():
                client.config_resetstat()
                samples[name].extend(latencies_us(fn, n=PER_ROUND, warmup=100))
                if name in script_command:  # the server's own time for the script, from its commandstats
                    server[name].append(client.info("commandstats")[script_command[name]]["usec_per_call"])
        results["latency"] = {name: summary(values) for name, values in samples.items()}
        results["server_us"] = {name: min(values) for name, values in server.items() if values}

        # Throughput of (d) with 1 and 4 client processes (each on its own agent's counters and the shared ones).
        context = multiprocessing.get_context("spawn")
        throughput = {}
        for procs in (1, 4):
            agents = [f"agent-{i}" for i in range(procs)]
            for agent in agents:
                install(client, engine, (*path[:3], agent), eight_limits())
            with context.Manager() as manager:
                barrier = manager.Barrier(procs)
                with context.Pool(procs) as pool:
                    seconds = 3.0
                    counts = pool.map(_throughput_worker, [(url, prefix, agent, seconds, barrier) for agent in agents])
            throughput[procs] = sum(counts) / seconds
        results["throughput"] = throughput

        # Memory: one agent's own keys (policy + counters) after a check, and a fleet's average.
        engine.check(org="bench", agent="agent-x", tokens=100)
        own = [engine.keys.agent_policy("bench", "agent-x"), engine.keys.counters("bench", "agent", "agent-x")]
        results["memory_own"] = sum(client.memory_usage(key) or 0 for key in own)
        fleet = 1000
        fleet_prefix = f"{prefix}f"
        fleet_engine = QuotaEngine(client, key_prefix=fleet_prefix, sweep_per_check=0)
        policy_and_counters = set()
        for i in range(fleet):
            fleet_path = ("fleet", f"team-{i // 250}", f"user-{i // 10}", f"agent-{i}")
            install(client, fleet_engine, fleet_path, eight_limits())
            fleet_engine.check(org="fleet", agent=fleet_path[3], tokens=100)
            policy_and_counters.add(fleet_engine.keys.agent_policy("fleet", fleet_path[3]))
            policy_and_counters.update(fleet_engine.keys.path_counters("fleet", fleet_path))
        results["memory_fleet"] = sum(client.memory_usage(key) or 0 for key in policy_and_counters) / fleet
        cleanup(client, fleet_prefix)

        # Over-admission: 8 processes x 60 attempts against an agent limit of 200.
        overadmit = {}
        for kind in ("seed003", "engine"):
            run_prefix = f"{prefix}o{kind}"
            agent_limit_200 = eight_limits()[:3] + [[LimitDoc("requests", Decimal(200), 3600),
                                                      LimitDoc("tokens", Decimal(BIG), 3600)]]
            install(client, QuotaEngine(client, key_prefix=run_prefix), path, agent_limit_200)
            with context.Manager() as manager:
                barrier = manager.Barrier(8)
                with context.Pool(8) as pool:
                    counts = pool.map(_overadmit_worker, [(url, run_prefix, kind, 60, barrier) for _ in range(8)])
            overadmit[kind] = sum(counts)
            cleanup(client, run_prefix)
        results["overadmit"] = overadmit
    finally:
        cleanup(client, prefix)
    return results


def report(results: dict) -> str:
    latency = results["latency"]
    names = list(latency)
    floor = latency[names[0]]["p50"]
    rows = [[name, f"{s['p50']:.0f}", f"{s['p99']:.0f}", f"{s['p50'] / floor:.2f}x"] for name, s in latency.items()]
    d = latency[names[3]]["p50"]
    targets = [
        ("(d) p50 / (a) p50", d / floor, 1.5),
        ("(d) p50 / (b) p50", d / latency[names[1]]["p50"], 0.6),
        ("(d) p50 / (c) p50", d / latency[names[2]]["p50"], 0.35),
        ("memory per agent, own keys (bytes)", results["memory_own"], 2048),
        ("memory per agent, fleet of 1000 (bytes)", results["memory_fleet"], 2048),
        ("over-admission, engine (8 procs, limit 200)", results["overadmit"]["engine"] - 200, 0),
    ]
    lines = [
        "Engine check latency (microseconds, one client, loopback)",
        table(["case", "p50", "p99", "p50 vs (a)"], rows),
        f"(d) p50 / (a') p50: {d / latency[names[4]]['p50']:.2f} (the floor on the engine's own client path)",
        *([f"(d) through the unix socket (QUOTAS_REDIS_URL, as `make run` connects the hot path): p50 "
           f"{latency[UNIX]['p50']:.0f} us, {latency[UNIX]['p50'] / d:.2f}x (d) over TCP"] if UNIX in latency else []),
        "server time per call (best round): " + "; ".join(
            f"{name.split(')')[0]}) {value:.0f} us" for name, value in results["server_us"].items()
        ) + ": the rest of each p50 is the client and the loopback",
        "",
        f"(d) throughput: 1 process {results['throughput'][1]:,.0f} checks/s; "
        f"4 processes {results['throughput'][4]:,.0f} checks/s",
        f"admitted by 8 processes x 60 attempts against a limit of 200: "
        f"seed-003 {results['overadmit']['seed003']}, engine {results['overadmit']['engine']}",
        "",
        table(["target", "measured", "target", "met"],
              [[name, f"{value:.2f}" if isinstance(value, float) else value, f"<= {target}", "yes" if value <= target else "NO"]
               for name, value, target in targets]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
