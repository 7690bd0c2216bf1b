"""``python -m benchmarks lock|renewal|tasks|jobcost|beat|down|all [options]``: run, print tables.

``all`` runs lock, renewal and tasks (about five minutes on 2 cores); ``beat`` kills and
restarts beat processes for minutes (``--kills``, ``--minutes``) and runs on its own;
``down`` times jobs that meet a down master (about two and a half minutes); ``jobcost``
takes a job's publish and run apart in one process, to the µs (about a minute).
Options after the name go to each benchmark (``--rounds``, ``--seconds``, ``--save``,
``--strict``); ``python -m benchmarks lock --help`` lists them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from benchmarks import (
    bench_beat,
    bench_down,
    bench_jobcost,
    bench_lock,
    bench_renewal,
    bench_tasks,
)

BENCHMARKS: dict[str, Callable[[list[str]], int]] = {
    "lock": bench_lock.main,
    "renewal": bench_renewal.main,
    "tasks": bench_tasks.main,
    "beat": bench_beat.main,
    "down": bench_down.main,
    "jobcost": bench_jobcost.main,
}
#: what ``all`` runs: the ones that take minutes, not tens of minutes
ALL = ("lock", "renewal", "tasks")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*BENCHMARKS, "all"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    names = list(ALL) if argv[0] == "all" else [argv[0]]
    status = 0
    for i, name in enumerate(names):
        if i:
            print()
        status |= BENCHMARKS[name](argv[1:])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
