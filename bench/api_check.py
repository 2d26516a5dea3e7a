"""Issue 4's benchmark: the check API over gunicorn, against a trivial JSON view on the same server.

Starts gunicorn as `make run` does (project/launch.py: project.wsgi:application, --workers
$WEB_CONCURRENCY (2), --access-logfile -, --no-control-socket, DEBUG=true) on a free loopback port,
on the database and Valkey `make bench` provides, after `manage.py migrate`, loading the demo
policy with every limit raised to 10^9 (so the checks are decided in full, but admitted) and
creating an API key. A load generator of its own (asyncio streams, one connection per request as
gunicorn's sync workers close each one) then measures, at 4, 8, 16 and 32 concurrent connections:

(a) GET /api/ping: a trivial JSON view, no auth: the web stack's own cost
(b) POST /api/v1/check for the demo agents (agent-1, agent-2, research-bot, copywriter; web_search, 100 tokens)
(c) POST /api/v1/check/batch with 100 such checks (at 2, 4 and 8 connections)

(a) and (b) rows are measured in ROUNDS short rounds, interleaved, and merged (requests, seconds,
latencies, CPU), so that where (a) peaks does not hang on one noisy stretch of seconds. The report gives (b) as a
share of (a), (b)'s p99 where (a) peaks (the fewest connections within 5% of its best: past that,
more connections only queue), and the batch's checks/s against (b)'s. The CPU
of the client, of gunicorn (master and workers) and of Valkey is shown for each row, and gunicorn's
CPU time per request: the server's cost whatever the client's share of the two cores.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import percentile, table

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
AGENTS = ("agent-1", "agent-2", "research-bot", "copywriter")
LEVELS = (4, 8, 16, 32)
BATCH_LEVELS = (2, 4, 8)
BATCH_SIZE = 100
SECONDS = 5.0  # per row of (c)
ROUNDS = 4  # (a) and (b) rows: measured this many times for ROUND_SECONDS, interleaved, and merged: this
ROUND_SECONDS = 2.5  # machine's speed changes from one few seconds to the next, and one 5 s row moves by 10%
WARMUP = 0.5
BIG = 10**9


# -- setup: database, policy, key, gunicorn --------------------------------------------------------


def _env() -> dict:
    for name in ("DATABASE_URL", "REDIS_URL"):
        if not os.environ.get(name):
            raise SystemExit(f"{name} is not set: run the benchmarks with `make bench ARGS=api`")
    env = dict(os.environ)
    env.setdefault("DEBUG", "true")  # as `make run`
    env.setdefault("SECRET_KEY", "bench-only-insecure-key")
    return env


def bench_policy(demo: dict) -> dict:
    """The demo policy with every amount raised out of reach (concurrency left alone)."""
    data = copy.deepcopy(demo)

    def lift(limits):
        for limit in limits or []:
            if limit["metric"] == "concurrency":
                continue
            limit["limit"] = BIG
            if "burst" in limit:
                limit["burst"] = BIG

    for tier in data.get("tiers", {}).values():
        lift(tier if isinstance(tier, list) else tier.get("limits"))

    def walk(node):
        lift(node.get("limits"))
        lift(node.get("overrides"))
        for key in ("teams", "users", "agents"):
            for child in node.get(key, []):
                walk(child)

    for org in data["orgs"]:
        walk(org)
    return data


def prepare(env: dict) -> str:
    """Migrate, load the bench policy (synced to Redis after commit), and return a new API key of acme-corp."""
    result = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"manage.py migrate failed:\n{result.stdout}{result.stderr}")
    os.environ.update({k: env[k] for k in ("DEBUG", "SECRET_KEY")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.db import transaction

    from quotas.models import Organization
    from quotas.policy.document import parse_policy, read_policy_file
    from quotas.selectors import known_tiers
    from quotas.services.api_keys import api_key_create
    from quotas.services.engine import get_engine
    from quotas.services.policy_load import policy_load

    demo = read_policy_file(REPO / "quotas" / "fixtures" / "demo_policy.yaml")
    with transaction.atomic():
        policy_load(doc=parse_policy(demo, known_tiers=known_tiers()))  # the demo first, as seed_demo loads it
    with transaction.atomic():
        policy_load(doc=parse_policy(bench_policy(demo), known_tiers=known_tiers()))
        _, raw = api_key_create(org=Organization.objects.get(slug="acme-corp"), name="bench/api_check")
    engine = get_engine()
    for agent in AGENTS:
        limits = engine.peek(org="acme-corp", agent=agent).limits
        assert limits and all(l.limit >= BIG for l in limits if l.metric != "concurrency"), (agent, limits)
    return raw


def start_gunicorn(env: dict) -> tuple[subprocess.Popen, int]:
    from project import embedded

    port = embedded.free_port()
    workers = env.get("WEB_CONCURRENCY") or "2"
    argv = [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--bind", f"{HOST}:{port}",
            "--workers", workers, "--access-logfile", "-", "--no-control-socket"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, process_group=0,
                            preexec_fn=embedded.die_with_parent(signal.SIGTERM))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gunicorn exited (status {proc.returncode}):\n{proc.stderr.read().decode()}")
        try:
            status, _ = asyncio.run(_request(port, _get("/api/ping")))
            if status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    stop_gunicorn(proc)
    raise SystemExit("gunicorn did not answer /api/ping within 30 s")


def stop_gunicorn(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: the master and its workers
            proc.wait()


# -- the load generator ----------------------------------------------------------------------------


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()


def _post(path: str, key: str, body: dict) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def _request(port: int, payload: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(payload)
        data = await reader.read(-1)  # gunicorn's sync workers close the connection after the answer
    finally:
        writer.close()
    return int(data[9:12]), data


async def _load(port: int, payloads: list[bytes], connections: int, seconds: float, warmup: float,
                count_allowed: bool) -> dict:
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, deadline = start + warmup, start + warmup + seconds
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    allowed = refused = errors = 0

    async def client(offset: int) -> None:
        nonlocal allowed, refused, errors
        i = offset
        while True:
            sent = loop.time()
            if sent >= deadline:
                return
            try:
                status, data = await _request(port, payloads[i % len(payloads)])
            except OSError:
                status, data = 0, b""
            i += 1
            if sent < measure_from:
                continue
            latencies.append(loop.time() - sent)
            statuses[status] = statuses.get(status, 0) + 1
            if count_allowed:
                allowed += data.count(b'"allowed":true')
                refused += data.count(b'"allowed":false')
                errors += data.count(b'"error":')

    cpu = time.process_time()
    await asyncio.gather(*(client(n) for n in range(connections)))
    wall = loop.time() - measure_from
    client_cpu = (time.process_time() - cpu) / (wall + warmup)
    return {"latencies": latencies, "statuses": statuses, "seconds": wall, "client_cpu": client_cpu,
            "allowed": allowed, "refused": refused, "errors": errors}


def _server_cpu(proc: subprocess.Popen):
    import psutil

    parent = psutil.Process(proc.pid)
    procs = [parent, *parent.children(recursive=True)]
    return lambda: sum(sum(p.cpu_times()[:2]) for p in procs)


def _valkey_cpu(client):
    def seconds() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return seconds


def measure(port: int, *, payloads: list[bytes], connections: int, server_cpu, valkey_cpu, seconds: float = SECONDS,
            count_allowed: bool = False, before: dict | None = None) -> dict:
    """One row: `connections` clients for `seconds`, merged with `before` (the same row's earlier rounds)."""
    cpu_before, valkey_before, started = server_cpu(), valkey_cpu(), time.monotonic()
    result = asyncio.run(_load(port, payloads, connections, seconds, WARMUP, count_allowed))
    result["elapsed"] = time.monotonic() - started
    result["server_cpu_s"] = server_cpu() - cpu_before
    result["valkey_cpu_s"] = valkey_cpu() - valkey_before
    result["client_cpu_s"] = result.pop("client_cpu") * result["elapsed"]
    if before:
        for name in ("seconds", "elapsed", "server_cpu_s", "valkey_cpu_s", "client_cpu_s", "allowed", "refused", "errors"):
            result[name] += before[name]
        result["latencies"] = before["latencies"] + result["latencies"]
        for code, n in before["statuses"].items():
            result["statuses"][code] = result["statuses"].get(code, 0) + n
    lat = result["latencies"]
    result["rounds"] = (before or {}).get("rounds", 0) + 1
    result["requests"] = len(lat)
    result["rps"] = len(lat) / result["seconds"]
    for name in ("server", "valkey", "client"):
        result[f"{name}_cpu"] = result[f"{name}_cpu_s"] / result["elapsed"]
    result["server_ms_per_request"] = result["server_cpu_s"] / len(lat) * 1000 if lat else float("nan")
    result["p50_ms"] = percentile(lat, 0.50) * 1000 if lat else float("nan")
    result["p99_ms"] = percentile(lat, 0.99) * 1000 if lat else float("nan")
    return result


def run() -> dict:
    env = _env()
    key = prepare(env)
    proc, port = start_gunicorn(env)
    results: dict = {"workers": int(env.get("WEB_CONCURRENCY") or 2), "cases": {}}
    cases = results["cases"]
    from quotas.services.engine import get_engine

    engine = get_engine()
    try:
        cpu = {"server_cpu": _server_cpu(proc), "valkey_cpu": _valkey_cpu(engine.client)}
        check = {"tool": "web_search", "tokens": 100}
        ping = [_get("/api/ping")]
        checks = [_post("/api/v1/check", key, {"agent": agent, **check}) for agent in AGENTS]
        batches = [_post("/api/v1/check/batch", key, {"checks": [
            {"agent": AGENTS[(n + i) % len(AGENTS)], **check} for i in range(BATCH_SIZE)]}) for n in range(len(AGENTS))]
        for _ in range(ROUNDS):  # interleaved: a noisy neighbour hurts both alike
            for connections in LEVELS:
                for name, payloads in (("ping", ping), ("check", checks)):
                    cases[(name, connections)] = measure(port, payloads=payloads, connections=connections,
                                                         seconds=ROUND_SECONDS, before=cases.get((name, connections)),
                                                         **cpu)
        for connections in BATCH_LEVELS:
            cases[("batch", connections)] = measure(port, payloads=batches, connections=connections,
                                                    count_allowed=True, **cpu)
    finally:
        stop_gunicorn(proc)
        keys = list(engine.client.scan_iter(engine.keys.everything(), count=5000))
        for i in range(0, len(keys), 1000):
            engine.client.delete(*keys[i:i + 1000])
    return results


# -- the report ------------------------------------------------------------------------------------

NAMES = {"ping": "(a) GET /api/ping", "check": "(b) POST /api/v1/check",
         "batch": f"(c) POST /api/v1/check/batch x{BATCH_SIZE}"}


def report(results: dict) -> str:
    cases = results["cases"]
    rows = []
    for (name, connections), r in cases.items():
        statuses = ", ".join(f"{code or 'conn error'}: {n}" for code, n in sorted(r["statuses"].items()))
        checks_s = r["rps"] * BATCH_SIZE if name == "batch" else (r["rps"] if name == "check" else None)
        rows.append([NAMES[name], connections, f"{r['rps']:,.0f}", f"{checks_s:,.0f}" if checks_s else "-",
                     f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", statuses,
                     f"{r['client_cpu'] * 100:.0f}%", f"{r['server_cpu'] * 100:.0f}%", f"{r['valkey_cpu'] * 100:.0f}%",
                     f"{r['server_ms_per_request']:.2f}"])

    def best(name):
        level = max((c for n, c in cases if n == name), key=lambda c: cases[(name, c)]["rps"])
        return level, cases[(name, level)]

    _, ping = best("ping")
    ping_level = min(c for n, c in cases if n == "ping" and cases[(n, c)]["rps"] >= 0.95 * ping["rps"])
    check_level, check = best("check")
    batch_level, batch = best("batch")
    check_at_ping_peak = cases[("check", ping_level)]
    share = check["rps"] / ping["rps"] * 100
    batch_ratio = batch["rps"] * BATCH_SIZE / check["rps"]
    decided = batch["allowed"] + batch["refused"]
    admitted = sum(cases[("check", c)]["statuses"].get(200, 0) for c in LEVELS)
    refused = sum(cases[("check", c)]["statuses"].get(429, 0) for c in LEVELS)
    targets = [
        ("(b) requests/s as % of (a)'s (best of each)", share, ">=", 70),
        (f"(b) p99 ms at {ping_level} connections, where (a) peaks", check_at_ping_peak["p99_ms"], "<", 10),
        ("(c) checks/s / (b) checks/s (best of each)", batch_ratio, ">=", 10),
    ]
    lines = [
        f"gunicorn, {results['workers']} sync workers (WEB_CONCURRENCY), DEBUG=true, access log on, as `make run`; "
        f"(a) and (b) rows: {ROUNDS} rounds of {ROUND_SECONDS} s each (interleaved, merged), (c) rows {SECONDS:.0f} s; "
        f"each after {WARMUP} s of warm-up; "
        "one connection per request; latency includes the connect",
        table(["case", "conns", "req/s", "checks/s", "p50 ms", "p99 ms", "answers", "client CPU", "gunicorn CPU",
               "valkey CPU", "gunicorn CPU ms/req"], rows),
        "",
        f"(a) peaks at {ping_level} connections (the fewest within 5% of its best, {ping['rps']:,.0f} req/s); "
        f"(b) peaks at {check_level}: {check['rps']:,.0f} req/s; (b) at {ping_level}: {check_at_ping_peak['rps']:,.0f} req/s, "
        f"p99 {check_at_ping_peak['p99_ms']:.1f} ms",
        f"(b) answers over all rows: {admitted:,} admitted (200), {refused:,} refused (429)",
        f"gunicorn CPU per request at the best rows: (a) {ping['server_ms_per_request']:.2f} ms, "
        f"(b) {check['server_ms_per_request']:.2f} ms, (c) {batch['server_ms_per_request']:.1f} ms "
        f"({batch['server_ms_per_request'] / BATCH_SIZE * 1000:.0f} us per check)",
        f"(c) peaks at {batch_level} connections: {batch['rps'] * BATCH_SIZE:,.0f} checks/s; per check decided in the "
        f"batches: {batch['allowed']:,} admitted, {batch['refused']:,} refused, {batch['errors']:,} errors "
        f"(of {decided + batch['errors']:,})",
        "",
        table(["target", "measured", "target", "met"],
              [[name, f"{value:.1f}", f"{op} {goal}", "yes" if (value >= goal if op == ">=" else value < goal) else "NO"]
               for name, value, op, goal in targets]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
