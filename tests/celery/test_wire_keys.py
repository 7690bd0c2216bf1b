"""Which job a publish is: keys from the wire form, markers per task, long keys capped.

A publisher and a worker must write the same key text for one job (or the worker never
clears the publisher's marker and every later publish returns a finished job); two tasks
sharing a ``lock_key`` template share the lock, never a marker; a key built from huge
arguments stays short.
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_redlock import SingletonTask
from celery_redlock.keys import compile_lock_key
from celery_redlock.lock.scripts import CLAIMED_BY

from .redlock_testkit import CeleryEnv, queue_length, run_worker

pytestmark = pytest.mark.timeout(60)


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


# Each changes its text on a json round trip: (1, 2) -> [1, 2], {1: "a"} -> {"1": "a"},
# Color.RED ("Color.RED" when formatted) -> "red".
VALUES = {
    "tuple": (1, 2),
    "int-keyed dict": {1: "a", 2: "b"},
    "str enum": Color.RED,
    "nested": {"ids": (3, 4), "color": Color.BLUE},
}
SERIALIZERS = ["json", "pickle", "msgpack"]
#: The documented bound of a template key (docs/configuration.rst, ``lock_key``).
MAX_KEY_LENGTH = 200


def _markers(env: CeleryEnv) -> list[str]:
    names: set[str] = set()
    for server in env.masters:
        with server.client() as conn:
            names.update(n.decode() for n in conn.scan_iter(match="redlock:*dedupe*"))
    # Not the markers' writer ids: they stay a claim call's time (see scripts.CLAIMED_BY).
    names = {n for n in names if not n.endswith(CLAIMED_BY)}
    return sorted(names)


@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("kind", list(VALUES))
def test_marker_cleared_when_the_job_starts_whatever_the_argument_types(
    env: CeleryEnv, make_app: Any, serializer: str, kind: str
) -> None:
    """``lock_key="batch:{ids}"`` with ``batch.delay((1, 2))``: the job's run clears the
    marker the publish wrote, so a publish after it ran is a new job that runs."""
    if serializer == "msgpack" and _has_int_key(VALUES[kind]):
        pytest.skip("msgpack refuses maps with int keys on the worker (strict_map_key)")
    app = make_app(task_serializer=serializer, accept_content=[serializer, "json"])

    @app.task(bind=True, base=SingletonTask, lock_key="batch:{ids}")
    def batch(self: Any, ids: Any) -> str:
        return str(self.request.id)

    value = VALUES[kind]
    first = batch.delay(value)
    assert batch.delay(value).id == first.id  # queued: the same job
    assert queue_length(app, env.queue) == 1
    with run_worker(app):
        assert first.get(timeout=10) == first.id
        assert _markers(env) == []  # taking the lock cleared the publisher's marker
        second = batch.delay(value)
        assert second.id != first.id, "a publish after the job ran returned the finished job"
        assert second.get(timeout=10) == second.id


def test_tasks_sharing_a_key_template_never_share_a_marker(env: CeleryEnv, make_app: Any) -> None:
    """build_report and send_invoice on ``acct:{account_id}``: one of each is queued and
    runs; each still coalesces its own duplicates."""
    app = make_app()

    @app.task(base=SingletonTask, lock_key="acct:{account_id}")
    def build_report(account_id: int) -> str:
        return f"report {account_id}"

    @app.task(base=SingletonTask, lock_key="acct:{account_id}")
    def send_invoice(account_id: int) -> str:
        return f"invoice {account_id}"

    report = build_report.delay(42)
    invoice = send_invoice.delay(42)
    assert invoice.id != report.id, "send_invoice returned build_report's job"
    assert build_report.delay(42).id == report.id
    assert send_invoice.delay(42).id == invoice.id
    assert queue_length(app, env.queue) == 2
    with run_worker(app):
        assert report.get(timeout=10) == "report 42"
        assert invoice.get(timeout=10) == "invoice 42"
    assert _markers(env) == []


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_a_default_passed_explicitly_is_the_same_job_as_one_left_out(
    env: CeleryEnv, make_app: Any, serializer: str
) -> None:
    """Defaults that change on the wire (a tuple, a str Enum, a float passed as an int):
    the explicit spelling is deduplicated against the queued job, never a second job
    that could run beside it (found by review: both ran at once)."""
    app = make_app()
    app.conf.task_serializer = serializer
    app.conf.accept_content = [serializer, "json"]

    @app.task(base=SingletonTask)
    def shaped(x: int, dims: Any = (1, 2), mode: Any = Color.RED, scale: Any = 1.0) -> int:
        return x

    first = shaped.delay(1)
    for spelled in ({"dims": (1, 2)}, {"mode": Color.RED}, {"scale": 1}, {"dims": [1, 2]}):
        assert shaped.apply_async((1,), spelled).id == first.id, spelled
    assert shaped.apply_async((1,), {"dims": (2, 1)}).id != first.id
    with run_worker(app):
        assert first.get(timeout=10) == 1
    assert shaped.apply_async((1,), {"mode": "red"}).id != first.id  # it ran: a new job


def test_a_key_from_20k_ids_is_capped_and_the_job_runs(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="batch:{ids}")
    def batch(self: Any, ids: list[int]) -> str:
        assert self.lease is not None
        return str(self.lease.key)

    ids = list(range(20_000))
    first = batch.delay(ids)
    assert batch.delay(ids).id == first.id
    assert batch.delay([*ids, 20_000]).id != first.id  # a different tail, a different key
    markers = _markers(env)
    assert len(markers) == 2
    for name in markers:
        assert len(name) < MAX_KEY_LENGTH + 100, f"marker name of {len(name)} characters"
    with run_worker(app):
        key = first.get(timeout=20)
        assert len(key) <= MAX_KEY_LENGTH
        assert key.startswith("batch:[0, 1, 2, 3")
        again = batch.delay(ids)
        assert again.id != first.id
        assert again.get(timeout=20) == key


# -- the same key text on both sides, for any arguments -------------------------------------

_scalars = st.one_of(
    st.integers(-(2**40), 2**40),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.sampled_from(list(Color)),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.integers(-5, 5), st.text(max_size=4)), inner, max_size=3),
    ),
    max_leaves=8,
)


def _has_int_key(value: object) -> bool:
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _has_int_key(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_int_key(v) for v in value)
    return False


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=_values, serializer=st.sampled_from(SERIALIZERS))
def test_publisher_and_worker_keys_are_the_same_text(ids: object, serializer: str) -> None:
    """The publisher's key (from the wire form) equals the key of the arguments a worker
    decodes from the message body Celery sends, ``(args, kwargs, embed)``."""
    from celery_redlock.identity import wire_arguments

    if serializer == "msgpack" and _has_int_key(ids):
        return  # not decodable by a worker at all (strict_map_key)

    def batch(ids: Any, tag: str = "x") -> None: ...

    for template in ("batch:{ids}", "batch:{ids}:{tag}"):
        build = compile_lock_key(template, batch, "batch")
        args, kwargs = [ids], {"tag": "t"}
        published = build(*wire_arguments(args, kwargs, serializer))
        body = dumps((args, kwargs, {"callbacks": None}), serializer=serializer)
        worker_args, worker_kwargs, _ = loads(body[2], body[0], body[1], force=True)
        assert published == build(worker_args, worker_kwargs)


def test_the_main_process_clears_a_revoked_jobs_own_marker(env: CeleryEnv, make_app: Any) -> None:
    """What the worker's main process does for a revoked or killed job (from the request's
    wire-form arguments) clears that task's marker, not a marker of the key alone."""
    from celery.app.task import Context

    from celery_redlock.wiring import _release_killed

    app = make_app()

    @app.task(base=SingletonTask, lock_key="batch:{ids}")
    def batch(ids: Any) -> int:
        return len(ids)

    first = batch.delay((1, 2))
    assert len(_markers(env)) == 1
    _release_killed(batch, Context(id=first.id, args=[[1, 2]], kwargs={}), "revoke")
    assert _markers(env) == []
    assert batch.delay((1, 2)).id != first.id
