"""Rate-limited logging of recurring events: the first line at once, then summaries.

A master that stays down, a key that thousands of jobs contend for, an outage that
reschedules every job: each is one *state* a human needs to hear about once, not once
per operation. :class:`Summary` decides, for one kind of event, which occurrence gets a
line: the first of an episode at once, then at most one line per ``period`` carrying the
count since the last line; the others are counted (and logged at DEBUG by
:func:`log_limited`). An episode ends when ``period`` passes without an event, or when
the caller says the state is over (:meth:`Summary.reset`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

__all__ = ["LOG_PERIOD", "Summary", "log_limited"]

#: At most one line per kind of event per this many seconds.
LOG_PERIOD: Final = 30.0


class Summary:
    """Which occurrences of one recurring event to log (see the module docstring)."""

    __slots__ = ("_clock", "_count", "_until", "period")

    def __init__(self, period: float = LOG_PERIOD, clock: Callable[[], float] = time.monotonic):
        self.period = period
        self._clock = clock
        self._count = 0
        self._until = 0.0

    def note(self) -> tuple[bool, int] | None:
        """Count one occurrence; say whether to log it.

        Returns None (stay quiet: it is counted), ``(True, 1)`` (the first of a new
        episode: log it as such) or ``(False, n)`` (log a summary of the ``n``
        occurrences since the last line, this one included).
        """
        # No lock: threads racing here only blur a count or repeat a line, and a lock
        # held by another thread at fork() would hang a forked child here.
        now = self._clock()
        self._count += 1
        if now < self._until:
            return None
        count, self._count = self._count, 0
        first = now >= self._until + self.period  # no window open: a new episode
        self._until = now + self.period
        return (True, 1) if first else (False, count)

    def reset(self) -> None:
        """The state is over: the next occurrence starts a new episode."""
        self._count = 0
        self._until = 0.0


_summaries: dict[str, Summary] = {}
_summaries_lock = threading.Lock()


def log_limited(logger: logging.Logger, level: int, topic: str, msg: str, *args: object) -> None:
    """Log ``msg % args`` at ``level`` as :class:`Summary` of ``topic`` allows, else at DEBUG.

    The first line of an episode says that more are summarised; a summary line says how
    many occurrences it stands for. ``topic`` names one kind of event (a task's contention
    reschedules, say); keep the number of topics bounded.
    """
    summary = _summaries.get(topic)
    if summary is None:
        with _summaries_lock:
            summary = _summaries.setdefault(topic, Summary())
    verdict = summary.note()
    if verdict is None:
        logger.debug(msg, *args)
        return
    # ``msg`` is the caller's constant format; the suffix only adds format fields.
    if verdict[0]:
        first = msg + " (more like it: one line per %.0f s)"
        logger.log(level, first, *args, summary.period)
    else:
        summed = msg + " (%d like it in the last %.0f s)"
        logger.log(level, summed, *args, verdict[1], summary.period)
