"""Lock scenarios under faults (see scenarios.py), each with its negative controls.

Each case runs one scenario with one variant of lock and resource, then checks the whole
history (:mod:`tests.chaos.checker`) against what that variant must show. A failure prints
the checker's report: a verdict per property and the timeline of the first violation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.testing import find_redis_server, redis_server_version

from . import netns
from .run import Run
from .scenarios import SCENARIOS, Scenario

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]


def _cases() -> list[Any]:
    cases = []
    for sc in SCENARIOS.values():
        for variant in sc.full:
            marks = [] if variant in sc.default else [pytest.mark.chaos_full]
            cases.append(pytest.param(sc.id, variant, id=f"{sc.id}-{variant}", marks=marks))
        cases.extend(
            pytest.param(sc.id, variant, id=f"{sc.id}-{variant}")
            for variant in sc.default
            if variant not in sc.full
        )
    return cases


def run_scenario(sc: Scenario, variant: str, workdir: Path) -> tuple[Run, Any, float]:
    config = sc.config()
    started = time.monotonic()
    with Run(workdir, config, variant) as run:
        sc.faults(run)
        time.sleep(sc.recovery)
        run.stop_agents()
        bound = None
        if sc.takeover:
            bound = {"*": config.ttl * 1000 + 200 + 2 * config.slack_ms}
        report = run.check(
            expect=sc.expectations(variant),
            takeover_bound_ms=bound,
            call_slack_ms=config.slack_ms,
        )
        if sc.extra is not None and report.ok:
            sc.extra(run, report)
    return run, report, time.monotonic() - started


@pytest.mark.parametrize(("scenario", "variant"), _cases())
def test_scenario(scenario: str, variant: str, tmp_path: Path, chaos_record: Any) -> None:
    sc = SCENARIOS[scenario]
    if sc.needs_redis7 and redis_server_version(find_redis_server()) < (7, 0, 0):
        pytest.skip("DEBUG SLEEP needs redis-server >= 7 (--enable-debug-command)")
    if sc.needs_root:
        reason = netns.available()
        if reason is not None:
            pytest.skip(reason)
    run, report, seconds = run_scenario(sc, variant, tmp_path / "run")
    outcome = "passed" if report.ok else "failed"
    chaos_record(
        scenario=scenario,
        variant=variant,
        title=sc.title,
        outcome=outcome,
        seconds=seconds,
        summary=report.summary(),
        verdicts={
            name: {
                "violations": v.violations,
                "label": v.label,
                "applicable": v.applicable,
                "measure": v.measure,
            }
            for name, v in report.verdicts.items()
        },
    )
    assert report.ok, f"{sc.id} [{variant}] {sc.title}\n{report.format()}\n{run.logs()}"
