"""Fenced writes refuse a holder that lost its lock while paused (Kleppmann's scenario).

Holder A takes a Redlock with a short TTL over real masters, reads its fence, and "pauses":
it does nothing until its validity has run out. B then takes the lock, gets a newer fence
and writes. A wakes up and writes with its old fence: the resource must refuse it, with
:class:`StaleFence` carrying both tokens. Checked for each helper: Redis ``SET`` and hash
(``FencedRedis``), a DB-API table row (``fenced_update_sql`` on sqlite3), and a Django model
row (``fenced_update``; Django runs in a fresh interpreter, as it can be configured once per
process).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redlock import Redlock, StaleFence
from celery_redlock.fencing import FencedRedis, fenced_update_sql
from celery_redlock.testing import Masters, RedisServer, wait_for

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Holders:
    """Fences of a paused stale holder (A) and of the holder that replaced it (B)."""

    stale: int
    current: int


@pytest.fixture
def holders(masters: Masters) -> Iterator[Holders]:
    a_client, b_client = Redlock(masters.urls), Redlock(masters.urls)
    try:
        lease_a = a_client.acquire("account:42", ttl=0.5)
        fence_a = lease_a.fence
        # A "pauses": it does nothing while its validity runs out.
        wait_for(lambda: not lease_a.held, timeout=5, message="A's validity to run out")
        with b_client.lock("account:42", ttl=10, blocking_timeout=5) as lease_b:
            fence_b = lease_b.fence
            assert fence_b > fence_a
            yield Holders(stale=fence_a, current=fence_b)
    finally:
        a_client.close()
        b_client.close()


@pytest.fixture
def resource(master_factory: Callable[..., RedisServer]) -> Iterator[redis.Redis]:
    """The protected resource: a Redis of its own, not one of the lock's masters."""
    with master_factory().client() as client:
        yield client


def assert_refused(exc: StaleFence, fence: int, current: int) -> None:
    """``exc`` names both tokens, also once rebuilt from its args as a result backend does."""
    assert (exc.fence, exc.current) == (fence, current)
    rebuilt = StaleFence(*exc.args)
    assert (rebuilt.fence, rebuilt.current, str(rebuilt)) == (fence, current, str(exc))


# -- Redis ------------------------------------------------------------------------------------


def test_redis_set_refuses_the_paused_holder(holders: Holders, resource: redis.Redis) -> None:
    fenced = FencedRedis(resource)
    fenced.set("balance:{42}", "200", fence=holders.current)
    with pytest.raises(StaleFence) as exc:
        fenced.set("balance:{42}", "100", fence=holders.stale)
    assert_refused(exc.value, holders.stale, holders.current)
    assert fenced.get("balance:{42}") == (b"200", holders.current)
    assert resource.get("balance:{42}") == b"200"  # a plain GET still reads the value


def test_redis_hset_refuses_the_paused_holder(holders: Holders, resource: redis.Redis) -> None:
    fenced = FencedRedis(resource)
    fenced.hset("account:{42}", mapping={"balance": 200, "owner": "B"}, fence=holders.current)
    with pytest.raises(StaleFence) as exc:
        fenced.hset("account:{42}", "balance", 100, fence=holders.stale)
    assert_refused(exc.value, holders.stale, holders.current)
    assert fenced.hget("account:{42}", "balance") == (b"200", holders.current)
    assert resource.hgetall("account:{42}") == {
        b"balance": b"200",
        b"owner": b"B",
        b"__fence__": str(holders.current).encode(),
    }


@pytest.mark.parametrize("kind", ["set", "hset"])
def test_redis_equal_fence_is_refused_and_a_larger_one_accepted(
    resource: redis.Redis, kind: str
) -> None:
    fenced = FencedRedis(resource)

    def write(value: str, fence: int) -> None:
        if kind == "set":
            fenced.set("k", value, fence=fence)
        else:
            fenced.hset("k", "v", value, fence=fence)

    def read() -> tuple[bytes | None, int | None]:
        return fenced.get("k") if kind == "set" else fenced.hget("k", "v")

    assert read() == (None, None)
    write("first", 10)
    with pytest.raises(StaleFence) as exc:
        write("replayed", 10)
    assert_refused(exc.value, 10, 10)
    write("newer", 11)
    assert read() == (b"newer", 11)


