"""``celery -A <app> redlock ls|inspect|clear|check`` against real masters.

The ``celery`` console script of this interpreter's environment runs as a subprocess, the
way an operator runs it, with a tiny app module (written to the test's directory) that
reads the masters from ``$REDLOCK_CLI_MASTERS``. The lock ``ls`` shows is taken by a real
SingletonTask run in an in-process worker (threads pool), so the columns show what a task
really writes: its id, name, worker, pid, TTL and fence.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import Redlock, SingletonTask
from celery_redlock.client import reset_clients
from celery_redlock.lock.scripts import CLAIMED_BY
from celery_redlock.testing import Masters, wait_for

CELERY = Path(sys.executable).with_name("celery")
APP_MODULE = """
import os

from celery import Celery

import celery_redlock

app = Celery("cliapp", broker="memory://")
app.conf.redlock_redis_urls = os.environ["REDLOCK_CLI_MASTERS"].split(",")
celery_redlock.install(app)
"""
WORKER = "cli-worker@testhost"
TASK = "cliapp.sync_account"

Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(tmp_path: Path, masters: Masters) -> Cli:
    """``cli("ls", "--json", input="y\\n")``: run ``celery -A cliapp redlock ...``
    (``urls=[...]``: with other masters than the fixture's)."""
    if not CELERY.exists():
        pytest.fail(f"no celery console script beside {sys.executable}", pytrace=False)
    (tmp_path / "cliapp.py").write_text(APP_MODULE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.update(REDLOCK_CLI_MASTERS=",".join(masters.urls), PYTHONPATH=str(tmp_path))

    def run(
        *args: str,
        input: str | None = None,  # noqa: A002 - subprocess's name
        urls: list[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        masters_env = {} if urls is None else {"REDLOCK_CLI_MASTERS": ",".join(urls)}
        return subprocess.run(
            [str(CELERY), "-A", "cliapp", "redlock", *args],
            cwd=tmp_path,
            env={**env, **masters_env},
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


@pytest.fixture
def redlock(masters: Masters) -> Iterator[Redlock]:
    client = Redlock(masters.urls)
    yield client
    client.close()


@pytest.fixture
def running_task(masters: Masters) -> Iterator[dict[str, Any]]:
    """A SingletonTask run holding ``account:42`` in an in-process worker until teardown."""
    app = Celery("cliapp", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        redlock_redis_urls=masters.urls,
    )
    gate = threading.Event()
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=SingletonTask, name=TASK, lock_key="account:{account_id}")
    def sync_account(self: Any, account_id: int) -> None:
        seen["fence"] = self.lease.fence
        seen["task_id"] = self.request.id
        # The worker's node name, or the machine's name where a pool does not pass it.
        seen["host"] = self.request.hostname or socket.gethostname()
        gate.wait(60)

    with start_worker(
        app,
        pool="threads",
        concurrency=1,
        perform_ping_check=False,
        loglevel="WARNING",
        hostname=WORKER,
        shutdown_timeout=20,
    ):
        try:
            sync_account.delay(42)
            wait_for(lambda: "fence" in seen, timeout=20, message="the task to hold its lock")
            yield seen
        finally:
            gate.set()
    reset_clients()
    app.close()


def lock_row(output: str, key: str) -> str:
    """The ``ls`` table row of the lock on ``key``."""
    rows = [line for line in output.splitlines() if re.match(rf"lock\s+{re.escape(key)}\s", line)]
    assert len(rows) == 1, output
    return rows[0].rstrip()


def test_ls_shows_the_running_task_and_how_many_masters_hold_it(
    cli: Cli, running_task: dict[str, Any], masters: Masters
) -> None:
    listed = cli("ls")
    assert listed.returncode == 0, listed.stderr
    row = lock_row(listed.stdout, "account:42")
    for column in ("owner", "task", "worker", "ttl", "fence", "on"):
        assert column in listed.stdout.splitlines()[0]
    assert running_task["task_id"] in row
    assert TASK in row
    assert f"{running_task['host']}:{os.getpid()}" in row
    assert re.search(r"\s(2\d|30)\.\ds\s", row), f"ttl of about 30 s expected: {row}"
    assert str(running_task["fence"]) in row
    assert row.endswith("3/3")

    as_json = cli("ls", "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["errors"] == {}
    (record,) = [r for r in report["keys"] if r["key"] == "account:42"]
    assert record["kind"] == "lock"
    assert record["owner_task_id"] == running_task["task_id"]
    assert record["task"] == TASK
    assert (record["host"], record["pid"]) == (running_task["host"], str(os.getpid()))
    assert record["fence"] == running_task["fence"]
    assert 0 < record["ttl"] <= 30
    assert (record["present_on"], record["masters"]) == (3, 3)

    masters[0].restart(keep_data=False)  # came back empty: it lost the key
    after = cli("ls")
    assert after.returncode == 0, after.stderr
    assert lock_row(after.stdout, "account:42").endswith("2/3")

    masters[1].kill()
    down = cli("ls", "--json")
    assert down.returncode == 0
    report = json.loads(down.stdout)
    assert list(report["errors"]) == [masters[1].url]
    (record,) = [r for r in report["keys"] if r["key"] == "account:42"]
    assert (record["present_on"], record["masters"]) == (1, 3)
    assert f"warning: {masters[1].url} not read" in cli("ls").stderr


def test_ls_pattern_and_no_match(cli: Cli, redlock: Redlock) -> None:
    with redlock.lock("report:1", ttl=30), redlock.lock("account:7", ttl=30):
        only = cli("ls", "report:*")
        assert only.returncode == 0, only.stderr
        assert "report:1" in only.stdout
        assert "account:7" not in only.stdout
    empty = cli("ls")
    assert (empty.returncode, empty.stdout.strip()) == (0, "no keys match")


def test_inspect_shows_every_redis_key_of_a_lock_on_every_master(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    with redlock.lock("account:9", ttl=30, meta={"task_id": "t-9"}) as lease:
        fence = lease.fence
        shown = cli("inspect", "account:9")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    assert [row["master"] for row in rows] == masters.urls
    for row in rows:
        assert row["redlock:{account:9}"]["value"] == lease.token
        assert 0 < row["redlock:{account:9}"]["pttl_ms"] <= 30_000
        assert row["redlock:{account:9}:meta"]["value"] == {"task_id": "t-9"}
        assert row["redlock:{account:9}:fence"]["value"] == str(fence)


def held_on(masters: Masters, name: str) -> int:
    count = 0
    for server in masters:
        with server.client() as conn:
            count += int(conn.exists(name))
    return count


def test_clear_asks_first_and_refuses_what_could_clear_too_much(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    for key in ("account:1", "account:2", "report:1"):
        redlock.acquire(key, ttl=60).fence  # noqa: B018 - reading it commits a fence counter

    for args in [(), ("",), ("--pattern",)]:  # nothing, empty, or --pattern without a glob
        refused = cli("clear", *args)
        assert refused.returncode == 2, (args, refused.stdout)
        assert "Usage:" in refused.stderr
    assert held_on(masters, "redlock:{account:1}") == 3

    declined = cli("clear", "account:1", input="n\n")
    assert declined.returncode == 1
    assert "redlock:{account:1}" in declined.stdout
    assert "Delete these" in declined.stdout
    assert "Aborted" in declined.stderr
    assert held_on(masters, "redlock:{account:1}") == 3

    confirmed = cli("clear", "account:1", input="y\n")
    assert confirmed.returncode == 0, confirmed.stderr
    assert re.search(r"removed \d+ keys", confirmed.stdout), confirmed.stdout
    assert held_on(masters, "redlock:{account:1}") == 0
    assert held_on(masters, "redlock:{account:1}:fence") == 3  # tokens keep increasing

    literal = cli("clear", "account:*", "--yes")  # exact by default: no key is named that
    assert literal.returncode == 0, literal.stderr
    assert "matched exactly; add --pattern" in literal.stdout
    assert held_on(masters, "redlock:{account:2}") == 3

    many = cli("clear", "--pattern", "account:*", "--yes")
    assert many.returncode == 0, many.stderr
    assert "redlock:{account:2}" in many.stdout
    assert "report" not in many.stdout
    assert held_on(masters, "redlock:{account:2}") == 0
    assert held_on(masters, "redlock:{report:1}") == 3

    nothing = cli("clear", "account:1", "--yes")
    assert (nothing.returncode, nothing.stdout.strip()) == (0, "nothing to clear")


def test_clear_all_refuses_an_explicit_empty_pattern(cli: Cli, redlock: Redlock) -> None:
    lease = redlock.acquire("account:1", ttl=60)
    for words in (("clear", "--all", ""), ("clear", "--all", "  "), ("clear", "")):
        refused = cli(*words, input="y\n")
        assert refused.returncode == 2, refused.stdout
        assert "PATTERN is empty" in refused.stderr
    lease.extend()  # raises LockLost if any of those calls had deleted the lock


def test_check_passes_on_a_quorum_and_fails_without_one(cli: Cli, masters: Masters) -> None:
    healthy = cli("check")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "quorum: 3 of 3 masters up, 2 needed: OK" in healthy.stdout
    report = json.loads(cli("check", "--json").stdout)
    assert report["quorum"] is True
    assert [m["reachable"] for m in report["masters"]] == [True, True, True]

    masters[2].kill()
    degraded = cli("check")
    assert degraded.returncode == 0, degraded.stdout
    assert "quorum: 2 of 3 masters up, 2 needed: OK" in degraded.stdout
    assert re.search(rf"{re.escape(masters[2].url)}\s+DOWN", degraded.stdout)

    masters[1].kill()
    broken = cli("check")
    assert broken.returncode != 0
    assert "quorum: 1 of 3 masters up, 2 needed: UNAVAILABLE" in broken.stdout
    as_json = cli("check", "--json")
    assert as_json.returncode != 0
    report = json.loads(as_json.stdout)
    assert report["quorum"] is False
    assert [m["reachable"] for m in report["masters"]] == [True, False, False]


def test_check_fails_when_two_masters_are_one_server(cli: Cli, masters: Masters) -> None:
    port = masters[0].port
    urls = [f"redis://localhost:{port}/0", f"redis://127.0.0.1:{port}/1", masters[1].url]
    result = cli("check", urls=urls)
    assert result.returncode == 3, result.stdout + result.stderr
    run_id = masters[0].run_id()[:8]
    assert f"masters #1 and #2 are the same server (run_id {run_id})" in result.stderr
    assert "quorum: 2 of 3 masters up, 2 needed: OK" in result.stdout
    report = json.loads(cli("check", "--json", urls=urls).stdout)
    # whichever of #1 and #2 answered second is the one refused
    assert sorted(m["duplicate_of"] or 0 for m in report["masters"]) in ([0, 0, 1], [0, 0, 2])


def test_a_claims_writer_id_is_no_row_of_its_own_and_goes_with_the_claim(
    redlock: Redlock, masters: Masters
) -> None:
    # A claim stores the id of the call that wrote it beside it (<claim>:{claimed-by): ls
    # shows the claim once, and clear takes both.
    from celery_redlock import admin

    assert redlock.claim("account:3", "dedupe:t", "job-3", 60, guard_for=0) == ("job-3", True)
    name = redlock._claim_name("account:3", "dedupe:t")
    assert held_on(masters, name + CLAIMED_BY) == 3
    rows, errors = admin.list_keys(redlock, "account:3")
    assert not errors
    assert [(row.kind, row.value, row.present_on) for row in rows] == [("dedupe", "job-3", 3)]
    deleted, errors = admin.clear(redlock, "account:3")
    assert not errors
    assert sorted(deleted) == [name, name + CLAIMED_BY]
    assert held_on(masters, name) == held_on(masters, name + CLAIMED_BY) == 0
