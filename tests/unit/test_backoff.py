"""Full-jitter backoff: the delays contention and outage reschedules and blocking acquire use."""

from __future__ import annotations

import math
import os
import random

import pytest

from celery_redlock.backoff import Backoff, backoff_ceiling, full_jitter, parse_backoff


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(0, 1.0), (1, 2.0), (3, 8.0), (5, 32.0), (6, 60.0), (7, 60.0), (10_000, 60.0)],
)
def test_window_doubles_per_attempt_up_to_the_cap(attempt: int, expected: float) -> None:
    assert backoff_ceiling(attempt, 1, 60) == expected


def test_huge_attempt_counts_neither_overflow_nor_exceed_the_cap() -> None:
    assert backoff_ceiling(10**9, 0.01, 0.2) == 0.2
    assert full_jitter(10**9, 0.01, 0.2) <= 0.2
    # A tiny base with an attempt past float range still ends at the cap.
    assert backoff_ceiling(5000, 1e-300, 1e300) == 1e300


def test_delays_stay_inside_the_window_and_cover_it() -> None:
    rng = random.Random(7)
    delays = [full_jitter(4, 0.5, 60, rng) for _ in range(2000)]
    assert all(0 <= d < 8.0 for d in delays)
    # Full jitter spreads over the whole window, not a band near its top.
    assert min(delays) < 0.8
    assert max(delays) > 7.2


def test_a_seeded_generator_gives_a_reproducible_sequence() -> None:
    first = [full_jitter(n, 1, 60, random.Random(3)) for n in range(8)]
    again = [full_jitter(n, 1, 60, random.Random(3)) for n in range(8)]
    assert first == again


def test_zero_cap_means_no_delay() -> None:
    assert full_jitter(3, 0, 0) == 0.0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (prefork workers)")
def test_forked_children_draw_different_delays() -> None:
    # Prefork children inherit the parent's generator state; random reseeds them at fork,
    # which keeps workers that hit the same lock from rescheduling in lock step.
    random.seed(1234)
    draws = []
    for _ in range(2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.write(write_end, repr(full_jitter(10, 1, 3600)).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            draws.append(float(pipe.read()))
        os.waitpid(pid, 0)
    assert draws[0] != draws[1]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1, 1, 60), ValueError),
        ((0, -1, 60), ValueError),
        ((0, 1, -60), ValueError),
        ((0, math.nan, 60), ValueError),
        ((0, 1, math.inf), ValueError),
        ((True, 1, 60), TypeError),
        ((1.5, 1, 60), TypeError),
        ((0, "1", 60), TypeError),
    ],
)
def test_invalid_arguments_are_refused(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        full_jitter(*args)  # type: ignore[arg-type]


def test_backoff_object_draws_inside_its_window() -> None:
    policy = Backoff(0.01, 0.2)  # the core's blocking acquire
    assert policy.ceiling(0) == 0.01
    assert policy.ceiling(4) == 0.16
    assert policy.ceiling(5) == 0.2
    rng = random.Random(1)
    assert all(0 <= policy.delay(n, rng) < policy.ceiling(n) for n in range(50))


@pytest.mark.parametrize(
    ("base", "cap", "error"),
    [
        (0, 60, ValueError),
        (2, 1, ValueError),
        (-1, 60, ValueError),
        (1, math.inf, ValueError),
        (True, 60, TypeError),
        ("1", 60, TypeError),
    ],
)
def test_backoff_object_validates_its_bounds(
    base: object, cap: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        Backoff(base, cap)  # type: ignore[arg-type]


def test_parse_backoff_accepts_pairs_and_instances() -> None:
    assert parse_backoff((1, 60)) == Backoff(1, 60)
    assert parse_backoff([0.5, 10]) == Backoff(0.5, 10)
    policy = Backoff(2, 4)
    assert parse_backoff(policy) is policy


@pytest.mark.parametrize("value", ["1,60", (1, 2, 3), 5, None, {"base": 1, "cap": 2}])
def test_parse_backoff_refuses_other_shapes(value: object) -> None:
    with pytest.raises(TypeError, match=r"pair \(base, cap\)"):
        parse_backoff(value)


def test_parse_backoff_refuses_base_above_cap() -> None:
    with pytest.raises(ValueError, match="must not be larger than cap"):
        parse_backoff((10, 1))
