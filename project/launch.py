"""`make run` and `make test`: python -m project.launch run|test [-- ARGS]

With DATABASE_URL / REDIS_URL unset, starts the profile's embedded servers
(project/embedded.py) with data under var/<profile>/ and exports their URLs to
the children; a variable that is set is used as is.

  run   migrate, collectstatic, seed_demo on an empty database, then gunicorn,
        a Celery worker and Celery beat, their output prefixed; Ctrl-C stops all.
  test  python -m pytest ARGS, with a random QUOTAS_REDIS_KEY_PREFIX.
  bench python -m bench ARGS on servers of its own (not timed tests: they print ratios).

Every child gets a parent-death signal and the launcher gets one from its own
parent (make), so killing either with SIGKILL still stops everything; the next
start cleans up whatever a killed run left (project/embedded.py).

Environment: AQ_VAR_DIR (default <repo>/var, as settings.VAR_DIR), PORT (8000),
WEB_CONCURRENCY (2).
No Django import: settings cannot load before the URLs exist.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from project import embedded
from project.embedded import EmbeddedError, Step

REPO = Path(__file__).resolve().parent.parent

PROFILES = {
    # profile: (postgres port, valkey port, durable postgres)
    "dev": (54329, 63799, True),
    "test": (54328, 63798, False),
    "bench": (54327, 63797, True),  # durable: the spend benchmark measures commits as they cost
}
COMMAND_PROFILE = {"run": "dev", "test": "test", "bench": "bench"}
CHILD_STOP_TIMEOUT_S = 15.0


class Stop(Exception):
    """A signal asked the launcher to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LaunchError(Exception):
    pass


def say(message: str) -> None:
    print(message, flush=True)


def var_dir() -> Path:
    return Path(os.environ.get("AQ_VAR_DIR") or REPO / "var").absolute()


