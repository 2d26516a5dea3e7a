"""`make bench`: every benchmark, or the ones named (python -m bench engine)."""

from __future__ import annotations

import sys
import time

from bench import api_check, engine_check, engine_instructions, spend

BENCHMARKS = {"engine": engine_check, "instructions": engine_instructions, "api": api_check, "spend": spend}


def main(names: list[str]) -> int:
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; there are {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in names or BENCHMARKS:
        module = BENCHMARKS[name]
        print(f"== {name}: {module.__doc__.strip().splitlines()[0]}", flush=True)
        started = time.monotonic()
        print(module.report(module.run()))
        print(f"({time.monotonic() - started:.0f}s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
