"""The README's main job, ``example_project/demo.py``, end to end and interrupted.

The demo starts 3 Redis masters, a Redis broker, 2 ``celery worker`` (prefork) and 2
``celery beat`` of the example Django project, plays scenarios (a) to (f) and prints a
summary; it must exit 0 with every scenario passed. Interrupted with Ctrl-C (SIGINT to
its process group, as a terminal sends it), it must leave no process behind: not the
servers, not the celery main processes, not their pool children.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redlock.testing import process_running, wait_for

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "example_project" / "demo.py"
SCENARIOS = "abcdef"

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DJANGO_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def printed_pids(output: str) -> list[int]:
    """The pids the demo printed for the processes it started, in order."""
    started = r"^\s+(?:redis master \d|redis broker|worker-[ab]|beat-[ab])\s+pid (\d+)\s"
    return [int(pid) for pid in re.findall(started, output, re.MULTILINE)]


def group_members(groups: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of ``groups``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) in groups:
            members.append(int(entry.name))
    return members


@contextlib.contextmanager
def demo_process(
    run_dir: Path,
) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str | None]]]:
    """The demo in its own session; its output lines arrive on the queue as printed."""
    proc = subprocess.Popen(
        [sys.executable, str(DEMO), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=demo_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # end of output

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:  # the demo's children die with it (PR_SET_PDEATHSIG)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def rest_of(lines: queue.Queue[str | None], timeout: float = 30) -> str:
    """The remaining output, up to its end."""
    out = []
    while (line := lines.get(timeout=timeout)) is not None:
        out.append(line)
    return "".join(out)


@pytest.mark.timeout(360)
def test_demo_runs_every_scenario_and_passes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(DEMO), "--run-dir", str(tmp_path)],
        cwd=ROOT,
        env=demo_env(),
        capture_output=True,
        text=True,
        timeout=330,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = output[output.index("\nSummary\n") :]
    for key in SCENARIOS:
        assert re.search(rf"^\({key}\) .*\bPASS$", summary, re.MULTILINE), summary
    assert "FAIL" not in summary
    assert "6 of 6 scenarios passed" in summary
    for figure in ("crash recovery", "beat failover", "fences of successive apply_payment"):
        assert figure in summary
    pids = printed_pids(output)
    assert len(pids) == 8, output  # 3 masters, broker, 2 workers, 2 beats
    assert [pid for pid in pids if process_running(pid)] == []
    assert group_members(set(pids[4:])) == []


@pytest.mark.timeout(180)
def test_ctrl_c_mid_run_leaves_no_process_behind(tmp_path: Path) -> None:
    with demo_process(tmp_path) as (proc, lines):
        seen: list[str] = []

        def reached_scenario_b() -> bool:
            with contextlib.suppress(queue.Empty):
                while (line := lines.get(timeout=0.1)) is not None:
                    seen.append(line)
                    if line.startswith("(b) "):
                        return True
            if proc.poll() is not None:
                raise AssertionError(f"demo exited with {proc.returncode}:\n{''.join(seen)}")
            return False

        wait_for(reached_scenario_b, timeout=120, interval=0, message="scenario (b) to start")
        pids = printed_pids("".join(seen))
        assert len(pids) == 8, "".join(seen)
        celery_groups = set(pids[4:])
        assert len(group_members(celery_groups)) > 4  # main processes and pool children
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        returncode = proc.wait(timeout=60)
        output = "".join(seen) + rest_of(lines)
        assert returncode == 128 + signal.SIGINT, output
        assert "interrupted by SIGINT" in output
        assert [pid for pid in pids if process_running(pid)] == [], output
        assert group_members(celery_groups) == [], output