def test_redis_fences_compare_exactly_past_float_precision(resource: redis.Redis) -> None:
    fenced = FencedRedis(resource)
    big = 2**60  # 2**60 + 1 and 2**60 are the same double: Lua numbers would call them equal
    fenced.set("k", "a", fence=big)
    fenced.set("k", "b", fence=big + 1)
    with pytest.raises(StaleFence) as exc:
        fenced.set("k", "c", fence=big)
    assert_refused(exc.value, big, big + 1)
    fenced.set("n", "short", fence=9)
    fenced.set("n", "longer", fence=10)  # "10" < "9" as text: compared as numbers
    assert fenced.get("n") == (b"longer", 10)


@pytest.mark.parametrize("bad", [-1, True, "5", None, 1.5])
def test_redis_rejects_a_fence_that_is_no_token(resource: redis.Redis, bad: Any) -> None:
    with pytest.raises(TypeError, match="fence must be a non-negative int"):
        FencedRedis(resource).set("k", "v", fence=bad)
    assert resource.exists("k", "k:fence") == 0


def test_redis_works_with_decoded_responses(master_factory: Callable[..., RedisServer]) -> None:
    with master_factory().client(decode_responses=True) as client:
        fenced = FencedRedis(client)
        fenced.hset("h", mapping={"a": "1"}, fence=5)
        with pytest.raises(StaleFence) as exc:
            fenced.hset("h", "a", "2", fence=4)
        assert_refused(exc.value, 4, 5)
        assert fenced.hget("h", "a") == ("1", 5)


def test_redis_write_survives_a_script_flush(resource: redis.Redis) -> None:
    fenced = FencedRedis(resource)
    fenced.set("k", "a", fence=1)
    resource.script_flush()  # a restarted or failed-over server forgets scripts
    fenced.set("k", "b", fence=2)
    assert fenced.get("k") == (b"b", 2)


# -- DB-API (sqlite3) ---------------------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(tmp_path / "bank.sqlite3")
    connection.execute(
        "CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER, fence INTEGER)"
    )
    connection.execute("INSERT INTO account VALUES (42, 0, 0), (43, 0, NULL)")
    connection.commit()
    yield connection
    connection.close()


def row(db: sqlite3.Connection, pk: int) -> tuple[int, int | None]:
    found = db.execute("SELECT balance, fence FROM account WHERE id = ?", (pk,)).fetchone()
    assert found is not None
    return found[0], found[1]


def test_sql_update_refuses_the_paused_holder(holders: Holders, db: sqlite3.Connection) -> None:
    fenced_update_sql(db, "account", 42, holders.current, {"balance": 200})
    with pytest.raises(StaleFence) as exc:
        fenced_update_sql(db, "account", 42, holders.stale, {"balance": 100})
    assert_refused(exc.value, holders.stale, holders.current)
    db.commit()
    assert row(db, 42) == (200, holders.current)


def test_sql_equal_refused_larger_accepted_missing_row_and_null_fence(
    db: sqlite3.Connection,
) -> None:
    fenced_update_sql(db, "account", 42, 10, {"balance": 1})
    with pytest.raises(StaleFence) as exc:
        fenced_update_sql(db, "account", 42, 10, {"balance": 2})
    assert_refused(exc.value, 10, 10)
    fenced_update_sql(db, "account", 42, 11, {"balance": 3})
    with pytest.raises(LookupError, match="no row in account with id = 999"):
        fenced_update_sql(db, "account", 999, 12, {"balance": 4})
    fenced_update_sql(db, "account", 43, 1, {"balance": 5})  # NULL: never written with a fence
    db.commit()
    assert (row(db, 42), row(db, 43)) == ((3, 11), (5, 1))


