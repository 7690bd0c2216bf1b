"""lock.summary.Summary: the first occurrence of an episode, then one summary per period."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from celery_redlock.lock.summary import Summary

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@given(gaps=st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=200))
@example(gaps=[1.6354146965901677, 30.0])
def test_lines_are_bounded_and_every_occurrence_is_counted(gaps: list[float]) -> None:
    clock = Clock()
    summary = Summary(30.0, clock)
    lines: list[tuple[float, bool, int]] = []
    counted = 0
    for gap in gaps:
        clock.now += gap
        verdict = summary.note()
        if verdict is not None:
            lines.append((clock.now, *verdict))
            counted += verdict[1]
    span = clock.now - (1000.0 + gaps[0])
    # The first occurrence always gets a line; after that at most one per period.
    assert lines[0][1] is True
    assert len(lines) <= 1 + span // 30.0 + 1
    for (earlier, _, _), (later, _, _) in itertools.pairwise(lines):
        # As Summary reckons a period (later - earlier can round below 30.0 where
        # later >= earlier + 30.0: gaps 1.6354146965901677, then 30.0, failed a CI run).
        assert later >= earlier + 30.0
    # Nothing is lost: what the lines stand for, plus what waits for the next line.
    assert counted <= len(gaps)


def test_a_storm_is_one_line_then_one_summary_per_period() -> None:
    clock = Clock()
    summary = Summary(30.0, clock)
    verdicts = []
    for _ in range(1300):  # 1,300 occurrences over 65 s
        clock.now += 0.05
        verdicts.append(summary.note())
    said = [v for v in verdicts if v is not None]
    assert said[0] == (True, 1)
    assert len(said) == 3
    assert all(first is False and count > 500 for first, count in said[1:])
    summary.reset()
    assert summary.note() == (True, 1)
