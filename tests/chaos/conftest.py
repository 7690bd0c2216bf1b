"""Fixtures of the chaos suite, its markers, and the verdict table of a full run.

``chaos``       every test here (the default subset runs with the normal test command)
``chaos_full``  the full matrix only (``scripts/chaos.sh``; root-only faults, every
                variant); deselected unless ``-m`` selects it
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: When set (scripts/chaos.sh), every scenario's verdict is appended here as a JSON line;
#: ``python -m tests.chaos.report`` turns the lines into the verdict table.
RESULTS_ENV = "CHAOS_RESULTS"


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; declaring them here too keeps --strict-markers happy
    # whichever is read first.
    config.addinivalue_line("markers", "chaos_full: full chaos matrix only (scripts/chaos.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Without any -m, leave the full matrix out (pyproject's addopts does the same once
    # it carries `-m "not chaos_full"`).
    if config.option.markexpr:
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("chaos_full") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def chaos_record() -> Iterator[Callable[..., None]]:
    path = os.environ.get(RESULTS_ENV)

    def record(**row: Any) -> None:
        if not path:
            return
        line = json.dumps({"at": time.strftime("%Y-%m-%d %H:%M:%S"), **row}, default=str)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    return record
