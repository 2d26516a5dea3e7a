"""The Lua scripts, loaded as one Redis Functions library.

``lua/lib.lua`` (the shared helpers) and each ``lua/NAME.lua`` (KEYS and ARGV
documented at its top) become one library, ``agentquotas_<hash>``, with one
function per script, ``aq_NAME_<hash>``: the hash of the source, so processes
of two versions can share a server during a deploy. A library is compiled once
per server, not per call: its helpers are defined once, and decoded policies
are kept in a bounded cache (``decode_policy`` in lib.lua, keyed by the policy
text itself, so an edited policy is never served stale).

``Scripts.run`` sends FCALL; when the server does not have the function (a new,
flushed or restarted server without persistence) it loads the library and sends
the call again. A Redis that cannot be reached in time becomes
``QuotaBackendUnavailable``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import cache
from pathlib import Path

import redis

from .decision import QuotaBackendUnavailable

try:  # hiredis packs a command in C: a third of the time of redis-py's own packer (20 arguments: 1.9 against 5.8 µs)
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - hiredis is in requirements.txt; redis-py's packer works the same
    _pack_command = None

LUA_DIR = Path(__file__).resolve().parent / "lua"
# Answers that mean "the server cannot serve this now" rather than "this call is wrong": redis-py
# turns most into their own classes (and drops the code from the message); the rest by their code.
UNAVAILABLE_ERRORS = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError, redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
)
UNAVAILABLE_CODES = ("BUSY", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM", "NOREPLICAS")


def unavailable(exc: BaseException) -> bool:
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).split(" ", 1)[0] in UNAVAILABLE_CODES
SCRIPT_NAMES = ("check", "check_batch", "settle", "lease", "sweep")

# Forks so far in this process's line: a connection made before a fork is the parent's (counted here
# rather than comparing os.getpid() on every call: a system call each).
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


@cache
def library() -> tuple[str, str]:
    """(version hash, library source). The hash is of the whole source, wrappers included."""
    parts = [(LUA_DIR / "lib.lua").read_text()]
    for name in SCRIPT_NAMES:
        body = (LUA_DIR / f"{name}.lua").read_text()
        # bind(): lib.lua's upvalues for the standard library, which a library cannot reach while loading
        parts.append(f"-- ---- {name}.lua ----\nlocal function script_{name}(KEYS, ARGV)\n"
                     f"if not floor then bind() end\n{body}\nend")
    version = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
    parts.insert(0, f"#!lua name=agentquotas_{version}")
    parts.extend(f"redis.register_function('aq_{name}_{version}', script_{name})" for name in SCRIPT_NAMES)
    return version, "\n".join(parts)


def function_name(name: str) -> str:
    if name not in SCRIPT_NAMES:
        raise ValueError(f"no script {name!r}; there are {', '.join(SCRIPT_NAMES)}")
    return f"aq_{name}_{library()[0]}"


class Scripts:
    """Runs the scripts, each call on a connection of the calling thread's own.

    The hot path sends its FCALL on a connection it keeps per thread (and per process: a forked
    worker opens its own), not through ``Redis.execute_command``: the client's per-command work
    (taking a connection from the pool and giving it back, its retry wrapper, its observability
    hooks) cost more than the script itself (bench/engine_check.py). The connection is redis-py's
    own, made from the client's settings (address, timeouts, decoding); on an error it is closed,
    and the next call connects again.
    """

    def __init__(self, client: redis.Redis):
        self.client = client
        self._local = threading.local()

    def _connection(self):
        local = self._local
        if getattr(local, "forks", -1) != _forks:  # a new thread, or the first call after a fork
            pool = self.client.connection_pool
            local.connection, local.forks = pool.connection_class(**pool.connection_kwargs), _forks
        return local.connection

    def _call(self, *command):
        reply = self._call_many([command])[0]
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    def _call_many(self, commands: list[tuple]) -> list:
        """Pipelined on the thread's connection: every command sent at once, then every reply read.
        An error answer takes its command's place in the list; the others are read on (the
        connection stays in step). A connection the server closed while idle (a restart, a timeout)
        fails only when next used: it is replaced and the commands sent once more, as redis-py's
        client does, if no reply was read. Anything else (a timeout, Ctrl-C) closes the connection:
        a reply half read must not be the next call's."""
        connection = self._connection()
        if _pack_command is not None:
            packed = [b"".join([_pack_command(command) for command in commands])]
        else:  # pragma: no cover
            packed = connection.pack_commands(commands)
        for attempt in (1, 2):
            replies: list = []
            try:
                connection.send_packed_command(packed)
                for _ in commands:
                    try:
                        replies.append(connection.read_response())
                    except redis.exceptions.ResponseError as error:
                        replies.append(error)
                return replies
            except redis.ConnectionError:
                connection.disconnect()
                if attempt == 2 or replies:  # once more only if no reply was read
                    raise
            except BaseException:
                connection.disconnect()
                raise

    def load(self) -> None:
        self.client.execute_command("FUNCTION", "LOAD", "REPLACE", library()[1])

    def run(self, name: str, keys: list, args: list):
        command = self._call
        try:
            try:
                return command("FCALL", function_name(name), len(keys), *keys, *args)
            except redis.exceptions.ResponseError as exc:
                if "Function not found" not in str(exc):
                    raise
                self.load()
                return command("FCALL", function_name(name), len(keys), *keys, *args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise QuotaBackendUnavailable(f"Redis did not answer: {exc}") from exc
        except redis.RedisError as exc:
            if unavailable(exc):
                raise QuotaBackendUnavailable(f"Redis cannot serve the check now: {type(exc).__name__}: {exc}") from exc
            raise