# ---------------------------------------------------------------------------
# One launcher per profile
# ---------------------------------------------------------------------------
def take_lock(path: Path, command: str):
    """Hold var/<profile>/launcher.pid for this process's lifetime (flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        fh.seek(0)
        pid = fh.read().strip() or "?"
        fh.close()
        raise LaunchError(
            f"make {command} is already running as pid {pid} ({path}); stop it with Ctrl-C"
            + (" in its terminal, or `kill " + pid + "`" if pid != "?" else "")
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


# ---------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------
def _pump(name: str, stream) -> None:
    prefix = f"{name:>6} | ".encode()
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        out.flush()
    stream.close()


class Launcher:
    def __init__(self, command: str, args: list[str]) -> None:
        self.command = command
        self.args = args
        self.profile = COMMAND_PROFILE[command]
        self.var = var_dir()
        self.home = self.var / self.profile
        self.env = dict(os.environ)
        self.servers: list[embedded._Server] = []
        self.children: dict[str, subprocess.Popen] = {}
        self.pumps: list[threading.Thread] = []
        self.stopping = False
        self.hurry = False
        self.foreground: subprocess.Popen | None = None

    # -- signals ----------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.foreground is not None and self.foreground.poll() is None:
            # pytest shares our terminal and got Ctrl-C itself; pass on anything else.
            if signum != signal.SIGINT:
                self.foreground.send_signal(signal.SIGTERM)
            return
        if self.stopping:
            self.hurry = True  # a second Ctrl-C: do not wait for graceful exits
            return
        self.stopping = True
        raise Stop(signum)

    # -- servers ------------------------------------------------------------------
    def start_servers(self) -> None:
        pg_port, valkey_port, durable = PROFILES[self.profile]
        common = {"owned_root": self.var, "say": say}
        if os.environ.get("DATABASE_URL"):
            say("DATABASE_URL is set: using it, not starting postgres")
        else:
            pg = embedded.Postgres(self.home / "postgres", pg_port, durable=durable, **common)
            self.servers.append(pg)
            pg.start()
            self.env["DATABASE_URL"] = pg.url
        if os.environ.get("REDIS_URL"):
            say("REDIS_URL is set: using it, not starting valkey")
        else:
            vk = embedded.Valkey(self.home / "valkey", valkey_port, **common)
            self.servers.append(vk)
            vk.start()
            self.env["REDIS_URL"] = vk.url
            if vk.socket_url and not os.environ.get("QUOTAS_REDIS_URL"):
                self.env["QUOTAS_REDIS_URL"] = vk.socket_url  # the hot path; cache and broker stay on TCP

    def stop_servers(self) -> None:
        for server in reversed(self.servers):
            if server.alive():
                with Step(f"stopping {server.name}", done="stopped"):
                    server.stop(timeout=2 if self.hurry else embedded.STOP_TIMEOUT_S)

    # -- children -------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Start a child in its own process group (Ctrl-C reaches only us; we stop it)."""
        proc = subprocess.Popen(
            argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            process_group=0, preexec_fn=embedded.die_with_parent(signal.SIGTERM),
        )
        pump = threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True)
        pump.start()
        self.children[name] = proc
        self.pumps.append(pump)
        return proc

    def manage(self, name: str, *args: str) -> int:
        """Run a manage.py command to completion, output prefixed with `name`."""
        proc = self.spawn(name, [sys.executable, "manage.py", *args])
        status = proc.wait()  # a signal here leaves it in self.children, to be stopped
        del self.children[name]
        return status

    def stop_children(self) -> None:
        live = {n: p for n, p in self.children.items() if p.poll() is None}
        if not live:
            return
        started = time.monotonic()
        say(f"stopping {', '.join(live)}...")
        for proc in live.values():
            proc.send_signal(signal.SIGTERM)
        deadline = started + CHILD_STOP_TIMEOUT_S
        while any(p.poll() is None for p in live.values()):
            if self.hurry or time.monotonic() > deadline:
                for name, proc in live.items():
                    if proc.poll() is None:
                        say(f"{name} did not stop in time: killing it")
                        try:  # the whole group: gunicorn and celery pool workers too
                            os.killpg(proc.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                for proc in live.values():
                    proc.wait()
                break
            time.sleep(0.05)
        for pump in self.pumps:  # let their last lines through
            pump.join(timeout=1)
        say(f"stopped {', '.join(live)} in {time.monotonic() - started:.1f}s")
        self.children.clear()

    # -- commands ----------------------------------------------------------------------
    def run(self) -> int:
        port = int(self.env.setdefault("PORT", "8000"))
        self.env.setdefault("DEBUG", "true")
        self.env.setdefault("SECRET_KEY", "dev-only-insecure-key-from-make-run")
        workers = self.env.get("WEB_CONCURRENCY") or "2"
        wait_port_free(port)
        self.start_servers()

        with Step("migrating the database", done="done"):
            if self.manage("migrate", "migrate", "--noinput", "-v", "0") != 0:
                raise LaunchError("`manage.py migrate` failed (output above)")
        with Step("collecting static files", done="done"):
            if self.manage("static", "collectstatic", "--noinput", "-v", "0") != 0:
                raise LaunchError("`manage.py collectstatic` failed (output above)")
        self.seed_if_empty()

        gunicorn = [sys.executable, "-m", "gunicorn", "project.wsgi:application",
                    "--bind", f"127.0.0.1:{port}", "--workers", workers, "--access-logfile", "-",
                    "--no-control-socket"]  # its default, ~/.gunicorn/gunicorn.ctl, is shared by every run
        celery = [sys.executable, "-m", "celery", "-A", "project"]
        self.spawn("web", gunicorn)
        # WARNING: beat sends a drain every few seconds; INFO would log three lines for each.
        self.spawn("worker", celery + ["worker", "--loglevel", "WARNING", "--concurrency", "2"])
        self.spawn("beat", celery + ["beat", "--loglevel", "WARNING",
                                     "--schedule", str(self.home / "celerybeat-schedule")])
        self.wait_serving(port)
        self.banner(port)
        while True:
            for name, proc in list(self.children.items()) + [(s.name, s.process) for s in self.servers]:
                if proc is not None and proc.poll() is not None:
                    raise LaunchError(f"{name} exited unexpectedly (status {proc.returncode}); stopping everything")
            time.sleep(0.2)

    def seed_if_empty(self) -> None:
        check = ("from django.apps import apps; "
                 "print('has-orgs' if apps.get_model('quotas', 'Organization').objects.exists() else 'empty')")
        result = subprocess.run([sys.executable, "manage.py", "shell", "-c", check], cwd=REPO, env=self.env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise LaunchError(f"could not count organizations:\n{result.stdout}{result.stderr}")
        if "empty" not in result.stdout.split():
            return
        if not (REPO / "quotas" / "management" / "commands" / "seed_demo.py").exists():
            raise LaunchError("the database is empty and the `seed_demo` management command does not exist yet "
                              "(quotas/management/commands/seed_demo.py); cannot load the demo data")
        say("empty database: loading the demo data (manage.py seed_demo)")
        if self.manage("seed", "seed_demo") != 0:
            raise LaunchError("`manage.py seed_demo` failed (output above)")

    def wait_serving(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            web = self.children["web"]
            if web.poll() is not None:
                raise LaunchError(f"web exited while starting (status {web.returncode}); see its output above")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise LaunchError(f"web is not accepting connections on port {port} after {timeout:.0f}s")

    def banner(self, port: int) -> None:
        lines = ["", "=" * 72, "agent-quotas is running", f"  admin:    http://127.0.0.1:{port}/admin/",
                 f"  API docs: http://127.0.0.1:{port}/api/docs/"]
        credentials = self.var / "demo-credentials.txt"
        if credentials.exists():
            lines += [f"  demo credentials ({credentials}):"]
            lines += ["    " + line for line in credentials.read_text().splitlines()]
        lines += ["Ctrl-C stops everything.", "=" * 72, ""]
        print("\n".join(lines), flush=True)

    def test(self) -> int:
        # settings.STATIC_ROOT; WhiteNoise warns on every request while it does not exist.
        Path(self.env.get("STATIC_ROOT") or self.var / "static").mkdir(parents=True, exist_ok=True)
        status = self.run_in_foreground("pytest", "test")
        if status == 5:
            print("error: pytest collected no tests (exit status 5): that counts as a failure; "
                  "check ARGS", file=sys.stderr, flush=True)
            return 1
        return status

    def bench(self) -> int:
        return self.run_in_foreground("bench", "bench")

    def run_in_foreground(self, module: str, profile: str) -> int:
        """Start the servers, then `python -m MODULE ARGS` with their URLs; its exit status."""
        self.env.setdefault("SECRET_KEY", f"{profile}-only-insecure-key-from-make-{profile}")
        self.env.setdefault("QUOTAS_REDIS_KEY_PREFIX", f"aq{profile}-{secrets.token_hex(4)}")
        self.start_servers()
        say(f"python -m {module} {' '.join(self.args)}".rstrip())
        # it stays in our process group: it gets Ctrl-C and the terminal (pytest --pdb) itself.
        self.foreground = subprocess.Popen(
            [sys.executable, "-m", module, *self.args], cwd=REPO, env=self.env,
            preexec_fn=embedded.die_with_parent(signal.SIGTERM),
        )
        status = self.foreground.wait()
        self.foreground = None
        return 128 - status if status < 0 else status  # killed by signal N: the shell's 128 + N

    def main(self) -> int:
        lock = take_lock(self.home / "launcher.pid", self.command)
        try:
            return {"run": self.run, "test": self.test, "bench": self.bench}[self.command]()
        finally:
            self.stopping = True
            self.stop_children()
            self.stop_servers()
            lock.close()


def wait_port_free(port: int, timeout: float = 10.0) -> None:
    """A killed run's gunicorn workers release the port within a second or two."""
    deadline = time.monotonic() + timeout
    while not embedded.port_free(port):
        if time.monotonic() > deadline:
            raise LaunchError(f"port {port} is in use by another program; set PORT to another port")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < (3, 11):
        print(f"error: Python 3.11 or newer is needed (this is {sys.version.split()[0]})", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMAND_PROFILE:
        print(__doc__.strip().split("\n\n")[0], file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    # make is our parent: if it is killed (even with SIGKILL) we get SIGTERM and stop our children.
    embedded.set_parent_death_signal(signal.SIGTERM)
    launcher = Launcher(command, args)
    launcher.install_signal_handlers()
    try:
        return launcher.main()
    except Stop as stop:
        say(f"{stop.args[0]}: stopped")
        return 128 + stop.signum
    except (LaunchError, EmbeddedError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
