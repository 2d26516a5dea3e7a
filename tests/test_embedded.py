"""The embedded servers and the launcher start real processes, and restart after a kill.

Each test works in its own temporary directory with its own free ports, so it
never touches var/ or the servers `make test` itself runs on.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
import redis

from project import embedded
from project.embedded import EmbeddedError, Postgres, Valkey

pytestmark = pytest.mark.embedded

REPO = Path(__file__).resolve().parent.parent

# A stand-in for a launcher: starts both servers, reports, then waits to be killed.
OWNER = """
import sys, time
from pathlib import Path
from project.embedded import Postgres, Valkey
base, die = Path(sys.argv[1]), sys.argv[2] == "1"
pg = Postgres(base / "postgres", None, owned_root=base, die_with_parent=die).start()
vk = Valkey(base / "valkey", None, owned_root=base, die_with_parent=die).start()
print("READY", pg.url, vk.url, pg.process.pid, vk.process.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def workdir():
    """A temporary directory the embedded servers may use.

    Not tmp_path: as root, PostgreSQL runs as a system user, which cannot enter
    pytest's private (0700) base directory; see test_root_needs_a_reachable_data_dir.
    """
    path = Path(tempfile.mkdtemp(prefix="aq-embedded-"))
    path.chmod(0o755)
    yield path
    for directory in (path / "var" / "postgres", path / "var" / "valkey", path / "var" / "dev" / "postgres",
                      path / "var" / "dev" / "valkey"):
        for comm in ("postgres", "valkey-server"):
            if directory.exists():
                embedded.stop_pids(embedded.processes_in(directory, comm), signal.SIGKILL, timeout=5)
    shutil.rmtree(path, ignore_errors=True)


def start_owner(base: Path, *, die_with_parent: bool) -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(base), "1" if die_with_parent else "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    for line in owner.stdout:
        lines.append(line)
        if line.startswith("READY"):
            _, pg_url, vk_url, pg_pid, vk_pid = line.split()
            return owner, {"pg_url": pg_url, "vk_url": vk_url, "pids": [int(pg_pid), int(vk_pid)]}
    owner.wait()
    pytest.fail("owner process did not start the servers:\n" + "".join(lines))


def write_data(info: dict, value: str) -> None:
    with psycopg.connect(info["pg_url"], autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS survives (value text)")
        conn.execute("INSERT INTO survives VALUES (%s)", (value,))
    redis.Redis.from_url(info["vk_url"]).set("survives", value)


def read_data(pg: Postgres, vk: Valkey) -> tuple[list[str], bytes | None]:
    with psycopg.connect(pg.url) as conn:
        rows = [r[0] for r in conn.execute("SELECT value FROM survives ORDER BY value")]
    return rows, redis.Redis.from_url(vk.url).get("survives")


def wait_dead(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(embedded.pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if embedded.pid_alive(p)]


def kill_owner(owner: subprocess.Popen) -> None:
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()


def test_servers_answer_and_data_survives_a_sigkilled_owner(workdir):
    base = workdir / "var"
    base.mkdir(mode=0o700)  # a project-owned dir the postgres user cannot enter yet
    owner, info = start_owner(base, die_with_parent=True)
    assert info["pg_url"].startswith("postgres://postgres@127.0.0.1:")
    assert info["vk_url"].startswith("redis://127.0.0.1:")
    assert redis.Redis.from_url(info["vk_url"]).ping()
    with psycopg.connect(info["pg_url"]) as conn:
        assert conn.execute("SELECT current_database(), 6 * 7").fetchone() == ("agent_quotas", 42)
    write_data(info, "before-kill")

    kill_owner(owner)
    # The parent-death signal stops both servers without anyone cleaning up.
    assert wait_dead(info["pids"]) == [], "servers outlived their SIGKILLed owner"

    with Postgres(base / "postgres", None, owned_root=base) as pg, Valkey(base / "valkey", None, owned_root=base) as vk:
        assert read_data(pg, vk) == (["before-kill"], b"before-kill")
    assert not (base / "postgres" / "postmaster.pid").exists()
    assert not (base / "valkey" / "valkey.pid").exists()
    if os.geteuid() == 0:
        assert base.stat().st_mode & stat.S_IXOTH


def test_a_live_orphan_and_stale_pid_files_do_not_block_a_start(workdir, capsys):
    base = workdir / "var"
    owner, info = start_owner(base, die_with_parent=False)
    write_data(info, "orphan")
    kill_owner(owner)
    time.sleep(0.3)
    assert all(embedded.pid_alive(p) for p in info["pids"]), "expected the servers to be left running"

    # 1. Live servers of these data directories, owned by nobody: stopped, then started fresh.
    pg, vk = Postgres(base / "postgres", None, owned_root=base), Valkey(base / "valkey", None, owned_root=base)
    with pg, vk:
        assert wait_dead(info["pids"], timeout=1) == []
        assert read_data(pg, vk) == (["orphan"], b"orphan")
        postmaster_pid = (base / "postgres" / "postmaster.pid").read_text()
    assert "stopping a leftover server" in capsys.readouterr().out

    # 2. Pid files left by a SIGKILL, naming a dead process, then a live process that is not a server
    #    (pid reuse). PostgreSQL itself refuses to start over the second.
    dead = subprocess.Popen(["true"])
    dead.wait()
    unrelated = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (dead.pid, unrelated.pid):
            lines = postmaster_pid.splitlines()
            (base / "postgres" / "postmaster.pid").write_text("\n".join([str(pid), *lines[1:]]) + "\n")
            (base / "valkey" / "valkey.pid").write_text(f"{pid}\n")
            with pg, vk:
                rows, value = read_data(pg, vk)
                assert (rows, value) == (["orphan"], b"orphan")
            assert "removing stale" in capsys.readouterr().out
        assert unrelated.poll() is None, "an unrelated process named in a stale pid file was killed"
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_taken_port_is_replaced_by_a_free_one(workdir, capsys):
    base = workdir / "var"
    with Valkey(base / "one", None, owned_root=base) as first:
        with Valkey(base / "two", first.port, owned_root=base) as second:
            assert second.port != first.port
            assert second.command("PING") == b"PONG"
    assert f"port {first.port} is in use" in capsys.readouterr().out


def test_valkey_serves_its_unix_socket_too_where_the_path_allows_one(workdir):
    base = workdir / "var"
    with Valkey(base / "valkey", None, owned_root=base) as vk:
        assert vk.socket_url == f"unix://{base / 'valkey' / 'valkey.sock'}?db=0"
        redis.Redis.from_url(vk.url).set("k", "through tcp")
        assert redis.Redis.from_url(vk.socket_url).get("k") == b"through tcp"  # one server, two ways in
    deep = Valkey(base / ("d" * 90) / "valkey", None, owned_root=base)
    assert deep.socket_path is None and deep.socket_url is None  # too long for a unix socket: TCP only
    assert "--unixsocket" not in deep._argv()


def test_the_launcher_gives_the_hot_path_the_embedded_valkeys_socket(workdir, monkeypatch):
    """QUOTAS_REDIS_URL (the hot path) is the socket; REDIS_URL (cache, Celery) stays on TCP."""
    from project.launch import Launcher

    for name in ("DATABASE_URL", "REDIS_URL", "QUOTAS_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AQ_VAR_DIR", str(workdir / "var"))
    launcher = Launcher("run", [])
    launcher.start_servers()
    try:
        assert launcher.env["REDIS_URL"].startswith("redis://127.0.0.1:")
        assert launcher.env["QUOTAS_REDIS_URL"] == f"unix://{workdir / 'var' / 'dev' / 'valkey' / 'valkey.sock'}?db=0"
        assert redis.Redis.from_url(launcher.env["QUOTAS_REDIS_URL"]).ping()
    finally:
        launcher.stop_servers()


def test_this_suites_hot_path_goes_the_way_quotas_redis_url_says():
    from django.conf import settings

    from quotas.services.engine import get_engine

    expected = redis.UnixDomainSocketConnection if settings.QUOTAS_REDIS_URL.startswith("unix://") else redis.Connection
    assert get_engine().client.connection_pool.connection_class is expected
    assert get_engine().client.ping()


def test_startup_failure_shows_the_server_log(workdir):
    base = workdir / "var"
    server = Valkey(base / "valkey", None, owned_root=base)
    server._argv = lambda: [str(embedded.valkey_bin()), "--no-such-option", "1"]
    with pytest.raises(EmbeddedError, match=r"(?s)valkey exited with status \d+ while starting.*no-such-option"):
        server.start()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as a separate system user")
def test_root_needs_a_reachable_data_dir(workdir):
    private = workdir / "private"
    private.mkdir(mode=0o700)  # like /root or pytest's base temp dir; not ours to chmod
    server = Postgres(private / "var" / "postgres", None, owned_root=private / "var")
    with pytest.raises(EmbeddedError, match=rf"(?s)cannot enter {private} .*chmod o\+x {private}"):
        server.start()


# ---------------------------------------------------------------------------
# The launcher: `make run` serves, survives a SIGKILL, and starts again.
# ---------------------------------------------------------------------------
SEED_DEMO = REPO / "quotas" / "management" / "commands" / "seed_demo.py"


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def launcher_env(var: Path, port: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG", "STATIC_ROOT", "PORT",
                        "QUOTAS_REDIS_KEY_PREFIX", "WEB_CONCURRENCY"}}
    return env | {"AQ_VAR_DIR": str(var), "PORT": str(port), "WEB_CONCURRENCY": "1"}


def start_launcher(env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "project.launch", "run"], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def wait_serving(launcher: subprocess.Popen, url: str, log: Path, *, run: int, timeout: float = 120) -> None:
    """Wait for the banner of the `run`-th launcher in the log, then for a 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"launcher exited ({launcher.returncode}):\n{log.read_text()[-4000:]}")
        # The banner comes first, so a 200 from a killed run's web server still shutting down does not count.
        if log.read_text().count("agent-quotas is running") >= run and http_status(url) == 200:
            return
        time.sleep(0.25)
    pytest.fail(f"{url} did not answer 200 within {timeout:.0f}s:\n{log.read_text()[-4000:]}")


@pytest.mark.skipif(not SEED_DEMO.exists(), reason=f"needs the seed_demo command ({SEED_DEMO.relative_to(REPO)})")
def test_make_run_serves_and_starts_again_after_sigkill(workdir):
    var, port, log = workdir / "var", embedded.free_port(), workdir / "launch.log"
    env, url = launcher_env(var, port), f"http://127.0.0.1:{port}/admin/login/"
    launchers = []
    try:
        launchers.append(start_launcher(env, log))
        wait_serving(launchers[-1], url, log, run=1)

        second = subprocess.run([sys.executable, "-m", "project.launch", "run"], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        assert second.returncode == 1
        assert f"make run is already running as pid {launchers[-1].pid}" in second.stderr

        launchers[-1].send_signal(signal.SIGKILL)
        launchers[-1].wait()
        launchers.append(start_launcher(env, log))
        wait_serving(launchers[-1], url, log, run=2)

        launchers[-1].send_signal(signal.SIGTERM)
        assert launchers[-1].wait(timeout=60) == 128 + signal.SIGTERM
        assert embedded.processes_in(var / "dev" / "postgres", "postgres") == []
        assert embedded.processes_in(var / "dev" / "valkey", "valkey-server") == []
        assert embedded.port_free(port), "the web server outlived the launcher"
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
