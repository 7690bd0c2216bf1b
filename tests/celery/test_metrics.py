"""The Prometheus exporter (celery_redlock.contrib.prometheus), scraped from a real prefork
worker: the children count in prometheus-client's multiprocess mode and the main process
serves the sum."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_redlock.testing import wait_for

from .redlock_proj.project import LOOP, QUICK
from .redlock_testkit import ProjEnv

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_prefork_worker_serves_its_childrens_metrics(
    proj_env: ProjEnv, spawn_worker: Any, tmp_path: Path
) -> None:
    port = _free_port()
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    proj_env.vars["REDLOCK_TEST_METRICS_PORT"] = str(port)
    proj_env.vars["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
    spawn_worker("m", conf={"redlock_ttl": 1.5}, app="redlock_proj.metrics_app")
    app = proj_env.client_app()

    samples = _scrape(port)
    ups = {k[1]: v for k, v in samples.items() if k[0] == "celery_redlock_master_up"}
    assert sorted(ups.values()) == [1.0, 1.0, 1.0], ups

    first = app.tasks[LOOP].apply_async(("m", 30))
    wait_for(
        lambda: any(e["event"] == "enter" for e in proj_env.events()), timeout=20, message="entered"
    )
    second = app.tasks[LOOP].apply_async(("m", 30))

    def rescheduled() -> bool:
        samples = _scrape(port)
        return (
            _value(samples, "celery_redlock_contention_reschedules_total", task=LOOP) >= 2
            and _value(samples, "celery_redlock_renewal_margin_seconds_count") >= 2
        )

    wait_for(rescheduled, timeout=30, interval=0.2, message="contention and renewals counted")
    proj_env.stop_loop("m")
    assert first.get(timeout=30) == "m"
    assert second.get(timeout=30) == "m"

    samples = _scrape(port)
    assert _value(samples, "celery_redlock_acquire_total", task=LOOP, outcome="acquired") == 2
    assert _value(samples, "celery_redlock_acquire_total", task=LOOP, outcome="contended") >= 2
    assert _value(samples, "celery_redlock_contended_total", task=LOOP, action="retry") >= 2
    assert _value(samples, "celery_redlock_contention_delay_seconds_total", task=LOOP) > 0.2
    assert _value(samples, "celery_redlock_hold_seconds_count", task=LOOP) == 2
    assert _value(samples, "celery_redlock_acquire_wait_seconds_count", task=LOOP) == 2
    # The second job waited through its reschedules until the first released: that wait,
    # not only its last acquire round, is counted.
    assert _value(samples, "celery_redlock_rescheduled_seconds_count", task=LOOP) == 2
    assert _value(samples, "celery_redlock_rescheduled_seconds_sum", task=LOOP) > 0.5
    assert _value(samples, "celery_redlock_beat_leader") == 0

    # One master stops: the process that meets it says so, and the gauge (the minimum over
    # the live processes) drops to 0 for that master only.
    proj_env.masters[2].stop()
    quick = app.tasks[QUICK]
    for i in range(4):
        assert quick.apply_async((f"q{i}",)).get(timeout=30) == f"q{i}"

    def one_down() -> dict[Any, float]:
        samples = _scrape(port)
        ups = {k[1]: v for k, v in samples.items() if k[0] == "celery_redlock_master_up"}
        return ups if sorted(ups.values()) == [0.0, 1.0, 1.0] else {}

    down = wait_for(one_down, timeout=20, interval=0.2, message="one master reported down")
    [(labels, _)] = [(k, v) for k, v in down.items() if v == 0.0]
    assert str(proj_env.masters[2].port) in dict(labels)["master"]
