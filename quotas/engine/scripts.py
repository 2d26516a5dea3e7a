"""The Lua scripts, read once from ``lua/`` with the shared helpers of ``lib.lua`` in front.

``Scripts.run`` sends EVALSHA; on NOSCRIPT (a restarted or flushed server) it
loads the script and sends it again, so callers never see it. A Redis that
cannot be reached in time becomes ``QuotaBackendUnavailable``.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import redis

from .decision import QuotaBackendUnavailable

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("check", "settle", "lease", "sweep")


@cache
def script_source(name: str) -> str:
    if name not in SCRIPT_NAMES:
        raise ValueError(f"no script {name!r}; there are {', '.join(SCRIPT_NAMES)}")
    lib = (LUA_DIR / "lib.lua").read_text()
    return f"{lib}\n-- ---- {name}.lua ----\n{(LUA_DIR / f'{name}.lua').read_text()}"


@cache
def script_sha(name: str) -> str:
    return hashlib.sha1(script_source(name).encode()).hexdigest()


class Scripts:
    def __init__(self, client: redis.Redis):
        self.client = client

    def run(self, name: str, keys: list, args: list):
        command = self.client.execute_command
        try:
            try:
                return command("EVALSHA", script_sha(name), len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                self.client.script_load(script_source(name))
                return command("EVALSHA", script_sha(name), len(keys), *keys, *args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise QuotaBackendUnavailable(f"Redis did not answer: {exc}") from exc
