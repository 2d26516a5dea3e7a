"""The Lua scripts, read once from ``lua/`` with the shared helpers of ``lib.lua`` in front.

redis-py's ``Script`` runs EVALSHA and, on NOSCRIPT (a restarted or flushed
server), loads the script and runs it again, so callers never see it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("check", "settle", "lease", "sweep")


@cache
def script_source(name: str) -> str:
    if name not in SCRIPT_NAMES:
        raise ValueError(f"no script {name!r}; there are {', '.join(SCRIPT_NAMES)}")
    lib = (LUA_DIR / "lib.lua").read_text()
    return f"{lib}\n-- ---- {name}.lua ----\n{(LUA_DIR / f'{name}.lua').read_text()}"


def register_scripts(client) -> dict:
    """name -> redis-py Script bound to ``client``."""
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}
