"""Random hex for reservation and lease ids, without a system call each.

``os.urandom`` is read 4 KiB at a time per thread and sliced: one ``getrandom`` per
512 ids of 8 bytes instead of one per id (a system call costs 5-10 µs on the
virtual machines the benchmarks run on). A forked child starts on bytes of its
own: two processes never hand out the same id.
"""

from __future__ import annotations

import os
import threading

CHUNK = 4096
_local = threading.local()


def _forget_in_child() -> None:
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_in_child)


def random_hex(nbytes: int = 8) -> str:
    """``secrets.token_hex(nbytes)``, from the same source, read ahead."""
    local = _local
    buffer, pos = getattr(local, "buffer", b""), getattr(local, "pos", 0)
    if pos + nbytes > len(buffer):
        buffer, pos = os.urandom(CHUNK), 0
        local.buffer = buffer
    local.pos = pos + nbytes
    return buffer[pos:pos + nbytes].hex()
