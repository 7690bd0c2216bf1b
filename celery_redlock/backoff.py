"""Full-jitter exponential backoff.

The delay before attempt ``n`` (counting from 0) is drawn uniformly from
``[0, min(cap, base * 2**n))``: the "full jitter" strategy, which spreads
competitors over the whole window so that they stop colliding instead of
retrying in lock step. Used for contention reschedules, outage reschedules
and the core's blocking acquire (base 10 ms, cap 200 ms).

This module knows nothing about Celery or Redis.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Backoff", "backoff_ceiling", "full_jitter", "parse_backoff"]


def _check_number(name: str, value: float, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int or float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def backoff_ceiling(attempt: int, base: float, cap: float) -> float:
    """Return ``min(cap, base * 2**attempt)``, the upper bound of the jitter window.

    Never overflows, however large ``attempt`` is.

    :raises ValueError: ``attempt`` is negative or ``base``/``cap`` negative or not finite.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise TypeError(f"attempt must be an int, got {type(attempt).__name__}")
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    _check_number("base", base)
    _check_number("cap", cap)
    if base == 0 or cap == 0:
        return 0.0
    # Compare exponents instead of computing base * 2**attempt, which overflows a float
    # (or, for 2**attempt as an int, costs memory) long before attempt stops growing.
    if attempt >= math.log2(cap) - math.log2(base):
        return float(cap)
    return math.ldexp(float(base), attempt)


def full_jitter(
    attempt: int,
    base: float,
    cap: float,
    rng: random.Random | None = None,
) -> float:
    """Return a delay drawn uniformly from ``[0, min(cap, base * 2**attempt))``.

    :param attempt: how many attempts were made before this one, from 0.
    :param base: seconds, the window of attempt 0.
    :param cap: seconds, the largest window.
    :param rng: the source of randomness; the module-level generator by default,
        which :mod:`random` reseeds in a forked child, so prefork workers do not
        share a sequence.
    :raises ValueError: ``attempt`` is negative or ``base``/``cap`` negative or not finite.
    """
    ceiling = backoff_ceiling(attempt, base, cap)
    draw = rng.random() if rng is not None else random.random()
    return draw * ceiling


#: The longest backoff window accepted (a day): a reschedule further out is a lost job.
MAX_CAP = 86400.0


@dataclass(frozen=True)
class Backoff:
    """A full-jitter backoff policy: ``base`` and ``cap`` in seconds, ``0 < base <= cap``.

    :raises TypeError: a bound is not an int or float (bools are refused).
    :raises ValueError: a bound is not finite, not positive, or ``base > cap``.
    """

    base: float
    cap: float

    def __post_init__(self) -> None:
        _check_number("base", self.base, positive=True)
        _check_number("cap", self.cap, positive=True)
        if self.base > self.cap:
            raise ValueError(f"base ({self.base!r}) must not be larger than cap ({self.cap!r})")
        if self.cap > MAX_CAP:
            raise ValueError(f"cap ({self.cap!r}) must be at most {MAX_CAP:g} seconds (a day)")

    def ceiling(self, attempt: int) -> float:
        """Upper bound of the window for ``attempt``: ``min(cap, base * 2**attempt)``."""
        return backoff_ceiling(attempt, self.base, self.cap)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A random delay for ``attempt``, see :func:`full_jitter`."""
        return full_jitter(attempt, self.base, self.cap, rng)


def parse_backoff(value: object) -> Backoff:
    """Turn a setting value into a :class:`Backoff`.

    Accepts a :class:`Backoff` or a two-item sequence ``(base, cap)`` of numbers
    with ``0 < base <= cap`` (a list works too, as settings files and JSON give lists).

    :raises TypeError: the value does not have that shape or holds non-numbers.
    :raises ValueError: the numbers are out of range.
    """
    if isinstance(value, Backoff):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError("expected a pair (base, cap) of seconds")
    base, cap = value
    return Backoff(base, cap)
