"""``celery redlock clear`` deletes exactly what it listed, ``check`` writes nothing and
counts every task's ``lock_ttl``, ``ls`` survives foreign values (issues 15 and 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from celery_redlock import LockLost, Redlock, admin
from celery_redlock.testing import Masters, wait_for

from .test_cli import Cli, held_on
from .test_cli import cli as cli
from .test_cli import redlock as redlock

pytestmark = pytest.mark.timeout(120)


def test_clear_finds_a_key_with_glob_characters_exactly(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    redlock.acquire("report:[1, 2]", ttl=60)
    redlock.acquire("report:1", ttl=60)
    cleared = cli("clear", "report:[1, 2]", "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert "redlock:{report:[1, 2]}" in cleared.stdout
    assert held_on(masters, "redlock:{report:[1, 2]}") == 0
    assert held_on(masters, "redlock:{report:1}") == 3


def test_clear_of_a_key_leaves_a_key_that_merely_starts_with_it(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    redlock.acquire("report:1}x", ttl=60)  # Redis key redlock:{report:1}x}
    redlock.acquire("report:1", ttl=60, meta={"task_id": "t1"})
    cleared = cli("clear", "report:1", "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert "redlock:{report:1}x}" not in cleared.stdout
    assert held_on(masters, "redlock:{report:1}") == 0
    assert held_on(masters, "redlock:{report:1}:meta") == 0
    assert held_on(masters, "redlock:{report:1}x}") == 3


def test_clear_deletes_only_what_was_listed_and_confirmed(
    redlock: Redlock, masters: Masters
) -> None:
    old = redlock.acquire("report:1", ttl=60)
    plan = admin.plan_clear(redlock, "report:*", pattern=True)
    assert plan.names == ["redlock:{report:1}"]
    # Between the listing and "y": the listed lock is released and taken again by a new
    # run, and another key appears. Neither was confirmed.
    old.release()
    new = redlock.acquire("report:1", ttl=60)
    other = redlock.acquire("report:2", ttl=60)
    deleted, changed, errors = admin.delete_planned(redlock, plan)
    assert (deleted, changed, errors) == ([], ["redlock:{report:1}"], {})
    new.extend()  # raises LockLost if the clear had deleted it
    other.extend()
    # Unchanged (only renewed: its TTL and its metadata's extension count move) since the
    # listing: deleted, with its metadata.
    plan = admin.plan_clear(redlock, "report:2")
    assert plan.names == ["redlock:{report:2}", "redlock:{report:2}:meta"]
    other.extend()
    deleted, changed, _ = admin.delete_planned(redlock, plan)
    assert (deleted, changed) == (["redlock:{report:2}", "redlock:{report:2}:meta"], [])
    assert held_on(masters, "redlock:{report:2}:meta") == 0
    assert held_on(masters, "redlock:{report:2}") == 0


def test_clear_all_keeps_beat_anchors_unless_named(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    anchor = "redlock:{beat:nightly}:anchor:60"
    redlock.claim("beat:nightly", "anchor:60", "1700000000.000000", 3600, guard_for=0)
    redlock.claim("beat:nightly#3", "sent", "beat-1", 3600, guard_for=0)
    everything = cli("clear", "--all", "--yes")
    assert everything.returncode == 0, everything.stderr
    assert "redlock:{beat:nightly#3}:sent" in everything.stdout
    assert anchor not in everything.stdout
    assert f"kept beat anchor {anchor}" in everything.stderr
    assert held_on(masters, anchor) == 3
    assert held_on(masters, "redlock:{beat:nightly#3}:sent") == 0
    assert admin.ANCHOR_SUFFIX == __import__("celery_redlock.beat").beat.ANCHOR_SUFFIX

    named = cli("clear", "beat:nightly", "--yes")
    assert named.returncode == 0, named.stderr
    assert held_on(masters, anchor) == 0


def test_ls_shows_a_foreign_non_numeric_value_as_unknown(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    with redlock.lock("report:9", ttl=30):
        for server in masters:
            with server.client() as conn:
                conn.set("redlock:{report:9}:fence", "not-a-number")
                conn.hset("redlock:{report:9}:meta", "acquired_at", "yesterday")
        listed = cli("ls")
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if "report:9" in line)
        assert row.count("unknown") == 2
        report = json.loads(cli("ls", "--json").stdout)
        (record,) = report["keys"]
        assert record["fence"] is None
        assert sorted(record["unreadable"]) == ["acquired_at", "fence"]


def _keys(masters: Masters) -> list[set[bytes]]:
    out = []
    for server in masters:
        with server.client() as conn:
            out.append(set(conn.keys("*")))
    return out


def test_check_writes_nothing(cli: Cli, masters: Masters) -> None:
    before = _keys(masters)
    result = cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _keys(masters) == before == [set(), set(), set()]


LONG_TASK_APP = """
import os

