"""``python -m benchmarks lock|renewal|all [options]``: run benchmarks, print their tables.

Options after the name go to each benchmark (``--rounds``, ``--seconds``, ``--save``,
``--strict``); ``python -m benchmarks lock --help`` lists them.
"""

from __future__ import annotations

import sys

from benchmarks import bench_lock, bench_renewal

BENCHMARKS = {"lock": bench_lock.main, "renewal": bench_renewal.main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*BENCHMARKS, "all"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    names = list(BENCHMARKS) if argv[0] == "all" else [argv[0]]
    status = 0
    for i, name in enumerate(names):
        if i:
            print()
        status |= BENCHMARKS[name](argv[1:])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
