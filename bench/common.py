"""Timing helpers for the benchmarks: latencies, percentiles, a plain table."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable


def redis_url() -> str:
    url = os.environ.get("REDIS_URL")
    if not url:
        raise SystemExit("REDIS_URL is not set: run the benchmarks with `make bench`, which starts a Valkey")
    return url


def latencies_us(fn: Callable[[], object], *, n: int, warmup: int = 200) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        fn()
        out.append((clock() - start) / 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.50), "p99": percentile(values, 0.99), "mean": statistics.fmean(values)}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