from celery import Celery

import celery_redlock
from celery_redlock import SingletonTask

app = Celery("cliapp", broker="memory://")
app.conf.redlock_redis_urls = os.environ["REDLOCK_CLI_MASTERS"].split(",")
celery_redlock.install(app)


@app.task(base=SingletonTask, lock_ttl=900)
def nightly_export():
    pass
"""


def test_check_restart_delay_counts_a_tasks_longer_lock_ttl(
    cli: Cli, masters: Masters, tmp_path: Path
) -> None:
    result = cli("check", "--json")
    assert json.loads(result.stdout)["max_ttl"] == 30
    (tmp_path / "cliapp.py").write_text(LONG_TASK_APP)
    result = cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "longest lock TTL: 900s" in result.stdout
    # the harness's masters have no persistence: the restart advice counts 900 s
    assert "restart it no sooner than 900s after a crash" in result.stdout


BAD_APP = """
from celery import Celery

import celery_redlock

app = Celery("cliapp", broker="memory://")
app.conf.redlock_redis_urls = ["redis://127.0.0.1:1/0"]
app.conf.redlock_ttl = "30s"
celery_redlock.install(app)
"""


@pytest.mark.parametrize("command", [("check",), ("ls",), ("clear", "x", "--yes")])
def test_a_bad_configuration_is_printed_not_a_traceback(
    cli: Cli, tmp_path: Path, command: tuple[str, ...]
) -> None:
    (tmp_path / "cliapp.py").write_text(BAD_APP)
    result: subprocess.CompletedProcess[str] = cli(*command)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "error: celery-redlock is not configured correctly: redlock_ttl" in result.stderr


def test_clear_at_the_prompt_keeps_what_changed_after_the_listing(
    tmp_path: Path, redlock: Redlock, masters: Masters, cli: Cli
) -> None:
    """The operator's path: ``clear --all GLOB`` lists, waits at the prompt; meanwhile a listed
    lock passes to a new run and a new lock appears; "y" deletes neither."""
    first = redlock.acquire("report:1", ttl=60)
    kept = redlock.acquire("report:2", ttl=60, meta={"task_id": "t2"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    env.update(REDLOCK_CLI_MASTERS=",".join(masters.urls), PYTHONPATH=str(tmp_path))
    celery = Path(sys.executable).with_name("celery")
    proc = subprocess.Popen(
        [str(celery), "-A", "cliapp", "redlock", "clear", "--all", "report:*"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out: list[bytes] = []

    def read() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(4096):  # type: ignore[attr-defined]
            out.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: b"Delete these" in b"".join(out), timeout=30, message="the prompt")
        first.release()
        second = redlock.acquire("report:1", ttl=60)  # a new run took the listed key
        late = redlock.acquire("report:3", ttl=60)  # not listed
        assert proc.stdin is not None
        proc.stdin.write(b"y\n")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    listed = b"".join(out).decode()
    assert "redlock:{report:1}" in listed
    assert "redlock:{report:3}" not in listed
    assert "removed 2 keys" in listed  # report:2 and its metadata
    assert held_on(masters, "redlock:{report:2}") == 0
    assert held_on(masters, "redlock:{report:2}:meta") == 0
    second.extend()  # raises LockLost if the clear had deleted it
    late.extend()
    with pytest.raises(LockLost):
        kept.extend()


def test_check_names_the_leading_beat_or_says_none_leads(
    cli: Cli, redlock: Redlock, masters: Masters
) -> None:
    result = cli("check", "--json")
    assert json.loads(result.stdout)["beat"]["state"] == "no leader"
    assert "beat (cliapp): NO LEADER" in cli("check").stdout
    # What a leading beat writes (celery_redlock.beat.BeatLeader): its identity in the
    # leader lease's metadata.
    lease = redlock.acquire("beat:leader:cliapp", 30, meta={"beat": "host-7:4242:abcdef"})
    try:
        before = _keys(masters)
        result = cli("check", "--json")
        beat = json.loads(result.stdout)["beat"]
        assert beat["state"] == "led"
        assert beat["leader"] == "host-7:4242:abcdef"
        assert "host-7:4242:abcdef holds the leader lease" in cli("check").stdout
        assert _keys(masters) == before  # still read-only
    finally:
        lease.release()
