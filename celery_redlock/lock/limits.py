"""The ranges every duration and factor of the lock core must fall in, and their checker.

One table, shared by the core (which refuses a value with ``ValueError`` naming the argument
and the range) and the Celery settings (which refuse it with ``ImproperlyConfigured`` naming
the setting). A value outside its range is never clamped: NaN, infinities and absurd numbers
reach code that does arithmetic and waits with them (a ``Condition.wait`` past
``threading.TIMEOUT_MAX`` raises; a NaN deadline is never reached; a 1e-6 s renewal interval
is a busy loop), so they are refused where they enter.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "DAY",
    "DRIFT_FLOOR",
    "MAX_BLOCKING_TIMEOUT",
    "MAX_CLAIM_TTL",
    "MAX_DEDUPE_TTL",
    "MAX_DRIFT",
    "MAX_FENCE_TTL",
    "MAX_HOLD",
    "MAX_NODE_TIMEOUT",
    "MAX_QUARANTINE",
    "MAX_SPIN_WAIT",
    "MAX_TTL",
    "MIN_NODE_TIMEOUT",
    "MIN_RENEW_EVERY",
    "MIN_TTL",
    "drift",
    "seconds",
    "show",
]

DAY: Final = 86400.0
#: A lock's TTL (``ttl``, ``lock_ttl``, ``extend(ttl)``): from 10 ms to one day. The TTL is
#: the crash-recovery time, not the run time (renewal keeps a lock as long as its holder runs).
MIN_TTL: Final = 0.01
MAX_TTL: Final = DAY
#: Renewal interval: at least 10 ms (shorter is a busy loop), and below the TTL.
MIN_RENEW_EVERY: Final = 0.01
#: Per-master connect and read timeout.
MIN_NODE_TIMEOUT: Final = 0.001
MAX_NODE_TIMEOUT: Final = 60.0
#: How long a blocking acquire may wait (``None`` waits forever).
MAX_BLOCKING_TIMEOUT: Final = 7 * DAY
#: The longest ``max_hold`` (the cap on an auto-renewed lease's whole life).
MAX_HOLD: Final = 30 * DAY
#: Claims (enqueue-dedupe markers, beat occurrence claims, beat anchors: these outlive any
#: deployment, 10 years or 100 intervals) and fence counters.
MAX_CLAIM_TTL: Final = 36500 * DAY
MAX_FENCE_TTL: Final = 400 * DAY
#: ``redlock_dedupe_ttl``: how long an enqueue-dedupe marker lives when nothing clears it.
MAX_DEDUPE_TTL: Final = 400 * DAY
#: ``restart_quarantine``: how long a restarted master may be kept out of the quorum.
MAX_QUARANTINE: Final = 7 * DAY
#: ``spin_wait``: polling for replies without sleeping; also below ``node_timeout``.
MAX_SPIN_WAIT: Final = 1.0
#: ``clock_drift_factor`` is in [0, MAX_DRIFT).
MAX_DRIFT: Final = 0.5
#: The fixed part of a lease's clock drift allowance (see :func:`drift`).
DRIFT_FLOOR: Final = 0.002


def drift(ttl: float, clock_drift_factor: float) -> float:
    """What a lease of ``ttl`` seconds loses to clock drift: ``ttl * clock_drift_factor``
    plus 2 ms. Its validity is ``ttl`` less this, less the time its round took, and a
    renewal must land within it (``renew_every`` below ``ttl - drift``)."""
    return ttl * clock_drift_factor + DRIFT_FLOOR


def show(number: float) -> str:
    """A bound as people read it: ``0.01``, ``86400``, ``34560000`` (never ``3.456e+07``)."""
    return f"{number:g}" if number < 1e6 else f"{number:.0f}"


def seconds(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    unit: str = "seconds",
) -> float:
    """Return ``value`` as a float if it is a finite number within the range, else raise.

    ``low_open``/``high_open`` exclude that bound. Raises ``TypeError`` for a value that is
    not an int or float (a bool or a str included) and ``ValueError`` for NaN, infinities
    and numbers outside the range; both messages name ``name`` and the accepted range.
    """
    kind = type(value)
    # The usual types are checked first: this runs several times per lock operation.
    if (kind is not float and kind is not int) and (
        isinstance(value, bool) or not isinstance(value, int | float)
    ):
        raise TypeError(
            f"{name} must be a number in {_range(low, high, low_open, high_open, unit)} "
            f"(int or float), got {value!r}"
        )
    number = float(value)  # type: ignore[arg-type]  # an int or a float, checked above
    if (
        not math.isfinite(number)
        or number < low
        or number > high
        or (low_open and number == low)
        or (high_open and number == high)
    ):
        raise ValueError(
            f"{name} must be a finite number in {_range(low, high, low_open, high_open, unit)}, "
            f"got {value!r}"
        )
    return number


def _range(low: float, high: float, low_open: bool, high_open: bool, unit: str) -> str:
    """The accepted range as error messages show it: ``[0.01, 86400] seconds``."""
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'} {unit}"