def test_sql_refuses_names_that_are_not_identifiers(db: sqlite3.Connection) -> None:
    with pytest.raises(ValueError, match="plain SQL identifier"):
        fenced_update_sql(db, "account; DROP TABLE account", 42, 1, {"balance": 1})
    with pytest.raises(ValueError, match="the fence column"):
        fenced_update_sql(db, "account", 42, 1, {"fence": 1})


# -- Django ORM -----------------------------------------------------------------------------------

_DJANGO_SCRIPT = """
import json, sys
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["celery_redlock.contrib.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()
from django.db import connection, models
from django.db.models import F
from celery_redlock.contrib.django.fencing import fenced_update

class Account(models.Model):
    balance = models.IntegerField(default=0)
    active = models.BooleanField(default=True)
    fence = models.BigIntegerField(null=True)
    token = models.BigIntegerField(default=0)

    class Meta:
        app_label = "celery_redlock"

with connection.schema_editor() as editor:
    editor.create_model(Account)
Account.objects.create(pk=42, fence=0)
Account.objects.create(pk=43, fence=None)
Account.objects.create(pk=44, active=False, fence=0)

outcomes = []
for op in json.loads(sys.argv[2]):
    target = Account.objects.filter(active=True) if op.get("active_only") else Account
    try:
        rows = fenced_update(
            target, op["pk"], op["fence"], op.get("fence_field", "fence"),
            balance=F("balance") + op["amount"],
        )
        outcomes.append({"ok": rows})
    except Exception as exc:
        outcomes.append({"error": type(exc).__name__, "args": list(exc.args)})
rows = {a.pk: [a.balance, a.fence, a.token] for a in Account.objects.order_by("pk")}
print(json.dumps({"outcomes": outcomes, "rows": rows}))
"""


def run_django(tmp_path: Path, operations: list[dict[str, Any]]) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _DJANGO_SCRIPT,
            str(tmp_path / "django.sqlite3"),
            json.dumps(operations),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def test_django_fenced_update_refuses_the_paused_holder(holders: Holders, tmp_path: Path) -> None:
    b, a = holders.current, holders.stale
    report = run_django(
        tmp_path,
        [
            {"pk": 42, "fence": b, "amount": 200},  # B, the current holder
            {"pk": 42, "fence": a, "amount": 100},  # A wakes up: refused
            {"pk": 42, "fence": b, "amount": 1},  # B's fence again: equal, refused
            {"pk": 42, "fence": b + 1, "amount": 5},  # a newer holder: accepted
        ],
    )
    accepted, stale, equal, newer = report["outcomes"]
    assert accepted == {"ok": 1}
    assert stale["error"] == "StaleFence"
    assert_refused(_raised(stale), a, b)
    assert equal["error"] == "StaleFence"
    assert_refused(_raised(equal), b, b)
    assert newer == {"ok": 1}
    assert report["rows"]["42"] == [205, b + 1, 0]


def test_django_missing_row_null_fence_and_other_fence_field(tmp_path: Path) -> None:
    report = run_django(
        tmp_path,
        [
            {"pk": 999, "fence": 5, "amount": 1},  # no such row
            {"pk": 44, "fence": 5, "amount": 1, "active_only": True},  # outside the queryset
            {"pk": 43, "fence": 5, "amount": 7},  # NULL fence: older than any token
            {"pk": 42, "fence": 3, "amount": 2, "fence_field": "token"},
            {"pk": 42, "fence": 3, "amount": 2, "fence_field": "token"},
            {"pk": 42, "fence": True, "amount": 1},
        ],
    )
    missing, filtered, null, other, other_again, not_a_token = report["outcomes"]
    assert missing["error"] == filtered["error"] == "DoesNotExist"
    assert "pk=999 does not exist" in missing["args"][0]
    assert null == other == {"ok": 1}
    assert other_again["error"] == "StaleFence"
    assert_refused(_raised(other_again), 3, 3)
    assert not_a_token["error"] == "TypeError"
    assert report["rows"] == {"42": [2, 0, 3], "43": [7, 5, 0], "44": [0, 0, 0]}


def _raised(outcome: dict[str, Any]) -> StaleFence:
    """The StaleFence a subprocess reported, rebuilt from its args as Celery would."""
    return StaleFence(*outcome["args"])
