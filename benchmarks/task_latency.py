"""Per-job latency, publish to body start, for the task benchmark (issue 17).

Jobs are published one at a time: each job's body pushes the time it started
(``time.monotonic()``, one clock for every process on Linux) to the counter Redis, and
the publisher waits for it (``BLPOP``) before publishing the next one. The latency is
the body's start less the moment ``apply_async`` was called, so it holds everything a
job pays before its body runs: at publish (a SingletonTask's dedupe claim), in the
broker, in the worker (the acquire round), never queueing behind other jobs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis

from benchmarks.common import median, num, percentile, progress, table, times

STARTED = "bench:started"


def latencies(task: Any, counter: redis.Redis, n: int, base: int) -> list[float]:
    """Publish ``n`` jobs one after another; return each one's latency in seconds."""
    counter.delete(STARTED)
    out = []
    for i in range(n):
        published = time.monotonic()
        task.apply_async((base + i, 0.0, True))
        reply = counter.blpop([STARTED], timeout=60)
        if reply is None:
            raise RuntimeError(f"a {task.name} job did not start within 60 s")
        out.append(float(reply[1]) - published)
    return out


def measure(
    tasks: dict[str, Any], counter: redis.Redis, rounds: int, n: int, base: int, what: str
) -> dict[str, list[list[float]]]:
    """Every contender's ``n`` latencies per round, in interleaved rounds (the order
    reversed every other round, as the throughput rounds)."""
    results: dict[str, list[list[float]]] = {name: [] for name in tasks}
    for rnd in range(rounds):
        order = list(tasks.items())
        if rnd % 2:
            order.reverse()
        for name, task in order:
            base += n
            samples = latencies(task, counter, n, base)
            results[name].append(samples)
            progress(
                f"{what}: round {rnd + 1}: {name}: p50 {percentile(samples, 50) * 1e6:,.0f} µs, "
                f"p99 {percentile(samples, 99) * 1e6:,.0f} µs"
            )
    return results


def rows(results: dict[str, list[list[float]]], reference: str) -> list[list[str]]:
    """Table rows: p50 and p99 in µs (medians over rounds); what each adds to
    ``reference`` at p50 and p99 (see :func:`added`); its p50 over the reference's
    (median of the rounds' ratios)."""
    out = []
    for name, per_round in results.items():
        cells = [num(median(percentile(s, q) * 1e6 for s in per_round)) for q in (50, 99)]
        if name == reference:
            cells += ["-", "-", "-"]
        else:
            ratio = median(
                percentile(a, 50) / percentile(b, 50)
                for a, b in zip(per_round, results[reference], strict=True)
            )
            cells += [
                num(added(results, name, reference, 50)),
                num(added(results, name, reference, 99)),
                times(ratio),
            ]
        out.append([name, *cells])
    return out


def lines(
    results: dict[str, list[list[float]]], reference: str, heading: Sequence[str]
) -> list[str]:
    return [
        *heading,
        *table(
            ["contender", "p50 µs", "p99 µs", "added p50", "added p99", "p50 vs plain"],
            rows(results, reference),
        ),
        "",
    ]


def added(results: dict[str, list[list[float]]], name: str, reference: str, q: float) -> float:
    """What ``name`` adds to ``reference`` at percentile ``q``, in µs: the median over
    rounds of the difference within each round (both under the same load)."""
    return median(
        (percentile(a, q) - percentile(b, q)) * 1e6
        for a, b in zip(results[name], results[reference], strict=True)
    )
